use super::*;
use crate::group::history::CallKind;

fn rec(h: &History, op: Op, size: u64) -> AgreementRecord {
    AgreementRecord::new(h, (0, op), size, 0, Note::Live(0), false)
}

/// How two ranks with these histories diverge at a growth.
fn at_growth(a: &History, b: &History) -> Divergence {
    explain(&[rec(a, Op::Grow, 1), rec(b, Op::Grow, 1)], "growth")
}

#[test]
fn identical_histories_agree_and_differences_are_named() {
    let (mut a, mut b) = (History::new(8), History::new(8));
    for h in [&mut a, &mut b] {
        h.record(CallKind::Alloc, 4096, 512);
        h.record(CallKind::Alloc, 8192, 512);
    }
    assert_eq!(rec(&a, Op::Grow, 1), rec(&b, Op::Grow, 1));
    a.record(CallKind::Alloc, 1 << 20, 512);
    b.record(CallKind::Alloc, 2 << 20, 512);
    let d = at_growth(&a, &b);
    assert_eq!(d.first_differing_call, Some(3));
    assert_eq!(
        d.calls[0].1.as_deref(),
        Some("call #3: alloc(1048576 B, align 512 B)")
    );
    assert_eq!(
        d.calls[1].1.as_deref(),
        Some("call #3: alloc(2097152 B, align 512 B)")
    );
}

#[test]
fn an_extra_call_on_one_rank_is_named() {
    let (mut a, mut b) = (History::new(8), History::new(8));
    a.record(CallKind::Alloc, 4096, 512);
    b.record(CallKind::Alloc, 4096, 512);
    a.record(CallKind::Free, 1, 0);
    let d = at_growth(&a, &b);
    assert_eq!(d.first_differing_call, Some(2));
    assert_eq!(d.calls[1].1, None);
    assert!(d.to_string().contains("rank 1: (no such call)"), "{d}");
}

#[test]
fn differences_older_than_the_history_are_reported_without_a_call() {
    let (mut a, mut b) = (History::new(2), History::new(2));
    a.record(CallKind::Alloc, 1, 512);
    b.record(CallKind::Alloc, 2, 512);
    for h in [&mut a, &mut b] {
        for _ in 0..3 {
            h.record(CallKind::Alloc, 4096, 512);
        }
    }
    let d = at_growth(&a, &b);
    assert_eq!(d.first_differing_call, None);
    assert_eq!(d.history_gone, Some(2));
    let text = d.to_string();
    assert!(text.contains("older than the 2 calls"), "{text}");
    assert!(text.contains("PoolConfig::history_len"), "{text}");
    assert!(
        text.contains("rank 1: pool call count 4, hash 0x"),
        "{text}"
    );
    assert!(
        text.contains("latest call #4: alloc(4096 B, align 512 B)"),
        "{text}"
    );
}

#[test]
fn same_calls_different_state_is_a_divergence_without_a_call() {
    let a = History::new(4);
    let x = AgreementRecord::new(&a, (0, Op::Grow), 1, 7, Note::Live(0), false);
    let y = AgreementRecord::new(&a, (0, Op::Grow), 1, 8, Note::Live(0), false);
    let d = explain(&[x, y], "growth");
    assert_eq!(d.first_differing_call, None);
    assert!(d.to_string().contains("state digest"), "{d}");
}

#[test]
fn same_history_different_operation_names_the_operation() {
    let a = History::new(4);
    let d = explain(
        &[rec(&a, Op::Grow, 1 << 20), rec(&a, Op::Close, 0)],
        "growth",
    );
    assert_eq!(d.first_differing_call, Some(1));
    assert_eq!(d.calls[1].1.as_deref(), Some("close (0 B)"));
}
