//! What a run reports: a [`Summary`] per mode (the `--json` object), the table,
//! and the check that the run did what it should; the pools' statistics it is made
//! from ([`stats`]), and the memory map (`--memory-map`, [`write_memory_map`]).

use super::cli::{Args, BackendChoice, Check, Mode};
use super::heal::{self, Healing};
use super::trainer::IDENTITY;
use super::{render, trace};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use symmpool::coll::{Path, PathPolicy};
use symmpool::observe::{MemoryStats, PoolSnapshot, StatValue};
use symmpool::{Error, ShrinkReport, SymmPool};

/// Print a line to stdout; a closed pipe (`| head`) is not an error worth a panic.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// Print `s` and a newline to stdout.
pub fn line(s: &str) {
    out!("{s}");
}

/// Median, minimum and maximum of a sample (NaN for an empty one).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The middle value (the mean of the two middle ones for an even count).
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `v`.
    pub fn of(v: &[f64]) -> Spread {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        Spread {
            median: (v[(n - 1) / 2] + v[n / 2]) / 2.0,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// A mode's losses and times, step by step, as `run_one_rank` records them.
#[derive(Debug, Clone, Default)]
pub struct Log {
    /// The first step run (0, or the step of a `--resume` state): the warm-up.
    pub first_step: usize,
    /// Loss per step.
    pub losses: Vec<f32>,
    /// Step time per step, in ms.
    pub step_ms: Vec<f64>,
    /// Window registrations by the end of the first step (including the setup's).
    pub registrations_first_step: u64,
    /// Window registrations so far.
    pub registrations: u64,
    /// Segments after the first (warm-up) step, before `fit_to_peak`.
    pub segments_first_step: u64,
    /// Window registrations of the pools a shrink or a grow replaced, when they were
    /// replaced (0 without one).
    pub registrations_replaced: u64,
    /// The lost rank survived (`--survive`).
    pub survival: Option<Survival>,
    /// The world grown back (`--heal`).
    pub heal: Option<Healing>,
    /// When this rank learnt of the loss, or began the heal (a newcomer: was
    /// admitted), until the first step at the new size ends.
    pub regrouped_at: Option<std::time::Instant>,
}

impl Log {
    /// The first step at a new world size ended: after the loss, or the heal, that
    /// began at `t0`; the step's first collective returned at `first_collective`; the
    /// pools have made `now` window registrations.
    pub fn first_step_regrouped(
        &mut self,
        t0: std::time::Instant,
        first_collective: Option<std::time::Instant>,
        now: u64,
    ) {
        let ms = |t| super::run::ms_since(t0, t);
        let step_ms = ms(std::time::Instant::now());
        let collective_ms = first_collective.map_or(0.0, ms);
        if let Some(h) = &mut self.heal {
            (h.first_step_ms, h.first_collective_ms) = (step_ms, collective_ms);
            h.registrations_first_step_after = now.saturating_sub(h.registrations_grow());
        } else if let Some(s) = &mut self.survival {
            (s.first_step_ms, s.first_collective_ms) = (step_ms, collective_ms);
            s.registrations_first_step_after = now.saturating_sub(s.registrations_shrink());
        }
    }
}

/// What one pool's shrink did ([`ShrinkReport`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShrunkPool {
    /// Which pool: `parameters`, `gradients` or `data`.
    pub pool: String,
    /// Segments kept (no reallocation).
    pub segments: usize,
    /// Window registrations made on the survivors' communicators.
    pub registrations: u64,
    /// Buffers of the old pool alive at the shrink.
    pub live_buffers: u64,
    /// Bytes of those buffers.
    pub live_bytes: u64,
    /// Blocks allocated by some survivors after others had stopped, pinned.
    #[serde(default)]
    pub pinned_blocks: u64,
    /// How long the shrink took, in ms.
    pub ms: f64,
}

/// How this rank survived a lost rank (`--survive`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Survival {
    /// The ranks lost, in the old numbering.
    pub lost_ranks: Vec<usize>,
    /// The world size before the loss.
    pub world_size_before: usize,
    /// The world size after it.
    pub world_size_after: usize,
    /// This rank before the loss.
    pub rank_before: usize,
    /// This rank after the loss.
    pub rank_after: usize,
    /// The step in which the loss was reported.
    pub lost_in_step: usize,
    /// The loss, as the error that reported it says (without the advice for a job that
    /// stops there: this one went on).
    pub error: String,
    /// The step the survivors went on from: the last one whose whole parameters every
    /// survivor kept. Its loss and the later ones are at the new world size.
    pub resumed_at_step: usize,
    /// From the error to every pool shrunk (and the step barrier among the survivors),
    /// in ms.
    pub shrink_ms: f64,
    /// From the error to the first collective call at the new world size returning
    /// (the all-gather of the first layer; on GPUs, enqueued), in ms.
    pub first_collective_ms: f64,
    /// From the error to the end of the first step at the new world size, in ms.
    pub first_step_ms: f64,
    /// What each pool's shrink did.
    pub pools: Vec<ShrunkPool>,
    /// Window registrations the first step at the new size made beyond the shrink's
    /// (growth for the larger shards, if the segments held no room).
    pub registrations_first_step_after: u64,
}

impl Survival {
    /// The survival reported by `pools`' shrinks (parameters first) after `lost`, in
    /// step `lost_in_step`, going on from `resumed_at_step`; the shrinks took
    /// `shrink_ms` from the error. The times to the first collective and step are
    /// filled in once it ends.
    pub fn new(
        lost: &Error,
        lost_in_step: usize,
        resumed_at_step: usize,
        shrink_ms: f64,
        pools: [(&str, &ShrinkReport); 3],
    ) -> Survival {
        let first = pools[0].1;
        Survival {
            lost_ranks: first.lost_ranks.clone(),
            world_size_before: first.old_world_size,
            world_size_after: first.world_size,
            rank_before: first.old_rank,
            rank_after: first.rank,
            lost_in_step,
            error: super::survive::loss_words(lost),
            resumed_at_step,
            shrink_ms,
            first_collective_ms: 0.0,
            first_step_ms: 0.0,
            pools: (pools.iter())
                .map(|(name, r)| ShrunkPool {
                    pool: name.to_string(),
                    segments: r.segments,
                    registrations: r.registrations,
                    live_buffers: r.live_buffers,
                    live_bytes: r.live_bytes,
                    pinned_blocks: r.pinned_blocks,
                    ms: r.took.as_secs_f64() * 1e3,
                })
                .collect(),
            registrations_first_step_after: 0,
        }
    }

    /// The window registrations the shrinks made.
    pub fn registrations_shrink(&self) -> u64 {
        self.pools.iter().map(|p| p.registrations).sum()
    }
}

/// What one mode did on one rank: the `--json` object. It deserialises too, so that a
/// launcher of rank processes can gather the ranks' summaries from their output.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// `host`, `shm` or `nccl` ([`Args::backend_name`]).
    pub backend: String,
    /// The rank that reports.
    pub rank: usize,
    /// Ranks at the start.
    pub ranks: usize,
    /// Ranks at the end: fewer after a lost rank survived (`--survive`), unless it was
    /// replaced (`--heal`).
    #[serde(default)]
    pub ranks_at_end: usize,
    /// The mode.
    pub mode: Mode,
    /// Layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Batch per rank.
    pub batch: usize,
    /// Steps.
    pub steps: usize,
    /// The first step run (0, or the step of a `--resume` state): `losses[i]` is step
    /// `first_step + i`'s.
    #[serde(default)]
    pub first_step: usize,
    /// SMs the GEMMs left to the communication (`--sm-margin`; 0 on the host and in
    /// `none`, where nothing communicates).
    #[serde(default)]
    pub sm_margin: usize,
    /// Median step time after the first step (which grows the pool), in ms.
    pub median_step_ms: f64,
    /// Fastest step after the first, in ms.
    pub min_step_ms: f64,
    /// Slowest step after the first, in ms.
    pub max_step_ms: f64,
    /// Loss of the first step.
    pub first_loss: f32,
    /// Loss of the last step.
    pub last_loss: f32,
    /// Window registrations, in all.
    pub registrations: u64,
    /// Window registrations per communicator role.
    pub registrations_per_communicator: BTreeMap<String, u64>,
    /// Window registrations by the end of the first step.
    pub registrations_first_step: u64,
    /// Window registrations after the first step (a warm pool makes none); after a
    /// lost rank, not counting the shrink's nor those of the first step at the new size
    /// (see [`Survival`]).
    pub registrations_after_first_step: u64,
    /// Segments after the first step, before the warm-up sizing (`fit_to_peak`).
    pub segments_first_step: u64,
    /// Segments of the pool at the end.
    pub segments: u64,
    /// Of those, small-class (≤ 1 MiB blocks) and large-class segments.
    pub segments_small: u64,
    /// Large-class segments at the end.
    pub segments_large: u64,
    /// Peak bytes in the pool's segments.
    pub peak_reserved_bytes: u64,
    /// Peak bytes in allocated blocks.
    pub peak_allocated_bytes: u64,
    /// How the ranks' collectives know who they are: [`IDENTITY`] (every collective
    /// tagged with its step, layer and op, `end_step` after every step), or `no
    /// collectives` for `none`.
    #[serde(default)]
    pub identity: String,
    /// How the collectives were checked across the ranks (`--check`).
    #[serde(default)]
    pub check: Check,
    /// Paths of the last step's all-gathers (distinct, `+`-joined).
    pub all_gather_paths: String,
    /// Paths of the last step's reduce-scatters.
    pub reduce_scatter_paths: String,
    /// Loss per step.
    pub losses: Vec<f32>,
    /// Step time per step, in ms.
    pub step_ms: Vec<f64>,
    /// Median step time over `ring`'s (`null` when `ring` did not run); see
    /// [`add_ratios`].
    #[serde(default)]
    pub over_ring: Option<f64>,
    /// Median step time over `none`'s, the same step without communication (`null`
    /// when `none` did not run): 1 is a step that hides all its communication.
    #[serde(default)]
    pub over_none: Option<f64>,
    /// The lost rank survived (`--survive`), if one was.
    #[serde(default)]
    pub survival: Option<Survival>,
    /// The lost rank replaced and the world grown back (`--heal`), if it was.
    #[serde(default)]
    pub heal: Option<Healing>,
    /// What `auto`'s calibration chose (`--calibrate`), on `auto`'s summary when it
    /// calibrated; `null` otherwise.
    #[serde(default)]
    pub calibration: Option<Calibrated>,
}

/// What `auto`'s calibration (`--calibrate`, `Coll::calibrate`) measured and chose.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibrated {
    /// Why it ran: symmpool's reason (`shared GPU`, `several nodes`;
    /// `Coll::calibration_reason`), or `asked` (`--calibrate always` elsewhere).
    pub reason: String,
    /// The sizes measured, bytes per rank: the smallest and largest of the run's
    /// collectives (and the powers of two between).
    pub min_bytes: u64,
    /// See `min_bytes`.
    pub max_bytes: u64,
    /// The thresholds chosen, as one line (`PathPolicy`'s `Display`).
    pub policy: String,
    /// All-gathers of at least this many bytes per rank take the copy engine
    /// (`u64::MAX`: none), outside `plain_all_gather_bands`.
    pub ce_all_gather_min_bytes: u64,
    /// Inclusive ranges of bytes per rank where all-gather takes the plain ring.
    pub plain_all_gather_bands: Vec<(u64, u64)>,
    /// Inclusive ranges where reduce-scatter takes the symmetric kernel (else ring).
    pub symmetric_reduce_scatter_bands: Vec<(u64, u64)>,
    /// Inclusive ranges where all-reduce takes the symmetric kernel (else ring).
    pub symmetric_all_reduce_bands: Vec<(u64, u64)>,
    /// How long the calibration took (wall clock, ms).
    pub ms: f64,
}

impl Calibrated {
    /// The note of a calibration that ran for `reason` over `(min, max)` bytes per
    /// rank in `ms`, choosing `policy`.
    pub fn new(reason: &str, policy: &PathPolicy, (min, max): (u64, u64), ms: f64) -> Self {
        Calibrated {
            reason: reason.into(),
            min_bytes: min,
            max_bytes: max,
            policy: policy.to_string(),
            ce_all_gather_min_bytes: policy.ce_all_gather_min_bytes,
            plain_all_gather_bands: policy.plain_all_gather_bands.clone(),
            symmetric_reduce_scatter_bands: policy.symmetric_reduce_scatter_bands.clone(),
            symmetric_all_reduce_bands: policy.symmetric_all_reduce_bands.clone(),
            ms,
        }
    }

    /// The summary's line: `calibrated (REASON): THRESHOLDS; took N ms`.
    pub fn line(&self) -> String {
        format!(
            "calibrated ({}): {}; took {:.0} ms",
            self.reason, self.policy, self.ms
        )
    }
}

/// Fill in every summary's `over_ring` and `over_none` from the others' median step
/// times (the summaries of one rank, one per mode).
pub fn add_ratios(results: &mut [Summary]) {
    let median_of = |m: Mode| {
        (results.iter())
            .find(|r| r.mode == m)
            .map(|r| r.median_step_ms)
    };
    let (ring, none) = (median_of(Mode::Ring), median_of(Mode::None));
    for r in results {
        r.over_ring = ring.map(|x| r.median_step_ms / x);
        r.over_none = none.map(|x| r.median_step_ms / x);
    }
}

/// The distinct paths in `p`, in order of first use, `+`-joined.
fn paths(p: &[Path]) -> String {
    let mut kinds: Vec<Path> = Vec::new();
    for x in p {
        if !kinds.contains(x) {
            kinds.push(*x);
        }
    }
    let names: Vec<String> = kinds.iter().map(|k| format!("{k:?}")).collect();
    names.join("+")
}

impl Summary {
    /// Summarise `log` and the pool's `stats` for one mode on `rank`.
    pub fn new(
        args: &Args,
        mode: Mode,
        rank: usize,
        log: Log,
        stats: &MemoryStats,
        ag: &[Path],
        rs: &[Path],
    ) -> Summary {
        let later = Spread::of(&log.step_ms[1.min(log.step_ms.len())..]);
        let get = |key: &str| stats.get(key).and_then(|v| v.as_u64()).unwrap_or(0);
        // `registrations.ROLE`: the registrations on the communicators of each role.
        let per_comm: BTreeMap<String, u64> = stats
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("registrations.")?.to_string(), v.as_u64()?)))
            .collect();
        // `none` computes on buffers no collective filled: its losses mean nothing and
        // may not even be finite (JSON has no NaN); they are reported as 0.
        let losses: Vec<f32> = if mode.communicates() {
            log.losses
        } else {
            vec![0.0; log.losses.len()]
        };
        let expected_later = (log.survival.as_ref()).map_or(0, |s| {
            s.registrations_shrink() + s.registrations_first_step_after
        }) + (log.heal.as_ref()).map_or(0, |h| {
            h.registrations_grow() + h.registrations_first_step_after
        });
        let ranks_at_end = match (&log.heal, &log.survival) {
            (Some(h), _) => h.world_size_after,
            (None, Some(s)) => s.world_size_after,
            (None, None) => args.ranks,
        };
        Summary {
            backend: args.backend_name().into(),
            rank,
            ranks: args.ranks,
            ranks_at_end,
            mode,
            layers: args.layers,
            hidden: args.hidden,
            batch: args.batch,
            steps: args.steps,
            first_step: log.first_step,
            sm_margin: if mode.communicates() {
                args.sm_margin
            } else {
                0
            },
            median_step_ms: later.median,
            min_step_ms: later.min,
            max_step_ms: later.max,
            first_loss: losses.first().copied().unwrap_or(f32::NAN),
            last_loss: losses.last().copied().unwrap_or(f32::NAN),
            registrations: log.registrations_replaced + per_comm.values().sum::<u64>(),
            registrations_per_communicator: per_comm,
            registrations_first_step: log.registrations_first_step,
            registrations_after_first_step: (log.registrations)
                .saturating_sub(log.registrations_first_step + expected_later),
            segments_first_step: log.segments_first_step,
            segments: get("segment.all.current"),
            segments_small: get("segment.small_pool.current"),
            segments_large: get("segment.large_pool.current"),
            peak_reserved_bytes: get("reserved_bytes.all.peak"),
            peak_allocated_bytes: get("allocated_bytes.all.peak"),
            identity: if mode.communicates() {
                IDENTITY
            } else {
                NO_COLLECTIVES
            }
            .into(),
            check: args.check,
            all_gather_paths: paths(ag),
            reduce_scatter_paths: paths(rs),
            losses,
            step_ms: log.step_ms,
            over_ring: None,
            over_none: None,
            survival: log.survival,
            heal: log.heal,
            calibration: None,
        }
    }

    /// The losses before a lost rank (at the old world size) and after it (at the new
    /// one, from the step the survivors went on from, to the heal if the world grew
    /// back: [`heal::losses_after`] has the rest); all of them before, without a loss.
    pub fn losses_around_the_loss(&self) -> (&[f32], &[f32]) {
        let healed = self.losses.len() - heal::losses_after(self).len();
        let at = (self.survival.as_ref()).map_or(healed, |s| s.resumed_at_step - self.first_step);
        self.losses[..healed].split_at(at.min(healed))
    }
}

/// What the summary says of a lost rank survived (`--survive`), line by line.
pub fn survival_lines(r: &Summary) -> Vec<String> {
    let Some(s) = &r.survival else {
        return Vec::new();
    };
    let (before, after) = r.losses_around_the_loss();
    // Up to 12 values a line: the first 6 and the last 6 of more (`--json` has all).
    let losses = |from: usize, l: &[f32]| {
        let value = |x: &f32| format!("{x:.4e}");
        let mut values: Vec<String> = l.iter().take(6).map(value).collect();
        if l.len() > 12 {
            values.push("…".into());
        }
        values.extend(l.iter().skip(6.max(l.len().saturating_sub(6))).map(value));
        match l.len() {
            0 => "none".to_string(),
            n => format!("steps {from}-{}: {}", from + n - 1, values.join(" ")),
        }
    };
    let mut lines = vec![
        format!(
            "lost: rank {} of {}, in step {}: {}",
            (s.lost_ranks.iter())
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            s.world_size_before,
            s.lost_in_step,
            s.error
        ),
        format!(
            "shrink: every pool {:.1} ms after the error; the first collective at world size \
             {} returned after {:.1} ms, its first step ended after {:.1} ms; went on from \
             step {} (the last whose parameters every survivor kept whole), rank {} → {}",
            s.shrink_ms,
            s.world_size_after,
            s.first_collective_ms,
            s.first_step_ms,
            s.resumed_at_step,
            s.rank_before,
            s.rank_after
        ),
    ];
    for p in &s.pools {
        lines.push(format!(
            "  {:<10} segments kept: {}, window registrations on the new communicators: {}, \
             live buffers: {} ({:.1} KiB), pinned blocks: {}, shrink: {:.1} ms",
            p.pool,
            p.segments,
            p.registrations,
            p.live_buffers,
            p.live_bytes as f64 / 1024.0,
            p.pinned_blocks,
            p.ms
        ));
    }
    lines.push(format!(
        "  registrations of the first step at world size {} beyond the shrink's: {}",
        s.world_size_after, s.registrations_first_step_after
    ));
    lines.push(format!(
        "losses at world size {}: {}",
        s.world_size_before,
        losses(r.first_step, before)
    ));
    lines.push(format!(
        "losses at world size {}: {}",
        s.world_size_after,
        losses(s.resumed_at_step, after)
    ));
    if let Some(h) = &r.heal {
        lines.extend(heal::lines(h, losses(h.at_step, heal::losses_after(r))));
    }
    lines
}

/// The identity of a mode that runs no collectives (`none`).
const NO_COLLECTIVES: &str = "no collectives";

/// What the summary says of the collectives' identity: the communicating modes' (and
/// the check that compares it across the ranks), and `none`'s where it ran.
pub fn identity_line(results: &[Summary]) -> String {
    let talking = results.iter().find(|r| r.mode.communicates());
    let silent = results.iter().any(|r| !r.mode.communicates());
    match talking {
        None => NO_COLLECTIVES.into(),
        Some(r) => {
            let check = match r.check {
                // One rank has no peer to compare with: symmpool runs every check as off.
                _ if r.ranks == 1 => "off (one rank)",
                c => c.name(),
            };
            let none = if silent { "; none: no collectives" } else { "" };
            format!("{}, check {check}{none}", r.identity)
        }
    }
}

/// One line per step and mode (rank 0, without `--quiet`); `again`: the step runs
/// again after a lost rank, at this world size.
pub fn step_line(mode: Mode, step: usize, loss: f32, ms: f64, again: Option<usize>) {
    let again = again.map_or_else(String::new, |w| format!("  (again, world {w})"));
    out!(
        "[{:>4}] step {step:>3}  loss {loss:.6e}  {ms:>9.2} ms{again}",
        mode.name()
    );
}

/// What rank 0 prints when the survivors of a lost rank go on (`--survive`): the loss,
/// the shrink and the new world size, in two lines.
pub fn survival_notice(s: &Survival) -> [String; 2] {
    let lost = (s.lost_ranks.iter())
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    [
        format!(
            "lost: rank {lost} of {}, in step {}: {}",
            s.world_size_before, s.lost_in_step, s.error
        ),
        format!(
            "shrunk: {} pools in {:.1} ms, world size {} → {} (this rank {} → {}); going on \
             from step {}, the last whose parameters every survivor kept whole",
            s.pools.len(),
            s.shrink_ms,
            s.world_size_before,
            s.world_size_after,
            s.rank_before,
            s.rank_after,
            s.resumed_at_step
        ),
    ]
}

/// A path as the table shows it. On the host backend there are no kernels and no
/// copy engines (every path makes the same copies): what is real is whether the
/// buffers were in registered windows (`window`) or not (`no window`).
fn path_words(p: &str, gpu: bool) -> String {
    if p.is_empty() {
        return "-".into();
    }
    if gpu {
        p.replace("CopyEngine", "copy engine")
            .replace("SymmetricKernel", "symmetric kernel")
            .replace("PlainKernel", "plain kernel")
    } else {
        p.replace("CopyEngine", "window")
            .replace("SymmetricKernel", "window")
            .replace("PlainKernel", "no window")
    }
}

/// The largest relative difference between the first mode's losses and any other's
/// (modes that communicate; `none`'s losses mean nothing).
pub fn loss_disagreement(results: &[Summary]) -> f64 {
    let mut trained = results.iter().filter(|r| r.mode.communicates());
    let Some(first) = trained.next() else {
        return 0.0;
    };
    let diffs: Vec<f64> = (results.iter().filter(|r| r.mode.communicates()))
        .flat_map(|r| r.losses.iter().zip(&first.losses))
        .map(|(a, b)| ((a - b) / b.abs().max(1e-30)).abs() as f64)
        .collect();
    Spread::of(&diffs).max
}

/// The world size as the summary says it: the ranks at the end, and, if a rank was lost
/// on the way (`--survive`), the ranks at the start and which were lost.
pub fn ranks_words(args: &Args, results: &[Summary]) -> String {
    match results.iter().find_map(|r| r.survival.as_ref()) {
        Some(s) => {
            let lost = (s.lost_ranks.iter())
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            let (now, healed) = match healing(results) {
                Some(h) => (
                    h.world_size_after,
                    format!(", replaced in step {}", h.at_step),
                ),
                None => (s.world_size_after, String::new()),
            };
            format!(
                "{now} ranks ({} at the start; rank {lost} lost in step {}{healed})",
                s.world_size_before, s.lost_in_step
            )
        }
        None => format!("{} ranks", args.ranks),
    }
}

/// The heal of `results`, if the world grew back.
fn healing(results: &[Summary]) -> Option<&Healing> {
    results.iter().find_map(|r| r.heal.as_ref())
}

/// Print the summaries: one JSON object per line with `--json`, else the table.
pub fn print(args: &Args, results: &[Summary]) {
    if args.json {
        for r in results {
            out!(
                "{}",
                serde_json::to_string(r).expect("a summary serialises")
            );
        }
        return;
    }
    // Time ratios mean overlap of communication with computation on GPUs only; on the
    // host backend each rank's thread computes and copies in turn.
    let gpu = args.backend == BackendChoice::Nccl;
    let ag_width = results
        .iter()
        .map(|r| path_words(&r.all_gather_paths, gpu).len());
    let w = ag_width.max().unwrap_or(0).max(16);
    let ratio = |x: Option<f64>| match x {
        Some(x) if gpu => format!("{x:.3}"),
        _ => "-".into(),
    };
    out!(
        "\nsummary: {} backend, {}, {} layers, hidden {}, batch {}, {} steps{}",
        args.backend_name(),
        ranks_words(args, results),
        args.layers,
        args.hidden,
        args.batch,
        args.steps,
        if args.backend == BackendChoice::Nccl {
            format!(", GEMMs leave {} SMs to the communication", args.sm_margin)
        } else {
            String::new()
        }
    );
    out!("identity: {}", identity_line(results));
    if let Some(c) = results.iter().find_map(|r| r.calibration.as_ref()) {
        out!("{}", c.line());
    }
    out!(
        "{:<5} {:>8} {:>7} {:>7} {:>11} {:>11} {:>14} {:>15} {:>9} {:>9}  {:<w$}  {}",
        "",
        "step",
        "",
        "",
        "first",
        "last",
        "registrations",
        "",
        "reserved",
        "allocated",
        "all-gather",
        "reduce-scatter",
    );
    out!(
        "{:<5} {:>8} {:>7} {:>7} {:>11} {:>11} {:>14} {:>15} {:>9} {:>9}  {:<w$}  {}",
        "mode",
        "ms",
        "t/ring",
        "t/none",
        "loss",
        "loss",
        "first / later",
        "segments",
        "MiB",
        "MiB",
        "path",
        "path",
    );
    let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
    let has_none = results.iter().any(|r| !r.mode.communicates());
    for r in results {
        let loss = |l: f32| {
            if r.mode.communicates() {
                format!("{l:.4e}")
            } else {
                "-".into()
            }
        };
        out!(
            "{:<5} {:>8.2} {:>7} {:>7} {:>11} {:>11} {:>14} {:>15} {:>9} {:>9}  {:<w$}  {}",
            r.mode.name(),
            r.median_step_ms,
            ratio(r.over_ring),
            ratio(r.over_none),
            loss(r.first_loss),
            loss(r.last_loss),
            format!(
                "{} / {}",
                r.registrations_first_step, r.registrations_after_first_step
            ),
            format!(
                "{} → {} ({}+{})",
                r.segments_first_step, r.segments, r.segments_small, r.segments_large
            ),
            mib(r.peak_reserved_bytes),
            mib(r.peak_allocated_bytes),
            path_words(&r.all_gather_paths, gpu),
            path_words(&r.reduce_scatter_paths, gpu),
        );
    }
    if gpu {
        out!(
            "(step ms: median after the first step; t/ring, t/none: step time over ring's, \
             none's (below 1: faster); registrations: NCCL windows registered in setup + \
             first step / later steps; segments: after the first step → after warm-up \
             sizing (small + large class); MiB: peak per rank; paths: last step)"
        );
    } else {
        out!(
            "({}. Real here: the \
             pool's placement, registrations and segments, and the collectives, which \
             move and sum real data between the ranks' memory (the same copies in every \
             mode: no copy engine or kernel runs; the path columns say whether the \
             buffers were in registered windows, `window`, or not, `no window`). Step \
             times measure host loops with nothing overlapped, so no time ratios. \
             registrations: windows registered in setup + first step / later steps; \
             segments: after the first step → after warm-up sizing (small + large \
             class); MiB: peak per rank; paths: last step)",
            if args.processes {
                "shm backend: a process per rank, memory shared between the processes"
            } else {
                "host backend: ranks are threads and memory is host memory"
            }
        );
    }
    if has_none {
        out!(
            "(none: the same step with its collectives left out, on buffers nothing filled, \
             so no losses; its step time is what hiding all communication would reach)"
        );
    }
    if let Some(auto) = results
        .iter()
        .find(|r| r.mode == Mode::Auto)
        .filter(|_| gpu)
    {
        out!(
            "auto t/none (step time over the same step without communication; 1 = all \
             hidden): {}   auto t/ring: {}",
            ratio(auto.over_none),
            ratio(auto.over_ring)
        );
    }
    for r in results {
        for l in survival_lines(r) {
            out!("{l}");
        }
    }
    if results.len() > 1 {
        // The trajectories must agree across modes (up to bf16 rounding on GPUs).
        let worst = loss_disagreement(results);
        out!("largest relative loss difference between modes: {worst:.2e}");
    }
}

/// The loss fell (in every mode that communicates) and nothing registered after the
/// first step (in every mode).
pub fn check(results: &[Summary]) -> Result<(), String> {
    for r in results {
        let (first, last, mode) = (r.first_loss, r.last_loss, r.mode.name());
        if r.mode.communicates() && (!last.is_finite() || last >= first) {
            return Err(format!("{mode}: loss did not fall ({first} -> {last})"));
        }

        if r.registrations_after_first_step != 0 {
            let n = r.registrations_after_first_step;
            return Err(format!("{mode}: {n} registrations after the first step"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// The pools' statistics, and what is written to files after the run: the memory map
// (`--memory-map`) here, the timeline (`--trace`) in `trace.rs`.

/// A mode's statistics: its parameter pool's and its gradient pool's, summed key by
/// key (peaks: the sum of the two pools' peaks).
pub fn stats(pools: &[SymmPool; 2]) -> MemoryStats {
    let mut all = pools[0].memory_stats();
    for (key, value) in pools[1].memory_stats() {
        let sum = match (all.get(&key), value) {
            (Some(StatValue::Count(a)), StatValue::Count(b)) => StatValue::Count(a + b),
            (Some(StatValue::Real(a)), StatValue::Real(b)) => StatValue::Real(a + b),
            (_, v) => v,
        };
        all.insert(key, sum);
    }
    all
}

/// Window registrations on every communicator.
pub fn registrations(stats: &MemoryStats) -> u64 {
    (stats.iter())
        .filter(|(k, _)| k.starts_with("registrations."))
        .filter_map(|(_, v)| v.as_u64())
        .sum()
}

/// Every rank's snapshot at the end of training (with `--memory-map`), per mode.
static MEMORY_MAPS: Mutex<Vec<(Mode, PoolSnapshot)>> = Mutex::new(Vec::new());

/// Draw rank by rank the pools of the first mode (`render_ranks` outlines any block
/// placed differently on some rank) and save every snapshot beside it as JSON.
fn write_memory_map(path: &std::path::Path, first: Mode) -> std::io::Result<()> {
    let mut all = std::mem::take(&mut *MEMORY_MAPS.lock());
    all.sort_by_key(|(m, s)| (*m != first, s.rank));
    let ranks: Vec<PoolSnapshot> = (all.iter())
        .filter(|(m, _)| *m == first)
        .map(|(_, s)| s.clone())
        .collect();
    std::fs::write(path, render::render_ranks(&ranks))?;
    let snapshots: Vec<&PoolSnapshot> = all.iter().map(|(_, s)| s).collect();
    let json = serde_json::to_string_pretty(&snapshots).map_err(std::io::Error::other)?;
    let mut json_path = path.as_os_str().to_owned();
    json_path.push(".json");
    std::fs::write(json_path, json)
}

/// Keep this rank's `snapshot` of `mode`'s parameter pool for the memory map.
pub fn keep_memory_map(mode: Mode, snapshot: PoolSnapshot) {
    MEMORY_MAPS.lock().push((mode, snapshot));
}

/// With ranks as processes: gather every rank's snapshots on rank 0, which writes the
/// memory map.
pub fn gather_memory_map(exchange: &dyn symmpool::Exchange, args: &Args) -> symmpool::Result<()> {
    let Some(path) = &args.memory_map else {
        return Ok(());
    };
    let mine = std::mem::take(&mut *MEMORY_MAPS.lock());
    let json = serde_json::to_vec(&mine).map_err(|e| symmpool::Error::Internal {
        what: format!("encoding a snapshot: {e}"),
    })?;
    let deadline = symmpool::Deadline::after(symmpool::GroupConfig::default().timeout);
    let channel = exchange.open_channel("fsdp_step:memory-map", deadline)?;
    let all = exchange.all_gather(channel, "memory map", &json, deadline)?;
    if exchange.rank() == 0 {
        let mut maps = MEMORY_MAPS.lock();
        for bytes in all {
            if let Ok(v) = serde_json::from_slice::<Vec<(Mode, PoolSnapshot)>>(&bytes) {
                maps.extend(v);
            }
        }
        drop(maps);
        write_memory_map(path, args.modes[0]).map_err(|e| symmpool::Error::Internal {
            what: format!("writing the memory map to {}: {e}", path.display()),
        })?;
    }
    Ok(())
}

/// With ranks as threads, after the run: write every rank's memory map
/// (`--memory-map`) and timeline (`--trace`). The error: what could not be written.
pub fn write_files(args: &Args) -> Result<(), String> {
    // With ranks as processes, rank 0 gathered every rank's snapshot and wrote it.
    let threads = !args.processes;
    if let Some(path) = args.memory_map.as_ref().filter(|_| threads) {
        write_memory_map(path, args.modes[0])
            .map_err(|e| format!("writing the memory map to {}: {e}", path.display()))?;
        if !args.json {
            line(&format!("memory map: {}", path.display()));
        }
    }
    // With ranks as processes, rank 0 gathered every rank's spans and wrote them.
    if let Some(path) = args.trace.as_ref().filter(|_| threads) {
        let spans = trace::take();
        trace::write(path, &spans)
            .map_err(|e| format!("writing the trace to {}: {e}", path.display()))?;
        eprintln!("trace: {}\n{}", path.display(), trace::summary(&spans, 0));
    }
    Ok(())
}
