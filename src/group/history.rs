//! The running record of pool calls: a sequence number, a running hash, and the last
//! few calls, which the ranks compare before every collective pool operation and
//! carry in every checked collective's record.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a call was, for the history and the hash.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[repr(u64)]
pub(crate) enum CallKind {
    Alloc = 1,
    Free = 2,
    Reserve = 3,
    Trim = 4,
    Close = 5,
    FitToPeak = 6,
}

/// One recorded call: `a` and `b` are its arguments (alloc: bytes, alignment; free:
/// the freed allocation's call number, 0; reserve: bytes, 1 for a small segment).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct CallRecord {
    pub(crate) seq: u64,
    pub(crate) kind: CallKind,
    pub(crate) a: u64,
    pub(crate) b: u64,
}

impl CallRecord {
    pub(crate) fn describe(&self) -> String {
        let (a, b) = (self.a, self.b);
        let call = match self.kind {
            CallKind::Alloc => format!("alloc({a} B, align {b} B)"),
            CallKind::Free => format!("free(buffer of call #{a})"),
            CallKind::Reserve if b == 1 => format!("reserve_small({a} B)"),
            CallKind::Reserve => format!("reserve({a} B)"),
            CallKind::Trim => "trim()".into(),
            CallKind::Close => "close()".into(),
            CallKind::FitToPeak => "fit_to_peak()".into(),
        };
        format!("call #{}: {call}", self.seq)
    }
}

/// The call count and running hash that a collective's record carries, written under
/// the pool's lock by [`History::record`] and read lock-free by [`load`](Self::load).
/// Stored hash first, count last (release), loaded count first (acquire): a reader sees
/// a hash at least as new as its count; a pair that mixes two calls needs a pool call
/// on another thread racing the collective, a divergence the checks report anyway.
pub(crate) struct CallHead {
    seq: AtomicU64,
    hash: AtomicU64,
}

impl CallHead {
    /// (calls recorded, running hash).
    #[inline]
    pub(crate) fn load(&self) -> (u64, u64) {
        let seq = self.seq.load(Ordering::Acquire);
        (seq, self.hash.load(Ordering::Acquire))
    }
}

/// Sequence number, running hash and the last `capacity` calls.
pub(crate) struct History {
    seq: u64,
    hash: u64,
    recent: VecDeque<CallRecord>,
    capacity: usize,
    head: Arc<CallHead>,
}

/// A 64-bit mix (SplitMix64's finaliser): deterministic, not seeded per process.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const HASH_SEED: u64 = 0x6a09_e667_f3bc_c908;

impl History {
    pub(crate) fn new(capacity: usize) -> Self {
        History {
            seq: 0,
            hash: HASH_SEED,
            recent: VecDeque::with_capacity(capacity),
            capacity,
            head: Arc::new(CallHead {
                seq: AtomicU64::new(0),
                hash: AtomicU64::new(HASH_SEED),
            }),
        }
    }

    /// Record a call.
    pub(crate) fn record(&mut self, kind: CallKind, a: u64, b: u64) {
        self.seq += 1;
        let call = CallRecord {
            seq: self.seq,
            kind,
            a,
            b,
        };
        self.hash = step(self.hash, &call);
        self.head.hash.store(self.hash, Ordering::Release);
        self.head.seq.store(self.seq, Ordering::Release);
        if self.capacity > 0 {
            if self.recent.len() == self.capacity {
                self.recent.pop_front();
            }
            self.recent.push_back(call);
        }
    }

    /// The running hash of every call recorded so far.
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Calls recorded so far.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The recent calls, oldest first.
    pub(crate) fn recent(&self) -> impl Iterator<Item = &CallRecord> {
        self.recent.iter()
    }

    /// The count and hash as others read them without the lock.
    pub(crate) fn head(&self) -> Arc<CallHead> {
        self.head.clone()
    }
}

/// The running hash after `hash` with `call` recorded.
fn step(hash: u64, call: &CallRecord) -> u64 {
    let (kind, a, b) = (call.kind as u64, call.a, call.b);
    mix(hash ^ mix(call.seq ^ mix(kind ^ mix(a ^ mix(b)))))
}

/// Where a survivor's pool stopped when its group lost a rank.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct Stop {
    /// Calls recorded ([`History::seq`]).
    pub(crate) seq: u64,
    /// Their running hash ([`History::hash`]).
    pub(crate) hash: u64,
    /// Allocations made (the last allocation number).
    pub(crate) allocs: u64,
    /// The last calls ([`History::recent`]).
    pub(crate) recent: Vec<CallRecord>,
}

impl Stop {
    /// Where a pool of `history` and `allocs` allocations stands.
    pub(crate) fn of(history: &History, allocs: u64) -> Stop {
        let recent = history.recent().copied().collect();
        Stop {
            seq: history.seq(),
            hash: history.hash(),
            allocs,
            recent,
        }
    }
}

/// What the survivors of a loss that stopped a few calls apart do to stand at the same
/// call: each replays the calls it lacks of the one furthest on (`calls`, `stops[me]`
/// onwards), and the blocks of the allocations in `pinned` (allocation numbers) that
/// are live then stay allocated on every rank (some rank holds no buffer for them).
/// `None` when they all stopped at the same call, or when a difference cannot be made
/// up, on every rank alike: a call missing from the furthest one's recent calls, one
/// that does not extend a rank's running hash (the ranks diverged), the free of an
/// allocation that rank made (its buffer is still live there), or a `close`. (A
/// `reserve`, `trim` or `fit_to_peak` made up is only recorded: the agreement it
/// records before could not be reached without the ranks behind.) The agreement then
/// reports what differs.
pub(crate) fn catch_up(
    stops: &[Stop],
    me: usize,
) -> Option<(Vec<CallRecord>, std::ops::RangeInclusive<u64>)> {
    let ahead = stops.iter().max_by_key(|s| s.seq)?;
    let calls_after = |s: &Stop| -> Option<Vec<CallRecord>> {
        let calls: Vec<CallRecord> = (ahead.recent.iter())
            .filter(|c| c.seq > s.seq)
            .copied()
            .collect();
        let hash = calls.iter().fold(s.hash, step);
        let made_up = calls.iter().all(|c| match c.kind {
            CallKind::Alloc => true,
            // A free of an allocation made after `s` stopped; an earlier one's buffer
            // is still live there.
            CallKind::Free => c.a > s.allocs,
            // Recorded before their agreement, which `s` never joined: they failed
            // and changed no memory.
            CallKind::Reserve | CallKind::Trim | CallKind::FitToPeak => true,
            CallKind::Close => false,
        });
        (calls.len() as u64 == ahead.seq - s.seq && hash == ahead.hash && made_up).then_some(calls)
    };
    let plans: Option<Vec<_>> = stops.iter().map(calls_after).collect();
    let least = stops.iter().map(|s| s.allocs).min()?;
    match plans?.swap_remove(me) {
        _ if stops.iter().all(|s| s.seq == ahead.seq) => None,
        calls => Some((calls, least.saturating_add(1)..=ahead.allocs)),
    }
}

/// A digest of an allocator's state (segment count, byte counts, call counts), compared
/// in the agreement beside the call hash.
pub(crate) fn state_digest(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x243f_6a88_85a3_08d3, |h, &p| mix(h ^ mix(p)))
}

#[cfg(test)]
#[path = "../../tests/unit/group/history.rs"]
mod tests;
