//! Measure the paths on this machine and derive a [`PathPolicy`] from them.

use super::Coll;
use super::path::CollOp::{self, AllGather, AllReduce, ReduceScatter};
use super::path::Path::{self, CopyEngine, PlainKernel, SymmetricKernel};
use super::path::{PathPolicy, in_bands};
use crate::backend::{Backend, BackendInfo, BackendKind, CommRole};
use crate::deadline::Deadline;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::CheckMode;
use crate::pool::SymmPool;
use crate::stream::Stream;
use serde::{Deserialize, Serialize};

/// Settings of [`Coll::calibrate`]. Every rank must pass the same values.
///
/// The sizes measured are `min_bytes`, the powers of two between, and `max_bytes`:
/// give the range of the sizes the job's collectives use (`with_range(s, s)` measures
/// the one size `s`). The time it takes is about 7 paths × `reps` × (iterations + 1)
/// calls per size, the iterations `bytes_per_rep` / size (3 to 500): the defaults
/// suit a benchmark; a job calibrating at start-up wants a few sizes, `reps` 3 and a
/// `bytes_per_rep` of about three times the largest size (3 iterations each).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CalibrateConfig {
    /// Smallest size measured, in bytes per rank (default 64 KiB, at least 4).
    pub min_bytes: u64,
    /// Largest size measured, in bytes per rank (default 256 MiB). The calibration
    /// allocates (world + 1) × this many bytes in a temporary pool.
    pub max_bytes: u64,
    /// Repetitions per size and path, interleaved; the median counts (default 5).
    pub reps: usize,
    /// Bytes per rank moved per timed repetition, which sets the iteration count of
    /// each size (default 512 MiB; at least 3 and at most 500 iterations).
    pub bytes_per_rep: u64,
}

impl Default for CalibrateConfig {
    fn default() -> Self {
        CalibrateConfig {
            min_bytes: 64 << 10,
            max_bytes: 256 << 20,
            reps: 5,
            bytes_per_rep: 512 << 20,
        }
    }
}

impl CalibrateConfig {
    setters! {
        /// The range of sizes measured (bytes per rank): `min_bytes`, the powers of
        /// two in between, and `max_bytes`.
        with_range(min_bytes: u64, max_bytes: u64);
        with_reps(reps: usize);
        with_bytes_per_rep(bytes_per_rep: u64);
    }

    /// Cheap settings for a job that calibrates at start-up over the sizes its
    /// collectives use, `min_bytes` to `max_bytes` per rank: 3 repetitions of 3
    /// iterations at the largest size (more at smaller ones, at most 8 at
    /// `min_bytes`). One size is then 7 × 3 × 4 = 84 calls: a quarter of a second
    /// where a call takes 3 ms (two ranks time-sharing one GPU).
    pub fn quick(min_bytes: u64, max_bytes: u64) -> Self {
        let per_rep = max_bytes
            .saturating_mul(3)
            .min(min_bytes.saturating_mul(8))
            .max(1);
        CalibrateConfig::default()
            .with_range(min_bytes, max_bytes)
            .with_reps(3)
            .with_bytes_per_rep(per_rep)
    }

    /// The sizes measured: `min_bytes`, the powers of two strictly between, and
    /// `max_bytes` (once when equal). The range is checked first.
    fn sizes(&self) -> Vec<u64> {
        let mut sizes = vec![self.min_bytes];
        // No overflow: max_bytes <= MAX_CALIBRATE_BYTES.
        let mut s = (self.min_bytes + 1).next_power_of_two();
        while s < self.max_bytes {
            sizes.push(s);
            s *= 2;
        }
        if self.max_bytes > self.min_bytes {
            sizes.push(self.max_bytes);
        }
        sizes
    }
}

/// One measured size: busbw in GB/s per path (`None`: path not available).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// Bytes per rank (all-gather input, reduce-scatter output).
    pub bytes: u64,
    /// All-gather: symmetric kernel, copy engine, plain.
    pub all_gather: [Option<f64>; 3],
    /// Reduce-scatter (bf16, sum): symmetric kernel, plain.
    pub reduce_scatter: [Option<f64>; 2],
    /// All-reduce (bf16, sum, `bytes` per rank): symmetric kernel, plain.
    #[serde(default)]
    pub all_reduce: [Option<f64>; 2],
}

/// The result of [`Coll::calibrate`]: the policy, and rank 0's measurements it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// Thresholds derived from rank 0's measurements; identical on every rank.
    pub policy: PathPolicy,
    /// Rank 0's measurements.
    pub measurements: Vec<Measurement>,
}

/// The largest size [`Coll::calibrate`] measures, in bytes per rank (16 GiB).
pub const MAX_CALIBRATE_BYTES: u64 = 16 << 30;

/// What is timed: (collective, path), all-gathers first, then reduce-scatters, then
/// all-reduces (the order of [`Measurement`]'s fields).
const TIMED: [(CollOp, Path); 7] = [
    (AllGather, SymmetricKernel),
    (AllGather, CopyEngine),
    (AllGather, PlainKernel),
    (ReduceScatter(ReduceOp::Sum), SymmetricKernel),
    (ReduceScatter(ReduceOp::Sum), PlainKernel),
    (AllReduce(ReduceOp::Sum), SymmetricKernel),
    (AllReduce(ReduceOp::Sum), PlainKernel),
];

/// Whether `backend` has a communicator of the role that `path` runs on.
fn has_role(backend: &Backend, path: Path) -> bool {
    let role = match path {
        SymmetricKernel => CommRole::Symmetric,
        CopyEngine => CommRole::CopyEngine,
        PlainKernel => CommRole::Plain,
    };
    backend.communicators().iter().any(|c| c.role == role)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Coll {
    /// Measure all-gather, reduce-scatter and all-reduce on every available path for
    /// the sizes of `config` ([`CalibrateConfig`]: `min_bytes`, the powers of two
    /// between, `max_bytes`), and derive the thresholds of the automatic choice from
    /// rank 0's figures, the fastest median at each size winning (a tie goes to this
    /// handle's current choice):
    /// - all-gather: the plain ring at the sizes where it beats the path the other
    ///   two thresholds pick ([`PathPolicy::plain_all_gather_bands`]); among the
    ///   other sizes, the copy engine from the smallest one from which it beats the
    ///   symmetric kernel at every larger one, the symmetric kernel below;
    /// - reduce-scatter and all-reduce: the symmetric kernel wherever it beats NCCL's
    ///   ordinary kernels.
    ///
    /// A band covers the run of measured sizes it won, extended to 0 below the
    /// smallest and to `u64::MAX` above the largest. Apply the result with
    /// [`set_path_policy`](Self::set_path_policy); the preferences
    /// ([`Choice`](super::Choice)) are this handle's.
    /// [`needs_calibration`](Self::needs_calibration) says when a job should. On the
    /// host and shared-memory backends every path is the same host copy: the result
    /// there follows timing noise, not a machine's paths.
    ///
    /// The measurements use a temporary pool on the same communicators as the
    /// handle's (first) pool, with its configuration but unchecked (its segments are
    /// registered and released again), so the handle's own segments are untouched.
    ///
    /// # Collective
    /// Every rank calls it at the same point with the same `config`: it grows and
    /// closes a pool, makes a handle for it, runs collectives, and exchanges rank 0's
    /// result over the backend's exchange, so every rank returns the same policy.
    ///
    /// # Errors
    /// [`Error::PoolClosed`]; [`Error::Config`] for an empty or inverted range, a
    /// range above [`MAX_CALIBRATE_BYTES`], or no repetitions;
    /// [`Error::ChannelMismatch`] when the ranks' `config`s differ (nothing runs);
    /// growth errors (out of memory for (world + 1) × `max_bytes`); collective
    /// errors; [`Error::CollectiveMismatch`] if rank 0 measured other sizes;
    /// [`Error::Timeout`] if ranks do not arrive.
    pub fn calibrate(&self, stream: &Stream, config: &CalibrateConfig) -> Result<Calibration> {
        let pool = self.pool();
        pool.check_open()?;
        if config.min_bytes < 4
            || config.min_bytes > config.max_bytes
            || config.max_bytes > MAX_CALIBRATE_BYTES
            || config.reps == 0
            || config.reps > 1000
            || config.bytes_per_rep == 0
        {
            return Err(Error::config(
                "CalibrateConfig",
                format!("{config:?}"),
                "4 <= min_bytes <= max_bytes <= MAX_CALIBRATE_BYTES, 1..=1000 reps and bytes_per_rep > 0",
            ));
        }
        // The caller's settings (core sizes, registration) in the handle's group,
        // unchecked (the checks cost the same on every path, and
        // under `Async` they pace back-to-back calls), under a name of its own that
        // carries `config`: ranks that calibrate differently fail in `SymmPool::create`
        // (`Error::ChannelMismatch`) before any collective; default paths.
        let c = config;
        let tmp_config = pool.config().clone().with_name(format!(
            "{}:calibrate:{}-{}:{}x{}",
            pool.config().name,
            c.min_bytes,
            c.max_bytes,
            c.reps,
            c.bytes_per_rep
        ));
        let tmp = SymmPool::create(pool.group(), tmp_config, CheckMode::Off)?;
        let tmp_coll = Coll::build(std::slice::from_ref(&tmp), None)?;
        let sizes = config.sizes();
        let measured: Result<Vec<Measurement>> = sizes
            .iter()
            .map(|&bytes| tmp_coll.measure(bytes, stream, config))
            .collect();
        drop(tmp_coll);
        let closed = tmp.close();
        let measurements = measured?;
        closed?;
        // Everyone adopts rank 0's figures, exchanged on the temporary pool's own
        // channel, which nothing else uses.
        let deadline = Deadline::after(pool.group().config().timeout);
        let mine = crate::group::encode(&measurements)?;
        let all =
            pool.backend()
                .exchange()
                .all_gather(tmp.channel(), "calibration", &mine, deadline)?;
        let Some(measurements) = all
            .first()
            .and_then(|b| crate::group::decode::<Vec<Measurement>>(b))
            .filter(|m| m.len() == sizes.len())
        else {
            return Err(Error::CollectiveMismatch {
                op: "calibrate",
                detail: "rank 0's measurements do not match this rank's sizes (did the ranks \
                         calibrate different ranges?)"
                    .into(),
            });
        };
        Ok(Calibration {
            policy: derive(&measurements, &self.path_policy()),
            measurements,
        })
    }

    /// Whether this job should [`calibrate`](Self::calibrate) before relying on the
    /// automatic path choice: whether [`calibration_reason`](Self::calibration_reason)
    /// gives a reason. Local and cheap (it reads the backend's identity, which the
    /// ranks agreed at set-up): the same answer on every rank.
    pub fn needs_calibration(&self) -> bool {
        self.calibration_reason().is_some()
    }

    /// Why this job's machine is not known to match [`PathPolicy::default`], which
    /// was measured on NCCL with every rank on its own GPU of one node: on NCCL with
    /// more than one rank, `Some("shared GPU")` when two or more ranks drive the same
    /// GPU (the ranks compare their GPUs' UUIDs at set-up), else `Some("several
    /// nodes")` when the ranks span several nodes ([`BackendInfo::nodes`](crate::backend::BackendInfo::nodes)).
    /// `None` on the host and shared-memory backends (their paths move the same
    /// bytes), at world size 1, and for ranks each on its own GPU of one node.
    pub fn calibration_reason(&self) -> Option<&'static str> {
        reason(self.pool().backend().info())
    }

    /// Time every available path of each collective of [`TIMED`] at `bytes` per rank,
    /// on this handle (calibration's, of its temporary pool).
    fn measure(&self, bytes: u64, stream: &Stream, c: &CalibrateConfig) -> Result<Measurement> {
        let (pool, entry) = (self.pool(), &self.inner.pools[0]);
        let (backend, world) = (pool.backend(), pool.world_size() as u64);
        let whole = pool.alloc(world * bytes, stream)?;
        let out = pool.alloc(bytes, stream)?;
        let (all, one) = (whole.region()?, out.region()?);
        let iters = (c.bytes_per_rep / bytes).clamp(3, 500) as usize;
        let mut timed: [Vec<f64>; TIMED.len()] = Default::default();
        for rep in 0..c.reps {
            // Rotate so no path always runs right after the same other one.
            for k in 0..TIMED.len() {
                let i = (k + rep) % TIMED.len();
                let (coll, path) = TIMED[i];
                if !has_role(backend, path) {
                    continue;
                }
                let (send, recv, count, dtype) = match coll {
                    AllGather => {
                        let own = all.sub(pool.rank() as u64 * bytes, bytes)?;
                        ((&whole, own), (&whole, all), bytes, DType::U8)
                    }
                    ReduceScatter(_) => ((&whole, all), (&out, one), bytes / 2, DType::BF16),
                    AllReduce(_) => (
                        (&whole, all.sub(0, bytes)?),
                        (&out, one),
                        bytes / 2,
                        DType::BF16,
                    ),
                };
                // The same dispatch as the public collectives, with the path forced.
                let run = || {
                    self.dispatch(
                        entry,
                        coll,
                        send,
                        recv,
                        count,
                        dtype,
                        stream,
                        Some(path),
                        None,
                    )
                };
                // Warm-up; a path that is not available for these buffers falls back
                // (the same on every rank) and is not measured.
                if run()?.path != path {
                    continue;
                }
                let ms = backend.data().time_ms(stream, &mut || {
                    for _ in 0..iters {
                        run()?;
                    }
                    Ok(())
                })? / iters as f64;
                // An all-reduce moves 2 (world - 1) / world of its bytes per rank.
                let moved = match coll {
                    AllReduce(_) => 2.0 * (world - 1) as f64 / world as f64,
                    _ => (world - 1) as f64,
                };
                timed[i].push(bytes as f64 * moved / (ms * 1e-3) / 1e9);
            }
        }
        let fold = |i: usize| (!timed[i].is_empty()).then(|| median(timed[i].clone()));
        Ok(Measurement {
            bytes,
            all_gather: [fold(0), fold(1), fold(2)],
            reduce_scatter: [fold(3), fold(4)],
            all_reduce: [fold(5), fold(6)],
        })
    }
}

/// [`Coll::calibration_reason`] of a backend of identity `info`.
fn reason(info: &BackendInfo) -> Option<&'static str> {
    if info.kind != BackendKind::Nccl || info.world_size <= 1 {
        None
    } else if info.shared_devices {
        Some("shared GPU")
    } else if info.nodes > 1 {
        Some("several nodes")
    } else {
        None
    }
}

/// Whether `a` beats `b` (busbw, `None`: not available); a tie goes to `a` when it is
/// the base policy's choice (`a_is_base`).
fn beats(a: Option<f64>, b: Option<f64>, a_is_base: bool) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a > b || (a == b && a_is_base),
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Thresholds from measurements (see [`Coll::calibrate`]); ties go to `base`'s choice.
fn derive(ms: &[Measurement], base: &PathPolicy) -> PathPolicy {
    let mut policy = base.clone();
    // All-gather figures are [symmetric, copy engine, plain].
    let base_plain = |m: &Measurement| in_bands(&base.plain_all_gather_bands, m.bytes);
    let base_ce = |m: &Measurement| !base_plain(m) && m.bytes >= base.ce_all_gather_min_bytes;
    // The sizes where the plain ring is the fastest of the three do not count for the
    // copy engine's threshold.
    let plain_fastest = |m: &Measurement| {
        let [symm, ce, plain] = m.all_gather;
        beats(plain, symm, base_plain(m)) && beats(plain, ce, base_plain(m))
    };
    let others: Vec<&Measurement> = ms.iter().filter(|m| !plain_fastest(m)).collect();
    // Copy engine from the smallest of those sizes where it wins at every larger one.
    let ce_wins = |m: &Measurement| beats(m.all_gather[1], m.all_gather[0], base_ce(m));
    let wins = others.iter().rev().take_while(|m| ce_wins(m)).count();
    policy.ce_all_gather_min_bytes = match others.len() - wins {
        // Every size plain: the threshold stays.
        _ if others.is_empty() => base.ce_all_gather_min_bytes,
        _ if wins == 0 => u64::MAX,
        0 => 0,
        first => others[first].bytes,
    };
    // The plain ring wherever it beats what that threshold picks (after the fallback
    // of a path that did not run).
    let threshold = policy.ce_all_gather_min_bytes;
    policy.plain_all_gather_bands = bands(ms, |m| {
        let [symm, ce, plain] = m.all_gather;
        let picked = if m.bytes >= threshold {
            ce.or(symm)
        } else {
            symm.or(ce)
        };
        beats(plain, picked, base_plain(m))
    });
    let symmetric = |pick: fn(&Measurement) -> [Option<f64>; 2], base_bands: &[(u64, u64)]| {
        bands(ms, |m| {
            let [symm, plain] = pick(m);
            beats(symm, plain, in_bands(base_bands, m.bytes))
        })
    };
    policy.symmetric_reduce_scatter_bands =
        symmetric(|m| m.reduce_scatter, &base.symmetric_reduce_scatter_bands);
    policy.symmetric_all_reduce_bands =
        symmetric(|m| m.all_reduce, &base.symmetric_all_reduce_bands);
    policy
}

/// The runs of measured sizes where `wins`, as inclusive bands: from 0 below the
/// smallest size, to `u64::MAX` above the largest.
fn bands(ms: &[Measurement], wins: impl Fn(&Measurement) -> bool) -> Vec<(u64, u64)> {
    let mut bands: Vec<(u64, u64)> = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        if !wins(m) {
            continue;
        }
        let lo = if i == 0 { 0 } else { m.bytes };
        let hi = if i + 1 == ms.len() { u64::MAX } else { m.bytes };
        match bands.last_mut() {
            Some(last) if i > 0 && last.1 == ms[i - 1].bytes => last.1 = hi,
            _ => bands.push((lo, hi)),
        }
    }
    bands
}

#[cfg(test)]
#[path = "../../tests/unit/coll/calibrate.rs"]
mod tests;
