use super::*;

/// A device stream value of a test's own kind.
struct Fake;

/// How many keys of `kind` the registry holds.
fn entries(kind: &'static str) -> usize {
    KNOWN.lock().keys().filter(|k| k.0 == kind).count()
}

#[test]
fn one_stream_wrapped_twice_has_one_id() {
    const KIND: &str = "test-twice";
    let s = Arc::new(Fake);
    let a = Stream::on_device(KIND, Some((1, 7)), s.clone());
    let b = Stream::on_device(KIND, Some((1, 7)), s.clone());
    assert_eq!(a.id(), b.id());
    assert_eq!(a.clone().id(), a.id());
    // Another value for the same stream (a second wrapper of one handle) too, and
    // the id stays while any wrapper lives.
    let other = Arc::new(Fake);
    let c = Stream::on_device(KIND, Some((1, 7)), other.clone());
    assert_eq!(c.id(), a.id());
    drop((a, b, s));
    assert_eq!(Stream::known_id(KIND, (1, 7)), Some(c.id()));
    assert_eq!(Stream::on_device(KIND, Some((1, 7)), other).id(), c.id());
    // Other keys (another handle, the same handle in another context) and unkeyed
    // streams are other streams.
    let s = Arc::new(Fake);
    let ids = [
        Stream::on_device(KIND, Some((1, 8)), s.clone()).id(),
        Stream::on_device(KIND, Some((2, 7)), s.clone()).id(),
        Stream::on_device(KIND, None, s.clone()).id(),
        Stream::on_device(KIND, None, s).id(),
    ];
    for (i, id) in ids.iter().enumerate() {
        assert_ne!(*id, c.id());
        assert!(!ids[..i].contains(id), "{ids:?}");
    }
}

#[test]
fn a_reused_handle_is_a_new_stream() {
    const KIND: &str = "test-reuse";
    let first = Stream::on_device(KIND, Some((1, 7)), Arc::new(Fake));
    let id = first.id();
    // The stream lives as long as a wrapper of it: the key still names it.
    let found = Stream::find::<Fake>(KIND, (1, 7)).unwrap();
    assert_eq!(found.id(), id);
    assert!(found.device::<Arc<Fake>>().is_some());
    assert!(Stream::find::<u8>(KIND, (1, 7)).is_none(), "another type");
    drop((first, found));
    // Every wrapper is gone, so the stream may be destroyed and its handle reused
    // by a new stream: that one is not taken for the old.
    assert_eq!(Stream::known_id(KIND, (1, 7)), None);
    assert!(Stream::find::<Fake>(KIND, (1, 7)).is_none());
    let second = Stream::on_device(KIND, Some((1, 7)), Arc::new(Fake));
    assert_ne!(second.id(), id);
}

#[test]
fn the_registry_keeps_only_live_streams() {
    const KIND: &str = "test-growth";
    let kept = Stream::on_device(KIND, Some((0, 0)), Arc::new(Fake));
    for raw in 1..1000 {
        let s = Arc::new(Fake);
        // Wrapped many times while it lives: one entry.
        for _ in 0..3 {
            Stream::on_device(KIND, Some((0, raw)), s.clone());
        }
        assert!(entries(KIND) <= 3, "{} entries", entries(KIND));
    }
    assert_eq!(Stream::known_id(KIND, (0, 0)), Some(kept.id()));
}
