//! Measure the paths on this machine and derive a [`PathPolicy`] from them.

use super::Coll;
use super::path::{CollOp, Path, PathPolicy};
use crate::backend::{Backend, CommRole};
use crate::deadline::Deadline;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::pool::SymmPool;
use crate::stream::Stream;
use serde::{Deserialize, Serialize};

/// Settings of [`Coll::calibrate`]. Every rank must pass the same values.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CalibrateConfig {
    /// Smallest size measured, in bytes per rank (default 64 KiB, at least 4).
    pub min_bytes: u64,
    /// Largest size measured, in bytes per rank (default 256 MiB). The calibration
    /// allocates world × this many bytes in a temporary pool.
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
    /// Set the range of sizes measured (bytes per rank; powers of two in between).
    pub fn with_range(mut self, min_bytes: u64, max_bytes: u64) -> Self {
        self.min_bytes = min_bytes;
        self.max_bytes = max_bytes;
        self
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

const AG_PATHS: [Path; 3] = [Path::SymmetricKernel, Path::CopyEngine, Path::PlainKernel];
const RS_PATHS: [Path; 2] = [Path::SymmetricKernel, Path::PlainKernel];

/// What is timed: (collective, path), all-gathers first, then reduce-scatters, then
/// all-reduces (the order of [`Measurement`]'s fields).
const TIMED: [(CollOp, Path); 7] = [
    (CollOp::AllGather, AG_PATHS[0]),
    (CollOp::AllGather, AG_PATHS[1]),
    (CollOp::AllGather, AG_PATHS[2]),
    (CollOp::ReduceScatter(ReduceOp::Sum), RS_PATHS[0]),
    (CollOp::ReduceScatter(ReduceOp::Sum), RS_PATHS[1]),
    (CollOp::AllReduce(ReduceOp::Sum), RS_PATHS[0]),
    (CollOp::AllReduce(ReduceOp::Sum), RS_PATHS[1]),
];

/// Whether `backend` has a communicator of the role that `path` runs on.
fn has_role(backend: &Backend, path: Path) -> bool {
    let role = match path {
        Path::SymmetricKernel => CommRole::Symmetric,
        Path::CopyEngine => CommRole::CopyEngine,
        Path::PlainKernel => CommRole::Plain,
    };
    backend.communicators().iter().any(|c| c.role == role)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

impl Coll {
    /// Measure all-gather, reduce-scatter and all-reduce on every available path for
    /// sizes from `min_bytes` to `max_bytes` per rank, and derive the thresholds of the
    /// automatic choice from rank 0's figures: the copy engine from the smallest size
    /// from which it beats the symmetric kernel at every larger size measured, and the
    /// symmetric reduce-scatter and all-reduce wherever they beat NCCL's ordinary
    /// kernels. Apply the result with [`set_path_policy`](Self::set_path_policy); the
    /// thresholds not measured are this handle's.
    ///
    /// The measurements use a temporary pool on the same backend as the handle's
    /// (first) pool, with its configuration (its segments are registered and released
    /// again), so the handle's own segments are untouched.
    ///
    /// # Collective
    /// Every rank calls it at the same point with the same `config`: it grows and
    /// closes a pool, makes a handle for it, runs collectives, and exchanges rank 0's
    /// result over the backend's exchange, so every rank returns the same policy.
    ///
    /// # Errors
    /// [`Error::PoolClosed`]; [`Error::Config`] for an empty or inverted range, a
    /// range above [`MAX_CALIBRATE_BYTES`], or no repetitions;
    /// growth errors (out of memory for world × `max_bytes`); collective errors;
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
            return Err(Error::Config {
                setting: "CalibrateConfig",
                value: format!("{config:?}"),
                expected: "4 <= min_bytes <= max_bytes <= MAX_CALIBRATE_BYTES, 1..=1000 reps and bytes_per_rep > 0",
            });
        }
        let backend = pool.backend();
        // The caller's settings (core sizes, timeout, registration); default paths.
        let tmp = SymmPool::new(backend.clone(), pool.config().clone())?;
        let tmp_coll = Coll::build(std::slice::from_ref(&tmp), None)?;
        // Powers of two; no overflow: max_bytes <= MAX_CALIBRATE_BYTES.
        let first = config.min_bytes.next_power_of_two();
        let sizes = std::iter::successors(Some(first), |s| Some(s * 2));
        let sizes: Vec<u64> = sizes.take_while(|&s| s <= config.max_bytes).collect();
        let measured: Result<Vec<Measurement>> = (sizes.iter())
            .map(|&bytes| tmp_coll.measure(bytes, stream, config))
            .collect();
        drop(tmp_coll);
        let closed = tmp.close();
        let measurements = measured?;
        closed?;
        // Everyone adopts rank 0's figures, exchanged on the temporary pool's own
        // channel, which nothing else uses.
        let deadline = Deadline::after(pool.config().timeout);
        let mine = crate::group::encode(&measurements)?;
        let all = (backend.exchange()).all_gather(tmp.channel(), "calibration", &mine, deadline)?;
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
                    CollOp::AllGather => {
                        let own = all.sub(pool.rank() as u64 * bytes, bytes)?;
                        ((&whole, own), (&whole, all), bytes, DType::U8)
                    }
                    CollOp::ReduceScatter(_) => {
                        ((&whole, all), (&out, one), bytes / 2, DType::BF16)
                    }
                    CollOp::AllReduce(_) => (
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
                    CollOp::AllReduce(_) => 2.0 * (world - 1) as f64 / world as f64,
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

/// Thresholds from measurements (see [`Coll::calibrate`]).
fn derive(ms: &[Measurement], base: &PathPolicy) -> PathPolicy {
    let mut policy = base.clone();
    // Copy engine from the smallest size where it wins at every larger size too.
    let ce_wins = |m: &Measurement| match (m.all_gather[1], m.all_gather[0]) {
        (Some(ce), Some(symm)) => ce >= symm,
        (Some(_), None) => true,
        _ => false,
    };
    let wins = ms.iter().rev().take_while(|m| ce_wins(m)).count();
    policy.ce_all_gather_min_bytes = match ms.len() - wins {
        _ if wins == 0 => u64::MAX,
        0 => 0,
        first => ms[first].bytes,
    };
    policy.symmetric_reduce_scatter_bands = symmetric_bands(ms, |m| m.reduce_scatter);
    policy.symmetric_all_reduce_bands = symmetric_bands(ms, |m| m.all_reduce);
    policy
}

/// The runs of sizes where the symmetric kernel (`[symmetric, plain]` of `pick`)
/// beats the ordinary kernels.
fn symmetric_bands(
    ms: &[Measurement],
    pick: impl Fn(&Measurement) -> [Option<f64>; 2],
) -> Vec<(u64, u64)> {
    let mut bands: Vec<(u64, u64)> = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        let wins =
            matches!(pick(m), [Some(s), Some(r)] if s > r) || matches!(pick(m), [Some(_), None]);
        if !wins {
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
