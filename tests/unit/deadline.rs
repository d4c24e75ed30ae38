use super::*;

#[test]
fn duration_max_saturates_and_means_never() {
    let d = Deadline::after(Duration::MAX);
    assert!(d.is_never());
    assert!(!d.expired());
    assert!(d.remaining() > Duration::from_secs(3600 * 24 * 365));
    // No overflow when capped or compared.
    assert!(d.cap(Duration::MAX).is_never());
    assert!(!d.cap(Duration::from_secs(1)).is_never());
}

#[test]
fn zero_timeout_is_expired_at_once() {
    let d = Deadline::after(Duration::ZERO);
    assert!(d.expired());
    assert_eq!(d.remaining(), Duration::ZERO);
    assert!(!d.is_never());
}

#[test]
fn cap_takes_the_earlier() {
    let start = Instant::now();
    let far = Deadline::after_from(start, Duration::from_secs(60));
    let near = Deadline::after_from(start, Duration::from_secs(1));
    assert_eq!(far.min(near), near);
    assert!(far.cap(Duration::from_millis(10)) < near);
    assert_eq!(near.cap(Duration::from_secs(3600)), near);
}

#[test]
fn a_call_deadline_is_fixed_once() {
    let lazy = CallDeadline::from_first_wait(Duration::from_secs(60));
    let first = lazy.get();
    assert_eq!(lazy.get(), first, "the first read fixes it");
    assert!(first.remaining() > Duration::from_secs(30));
    let fixed = Deadline::after(Duration::from_secs(1));
    assert_eq!(CallDeadline::from(fixed).get(), fixed);
}
