//! Every rank's snapshot in one collective call.

use super::snapshot::{PoolSnapshot, SegmentView};
use crate::control::gather_records;
use crate::deadline::Deadline;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::pool::{StatValue, SymmPool};
use serde::{Deserialize, Serialize};

/// A statistic on the wire (postcard cannot read the untagged [`StatValue`]).
#[derive(Serialize, Deserialize)]
enum WireStat {
    Count(u64),
    Real(f64),
}

/// A rank's [`PoolSnapshot`] on the wire: its segments and statistics (the pool's
/// name and the world size are every rank's, the rank is its place among the answers).
type Wire = (Vec<SegmentView>, Vec<(String, WireStat)>);

impl SymmPool {
    /// Every rank's [`memory_snapshot`](Self::memory_snapshot), in rank order, on every
    /// rank: one round on the pool's channel, waiting for the peers until the pool's
    /// timeout. The `memory_map` example draws them side by side.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its sequence of collective pool calls
    /// (growth, `reserve`, `trim`, `close`, and this), as for
    /// [`reserve`](Self::reserve).
    ///
    /// # Errors
    /// [`Error::PayloadTooLarge`] if this rank's encoded snapshot is over the
    /// exchange's payload limit (16 MiB shared by the ranks on the TCP store: some ten
    /// thousand blocks per rank with 8 ranks); [`Error::Timeout`], [`Error::PeerLost`],
    /// [`Error::GroupBroken`] from the exchange; [`Error::Protocol`] if a peer's answer
    /// does not decode (a peer in another collective pool call at this point).
    pub fn gather_memory_snapshots(&self) -> Result<Vec<PoolSnapshot>> {
        let deadline = Deadline::after(self.group().config().timeout);
        let exchange = self.backend().exchange();
        let channel = self.inner.channel;
        let (_, gathered) = self.observe_with(|_, mine| {
            let stats = mine.stats.iter().map(|(k, v)| {
                let v = match *v {
                    StatValue::Count(n) => WireStat::Count(n),
                    StatValue::Real(x) => WireStat::Real(x),
                };
                (k.clone(), v)
            });
            let mine: Wire = (mine.segments.clone(), stats.collect());
            // Under the pool's lock, as an agreement: no other round of this rank on
            // the pool's channel runs meanwhile. This rank's own comes back decoded too.
            gather_records(exchange, channel, "memory snapshot", &mine, deadline)
        });
        let snapshot = |(rank, (segments, stats)): (usize, Wire)| PoolSnapshot {
            pool: self.config().name.clone(),
            rank,
            world_size: self.world_size(),
            segments,
            stats: stats
                .into_iter()
                .map(|(k, v)| match v {
                    WireStat::Count(n) => (k, StatValue::Count(n)),
                    WireStat::Real(x) => (k, StatValue::Real(x)),
                })
                .collect(),
        };
        Ok(gathered?.into_iter().enumerate().map(snapshot).collect())
    }
}
