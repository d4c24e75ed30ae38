use super::*;

#[test]
fn the_lock_free_head_follows_the_history() {
    let mut h = History::new(2);
    let head = h.head();
    assert_eq!(head.load(), (0, HASH_SEED));
    h.record(CallKind::Alloc, 4096, 512);
    h.record(CallKind::Free, 1, 0);
    assert_eq!(head.load(), (h.seq(), h.hash()));
    assert_eq!(h.recent().count(), 2);
}
