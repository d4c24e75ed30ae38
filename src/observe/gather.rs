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

/// A [`PoolSnapshot`] on the wire.
#[derive(Serialize, Deserialize)]
struct WireSnapshot {
    pool: String,
    rank: usize,
    world_size: usize,
    segments: Vec<SegmentView>,
    stats: Vec<(String, WireStat)>,
}

impl WireSnapshot {
    fn of(snap: PoolSnapshot) -> Self {
        let stats = (snap.stats.into_iter())
            .map(|(k, v)| match v {
                StatValue::Count(n) => (k, WireStat::Count(n)),
                StatValue::Real(x) => (k, WireStat::Real(x)),
            })
            .collect();
        WireSnapshot {
            pool: snap.pool,
            rank: snap.rank,
            world_size: snap.world_size,
            segments: snap.segments,
            stats,
        }
    }

    fn into_snapshot(self) -> PoolSnapshot {
        PoolSnapshot {
            pool: self.pool,
            rank: self.rank,
            world_size: self.world_size,
            segments: self.segments,
            stats: (self.stats.into_iter())
                .map(|(k, v)| match v {
                    WireStat::Count(n) => (k, StatValue::Count(n)),
                    WireStat::Real(x) => (k, StatValue::Real(x)),
                })
                .collect(),
        }
    }
}

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
        let (_, _, gathered) = self.observe_with(|_, segments, stats| {
            let mine = WireSnapshot::of(self.snapshot_of(segments.to_vec(), stats.clone()));
            // Under the pool's lock, as an agreement: no other round of this rank on
            // the pool's channel runs meanwhile. This rank's own comes back decoded too.
            gather_records(exchange, channel, "memory snapshot", &mine, deadline)
        });
        let all = gathered?.into_iter();
        Ok(all.map(WireSnapshot::into_snapshot).collect())
    }
}
