//! The agreement ranks reach before every collective pool operation (growth,
//! `reserve`, `trim`, `close`, `fit_to_peak`), and the readiness flags it carries.
//!
//! The ranks exchange one [`AgreementRecord`] each: the operation, the pool's call
//! count, requested size, call hash, allocator state digest, the recent calls, and
//! whether the rank's pool is broken. A broken pool on any rank is
//! [`Error::PoolBroken`] on every rank, before the records are compared (a broken
//! rank's refused calls are not in its history, so its record differs for that reason
//! alone); `close` goes on regardless, to release the memory. Otherwise identical
//! records mean identical allocator states, so the registrations that follow pair the
//! right segments. Any difference is [`Error::Divergence`] on every rank, naming the
//! first differing call.

use super::history::{CallRecord, History};
use super::record::{self, Fields, Value, first_difference};
use crate::control::{ChannelId, Exchange};
use crate::deadline::Deadline;
use crate::error::{Divergence, Error, Result};
use serde::{Deserialize, Serialize};

/// The collective pool operation being agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Op {
    Grow,
    Reserve,
    Trim,
    Close,
    FitToPeak,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Grow => "growth",
            Op::Reserve => "reserve",
            Op::Trim => "trim",
            Op::Close => "close",
            Op::FitToPeak => "fit_to_peak",
        }
    }
}

/// A rank's readiness for a collective pool operation, carried in the agreement (as
/// its per-rank value) so that a rank-local obstacle fails every rank the same way
/// instead of leaving the others to time out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Readiness {
    /// Nothing stands in the way.
    Ready = 1,
    /// A stream of the operation is capturing a CUDA graph: no registration now.
    Capturing = 2,
    /// A window registration failed earlier (on some rank; every rank learnt it in
    /// the growth's outcome round): the ranks' windows may be out of step.
    RegistrationBroken = 3,
    /// This rank's pool is broken (a panic under its lock, an internal error).
    PoolBroken = 4,
}

impl Readiness {
    pub(crate) fn from_u64(x: u64) -> Option<Self> {
        Some(match x {
            1 => Readiness::Ready,
            2 => Readiness::Capturing,
            3 => Readiness::RegistrationBroken,
            4 => Readiness::PoolBroken,
            _ => return None,
        })
    }
}

/// One rank's record of an agreement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AgreementRecord {
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) size: u64,
    pub(crate) hash: u64,
    pub(crate) state: u64,
    /// A per-rank value that may differ (readiness, an outcome): returned, not compared.
    pub(crate) extra: u64,
    /// The rank's pool is broken.
    pub(crate) broken: bool,
    pub(crate) recent: Vec<CallRecord>,
    /// At `close`: the rank's live buffers (at most [`MAX_LIVE_NAMED`]), to name them
    /// when they refuse the close; empty otherwise. Not compared.
    pub(crate) live: Vec<LiveBuffer>,
}

/// A live buffer as a `close` that it refuses names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LiveBuffer {
    pub(crate) segment: u32,
    pub(crate) offset_bytes: u64,
    pub(crate) requested_bytes: u64,
}

impl std::fmt::Display for LiveBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} B at segment {} offset {}",
            self.requested_bytes, self.segment, self.offset_bytes
        )
    }
}

/// Most live buffers a rank names in a `close` agreement.
pub(crate) const MAX_LIVE_NAMED: usize = 16;

impl AgreementRecord {
    pub(crate) fn new(
        history: &History,
        op: Op,
        size: u64,
        state: u64,
        extra: u64,
        broken: bool,
    ) -> Self {
        AgreementRecord {
            op,
            seq: history.seq(),
            size,
            hash: history.hash(),
            state,
            extra,
            broken,
            recent: history.recent().copied().collect(),
            live: Vec::new(),
        }
    }

    /// The same record naming `live` buffers (a `close`'s), the first
    /// [`MAX_LIVE_NAMED`] of them.
    pub(crate) fn with_live(mut self, live: impl IntoIterator<Item = LiveBuffer>) -> Self {
        self.live = live.into_iter().take(MAX_LIVE_NAMED).collect();
        self
    }
}

impl Fields for AgreementRecord {
    const NAMES: &'static [&'static str] = &[
        "operation",
        "pool call count",
        "size",
        "pool call hash",
        "allocator state",
    ];

    fn field(&self, i: usize) -> Value {
        match i {
            0 => Value::Name(self.op.name()),
            1 => Value::Number(self.seq),
            2 => Value::Number(self.size),
            3 => Value::Hex(self.hash),
            _ => Value::Hex(self.state),
        }
    }
}

/// Exchange this rank's record with all ranks and check they agree; every rank's
/// record (`None`: unreadable, possible only when a broken rank or a close with live
/// buffers skipped the comparison).
///
/// `during` names the round for errors. The records come back in rank order with
/// their `extra` values, which may differ.
///
/// # Errors
/// [`Error::Timeout`] if a rank does not arrive by `deadline`; [`Error::PoolBroken`]
/// (with a reason naming the first broken rank) if any rank's pool is broken, unless
/// the operation is [`Op::Close`], which then skips the comparison;
/// [`Error::Divergence`] if records differ in operation, call count, size, hash or
/// allocator state (but for a `close` on every rank where some rank has live
/// buffers: the close fails on them, and a buffer dropped late on one rank shows in
/// its history, not as a divergence).
pub(crate) fn agree_records(
    exchange: &dyn Exchange,
    channel: ChannelId,
    during: &'static str,
    mine: &AgreementRecord,
    deadline: Deadline,
) -> Result<Vec<Option<AgreementRecord>>> {
    let span = tracing::debug_span!(target: "symmpool::pool", "agreement", rank = exchange.rank(), during, size = mine.size);
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let all = exchange.all_gather(channel, during, &record::encode(mine)?, deadline)?;
    let me = exchange.rank();
    let records: Vec<Option<AgreementRecord>> = all.iter().map(|b| record::decode(b)).collect();
    if records.len() != exchange.world_size() || records.get(me) != Some(&Some(mine.clone())) {
        return Err(Error::Internal {
            what: format!(
                "the exchange returned {} records for {} ranks, or not this rank's own record",
                records.len(),
                exchange.world_size()
            ),
        });
    }
    // A broken rank refuses calls without recording them: its history says nothing
    // about the peers', so brokenness wins over any difference of the records.
    if let Some(rank) = records
        .iter()
        .position(|r| r.as_ref().is_some_and(|r| r.broken))
    {
        if mine.op == Op::Close {
            return Ok(records);
        }
        return Err(Error::PoolBroken {
            reason: format!("rank {rank}'s pool is broken"),
        });
    }
    let decoded: Option<Vec<&AgreementRecord>> = records.iter().map(Option::as_ref).collect();
    if let Some(decoded) = &decoded
        && decoded.iter().all(|r| r.op == Op::Close)
        && decoded.iter().any(|r| r.extra > 0)
    {
        // Every rank closes and some hold live buffers: the close fails on them (a
        // buffer dropped late on one rank is a free in its history alone).
        return Ok(records);
    }
    if let Some(decoded) = decoded
        && first_difference(&decoded).is_none()
    {
        tracing::debug!(target: "symmpool::pool", rank = me, during, world = records.len(),
            seconds = started.elapsed().as_secs_f64(), "ranks agreed");
        return Ok(records);
    }
    Err(Error::Divergence(Box::new(explain(&records, during))))
}

/// Find the first call where the ranks' histories differ.
fn explain(records: &[Option<AgreementRecord>], during: &'static str) -> Divergence {
    let decoded: Vec<&AgreementRecord> = records.iter().flatten().collect();
    if decoded.len() != records.len() {
        return Divergence {
            during,
            first_differing_call: None,
            history_gone: None,
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
    let call_at = |r: &AgreementRecord, seq: u64| r.recent.iter().find(|c| c.seq == seq).copied();
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
                history_gone: None,
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
            history_gone: None,
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
    // Unless only the operation differs, the first differing call is older than
    // every call the ranks remember: say where each rank is.
    let remembered = decoded.iter().map(|r| r.recent.len()).max().unwrap_or(0);
    Divergence {
        during,
        first_differing_call: if same_history { Some(hi + 1) } else { None },
        history_gone: (!same_history).then_some(remembered),
        calls: decoded
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let what = if same_history {
                    format!("{} ({} B)", r.op.name(), r.size)
                } else {
                    let latest = r
                        .recent
                        .last()
                        .map_or("no calls".into(), |c| format!("latest {}", c.describe()));
                    format!("pool call count {}, hash {:#018x}, {latest}", r.seq, r.hash)
                };
                (rank, Some(what))
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::history::CallKind;

    fn rec(h: &History, op: Op, size: u64) -> Option<AgreementRecord> {
        Some(AgreementRecord::new(h, op, size, 0, 0, false))
    }

    /// How two ranks with these histories diverge at a growth.
    fn at_growth(a: &History, b: &History) -> Divergence {
        explain(&[rec(a, Op::Grow, 1), rec(b, Op::Grow, 1)], "growth")
    }

    #[test]
    fn identical_histories_agree_and_differences_are_named() {
        let (mut a, mut b) = (History::new(8), History::new(8));
        for h in [&mut a, &mut b] {
            h.record(CallKind::Alloc, 4096, 512);
            h.record(CallKind::Alloc, 8192, 512);
        }
        assert_eq!(rec(&a, Op::Grow, 1), rec(&b, Op::Grow, 1));
        a.record(CallKind::Alloc, 1 << 20, 512);
        b.record(CallKind::Alloc, 2 << 20, 512);
        let d = at_growth(&a, &b);
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
        let (mut a, mut b) = (History::new(8), History::new(8));
        a.record(CallKind::Alloc, 4096, 512);
        b.record(CallKind::Alloc, 4096, 512);
        a.record(CallKind::Free, 1, 0);
        let d = at_growth(&a, &b);
        assert_eq!(d.first_differing_call, Some(2));
        assert_eq!(d.calls[1].1, None);
        assert!(d.to_string().contains("rank 1: (no such call)"), "{d}");
    }

    #[test]
    fn differences_older_than_the_history_are_reported_without_a_call() {
        let (mut a, mut b) = (History::new(2), History::new(2));
        a.record(CallKind::Alloc, 1, 512);
        b.record(CallKind::Alloc, 2, 512);
        for h in [&mut a, &mut b] {
            for _ in 0..3 {
                h.record(CallKind::Alloc, 4096, 512);
            }
        }
        let d = at_growth(&a, &b);
        assert_eq!(d.first_differing_call, None);
        assert_eq!(d.history_gone, Some(2));
        let text = d.to_string();
        assert!(text.contains("older than the 2 calls"), "{text}");
        assert!(text.contains("PoolConfig::history_len"), "{text}");
        assert!(
            text.contains("rank 1: pool call count 4, hash 0x"),
            "{text}"
        );
        assert!(
            text.contains("latest call #4: alloc(4096 B, align 512 B)"),
            "{text}"
        );
    }

    #[test]
    fn same_calls_different_state_is_a_divergence_without_a_call() {
        let a = History::new(4);
        let x = Some(AgreementRecord::new(&a, Op::Grow, 1, 7, 0, false));
        let y = Some(AgreementRecord::new(&a, Op::Grow, 1, 8, 0, false));
        let d = explain(&[x, y], "growth");
        assert_eq!(d.first_differing_call, None);
        assert!(d.to_string().contains("state digest"), "{d}");
    }

    #[test]
    fn an_unreadable_record_is_named_not_a_panic() {
        let a = History::new(4);
        let d = explain(&[rec(&a, Op::Grow, 1), None], "growth");
        assert_eq!(d.first_differing_call, None);
        assert!(d.to_string().contains("unreadable"), "{d}");
    }

    #[test]
    fn same_history_different_operation_names_the_operation() {
        let a = History::new(4);
        let d = explain(
            &[rec(&a, Op::Grow, 1 << 20), rec(&a, Op::Close, 0)],
            "growth",
        );
        assert_eq!(d.first_differing_call, Some(1));
        assert_eq!(d.calls[1].1.as_deref(), Some("close (0 B)"));
    }
}
