//! Rounds of a gather among the threads of one process: what the host backend's
//! registrations and collectives pair their ranks with.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Rounds of a gather among the threads of one process, matched by each rank's own
/// round counter. A round is dropped once every rank has read it.
///
/// A timeout breaks the group for good: the rank that timed out withdraws its post
/// (so no late peer pairs with it) and every later or still-waiting gather fails with
/// [`Error::GroupBroken`]. After a timeout the ranks' round counters are out of step,
/// and pairing later rounds would match different calls with each other.
pub(crate) struct Rendezvous<T> {
    world: usize,
    state: Mutex<RvState<T>>,
    cv: Condvar,
}

struct RvState<T> {
    rounds: BTreeMap<u64, Round<T>>,
    /// The rank that timed out first, and in what.
    broken: Option<(usize, &'static str)>,
}

struct Round<T> {
    posted: Vec<Option<T>>,
    read: usize,
}

impl<T: Clone> Rendezvous<T> {
    pub(crate) fn new(world: usize) -> Self {
        Rendezvous {
            world,
            state: Mutex::new(RvState {
                rounds: BTreeMap::new(),
                broken: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Post `value` for `rank` in `round` and wait until every rank has posted in that
    /// round.
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout` (which breaks the group);
    /// [`Error::GroupBroken`] if a rank timed out before or while waiting.
    pub(crate) fn gather(
        &self,
        op: &'static str,
        rank: usize,
        round: u64,
        value: T,
        timeout: Duration,
    ) -> Result<Vec<T>> {
        let deadline = crate::control::deadline_after(Instant::now(), timeout);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((by, what)) = state.broken {
            return Err(Error::GroupBroken { rank: by, op: what });
        }
        let world = self.world;
        let entry = state.rounds.entry(round).or_insert_with(|| Round {
            posted: vec![None; world],
            read: 0,
        });
        entry.posted[rank] = Some(value);
        self.cv.notify_all();
        loop {
            let complete = state
                .rounds
                .get(&round)
                .is_some_and(|r| r.posted.iter().all(Option::is_some));
            if complete {
                break;
            }
            if let Some((by, what)) = state.broken {
                Self::withdraw(&mut state, round, rank);
                return Err(Error::GroupBroken { rank: by, op: what });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = state.rounds.get(&round).map_or_else(Vec::new, |r| {
                    r.posted
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.is_none())
                        .map(|(i, _)| i)
                        .collect()
                });
                Self::withdraw(&mut state, round, rank);
                state.broken = Some((rank, op));
                self.cv.notify_all();
                return Err(Error::Timeout {
                    op,
                    waited: timeout,
                    missing_ranks: missing,
                });
            }
            state = self
                .cv
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let complete = state
            .rounds
            .get_mut(&round)
            .and_then(|r| Some((r.posted.iter().cloned().collect::<Option<Vec<T>>>()?, r)));
        let Some((out, r)) = complete else {
            return Err(Error::Internal {
                what: format!("rendezvous round {round} vanished while complete"),
            });
        };
        r.read += 1;
        if r.read == world {
            state.rounds.remove(&round);
        }
        Ok(out)
    }

    /// Take `rank`'s post out of `round` (dropping the round once empty).
    fn withdraw(state: &mut RvState<T>, round: u64, rank: usize) {
        if let Some(r) = state.rounds.get_mut(&round) {
            r.posted[rank] = None;
            if r.posted.iter().all(Option::is_none) {
                state.rounds.remove(&round);
            }
        }
    }

    /// Rounds still held (for tests: nothing leaks after timeouts).
    #[cfg(test)]
    pub(crate) fn rounds_held(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rounds
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn a_timeout_breaks_the_rendezvous_and_leaves_nothing_behind() {
        let rv = Rendezvous::new(2);
        assert!(matches!(
            rv.gather("test", 0, 1, 7u64, Duration::from_millis(50)),
            Err(Error::Timeout { .. })
        ));
        assert!(matches!(
            rv.gather("test", 1, 1, 8u64, Duration::from_secs(5)),
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
                    s.spawn(move || rv.gather("test", r, 1, r as u64 * 10, Duration::MAX))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        for o in out {
            assert_eq!(o, vec![0, 10, 20]);
        }
    }
}
