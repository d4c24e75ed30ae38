use super::*;

#[test]
fn refusals_are_logged_once_per_kind_per_interval_then_counted() {
    let t0 = Instant::now();
    let peer = SocketAddr::from(([10, 0, 0, 1], 5));
    let mut log = RefusalLog::new(t0);
    let mut lines = Vec::new();
    for i in 0..100u32 {
        let at = t0 + Duration::from_millis(u64::from(i));
        lines.extend(log.lines_for(at, RefusalKind::Busy, peer, "busy"));
        if i % 10 == 0 {
            lines.extend(log.lines_for(at, RefusalKind::Garbage, peer, "garbage"));
        }
    }
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].contains("busy") && lines[1].contains("garbage"));
    // The next refusal after the interval sums up the last one first.
    let later = t0 + REFUSAL_LOG_INTERVAL;
    let next = log.lines_for(later, RefusalKind::Busy, peer, "busy");
    assert_eq!(next.len(), 2, "{next:?}");
    assert!(
        next[0].contains("refused 108 more connections")
            && next[0].contains("99 too many handshakes in flight")
            && next[0].contains("9 not the store's protocol"),
        "{}",
        next[0]
    );
    assert!(next[1].contains("busy"));
    // Nothing more to sum up: one refusal of a kind is its own line.
    assert_eq!(log.summary(later + REFUSAL_LOG_INTERVAL, false), None);
}
