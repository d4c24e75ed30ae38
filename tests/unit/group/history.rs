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

#[test]
fn survivors_a_few_allocations_apart_catch_up_and_nothing_else_does() {
    // Three survivors of one history: rank 0 stopped after 3 calls (2 allocations),
    // rank 1 after 4 (a third allocation), rank 2 after 6 (a fourth allocation, and
    // its free).
    let mut h = History::new(4);
    let mut stops = Vec::new();
    for (kind, a, b, allocs) in [
        (CallKind::Alloc, 1024, 512, 1),
        (CallKind::Alloc, 2048, 512, 2),
        (CallKind::Free, 1, 0, 2),
        (CallKind::Alloc, 512, 512, 3),
        (CallKind::Alloc, 4096, 512, 4),
        (CallKind::Free, 4, 0, 4),
    ] {
        h.record(kind, a, b);
        if [3, 4, 6].contains(&h.seq()) {
            stops.push(Stop::of(&h, allocs));
        }
    }
    let (calls, pinned) = catch_up(&stops, 0).unwrap();
    assert_eq!(calls.iter().map(|c| c.seq).collect::<Vec<_>>(), [4, 5, 6]);
    assert_eq!(pinned, 3..=4);
    assert_eq!(catch_up(&stops, 1).unwrap().0.len(), 2);
    assert_eq!(catch_up(&stops, 2).unwrap().0, []);
    // All at one call: nothing to do.
    assert!(catch_up(&[stops[2].clone(), stops[2].clone()], 0).is_none());
    // A different history (hash), calls gone from the recent ones, or a free of an
    // allocation the behind rank made (its buffer is live there): on every rank, none.
    let mut other = stops[0].clone();
    other.hash ^= 1;
    assert!(catch_up(&[other, stops[2].clone()], 1).is_none());
    let mut short = stops[2].clone();
    short.recent.drain(..2);
    assert!(catch_up(&[stops[0].clone(), short], 1).is_none());
    // A trim that met the loss is made up (a record only); a close is not.
    let mut t = History::new(4);
    let before = Stop::of(&t, 0);
    t.record(CallKind::Trim, 0, 0);
    assert_eq!(
        catch_up(&[before.clone(), Stop::of(&t, 0)], 0)
            .unwrap()
            .0
            .len(),
        1
    );
    t.record(CallKind::Close, 0, 0);
    assert!(catch_up(&[before, Stop::of(&t, 0)], 0).is_none());
    h.record(CallKind::Free, 2, 0);
    let freed_early = Stop::of(&h, 4);
    assert!(catch_up(&[stops[2].clone(), freed_early], 0).is_none());
}
