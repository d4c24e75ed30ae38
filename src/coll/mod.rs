//! Collectives on pool buffers: all-gather (copy engine or symmetric kernel) and
//! reduce-scatter (symmetric kernel or ring), with a per-call path choice: the fastest
//! of the backend's paths for the size, as calibrated (on NCCL the calls themselves
//! carry the cost of non-blocking communicators; BENCHMARKS.md has the figures).
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
//! # Checked collectives
//! NCCL's symmetric kernels and copy engines read and write peers at the caller's
//! window offset and check nothing: if the ranks disagree about a buffer (a free and an
//! allocation in different orders, a skipped collective, two pools crossed, two threads
//! racing on one rank) the result is silent corruption or a hang. So every collective
//! makes a **record**, the same mechanism on every backend:
//!
//! | field | what |
//! |---|---|
//! | record kind | collective, or periodic light agreement |
//! | pool | the ordinal of the pool's exchange channel (its identity among the ranks) |
//! | pool collective number | collectives issued on this pool so far |
//! | collective, element type, reduction, count | the call |
//! | communicator, communicator sequence number | the communicator the path chose, and the collectives issued on it over *every* pool of the backend (crossed pools differ here) |
//! | path | copy engine, symmetric kernel, plain kernel |
//! | input and output: allocation, segment, offset, bytes | the buffers (allocation sequence numbers are the same on every rank for the same call sequence) |
//! | pool call count and hash | the pool's running hash of every allocation and free before the call |
//!
//! The ranks compare their records on a channel of the pool's own, opened when the
//! pool is created (the mode is part of its name, so ranks with different modes fail
//! there). What happens depends on [`PoolConfig::check`](crate::PoolConfig::check):
//!
//! * [`CheckMode::Strict`]: before the collective is launched, the ranks exchange and
//!   compare the record. A difference is [`Error::CollectiveDivergence`] on every rank,
//!   naming the first differing field and each rank's value, and **no data moves**.
//!   Costs one control-plane round per collective on the calling thread; the round
//!   and the launch are one step per pool (a second thread waits).
//! * [`CheckMode::Async`] (the default): the calling thread posts the record into a
//!   bounded queue ([`PoolConfig::check_queue`](crate::PoolConfig::check_queue) records,
//!   64 by default) and returns; a background thread of the pool exchanges the posted
//!   records in batches and compares them. A difference breaks the pool on every rank:
//!   the next collective fails with [`Error::CollectiveDivergence`], the next pool call
//!   with [`Error::PoolBroken`]. **Detection bound**: a divergence at this rank's
//!   collective *k* is reported by its collective *k* + `check_queue` + 1 at the latest
//!   (a caller that finds the queue full waits for room), and in time within one
//!   control-plane round after the last rank posted record *k*; a rank that never posts
//!   its record *k* (it skipped the last collective) is reported after the pool's
//!   timeout ([`Error::Timeout`] breaks the exchange). [`wait_checks`] waits until
//!   everything posted is compared. The diverging collectives themselves may have run
//!   (and moved wrong data, or timed out).
//! * [`CheckMode::Off`]: no record, no light agreement: a divergence is what it is
//!   without the crate (silent corruption on the symmetric paths, a hang or an NCCL
//!   error otherwise; the host backends move the data at the offsets given, bounds
//!   checked, and time out on mismatched rounds).
//!
//! **Light agreement**: under `Async` and `Strict`, once every
//! [`PoolConfig::check_every_calls`](crate::PoolConfig::check_every_calls) pool calls
//! (1024 by default) the next allocation posts (or, under `Strict`, exchanges) a record
//! of the pool's call count and running hash, so a loop of cache hits without
//! collectives cannot drift unseen.
//!
//! **Breakage is consistent**: after a mismatch, or a collective that timed out or
//! lost a peer, every later collective and every later pool call of that pool fails on
//! this rank, and every collective pool operation (`reserve`, `trim`, growth) fails on
//! every rank ([`Error::PoolBroken`]); `close` still releases the memory.
//!
//! **NCCL's own check**: NCCL ≥ 2.29.7 has `NCCL_CHECK_MODE=DEBUG_GLOBAL`, which checks
//! each collective's registration and offsets across ranks (not skipped calls: a
//! skipped collective pairs with the next one); `scripts/gpu-check.sh run` sets it
//! when run with `NCCL_CHECK=1` (only for an NCCL that has it).
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
mod check;
mod path;

pub use calibrate::{CalibrateConfig, Calibration, MAX_CALIBRATE_BYTES, Measurement, calibrate};
pub use path::{Choice, CollectiveReport, Path, PathPolicy, path_name};
pub(crate) use path::{PATHS, path_index};

use crate::backend::{CollArgs, Region};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::pool::{CheckMode, SymmBuffer, SymmPool};
use crate::stream::Stream;
use path::{Coll, Inputs, select};
use std::sync::RwLock;

/// The collectives' own state of one pool: its path policy and its checks.
#[derive(Debug)]
struct PoolColl {
    policy: RwLock<PathPolicy>,
    check: check::Checker,
}

fn state(pool: &SymmPool) -> Result<&PoolColl> {
    pool.extension(|| PoolColl {
        policy: RwLock::new(PathPolicy::default()),
        check: check::Checker::new(pool),
    })
}

/// The check mode of `pool` (its configuration's [`PoolConfig::check`](crate::PoolConfig::check)).
pub fn check_mode(pool: &SymmPool) -> CheckMode {
    pool.config().check
}

/// Wait until every collective record this rank posted on `pool` has been compared
/// with the peers' (under [`CheckMode::Async`]; at once otherwise), and return the
/// verdict: for example at the end of a training step, or before reading results
/// that must be trusted.
///
/// # Collective
/// The comparison needs the peers' records: every rank should call it at the same
/// point (or at least have made the same collectives).
///
/// # Errors
/// [`Error::CollectiveDivergence`] or [`Error::PoolBroken`] if a check failed;
/// [`Error::Timeout`] if the records are not compared within twice the pool's timeout.
pub fn wait_checks(pool: &SymmPool) -> Result<()> {
    let st = state(pool)?;
    match st.check.mode() {
        CheckMode::Async => st.check.wait_compared(),
        _ => st.check.check(),
    }
}

/// The periodic light agreement of the pool's running call hash (from `alloc`, with
/// the pool's state held): a record of kind "light" through the pool's check.
pub(crate) fn light_agreement(pool: &SymmPool, call_seq: u64, hash: u64) -> Result<()> {
    let st = state(pool)?;
    let mut record = [0u64; check::WORDS];
    record[check::field::KIND] = check::LIGHT;
    record[check::field::POOL] = pool.channel().ordinal();
    record[check::field::PATH] = 3;
    record[check::field::CALL_SEQ] = call_seq;
    record[check::field::CALL_HASH] = hash;
    match st.check.mode() {
        CheckMode::Off => Ok(()),
        CheckMode::Async => st.check.post(record),
        CheckMode::Strict => {
            let mut compared = st.check.strict_lock();
            st.check.strict_round(&mut compared, &record)
        }
    }
}

/// (allocation number, segment, offset, bytes) of a buffer, for a record.
fn buffer_words(b: &SymmBuffer) -> [u64; 4] {
    [
        b.allocation_seq(),
        u64::from(b.segment().0),
        b.offset_bytes(),
        b.len_bytes(),
    ]
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
    let coll_state = state(pool).map_err(|e| failed(pool, e))?;
    let checker = &coll_state.check;
    let mode = checker.mode();
    if let Err(e) = checker.check() {
        return Err(failed(pool, e));
    }
    // The pool's call count and hash, read before any check lock is taken (`alloc`
    // takes the state first, then the check lock).
    let calls = match mode {
        CheckMode::Off => (0, 0),
        _ => {
            let st = pool.state();
            (st.history.seq(), st.history.hash())
        }
    };
    // The policy is read in place (a clone per call cost as much as the rest of the
    // call); only a forced path, which calibration uses, builds one of its own.
    let (comm, path) = {
        let shared = coll_state.policy.read().unwrap_or_else(|p| p.into_inner());
        let forced = force.map(|p| {
            shared
                .clone()
                .with_choices(Choice::Prefer(p), Choice::Prefer(p))
        });
        select(&Inputs {
            coll,
            bytes_per_rank,
            dtype,
            version: backend.nccl_version(),
            world_size: backend.world_size(),
            nodes: backend.info().nodes,
            comms: backend.communicators(),
            registered: &registered,
            policy: forced.as_ref().unwrap_or(&shared),
        })
    };
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
    // Strict: the record's round and the launch are one step on this pool.
    let mut strict = (mode == CheckMode::Strict).then(|| checker.strict_lock());
    if mode != CheckMode::Off {
        let mut record = [0u64; check::WORDS];
        record[check::field::KIND] = check::COLLECTIVE;
        record[check::field::POOL] = pool.channel().ordinal();
        record[check::field::POOL_COLLECTIVE] = checker.next_collective();
        let (kind, reduction) = match coll {
            Coll::AllGather => (1, 0),
            Coll::ReduceScatter(op) => (2, op as u64 + 1),
        };
        record[check::field::OP] = kind;
        record[check::field::DTYPE] = dtype as u64;
        record[check::field::REDUCTION] = reduction;
        record[check::field::COUNT] = count;
        record[check::field::COMM] = comm as u64;
        record[check::field::COMM_SEQ] = backend.next_collective_seq(comm);
        record[check::field::PATH] = path as u64;
        record[check::field::INPUT..check::field::INPUT + 4]
            .copy_from_slice(&buffer_words(send_buf));
        record[check::field::OUTPUT..check::field::OUTPUT + 4]
            .copy_from_slice(&buffer_words(recv_buf));
        record[check::field::CALL_SEQ] = calls.0;
        record[check::field::CALL_HASH] = calls.1;
        let checked = match strict.as_mut() {
            Some(compared) => checker.strict_round(compared, &record),
            None => checker.post(record),
        };
        if let Err(e) = checked {
            return Err(failed(pool, e));
        }
    }
    let ran = match coll {
        Coll::AllGather => backend.collectives().all_gather(&args),
        Coll::ReduceScatter(_) => backend.collectives().reduce_scatter(&args),
    };
    drop(strict);
    if let Err(e) = ran {
        checker.break_on(&e);
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
/// backend also [`Error::Timeout`]); [`Error::CollectiveDivergence`] when the pool's
/// collective check finds the ranks disagree (see "Checked collectives" above).
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
    let whole = buffer.region()?;
    let (send, count) = own_chunk::<T>(OP, pool, buffer, whole)?;
    dispatch(
        pool,
        Coll::AllGather,
        (buffer, send),
        (buffer, whole),
        count,
        T::DTYPE,
        stream,
        None,
    )
}

/// This rank's chunk of a buffer (`whole`, its region) split into world equal parts,
/// and its element count.
fn own_chunk<'a, T: Element>(
    op: &'static str,
    pool: &SymmPool,
    buffer: &SymmBuffer,
    whole: Region<'a>,
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
    let own = whole.sub(pool.rank() as u64 * chunk_bytes, chunk_bytes)?;
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
    let whole = buffer.region()?;
    let (recv, count) = own_chunk::<T>(OP, pool, buffer, whole)?;
    dispatch(
        pool,
        Coll::ReduceScatter(op),
        (buffer, whole),
        (buffer, recv),
        count,
        T::DTYPE,
        stream,
        None,
    )
}
