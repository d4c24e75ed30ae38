//! [`LocalExchange`]: the ranks are threads of one process.

use super::{ChannelId, GatherRounds, Rendezvous, Round, Rounds};
use crate::error::Result;
use std::fmt;
use std::sync::Arc;

/// An [`Exchange`](super::Exchange) among ranks that are threads of one process.
///
/// Made for a whole group at once with [`LocalExchange::group`]; hand one to each
/// rank's thread. Payloads have no size limit beyond memory.
pub struct LocalExchange {
    /// The group's rounds, matched by (channel, round).
    shared: Arc<Rendezvous<(ChannelId, u64), Vec<u8>>>,
    rounds: Rounds,
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
                shared: shared.clone(),
                rounds: Rounds::new(rank, world_size, usize::MAX),
            })
            .collect()
    }
}

impl fmt::Debug for LocalExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalExchange")
            .field("rank", &self.rounds.rank)
            .field("world_size", &self.rounds.world_size)
            .finish()
    }
}

impl GatherRounds for LocalExchange {
    fn rounds(&self) -> &Rounds {
        &self.rounds
    }

    fn gather_round(&self, round: Round<'_>) -> Result<Vec<Vec<u8>>> {
        let key = (round.channel, round.number);
        let (rank, payload) = (self.rounds.rank, round.payload.to_vec());
        self.shared
            .gather(round.op, rank, key, payload, round.deadline)
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/local.rs"]
mod tests;
