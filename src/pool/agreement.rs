//! The running record of pool calls, and the agreement ranks reach before every
//! collective pool operation.
//!
//! Every pool call that can influence placement (alloc, free, reserve, trim, close)
//! advances a sequence number and a running hash, and is kept in a short history.
//! Before growth, `reserve`, `trim` and `close`, the ranks exchange (operation, call
//! count, requested size, hash, history) and whether their pool is broken. A broken
//! pool on any rank is [`Error::PoolBroken`] on every rank, before the records are
//! compared (a broken rank's refused calls are not in its history, so its record
//! differs for that reason alone); `close` goes on regardless, to release the memory.
//! Otherwise identical records mean identical allocator states, so the registrations
//! that follow pair the right segments. Any difference is [`Error::Divergence`] on
//! every rank, naming the first differing call.

use crate::control::{ChannelId, Exchange};
use crate::error::{Divergence, Error, Result};
use std::collections::VecDeque;
use std::time::Duration;

/// What a call was, for the history and the hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum CallKind {
    Alloc = 1,
    Free = 2,
    Reserve = 3,
    Trim = 4,
    Close = 5,
    FitToPeak = 6,
}

impl CallKind {
    fn from_u64(x: u64) -> Option<Self> {
        Some(match x {
            1 => CallKind::Alloc,
            2 => CallKind::Free,
            3 => CallKind::Reserve,
            4 => CallKind::Trim,
            5 => CallKind::Close,
            6 => CallKind::FitToPeak,
            _ => return None,
        })
    }
}

/// One recorded call: `a` and `b` are its arguments (alloc: bytes, alignment; free:
/// the freed allocation's call number, 0; reserve: bytes, 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallRecord {
    pub(crate) seq: u64,
    pub(crate) kind: CallKind,
    pub(crate) a: u64,
    pub(crate) b: u64,
}

impl CallRecord {
    pub(crate) fn describe(&self) -> String {
        match self.kind {
            CallKind::Alloc => format!(
                "call #{}: alloc({} B, align {} B)",
                self.seq, self.a, self.b
            ),
            CallKind::Free => format!("call #{}: free(buffer of call #{})", self.seq, self.a),
            CallKind::Reserve if self.b == 1 => {
                format!("call #{}: reserve_small({} B)", self.seq, self.a)
            }
            CallKind::Reserve => format!("call #{}: reserve({} B)", self.seq, self.a),
            CallKind::Trim => format!("call #{}: trim()", self.seq),
            CallKind::Close => format!("call #{}: close()", self.seq),
            CallKind::FitToPeak => format!("call #{}: fit_to_peak()", self.seq),
        }
    }
}

/// Sequence number, running hash and the last `capacity` calls.
#[derive(Debug, Clone)]
pub(crate) struct History {
    seq: u64,
    hash: u64,
    recent: VecDeque<CallRecord>,
    capacity: usize,
}

/// A 64-bit mix (SplitMix64's finaliser): deterministic, not seeded per process.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl History {
    pub(crate) fn new(capacity: usize) -> Self {
        History {
            seq: 0,
            hash: 0x6a09_e667_f3bc_c908,
            recent: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Record a call and return its sequence number.
    pub(crate) fn record(&mut self, kind: CallKind, a: u64, b: u64) -> u64 {
        self.seq += 1;
        let seq = self.seq;
        self.hash = mix(self.hash ^ mix(seq ^ mix((kind as u64) ^ mix(a ^ mix(b)))));
        if self.capacity > 0 {
            if self.recent.len() == self.capacity {
                self.recent.pop_front();
            }
            self.recent.push_back(CallRecord { seq, kind, a, b });
        }
        seq
    }

    /// The running hash of every call recorded so far.
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Calls recorded so far.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Encode the agreement record for `during` (an operation code) with `size`.
    fn encode(&self, op: u64, size: u64, state: u64, extra: u64, broken: bool) -> Vec<u64> {
        let mut v = vec![
            MAGIC,
            op,
            self.seq,
            size,
            self.hash,
            state,
            extra,
            u64::from(broken),
            self.recent.len() as u64,
        ];
        for r in &self.recent {
            v.extend([r.seq, r.kind as u64, r.a, r.b]);
        }
        v
    }
}

const MAGIC: u64 = 0x5359_4d4d_504f_4f4c; // "SYMMPOOL"

/// A decoded agreement record from one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) op: u64,
    pub(crate) seq: u64,
    pub(crate) size: u64,
    pub(crate) hash: u64,
    pub(crate) state: u64,
    pub(crate) extra: u64,
    /// The rank's pool is broken.
    pub(crate) broken: bool,
    pub(crate) recent: Vec<CallRecord>,
}

/// Little-endian 64-bit words of a peer's payload (a trailing partial word is dropped,
/// so a malformed payload decodes to an unreadable record, not a panic).
fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

fn decode(v: &[u64]) -> Option<Record> {
    const HEADER: usize = 9;
    if v.len() < HEADER || v[0] != MAGIC || v[7] > 1 {
        return None;
    }
    let n = usize::try_from(v[8]).ok()?;
    if v.len() != n.checked_mul(4)?.checked_add(HEADER)? {
        return None;
    }
    let recent = v[HEADER..]
        .chunks_exact(4)
        .map(|c| {
            Some(CallRecord {
                seq: c[0],
                kind: CallKind::from_u64(c[1])?,
                a: c[2],
                b: c[3],
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Record {
        op: v[1],
        seq: v[2],
        size: v[3],
        hash: v[4],
        state: v[5],
        extra: v[6],
        broken: v[7] == 1,
        recent,
    })
}

/// Exchange the record of this rank with all ranks and check they agree.
///
/// `op` identifies the operation (and `during` names it for errors), `size` its size
/// argument. `extra` is a per-rank value that may differ (e.g. live buffer count); all
/// ranks' values are returned in rank order. `broken` says this rank's pool is broken.
///
/// # Errors
/// [`Error::Timeout`] if a rank does not arrive; [`Error::PoolBroken`] (with a reason
/// naming the first broken rank) if any rank's pool is broken, unless `op` is
/// [`op::CLOSE`], which then skips the comparison; [`Error::Divergence`] if records
/// differ in operation, call count, size, hash or allocator state.
#[allow(clippy::too_many_arguments)]
pub(crate) fn agree(
    exchange: &dyn Exchange,
    channel: ChannelId,
    history: &History,
    op: u64,
    during: &'static str,
    size: u64,
    state: u64,
    extra: u64,
    broken: bool,
    timeout: Duration,
) -> Result<Vec<u64>> {
    let span = tracing::debug_span!(target: "symmpool::pool", "agreement", rank = exchange.rank(), during, size);
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let sent = history.encode(op, size, state, extra, broken);
    let bytes: Vec<u8> = sent.iter().flat_map(|w| w.to_le_bytes()).collect();
    let all: Vec<Vec<u64>> = exchange
        .all_gather(channel, during, &bytes, timeout)?
        .iter()
        .map(|b| words(b))
        .collect();
    let me = exchange.rank();
    if all.len() != exchange.world_size() || all.get(me) != Some(&sent) {
        return Err(Error::Internal {
            what: format!(
                "the exchange returned {} records for {} ranks, or not this rank's own record",
                all.len(),
                exchange.world_size()
            ),
        });
    }
    let records: Vec<Option<Record>> = all.iter().map(|v| decode(v)).collect();
    let Some(mine) = decode(&sent) else {
        return Err(Error::Internal {
            what: "this rank's own agreement record does not decode".into(),
        });
    };
    let extras = |records: &[Option<Record>]| {
        records
            .iter()
            .map(|r| r.as_ref().map_or(0, |r| r.extra))
            .collect()
    };
    // A broken rank refuses calls without recording them: its history says nothing
    // about the peers', so brokenness wins over any difference of the records.
    if let Some(rank) = records
        .iter()
        .position(|r| r.as_ref().is_some_and(|r| r.broken))
    {
        if op == op::CLOSE {
            return Ok(extras(&records));
        }
        return Err(Error::PoolBroken {
            reason: format!("rank {rank}'s pool is broken"),
        });
    }
    let agrees = |r: &Option<Record>| {
        r.as_ref().is_some_and(|r| {
            r.op == mine.op
                && r.seq == mine.seq
                && r.size == mine.size
                && r.hash == mine.hash
                && r.state == mine.state
        })
    };
    if records.iter().all(agrees) {
        tracing::debug!(target: "symmpool::pool", rank = me, during, world = records.len(),
            seconds = started.elapsed().as_secs_f64(), "ranks agreed");
        return Ok(extras(&records));
    }
    Err(Error::Divergence(Box::new(explain(&records, during, size))))
}

/// Find the first call where the ranks' histories differ.
fn explain(records: &[Option<Record>], during: &'static str, _size: u64) -> Divergence {
    let decoded: Vec<&Record> = records.iter().flatten().collect();
    if decoded.len() != records.len() {
        return Divergence {
            during,
            first_differing_call: None,
            calls: records
                .iter()
                .enumerate()
                .map(|(r, x)| {
                    (
                        r,
                        x.as_ref()
                            .map(|_| "valid record".to_string())
                            .or(Some("unreadable agreement record".into())),
                    )
                })
                .collect(),
        };
    }
    // The calls every rank still remembers start at the largest oldest-seq.
    let lo = decoded
        .iter()
        .map(|r| r.recent.first().map_or(r.seq + 1, |c| c.seq))
        .max()
        .unwrap_or(1);
    let hi = decoded.iter().map(|r| r.seq).max().unwrap_or(0);
    let call_at = |r: &Record, seq: u64| r.recent.iter().find(|c| c.seq == seq).copied();
    for seq in lo..=hi {
        let calls: Vec<Option<CallRecord>> = decoded
            .iter()
            .map(|r| call_at(r, seq).map(|c| CallRecord { seq, ..c }))
            .collect();
        let same = calls.windows(2).all(|w| match (w[0], w[1]) {
            (Some(a), Some(b)) => (a.kind, a.a, a.b) == (b.kind, b.a, b.b),
            (None, None) => true,
            _ => false,
        });
        if !same {
            return Divergence {
                during,
                first_differing_call: Some(seq),
                calls: calls
                    .iter()
                    .enumerate()
                    .map(|(r, c)| (r, c.map(|c| c.describe())))
                    .collect(),
            };
        }
    }
    // Every remembered call matches: the difference is older than the history, or it
    // is in the operation itself.
    let same_history = decoded
        .windows(2)
        .all(|w| w[0].hash == w[1].hash && w[0].seq == w[1].seq);
    let same_request = decoded
        .windows(2)
        .all(|w| w[0].op == w[1].op && w[0].size == w[1].size);
    if same_history && same_request {
        // Same calls, different allocator states: something outside the recorded
        // calls changed one rank's allocator (a bug, or memory released on one rank).
        return Divergence {
            during,
            first_differing_call: None,
            calls: decoded
                .iter()
                .enumerate()
                .map(|(rank, r)| {
                    (
                        rank,
                        Some(format!("allocator state digest {:#018x}", r.state)),
                    )
                })
                .collect(),
        };
    }
    Divergence {
        during,
        first_differing_call: if same_history { Some(hi + 1) } else { None },
        calls: decoded
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let what = if same_history {
                    format!("{} ({} B)", op_name(r.op), r.size)
                } else {
                    r.recent
                        .last()
                        .map_or("no calls".into(), |c| format!("latest {}", c.describe()))
                };
                (rank, Some(what))
            })
            .collect(),
    }
}

/// A digest of an allocator's state (segment count, byte counts, call counts), compared
/// in the agreement beside the call hash.
pub(crate) fn state_digest(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x243f_6a88_85a3_08d3, |h, &p| mix(h ^ mix(p)))
}

/// Operation codes of the agreement.
pub(crate) mod op {
    pub(crate) const GROW: u64 = 1;
    pub(crate) const RESERVE: u64 = 2;
    pub(crate) const TRIM: u64 = 3;
    pub(crate) const CLOSE: u64 = 4;
    pub(crate) const FIT: u64 = 5;
}

fn op_name(op: u64) -> &'static str {
    match op {
        op::GROW => "growth",
        op::RESERVE => "reserve",
        op::TRIM => "trim",
        op::CLOSE => "close",
        op::FIT => "fit_to_peak",
        _ => "unknown operation",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(h: &History, op: u64, size: u64) -> Option<Record> {
        decode(&h.encode(op, size, 0, 0, false))
    }

    #[test]
    fn identical_histories_agree_and_differences_are_named() {
        let mut a = History::new(8);
        let mut b = History::new(8);
        for h in [&mut a, &mut b] {
            h.record(CallKind::Alloc, 4096, 512);
            h.record(CallKind::Alloc, 8192, 512);
        }
        assert_eq!(rec(&a, op::GROW, 1), rec(&b, op::GROW, 1));
        a.record(CallKind::Alloc, 1 << 20, 512);
        b.record(CallKind::Alloc, 2 << 20, 512);
        let d = explain(&[rec(&a, op::GROW, 1), rec(&b, op::GROW, 1)], "growth", 1);
        assert_eq!(d.first_differing_call, Some(3));
        assert_eq!(
            d.calls[0].1.as_deref(),
            Some("call #3: alloc(1048576 B, align 512 B)")
        );
        assert_eq!(
            d.calls[1].1.as_deref(),
            Some("call #3: alloc(2097152 B, align 512 B)")
        );
    }

    #[test]
    fn an_extra_call_on_one_rank_is_named() {
        let mut a = History::new(8);
        let mut b = History::new(8);
        a.record(CallKind::Alloc, 4096, 512);
        b.record(CallKind::Alloc, 4096, 512);
        a.record(CallKind::Free, 1, 0);
        let d = explain(&[rec(&a, op::GROW, 1), rec(&b, op::GROW, 1)], "growth", 1);
        assert_eq!(d.first_differing_call, Some(2));
        assert_eq!(d.calls[1].1, None);
        assert!(d.to_string().contains("rank 1: (no such call)"), "{d}");
    }

    #[test]
    fn differences_older_than_the_history_are_reported_without_a_call() {
        let mut a = History::new(2);
        let mut b = History::new(2);
        a.record(CallKind::Alloc, 1, 512);
        b.record(CallKind::Alloc, 2, 512);
        for h in [&mut a, &mut b] {
            for _ in 0..3 {
                h.record(CallKind::Alloc, 4096, 512);
            }
        }
        let d = explain(&[rec(&a, op::GROW, 1), rec(&b, op::GROW, 1)], "growth", 1);
        assert_eq!(d.first_differing_call, None);
    }

    #[test]
    fn same_calls_different_state_is_a_divergence_without_a_call() {
        let a = History::new(4);
        let x = decode(&a.encode(op::GROW, 1, 7, 0, false));
        let y = decode(&a.encode(op::GROW, 1, 8, 0, false));
        let d = explain(&[x, y], "growth", 1);
        assert_eq!(d.first_differing_call, None);
        assert!(d.to_string().contains("state digest"), "{d}");
    }

    #[test]
    fn same_history_different_operation_names_the_operation() {
        let a = History::new(4);
        let d = explain(
            &[rec(&a, op::GROW, 1 << 20), rec(&a, op::CLOSE, 0)],
            "growth",
            0,
        );
        assert_eq!(d.first_differing_call, Some(1));
        assert_eq!(d.calls[1].1.as_deref(), Some("close (0 B)"));
    }
}
