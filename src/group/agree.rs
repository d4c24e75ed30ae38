//! The agreement ranks reach before every collective pool operation (growth,
//! `reserve`, `trim`, `close`, `fit_to_peak`): one [`AgreementRecord`] per rank (the
//! operation, the pool's call count, hash, recent calls and allocator state digest,
//! its readiness), judged by [`agree_records`]. Identical records mean identical
//! allocator states, so the registrations that follow pair the right segments.

use super::history::{CallRecord, History};
use super::ledger::Ledger;
use super::record::{Fields, Value, first_difference};
use crate::deadline::Deadline;
use crate::error::{Divergence, Error, Result};
use serde::{Deserialize, Serialize};

/// The collective pool operation being agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) enum Op {
    Grow,
    Reserve,
    Trim,
    Close,
    FitToPeak,
    Shrink,
    /// A grow: the group's ranks and newcomers.
    Admit,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Grow => "growth",
            Op::Reserve => "reserve",
            Op::Trim => "trim",
            Op::Close => "close",
            Op::FitToPeak => "fit_to_peak",
            Op::Shrink => "shrink",
            Op::Admit => "grow",
        }
    }
}

/// A rank's readiness for a collective pool operation, carried in the agreement (as
/// its per-rank value) so that a rank-local obstacle fails every rank the same way
/// instead of leaving the others to time out.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) enum Readiness {
    /// Nothing stands in the way.
    Ready,
    /// A stream of the operation is capturing a CUDA graph: no registration now.
    Capturing,
    /// A window registration failed earlier (on some rank; every rank learnt it in
    /// the growth's outcome round): the ranks' windows may be out of step.
    RegistrationBroken,
    /// This rank's pool is broken (a panic under its lock, an internal error).
    PoolBroken,
}

/// What a rank says in an agreement beside what the ranks compare: it may differ
/// between ranks, and comes back to every rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) enum Note {
    /// Before an operation: whether this rank can make it.
    Ready(Readiness),
    /// A growth's confirmation: whether this rank got its segment.
    Allocated(bool),
    /// After a registration: how it went on this rank.
    Registration(Registered),
    /// A `close`: this rank's live buffers.
    Live(u64),
    /// A shrink: this rank's rank before it.
    Was(u64),
}

/// What a rank ready for an operation says, where it has nothing else to say.
pub(crate) const READY: Note = Note::Ready(Readiness::Ready);

/// How a window registration went on a rank (its growth's outcome round).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) enum Registered {
    Yes,
    /// It failed on this rank.
    Failed,
    /// The communicator has no symmetric support (no window, no failure).
    NoWindow,
    /// It waited for peers that did not come (a peer that failed before its round):
    /// blamed only if no rank failed on its own.
    Waited,
}

/// One rank's record of an agreement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct AgreementRecord {
    pub(crate) op: Op,
    /// The pool (the ordinal of its exchange channel): pools over one communicator
    /// set share a ledger.
    pub(crate) pool: u64,
    pub(crate) seq: u64,
    pub(crate) size: u64,
    pub(crate) hash: u64,
    pub(crate) state: u64,
    /// What the rank says beside the compared fields: returned, not compared.
    pub(crate) extra: Note,
    /// The rank's pool is broken.
    pub(crate) broken: bool,
    pub(crate) recent: Vec<CallRecord>,
    /// At `close`: the rank's live buffers (at most [`MAX_LIVE_NAMED`]), to name them
    /// when they refuse the close; empty otherwise. Not compared.
    pub(crate) live: Vec<LiveBuffer>,
}

/// A live buffer as a `close` that it refuses names it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
        (pool, op): (u64, Op),
        size: u64,
        state: u64,
        extra: Note,
        broken: bool,
    ) -> Self {
        AgreementRecord {
            op,
            pool,
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

    /// The record's kind with where the rank is, as a divergence of record kinds names it.
    pub(crate) fn describe_kind(&self) -> String {
        let (size, seq) = (self.size, self.seq);
        match self.op {
            Op::Grow => format!("a growth of the pool by {size} bytes (at its call #{seq})"),
            op => format!("a {} of the pool (at its call #{seq})", op.name()),
        }
    }
}

impl Fields for AgreementRecord {
    const NAMES: &'static [&'static str] = &[
        "operation",
        "pool (channel ordinal)",
        "pool call count",
        "size",
        "pool call hash",
        "allocator state",
    ];

    fn field(&self, i: usize) -> Value {
        match i {
            0 => Value::Name(self.op.name()),
            1 => Value::Number(self.pool),
            2 => Value::Number(self.seq),
            3 => Value::Number(self.size),
            4 => Value::Hex(self.hash),
            _ => Value::Hex(self.state),
        }
    }
}

/// Append this rank's record to `ledger` (the round named `during`) and judge every
/// rank's record: they come back in rank order with their `extra` values.
///
/// # Errors
/// As [`Ledger::agree`]; [`Error::PoolBroken`] naming the first broken rank if any
/// rank's pool is broken (but for a `close`, which skips the comparison);
/// [`Error::Divergence`] if records differ in a compared field (but for a `close` on
/// every rank where some rank has live buffers: the close fails on them).
pub(crate) fn agree_records(
    ledger: &Ledger,
    during: &'static str,
    mine: AgreementRecord,
    deadline: Deadline,
) -> Result<Vec<AgreementRecord>> {
    let span =
        tracing::debug_span!(target: "symmpool::pool", "agreement", during, size = mine.size);
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let op = mine.op;
    let records = ledger.agree(mine, during, deadline)?;
    // A broken rank refuses calls without recording them: its history says nothing
    // about the peers', so brokenness wins over any difference of the records.
    if let Some(rank) = records.iter().position(|r| r.broken) {
        if op == Op::Close {
            return Ok(records);
        }
        return Err(Error::PoolBroken {
            reason: format!("rank {rank}'s pool is broken"),
        });
    }
    if records.iter().all(|r| r.op == Op::Close)
        && (records.iter()).any(|r| matches!(r.extra, Note::Live(n) if n > 0))
    {
        // Every rank closes and some hold live buffers: the close fails on them (a
        // buffer dropped late on one rank is a free in its history alone).
        return Ok(records);
    }
    if first_difference(&records).is_none() {
        tracing::debug!(target: "symmpool::pool", during, world = records.len(),
            seconds = started.elapsed().as_secs_f64(), "ranks agreed");
        return Ok(records);
    }
    Err(Error::Divergence(Box::new(explain(&records, during))))
}

/// Find the first call where the ranks' histories differ.
fn explain(decoded: &[AgreementRecord], during: &'static str) -> Divergence {
    let diverged = |first_differing_call, history_gone, calls| Divergence {
        during,
        first_differing_call,
        history_gone,
        calls,
    };
    // Every rank's record, as `what` describes it.
    let each = |what: &dyn Fn(&AgreementRecord) -> String| {
        (decoded.iter().map(|r| Some(what(r))).enumerate()).collect()
    };
    if decoded.windows(2).any(|w| w[0].pool != w[1].pool) {
        // Pools over one communicator set share a ledger: one rank's agreement met
        // another pool's (the pools are used in different orders, or from threads).
        let order = |r: &AgreementRecord| {
            let (op, pool, size, seq) = (r.op.name(), r.pool, r.size, r.seq);
            format!(
                "{op} of the pool with channel ordinal {pool} ({size} B, at its call #{seq}; pools sharing communicators must make their collective operations in the same order on every rank)"
            )
        };
        return diverged(None, None, each(&order));
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
        let calls: Vec<Option<CallRecord>> = decoded.iter().map(|r| call_at(r, seq)).collect();
        // Calls of one number: the same where kind and arguments are.
        if calls.windows(2).any(|w| w[0] != w[1]) {
            let calls = calls.iter().map(|c| c.map(|c| c.describe()));
            return diverged(Some(seq), None, calls.enumerate().collect());
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
        let digest = |r: &AgreementRecord| format!("allocator state digest {:#018x}", r.state);
        return diverged(None, None, each(&digest));
    }
    // Unless only the operation differs, the first differing call is older than
    // every call the ranks remember: say where each rank is.
    let remembered = decoded.iter().map(|r| r.recent.len()).max().unwrap_or(0);
    let calls = each(&|r| {
        if same_history {
            return match r.op {
                Op::Admit => format!("grow (pool layout and settings digest {:#018x})", r.size),
                op => format!("{} ({} B)", op.name(), r.size),
            };
        }
        let latest =
            (r.recent.last()).map_or("no calls".into(), |c| format!("latest {}", c.describe()));
        format!("pool call count {}, hash {:#018x}, {latest}", r.seq, r.hash)
    });
    let gone = (!same_history).then_some(remembered);
    diverged(same_history.then_some(hi + 1), gone, calls)
}

#[cfg(test)]
#[path = "../../tests/unit/group/agree.rs"]
mod tests;
