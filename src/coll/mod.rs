//! Collectives on pool buffers: all-gather (copy engine or symmetric kernel) and
//! reduce-scatter (symmetric kernel or ring), with a per-call path choice that is
//! never slower than plain NCCL in the collectives benchmark.
//!
//! Each call checks its buffers first (same pool, open, sizes consistent), picks a
//! communicator and path from the NCCL version, the communicators' CTA policies, the
//! buffers' registrations and the size ([`PathPolicy`]), runs it, and returns a
//! [`CollectiveReport`] naming the path. A call never falls back silently to something
//! that could corrupt data: an inconsistent call is an error.
//!
//! # Collective
//! Every function here is collective: every rank calls it in the same order, with
//! buffers of the same sizes from the same pool call sequence (hence the same offsets).
//!
//! ```
//! use symmpool::{coll, PoolConfig, Stream, SymmPool};
//!
//! let pools = SymmPool::host_group(2, PoolConfig::default())?;
//! std::thread::scope(|s| {
//!     for pool in &pools {
//!         s.spawn(move || {
//!             let stream = Stream::host();
//!             let rank = pool.rank();
//!             // FSDP style: each rank holds its shard inside the gathered buffer.
//!             let params = pool.alloc(2 * 4 * 1024, &stream).unwrap();
//!             let shard = params.view::<f32>().unwrap().slice(rank * 1024, 1024).unwrap();
//!             shard.copy_from_host(&vec![rank as f32; 1024]).unwrap();
//!             let report = coll::all_gather_in_place::<f32>(&params, &stream).unwrap();
//!             assert_eq!(report.path, coll::Path::SymmetricKernel);
//!             let all = params.read::<f32>().unwrap();
//!             assert_eq!((all[0], all[1024]), (0.0, 1.0));
//!         });
//!     }
//! });
//! # Ok::<(), symmpool::Error>(())
//! ```

mod calibrate;
mod path;

pub use calibrate::{CalibrateConfig, Calibration, MAX_CALIBRATE_BYTES, Measurement, calibrate};
pub use path::{Choice, CollectiveReport, Path, PathPolicy, path_name};
pub(crate) use path::{PATHS, path_index};

use crate::backend::{CollArgs, Region};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::pool::{SymmBuffer, SymmPool};
use crate::stream::Stream;
use path::{Coll, Inputs, select};
use std::sync::{Arc, RwLock};

/// The collectives' own state of one pool: its path policy.
#[derive(Debug, Default)]
struct PoolColl {
    policy: RwLock<PathPolicy>,
}

fn state(pool: &SymmPool) -> Result<Arc<PoolColl>> {
    pool.extension(PoolColl::default)
}

/// The path thresholds the collectives use on `pool` now ([`PathPolicy::default`]
/// until [`set_path_policy`] replaces them).
pub fn path_policy(pool: &SymmPool) -> PathPolicy {
    state(pool)
        .map(|s| s.policy.read().unwrap_or_else(|p| p.into_inner()).clone())
        .unwrap_or_default()
}

/// Replace the path thresholds of `pool` (for example with the result of
/// [`calibrate`]).
///
/// # Collective
/// Every rank must use the same policy (a different choice of communicator on two
/// ranks hangs the collective); [`calibrate`] returns the same policy on every rank.
///
/// # Errors
/// [`Error::Internal`] if the pool's extension slot holds something else (a bug).
pub fn set_path_policy(pool: &SymmPool, policy: PathPolicy) -> Result<()> {
    *state(pool)?
        .policy
        .write()
        .unwrap_or_else(|p| p.into_inner()) = policy;
    Ok(())
}

/// Check that the buffers are this pool's, the pool is open, and note `stream` on
/// buffers allocated elsewhere (so their reuse waits for this collective).
fn prepare<'a>(bufs: &[&'a SymmBuffer], stream: &Stream) -> Result<&'a SymmPool> {
    let pool = bufs[0].pool();
    for b in bufs {
        if !b.pool().same_pool(pool) {
            return Err(failed(
                pool,
                Error::ForeignBuffer {
                    allocation_seq: b.allocation_seq(),
                },
            ));
        }
    }
    if let Err(e) = pool.check_open() {
        return Err(failed(pool, e));
    }
    if let Err(e) = pool.backend().check_stream(stream) {
        return Err(failed(pool, e));
    }
    for b in bufs {
        if b.stream().id() != stream.id()
            && let Err(e) = b.record_stream(stream)
        {
            return Err(failed(pool, e));
        }
    }
    Ok(pool)
}

/// Report `e` before a public collective returns it (out of line: the error path).
#[cold]
#[inline(never)]
fn failed(pool: &SymmPool, e: Error) -> Error {
    crate::pool::events::call_failed(pool, "collective", &e);
    e
}

fn invalid(op: &'static str, detail: String) -> Error {
    tracing::error!(target: "symmpool::coll", op, error = %detail, "symmpool call failed");
    Error::InvalidCollective { op, detail }
}

/// Elements of `T` in `bytes`, or an error if `T` does not divide it.
fn elements<T: Element>(op: &'static str, what: &str, bytes: u64) -> Result<u64> {
    let size = std::mem::size_of::<T>() as u64;
    if bytes == 0 || !bytes.is_multiple_of(size) {
        return Err(invalid(
            op,
            format!("{what} of {bytes} bytes is not a positive number of {size}-byte elements"),
        ));
    }
    Ok(bytes / size)
}

/// One side of a collective: the buffer and the bytes of it the call touches.
type Side<'a> = (&'a SymmBuffer, Region<'a>);

/// Pick the path and run one collective: the one dispatch of the public collectives
/// and of [`calibrate`]. `force` replaces the policy's preference for this call.
#[allow(clippy::too_many_arguments)]
fn dispatch(
    pool: &SymmPool,
    coll: Coll,
    (send_buf, send): Side<'_>,
    (recv_buf, recv): Side<'_>,
    count: u64,
    dtype: DType,
    stream: &Stream,
    force: Option<Path>,
) -> Result<CollectiveReport> {
    let backend = pool.backend();
    let bytes_per_rank = count.checked_mul(dtype.size_bytes()).ok_or_else(|| {
        invalid(
            "collective",
            format!("{count} elements overflow a byte count"),
        )
    })?;
    let registered = |c: usize| (send_buf.in_window(c), recv_buf.in_window(c));
    let mut policy = path_policy(pool);
    if let Some(p) = force {
        policy = policy.with_choices(Choice::Prefer(p), Choice::Prefer(p));
    }
    let (comm, path) = select(&Inputs {
        coll,
        bytes_per_rank,
        dtype,
        version: backend.nccl_version(),
        world_size: backend.world_size(),
        nodes: backend.info().nodes,
        comms: backend.communicators(),
        registered: &registered,
        policy: &policy,
    });
    let op = match coll {
        Coll::AllGather => ReduceOp::Sum,
        Coll::ReduceScatter(op) => op,
    };
    let windows = if path == Path::PlainKernel {
        (None, None)
    } else {
        (send_buf.window(comm), recv_buf.window(comm))
    };
    let args = CollArgs::new(comm, send, recv, count, dtype, op, stream, windows);
    let ran = match coll {
        Coll::AllGather => backend.collectives().all_gather(&args),
        Coll::ReduceScatter(_) => backend.collectives().reduce_scatter(&args),
    };
    if let Err(e) = ran {
        return Err(failed(pool, e));
    }
    let report = CollectiveReport {
        path,
        comm,
        role: backend.communicators()[comm].role,
        bytes_per_rank,
    };
    pool.count_collective(path_index(path), bytes_per_rank);
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        path::collective(coll == Coll::AllGather, &report);
    }
    Ok(report)
}

/// Out-of-place all-gather: every rank's `input` (N elements of `T`) lands at
/// `rank * N` in every rank's `output` (world × N elements), on `stream`.
///
/// # Collective
/// Every rank, same order, same sizes.
///
/// # Errors
/// [`Error::ForeignBuffer`] if the buffers come from different pools;
/// [`Error::PoolClosed`]; [`Error::InvalidCollective`] if `T` does not divide the input
/// or `output` is not exactly world × `input` bytes; backend errors (on the host
/// backend also [`Error::CollectiveMismatch`] and [`Error::Timeout`]).
pub fn all_gather<T: Element>(
    input: &SymmBuffer,
    output: &SymmBuffer,
    stream: &Stream,
) -> Result<CollectiveReport> {
    const OP: &str = "all_gather";
    let pool = prepare(&[input, output], stream)?;
    let count = elements::<T>(OP, "input", input.len_bytes())?;
    let world = pool.world_size() as u64;
    if input.len_bytes().checked_mul(world) != Some(output.len_bytes()) {
        return Err(invalid(
            OP,
            format!(
                "output has {} bytes, expected {world} x {} bytes",
                output.len_bytes(),
                input.len_bytes()
            ),
        ));
    }
    dispatch(
        pool,
        Coll::AllGather,
        (input, input.region()?),
        (output, output.region()?),
        count,
        T::DTYPE,
        stream,
        None,
    )
}

/// In-place all-gather, FSDP style: `buffer` holds world × N elements of `T`, this
/// rank's N at `rank * N`; afterwards every rank has all of them.
///
/// # Collective
/// Every rank, same order, same sizes.
///
/// # Errors
/// [`Error::InvalidCollective`] unless the length is a positive multiple of
/// world × `size_of::<T>()`; otherwise as [`all_gather`].
pub fn all_gather_in_place<T: Element>(
    buffer: &SymmBuffer,
    stream: &Stream,
) -> Result<CollectiveReport> {
    const OP: &str = "all_gather_in_place";
    let pool = prepare(&[buffer], stream)?;
    let (send, count) = own_chunk::<T>(OP, pool, buffer)?;
    dispatch(
        pool,
        Coll::AllGather,
        (buffer, send),
        (buffer, buffer.region()?),
        count,
        T::DTYPE,
        stream,
        None,
    )
}

/// This rank's chunk of a buffer split into world equal parts, and its element count.
fn own_chunk<'a, T: Element>(
    op: &'static str,
    pool: &SymmPool,
    buffer: &'a SymmBuffer,
) -> Result<(Region<'a>, u64)> {
    let world = pool.world_size() as u64;
    let total = elements::<T>(op, "buffer", buffer.len_bytes())?;
    if !total.is_multiple_of(world) {
        return Err(invalid(
            op,
            format!("{total} elements do not split evenly over {world} ranks"),
        ));
    }
    let count = total / world;
    let chunk_bytes = count * std::mem::size_of::<T>() as u64;
    let own = buffer
        .region()?
        .sub(pool.rank() as u64 * chunk_bytes, chunk_bytes)?;
    Ok((own, count))
}

/// Out-of-place reduce-scatter: `output` (N elements of `T`) gets the reduction over
/// ranks of elements `[rank * N, (rank + 1) * N)` of every rank's `input`
/// (world × N elements). `Sum` may run NCCL's symmetric kernel; other operations run
/// NCCL's ordinary kernels.
///
/// # Collective
/// Every rank, same order, same sizes and operation.
///
/// # Errors
/// As [`all_gather`], with `input` exactly world × `output` bytes.
pub fn reduce_scatter<T: Element>(
    input: &SymmBuffer,
    output: &SymmBuffer,
    op: ReduceOp,
    stream: &Stream,
) -> Result<CollectiveReport> {
    const OP: &str = "reduce_scatter";
    let pool = prepare(&[input, output], stream)?;
    let count = elements::<T>(OP, "output", output.len_bytes())?;
    let world = pool.world_size() as u64;
    if output.len_bytes().checked_mul(world) != Some(input.len_bytes()) {
        return Err(invalid(
            OP,
            format!(
                "input has {} bytes, expected {world} x {} bytes",
                input.len_bytes(),
                output.len_bytes()
            ),
        ));
    }
    dispatch(
        pool,
        Coll::ReduceScatter(op),
        (input, input.region()?),
        (output, output.region()?),
        count,
        T::DTYPE,
        stream,
        None,
    )
}

/// In-place reduce-scatter: `buffer` holds world × N elements of `T`; afterwards
/// this rank's chunk `[rank * N, (rank + 1) * N)` holds the reduction over ranks.
///
/// # Collective
/// Every rank, same order, same sizes and operation.
///
/// # Errors
/// As [`all_gather_in_place`].
pub fn reduce_scatter_in_place<T: Element>(
    buffer: &SymmBuffer,
    op: ReduceOp,
    stream: &Stream,
) -> Result<CollectiveReport> {
    const OP: &str = "reduce_scatter_in_place";
    let pool = prepare(&[buffer], stream)?;
    let (recv, count) = own_chunk::<T>(OP, pool, buffer)?;
    dispatch(
        pool,
        Coll::ReduceScatter(op),
        (buffer, buffer.region()?),
        (buffer, recv),
        count,
        T::DTYPE,
        stream,
        None,
    )
}
