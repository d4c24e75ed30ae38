//! Host-side exchange among ranks, used to agree before collective pool operations.
//!
//! NCCL cannot report divergence: if ranks' registration sequences differ they hang
//! in bootstrap or silently pair the wrong buffers. So before every collective pool
//! operation the ranks exchange a small record (call count, requested size, running
//! hash of all pool calls, recent history) over an [`Exchange`], with a timeout. The
//! crate provides [`LocalExchange`] for ranks that are threads of one process; a
//! runtime with one rank per process plugs in its own (a TCP store, MPI, ...).

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// An all-gather of small host-side messages among the ranks of a pool.
///
/// # Collective
/// Every rank calls [`all_gather`](Self::all_gather) the same number of times, in the
/// same order. If a rank does not arrive within `timeout`, the call returns
/// [`Error::Timeout`] naming the missing ranks instead of blocking forever.
pub trait Exchange: Send + Sync + fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Contribute `payload` and return every rank's payload, in rank order. `op` names
    /// the operation waiting (`"close"`, `"growth"`), for errors.
    ///
    /// # Errors
    /// [`Error::Timeout`] if some rank does not contribute within `timeout`.
    fn all_gather(
        &self,
        op: &'static str,
        payload: Vec<u64>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u64>>>;
}

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

/// Far enough to mean "no deadline" for a `Duration::MAX` timeout.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

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
        let now = Instant::now();
        let deadline = now
            .checked_add(timeout)
            .or_else(|| now.checked_add(FOREVER))
            .unwrap_or(now);
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

/// An [`Exchange`] among ranks that are threads of one process.
///
/// Made for a whole group at once with [`LocalExchange::group`]; hand one to each
/// rank's thread.
pub struct LocalExchange {
    rank: usize,
    shared: Arc<Rendezvous<Vec<u64>>>,
    round: Mutex<u64>,
}

impl LocalExchange {
    /// One exchange per rank for `world_size` ranks.
    ///
    /// # Panics
    /// If `world_size` is 0.
    #[track_caller]
    pub fn group(world_size: usize) -> Vec<LocalExchange> {
        assert!(world_size > 0, "a group needs at least one rank");
        let shared = Arc::new(Rendezvous::new(world_size));
        (0..world_size)
            .map(|rank| LocalExchange {
                rank,
                shared: shared.clone(),
                round: Mutex::new(0),
            })
            .collect()
    }
}

impl fmt::Debug for LocalExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalExchange")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world)
            .finish()
    }
}

impl Exchange for LocalExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(
        &self,
        op: &'static str,
        payload: Vec<u64>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u64>>> {
        let mut round = self.round.lock().unwrap_or_else(|p| p.into_inner());
        *round += 1;
        self.shared.gather(op, self.rank, *round, payload, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn gathers_in_rank_order() {
        let group = LocalExchange::group(3);
        let out: Vec<_> = thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|x| {
                    s.spawn(move || {
                        x.all_gather("test", vec![x.rank() as u64 * 10], Duration::from_secs(5))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        for o in out {
            assert_eq!(o, vec![vec![0], vec![10], vec![20]]);
        }
    }

    #[test]
    fn missing_rank_times_out_naming_it() {
        let group = LocalExchange::group(3);
        let (a, b) = thread::scope(|s| {
            let a = s.spawn(|| group[0].all_gather("test", vec![1], Duration::from_millis(200)));
            let b = s.spawn(|| group[1].all_gather("test", vec![1], Duration::from_secs(30)));
            (a.join().unwrap(), b.join().unwrap())
        });
        match a {
            Err(Error::Timeout { missing_ranks, .. }) => assert_eq!(missing_ranks, vec![2]),
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            matches!(b, Err(Error::GroupBroken { rank: 0, .. })),
            "{b:?}"
        );
    }

    #[test]
    fn a_timeout_breaks_the_group_for_every_rank() {
        let group = LocalExchange::group(2);
        assert!(matches!(
            group[0].all_gather("test", vec![7], Duration::from_millis(50)),
            Err(Error::Timeout { .. })
        ));
        // The late rank does not pair with the withdrawn post; it learns who broke it.
        for _ in 0..2 {
            match group[1].all_gather("test", vec![8], Duration::from_secs(5)) {
                Err(Error::GroupBroken { rank: 0, .. }) => {}
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            group[0].all_gather("test", vec![9], Duration::from_secs(5)),
            Err(Error::GroupBroken { rank: 0, .. })
        ));
        assert_eq!(group[0].shared.rounds_held(), 0, "nothing left behind");
    }

    #[test]
    fn waiting_ranks_fail_as_soon_as_a_peer_times_out() {
        let group = LocalExchange::group(3);
        let started = Instant::now();
        let errs: Vec<Error> = thread::scope(|s| {
            let a = s.spawn(|| group[0].all_gather("test", vec![1], Duration::from_millis(100)));
            let b = s.spawn(|| group[1].all_gather("test", vec![1], Duration::from_secs(30)));
            vec![
                a.join().unwrap().unwrap_err(),
                b.join().unwrap().unwrap_err(),
            ]
        });
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(matches!(errs[0], Error::Timeout { .. }));
        assert!(matches!(errs[1], Error::GroupBroken { rank: 0, .. }));
    }

    #[test]
    fn an_endless_timeout_does_not_overflow() {
        let group = LocalExchange::group(1);
        assert_eq!(
            group[0].all_gather("test", vec![5], Duration::MAX).unwrap(),
            vec![vec![5]]
        );
    }
}
