use super::*;
use std::thread;
use std::time::Duration;

impl<K: Ord + Copy, T: Clone> Rendezvous<K, T> {
    /// Warn every `interval` (instead of [`WAIT_WARNING_INTERVAL`]) in a long wait.
    pub(crate) fn with_wait_warning_interval(mut self, interval: Duration) -> Self {
        self.warn_every = interval;
        self
    }

    /// Rounds still held (nothing leaks after timeouts).
    pub(crate) fn rounds_held(&self) -> usize {
        self.state.lock().rounds.len()
    }
}

#[test]
fn a_timeout_breaks_the_rendezvous_and_leaves_nothing_behind() {
    let rv = Rendezvous::new(2);
    assert!(matches!(
        rv.gather(
            "test",
            0,
            1,
            7u64,
            Deadline::after(Duration::from_millis(50)),
            || false
        ),
        Err(Error::Timeout { .. })
    ));
    assert!(matches!(
        rv.gather(
            "test",
            1,
            1,
            8u64,
            Deadline::after(Duration::from_secs(5)),
            || false
        ),
        Err(Error::GroupBroken { rank: 0, .. })
    ));
    assert_eq!(rv.rounds_held(), 0, "nothing left behind");
}

#[test]
fn gathers_in_rank_order() {
    let rv = Rendezvous::new(3);
    let out: Vec<Vec<u64>> = thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let rv = &rv;
                s.spawn(move || rv.gather("test", r, 1, r as u64 * 10, Deadline::never(), || false))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for o in out {
        assert_eq!(o, vec![0, 10, 20]);
    }
}
