//! Which path a collective takes, and the measured thresholds behind the choice.

use crate::backend::{CommInfo, CommRole};
use crate::dtype::{DType, ReduceOp};
use crate::error::NcclVersion;
use CollOp::{AllGather, AllReduce, ReduceScatter};
use Path::{CopyEngine, PlainKernel, SymmetricKernel};
use serde::Serialize;

/// How NCCL will run a collective. On the host backend it is the path NCCL would take
/// under the same version, communicators and registrations (the host moves the same
/// data whatever the path), so path selection is tested without GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Path {
    /// Copy-engine all-gather: no SMs (`CTAPolicy = NCCL_CTA_POLICY_ZERO`, output in a
    /// symmetric window; NCCL 2.28+). NCCL 2.28 logs `Init CE` once and no per-call
    /// line; 2.29+ logs `[Copy Engine]`.
    CopyEngine,
    /// NCCL's symmetric kernels (both buffers in symmetric windows; NCCL 2.27+). Logged
    /// as `<Coll> [Symmetric]: ... Kernel <name>`.
    SymmetricKernel,
    /// NCCL's ordinary ring/tree kernels through its internal buffers.
    PlainKernel,
}

/// What a collective did: the path, the communicator, and the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CollectiveReport {
    /// The path NCCL takes, derived from the NCCL version, the communicator's CTA
    /// policy and the buffers' registrations.
    pub path: Path,
    /// Index of the communicator used, in the backend's list.
    pub comm: usize,
    /// Its role.
    pub role: CommRole,
    /// Bytes per rank: the all-gather input, the reduce-scatter output, the
    /// all-reduce buffer.
    pub bytes_per_rank: u64,
}

/// A request to use one path, or the automatic choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Choice {
    /// The crate picks by size (see [`PathPolicy`]).
    Auto,
    /// Prefer this path; falls back (and reports the fallback) when it is not
    /// available for the call.
    Prefer(Path),
}

/// Thresholds of the automatic path choice, in bytes per rank.
///
/// The defaults come from the collectives benchmark on two H200s linked by NVLink
/// without NVLink multicast, each rank on its own GPU of one node (figures and dates in
/// the repository's `BENCHMARKS.md`):
/// - all-gather: the symmetric kernel beats ring at every size and the copy engine up
///   to about 16 MiB per rank; the copy engine wins from about 64 MiB.
/// - reduce-scatter: the symmetric kernel wins for small outputs (its LL kernel) and
///   around 1–2 MiB (its LD kernel), and loses to ring in between and for large
///   outputs.
/// - all-reduce: the symmetric kernel wherever NCCL has one for the call (no
///   measurement yet: calibrate to narrow it).
///
/// Elsewhere they can be far from the best path (two ranks time-sharing one GPU: auto
/// 1.34 × ring with these defaults). [`Coll::calibrate`](super::Coll::calibrate)
/// measures every path on the machine at hand and derives a policy in which each
/// collective takes, at each size measured, its fastest path (the plain ring
/// included); [`Coll::needs_calibration`](super::Coll::needs_calibration) says when
/// the defaults are not known to hold.
///
/// The automatic choice per call: an all-gather whose size is in
/// [`plain_all_gather_bands`](Self::plain_all_gather_bands) runs on the plain ring,
/// else on the copy engine from [`ce_all_gather_min_bytes`](Self::ce_all_gather_min_bytes)
/// and on the symmetric kernel below; a reduce-scatter or all-reduce runs on the
/// symmetric kernel inside its bands and on the plain ring outside. A path that is
/// not available for the call falls back (see [`Path`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PathPolicy {
    /// All-gathers of at least this many bytes per rank use the copy engine; smaller
    /// ones the symmetric kernel (default 32 MiB). Sizes in
    /// [`plain_all_gather_bands`](Self::plain_all_gather_bands) come first.
    pub ce_all_gather_min_bytes: u64,
    /// Inclusive ranges of input bytes per rank where all-gather uses NCCL's ring on
    /// the unregistered communicator, whatever the other thresholds say (default
    /// empty: the symmetric kernel and the copy engine beat it at every size on the
    /// reference machine).
    pub plain_all_gather_bands: Vec<(u64, u64)>,
    /// Inclusive ranges of output bytes per rank where reduce-scatter uses the
    /// symmetric kernel; other sizes use NCCL's ring on the unregistered communicator
    /// (default `[(0, 128 KiB), (1 MiB, 4 MiB)]`).
    pub symmetric_reduce_scatter_bands: Vec<(u64, u64)>,
    /// Inclusive ranges of bytes per rank where all-reduce uses the symmetric
    /// kernel; other sizes use NCCL's ordinary kernels on the unregistered
    /// communicator (default `[(0, u64::MAX)]`: every size).
    pub symmetric_all_reduce_bands: Vec<(u64, u64)>,
    /// Override for all-gather.
    pub all_gather: Choice,
    /// Override for reduce-scatter.
    pub reduce_scatter: Choice,
    /// Override for all-reduce.
    pub all_reduce: Choice,
}

impl Default for PathPolicy {
    fn default() -> Self {
        PathPolicy {
            ce_all_gather_min_bytes: 32 << 20,
            plain_all_gather_bands: Vec::new(),
            symmetric_reduce_scatter_bands: vec![(0, 128 << 10), (1 << 20, 4 << 20)],
            symmetric_all_reduce_bands: vec![(0, u64::MAX)],
            all_gather: Choice::Auto,
            reduce_scatter: Choice::Auto,
            all_reduce: Choice::Auto,
        }
    }
}

impl PathPolicy {
    setters! {
        /// Prefer paths for all-gather and reduce-scatter.
        with_choices(all_gather: Choice, reduce_scatter: Choice);
        with_ce_all_gather_min_bytes(ce_all_gather_min_bytes: u64);
        with_plain_all_gather_bands(plain_all_gather_bands: Vec<(u64, u64)>);
        with_symmetric_reduce_scatter_bands(symmetric_reduce_scatter_bands: Vec<(u64, u64)>);
        with_symmetric_all_reduce_bands(symmetric_all_reduce_bands: Vec<(u64, u64)>);
        with_all_reduce(all_reduce: Choice);
    }

    /// This policy with every collective preferring `path` (calibration forces one
    /// path at a time). Out of line: calibration only, off the call path.
    #[cold]
    #[inline(never)]
    pub(crate) fn forcing(&self, path: Path) -> Self {
        let prefer = Choice::Prefer(path);
        PathPolicy {
            all_gather: prefer,
            reduce_scatter: prefer,
            all_reduce: prefer,
            ..self.clone()
        }
    }
}

/// One line of the automatic choice, for logs: per collective the path of each size
/// range, for example (the defaults)
/// `all-gather: symm < 32 MiB, ce ≥ 32 MiB; reduce-scatter: symm ≤ 128 KiB, 1 MiB–4 MiB,
/// else plain; all-reduce: symm`, and, with plain bands,
/// `all-gather: plain ≤ 64 KiB, else symm < 32 MiB, ce ≥ 32 MiB`. A preference other
/// than [`Choice::Auto`] is added as `(prefers ce)`.
impl std::fmt::Display for PathPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ag = match self.ce_all_gather_min_bytes {
            0 => "ce".to_string(),
            u64::MAX => "symm".to_string(),
            t => format!("symm < {b}, ce ≥ {b}", b = bytes(t)),
        };
        // The path `inside` the bands, else `outside`.
        let banded = |bands: &[(u64, u64)], inside: &str, outside: String| match bands {
            [] => outside,
            [(0, u64::MAX)] => inside.to_string(),
            bands => format!("{inside} {}, else {outside}", in_words(bands)),
        };
        let ag = banded(&self.plain_all_gather_bands, "plain", ag);
        let symm = |bands| banded(bands, "symm", "plain".into());
        let prefers = |c: Choice| match c {
            Choice::Auto => String::new(),
            // A path's short name, as in the line: `ce`, `symm`, `plain`.
            Choice::Prefer(p) => format!(
                " (prefers {})",
                match p {
                    CopyEngine => "ce",
                    SymmetricKernel => "symm",
                    PlainKernel => "plain",
                }
            ),
        };
        write!(
            f,
            "all-gather: {ag}{}; reduce-scatter: {}{}; all-reduce: {}{}",
            prefers(self.all_gather),
            symm(&self.symmetric_reduce_scatter_bands),
            prefers(self.reduce_scatter),
            symm(&self.symmetric_all_reduce_bands),
            prefers(self.all_reduce),
        )
    }
}

/// A byte count in the largest binary unit that divides it (`u64::MAX`: `∞`).
fn bytes(b: u64) -> String {
    let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    match units
        .iter()
        .find(|(s, _)| b != 0 && b.trailing_zeros() >= *s)
    {
        _ if b == u64::MAX => "∞".into(),
        Some((s, unit)) => format!("{} {unit}", b >> s),
        None => format!("{b} B"),
    }
}

/// Inclusive bands, each `≤ hi` from 0, `≥ lo` to the top, `lo–hi`, or one size.
fn in_words(bands: &[(u64, u64)]) -> String {
    crate::error::joined(bands, ", ", |&(lo, hi)| match (lo, hi) {
        (0, u64::MAX) => "every size".into(),
        (0, hi) => format!("≤ {}", bytes(hi)),
        (lo, u64::MAX) => format!("≥ {}", bytes(lo)),
        _ if lo == hi => bytes(lo),
        _ => format!("{}–{}", bytes(lo), bytes(hi)),
    })
}

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CollOp {
    AllGather,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
}

impl CollOp {
    /// The collective's name in events: `all_gather`, `reduce_scatter`, `all_reduce`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            AllGather => "all_gather",
            ReduceScatter(_) => "reduce_scatter",
            AllReduce(_) => "all_reduce",
        }
    }

    /// The reduction (`Sum` for an all-gather, which has none).
    pub(crate) fn reduction(self) -> ReduceOp {
        match self {
            AllGather => ReduceOp::Sum,
            ReduceScatter(op) | AllReduce(op) => op,
        }
    }
}

/// `ncclAvg`: NCCL 2.10 (older NCCLs refuse the reduction).
pub(crate) const AVG: NcclVersion = NcclVersion::new(2, 10, 0);

/// Everything the choice depends on.
pub(crate) struct Inputs<'a> {
    pub(crate) coll: CollOp,
    pub(crate) bytes_per_rank: u64,
    pub(crate) dtype: DType,
    pub(crate) version: NcclVersion,
    pub(crate) world_size: usize,
    /// Nodes the ranks span ([`BackendInfo::nodes`](crate::backend::BackendInfo::nodes)).
    pub(crate) nodes: usize,
    pub(crate) comms: &'a [CommInfo],
    /// Whether (send, recv) are in symmetric windows on communicator `c`.
    pub(crate) registered: &'a dyn Fn(usize) -> (bool, bool),
    pub(crate) policy: &'a PathPolicy,
}

/// Pick the communicator and path. Rules (NCCL's, read from its source: `enqueue.cc`
/// and `symmetric/` of NCCL 2.27–2.29):
/// - copy engine: NCCL ≥ 2.28, a `CTAPolicy = ZERO` communicator, the output in a
///   window (and, before 2.29, the input too), more than one rank;
/// - symmetric kernel: NCCL ≥ 2.27, both buffers in windows on a default-policy
///   communicator; for reduce-scatter and all-reduce also `Sum` (or `Avg` from
///   2.30) on fp32/fp16/bf16;
/// - otherwise the plain communicator.
///
/// Across nodes ([`Inputs::nodes`] above 1; see [`one_nvlink_domain_needed`]), the
/// copy engine is never chosen up to NCCL 2.30.3 and the symmetric kernels not before
/// 2.29: those need every rank in one NVLink domain, which ranks on several hosts are
/// not known to share.
///
/// Inlined into the call path (one caller in release code): out of line, the choice
/// cost ≈ 70 instructions more per call, the `registered` closure then called through
/// its vtable (BENCHMARKS.md, "Lean call path").
#[inline]
pub(crate) fn select(i: &Inputs<'_>) -> (usize, Path) {
    // The candidates are tried in the order of preference, each only if the one
    // before is not available: most calls settle on the first (a cost on every
    // collective call, hence plain functions rather than closures).
    let (choice, auto) = match i.coll {
        AllGather => (
            i.policy.all_gather,
            // The plain bands are empty unless calibrated: one length check.
            if in_bands(&i.policy.plain_all_gather_bands, i.bytes_per_rank) {
                [PlainKernel, PlainKernel]
            } else if i.bytes_per_rank >= i.policy.ce_all_gather_min_bytes {
                [CopyEngine, SymmetricKernel]
            } else {
                [SymmetricKernel, CopyEngine]
            },
        ),
        ReduceScatter(_) | AllReduce(_) => {
            let (bands, choice) = match i.coll {
                AllReduce(_) => (&i.policy.symmetric_all_reduce_bands, i.policy.all_reduce),
                _ => (
                    &i.policy.symmetric_reduce_scatter_bands,
                    i.policy.reduce_scatter,
                ),
            };
            let symmetric = in_bands(bands, i.bytes_per_rank);
            (
                choice,
                if symmetric {
                    [SymmetricKernel, PlainKernel]
                } else {
                    [PlainKernel, PlainKernel]
                },
            )
        }
    };
    if let Choice::Prefer(p) = choice
        && let Some(c) = attempt(i, p)
    {
        return (c, p);
    }
    for p in auto {
        if let Some(c) = attempt(i, p) {
            return (c, p);
        }
    }
    (plain(i), PlainKernel)
}

/// Whether `bytes` lies in one of the inclusive ranges `bands`.
#[inline]
pub(crate) fn in_bands(bands: &[(u64, u64)], bytes: u64) -> bool {
    bands.iter().any(|&(lo, hi)| (lo..=hi).contains(&bytes))
}

/// The communicator of `path` for the call, if the path is available for it.
#[inline]
fn attempt(i: &Inputs<'_>, path: Path) -> Option<usize> {
    match path {
        CopyEngine => copy_engine(i),
        SymmetricKernel => symmetric(i),
        PlainKernel => Some(plain(i)),
    }
}

/// The first communicator of `role`.
#[inline]
fn find(i: &Inputs<'_>, role: CommRole) -> Option<usize> {
    i.comms.iter().position(|c| c.role == role)
}

/// The copy-engine communicator, if the copy engine can run the call.
fn copy_engine(i: &Inputs<'_>) -> Option<usize> {
    let c = find(i, CommRole::CopyEngine)?;
    if i.coll != AllGather
        || i.world_size <= 1
        || i.version < NcclVersion::COPY_ENGINE
        || i.comms[c].cta_policy & 2 == 0
        || (i.nodes > 1 && one_nvlink_domain_needed(i.version).0)
    {
        return None;
    }
    let (send, recv) = (i.registered)(c);
    (recv && (send || i.version >= NcclVersion::CE_RECV_ONLY)).then_some(c)
}

/// The symmetric communicator, if NCCL's symmetric kernels can run the call.
#[inline]
fn symmetric(i: &Inputs<'_>) -> Option<usize> {
    let op_ok = match i.coll {
        AllGather => true,
        ReduceScatter(ReduceOp::Sum) | AllReduce(ReduceOp::Sum) => i.dtype.symmetric_reduce(),
        ReduceScatter(ReduceOp::Avg) | AllReduce(ReduceOp::Avg) => {
            i.dtype.symmetric_reduce() && i.version >= NcclVersion::SYMMETRIC_AVG
        }
        ReduceScatter(_) | AllReduce(_) => false,
    };
    if !op_ok
        || i.version < NcclVersion::WINDOWS
        || (i.nodes > 1 && one_nvlink_domain_needed(i.version).1)
    {
        return None;
    }
    let c = find(i, CommRole::Symmetric)?;
    let (send, recv) = (i.registered)(c);
    (send && recv).then_some(c)
}

/// The unregistered communicator; without one, NCCL runs its ordinary kernels on the first.
fn plain(i: &Inputs<'_>) -> usize {
    find(i, CommRole::Plain).unwrap_or(0)
}

/// Whether (the copy engine, the symmetric kernels) need every rank in one NVLink
/// domain under NCCL `version`: the copy engine from 2.28 through 2.30.3, the
/// symmetric kernels before 2.29.
pub(crate) fn one_nvlink_domain_needed(version: NcclVersion) -> (bool, bool) {
    (
        version <= NcclVersion::new(2, 30, 3),
        version < NcclVersion::new(2, 29, 0),
    )
}

/// Every [`Path`], in its declaration's order: a path's number (`path as usize`,
/// its index here) numbers the handle's per-path counters and the records' path.
pub(crate) const PATHS: [Path; 3] = [CopyEngine, SymmetricKernel, PlainKernel];

/// The name of a path in statistics keys and events: `copy_engine`,
/// `symmetric_kernel`, `plain_kernel`.
pub fn path_name(path: Path) -> &'static str {
    match path {
        CopyEngine => "copy_engine",
        SymmetricKernel => "symmetric_kernel",
        PlainKernel => "plain_kernel",
    }
}

/// A collective ran: report the path chosen (the caller counts it, and checks the
/// level first, so that when off the event costs one load and not also the `log`
/// fallback's: the hot path's events go to tracing subscribers only).
#[cold]
pub(crate) fn collective(pool: &crate::SymmPool, coll: CollOp, report: &CollectiveReport) {
    tracing::debug!(
        target: "symmpool::coll",
        rank = pool.rank(),
        pool = %pool.config().name,
        op = coll.name(),
        path = path_name(report.path),
        comm = report.comm,
        bytes_per_rank = report.bytes_per_rank,
        "collective"
    );
}

#[cfg(test)]
#[path = "../../tests/unit/coll/path.rs"]
mod tests;
