//! [`LocalExchange`]: the ranks are threads of one process.

use super::{ChannelId, Exchange, deadline_after, open_channel_with};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Rounds of a gather among the threads of one process, matched by (channel, round).
/// A round is dropped once every rank has read it.
///
/// A timeout breaks the group for good: the rank that timed out withdraws its post
/// (so no late peer pairs with it) and every later or still-waiting gather, on every
/// channel, fails with [`Error::GroupBroken`].
struct Rendezvous {
    world: usize,
    state: Mutex<RvState>,
    cv: Condvar,
}

struct RvState {
    rounds: BTreeMap<(ChannelId, u64), Round>,
    /// The rank that timed out first, and in what.
    broken: Option<(usize, &'static str)>,
}

struct Round {
    posted: Vec<Option<Vec<u8>>>,
    read: usize,
}

impl Rendezvous {
    fn gather(
        &self,
        op: &'static str,
        rank: usize,
        key: (ChannelId, u64),
        value: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let deadline = deadline_after(Instant::now(), timeout);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((by, what)) = state.broken {
            return Err(Error::GroupBroken { rank: by, op: what });
        }
        let world = self.world;
        let entry = state.rounds.entry(key).or_insert_with(|| Round {
            posted: vec![None; world],
            read: 0,
        });
        entry.posted[rank] = Some(value.to_vec());
        self.cv.notify_all();
        loop {
            if let Some(r) = state.rounds.get_mut(&key)
                && r.posted.iter().all(Option::is_some)
            {
                let out: Vec<Vec<u8>> = r.posted.iter().flatten().cloned().collect();
                r.read += 1;
                if r.read == world {
                    state.rounds.remove(&key);
                }
                return Ok(out);
            }
            if let Some((by, what)) = state.broken {
                Self::withdraw(&mut state, key, rank);
                return Err(Error::GroupBroken { rank: by, op: what });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = state.rounds.get(&key).map_or_else(Vec::new, |r| {
                    r.posted
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.is_none())
                        .map(|(i, _)| i)
                        .collect()
                });
                Self::withdraw(&mut state, key, rank);
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
    }

    /// Take `rank`'s post out of the round (dropping the round once empty).
    fn withdraw(state: &mut RvState, key: (ChannelId, u64), rank: usize) {
        if let Some(r) = state.rounds.get_mut(&key) {
            r.posted[rank] = None;
            if r.posted.iter().all(Option::is_none) {
                state.rounds.remove(&key);
            }
        }
    }
}

/// An [`Exchange`] among ranks that are threads of one process.
///
/// Made for a whole group at once with [`LocalExchange::group`]; hand one to each
/// rank's thread. Payloads have no size limit beyond memory.
pub struct LocalExchange {
    rank: usize,
    shared: Arc<Rendezvous>,
    rounds: Mutex<HashMap<ChannelId, u64>>,
    channels: Mutex<u64>,
}

impl LocalExchange {
    /// One exchange per rank for `world_size` ranks.
    ///
    /// # Panics
    /// If `world_size` is 0.
    #[track_caller]
    pub fn group(world_size: usize) -> Vec<LocalExchange> {
        assert!(world_size > 0, "a group needs at least one rank");
        let shared = Arc::new(Rendezvous {
            world: world_size,
            state: Mutex::new(RvState {
                rounds: BTreeMap::new(),
                broken: None,
            }),
            cv: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| LocalExchange {
                rank,
                shared: shared.clone(),
                rounds: Mutex::new(HashMap::new()),
                channels: Mutex::new(0),
            })
            .collect()
    }

    /// Rounds still held by the group (for tests: nothing leaks after timeouts).
    #[cfg(test)]
    fn rounds_held(&self) -> usize {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rounds
            .len()
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
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let round = {
            let mut rounds = self.rounds.lock().unwrap_or_else(|p| p.into_inner());
            let r = rounds.entry(channel).or_insert(0);
            *r += 1;
            *r
        };
        self.shared
            .gather(op, self.rank, (channel, round), payload, timeout)
    }

    fn open_channel(&self, name: &str, timeout: Duration) -> Result<ChannelId> {
        open_channel_with(self, &self.channels, name, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_left_behind_after_a_timeout() {
        let group = LocalExchange::group(2);
        let ch = ChannelId::CONTROL;
        assert!(matches!(
            group[0].all_gather(ch, "t", &[7], Duration::from_millis(20)),
            Err(Error::Timeout { .. })
        ));
        assert!(matches!(
            group[1].all_gather(ch, "t", &[8], Duration::from_secs(5)),
            Err(Error::GroupBroken { rank: 0, .. })
        ));
        assert_eq!(group[0].rounds_held(), 0);
    }
}
