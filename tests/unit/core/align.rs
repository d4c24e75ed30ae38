use super::*;

#[test]
fn pow2() {
    assert!(!is_pow2(0));
    assert!(is_pow2(1));
    assert!(is_pow2(512));
    assert!(!is_pow2(513));
    assert!(is_pow2(1 << 63));
    assert!(!is_pow2(u64::MAX));
}

#[test]
fn rounding_edges() {
    assert_eq!(align_up(0, 512), Some(0));
    assert_eq!(align_up(1, 512), Some(512));
    assert_eq!(align_up(512, 512), Some(512));
    assert_eq!(align_up(513, 512), Some(1024));
    assert_eq!(align_up(u64::MAX - 511, 512), Some(u64::MAX - 511));
    assert_eq!(align_up(u64::MAX - 510, 512), None);
    assert_eq!(align_up(u64::MAX, 1), Some(u64::MAX));
    assert_eq!(align_up(5, 3), None);
    assert_eq!(align_up(5, 0), None);
}
