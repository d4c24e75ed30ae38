//! The collective calls of a [`Coll`] handle: argument checks, the path choice, the
//! record, the launch.

use super::path::CollOp::{self, AllGather, AllReduce, ReduceScatter};
use super::path::{AVG, Inputs, select};
use super::{Coll, CollectiveReport, Path, PoolColl, path};
use crate::backend::{CallDeadline, CollArgs, Region};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::group::{BufferRecord, CheckMode, CollKind, CollectiveRecord, RecordKind};
use crate::pool::{SymmBuffer, SymmPool};
use crate::stream::Stream;
use std::sync::atomic::Ordering;

/// Check that the buffers are this pool's, the pool is open, and note `stream` on
/// buffers allocated elsewhere (so their reuse waits for this collective).
fn prepare<'a>(bufs: &[&'a SymmBuffer], stream: &Stream) -> Result<&'a SymmPool> {
    let pool = bufs[0].pool();
    let checked = (|| {
        if let Some(b) = bufs.iter().find(|b| !b.pool().same_pool(pool)) {
            let allocation_seq = b.allocation_seq();
            return Err(Error::ForeignBuffer { allocation_seq });
        }
        pool.check_open()?;
        pool.backend().check_stream(stream)?;
        bufs.iter().try_for_each(|b| b.use_on(stream))
    })();
    checked.map_err(|e| failed(pool, e))?;
    Ok(pool)
}

/// Report `e` before a public collective returns it (out of line: the error path).
#[cold]
#[inline(never)]
fn failed(pool: &SymmPool, e: Error) -> Error {
    crate::pool::events::call_failed(pool, "collective", &e);
    e
}

pub(super) fn invalid(op: &'static str, detail: String) -> Error {
    tracing::debug!(target: "symmpool::coll", op, error = %detail, "symmpool call failed");
    Error::InvalidCollective { op, detail }
}

/// Elements of `T` in `bytes`, or an error if `T` does not divide it.
pub(super) fn elements<T: Element>(op: &'static str, what: &str, bytes: u64) -> Result<u64> {
    let size = size_of::<T>() as u64;
    if bytes == 0 || !bytes.is_multiple_of(size) {
        return Err(invalid(
            op,
            format!("{what} of {bytes} bytes is not a positive number of {size}-byte elements"),
        ));
    }
    Ok(bytes / size)
}

/// One side of a collective: the buffer and the bytes of it the call touches.
pub(super) type Side<'a> = (&'a SymmBuffer, Region<'a>);

/// A buffer as a record carries it.
#[inline]
fn buffer_record(b: &SymmBuffer) -> BufferRecord {
    BufferRecord {
        allocation: b.allocation_seq(),
        segment: b.segment().0,
        offset_bytes: b.offset_bytes(),
        len_bytes: b.len_bytes(),
    }
}

/// This rank's chunk of a buffer (`whole`, its region) split into world equal parts,
/// and its element count.
#[inline]
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
    let chunk_bytes = count * size_of::<T>() as u64;
    let own = whole.sub(pool.rank() as u64 * chunk_bytes, chunk_bytes)?;
    Ok((own, count))
}

/// The collectives of a [`Coll`] handle ([`CollectiveCalls`]), each carrying the
/// caller's identity of the call: a `u64` tag (for example a hash of the layer, the
/// parameter group and the step), made by [`Coll::tagged`]. Two words on the stack:
/// make one per call.
///
/// Under [`CheckMode::Strict`] and [`CheckMode::Async`] the tag is a field of the
/// collective's record (compared before the other fields of the call), so ranks that
/// issue the same shape of call for different layers (one persistent gather buffer
/// for every layer, one rank skipping a layer) fail with
/// [`Error::CollectiveDivergence`] naming the field `tag`: under `Strict` before any
/// data moves, under `Async` within the documented bound. Under [`CheckMode::Off`]
/// the tag is ignored. Every `u64` is a tag, 0 included.
///
/// Every collective needs its tag: an untagged one (a call on the [`Coll`] itself) is
/// refused with [`Error::Untagged`], in every check mode and at every world size,
/// unless its pool was made for untagged collectives
/// ([`PoolConfig::with_untagged_collectives`](crate::PoolConfig::with_untagged_collectives)).
///
/// ```
/// use symmpool::{Coll, CollectiveCalls, PoolConfig, Stream, SymmPool};
///
/// let pools = SymmPool::host_group(2, PoolConfig::default())?;
/// std::thread::scope(|s| {
///     for pool in &pools {
///         s.spawn(move || {
///             let coll = Coll::new(pool).unwrap();
///             let stream = Stream::host();
///             let gathered = pool.alloc(2 * 4 * 256, &stream).unwrap();
///             for layer in 0..4u64 {
///                 let tag = (7 << 32) | layer; // step 7, layer `layer`
///                 coll.tagged(tag).all_gather_in_place::<f32>(&gathered, &stream).unwrap();
///             }
///             coll.end_step().unwrap();
///         });
///     }
/// });
/// # Ok::<(), symmpool::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct TaggedColl<'a> {
    pub(super) coll: &'a Coll,
    pub(super) tag: u64,
}

impl TaggedColl<'_> {
    /// The tag the calls carry.
    pub fn tag(&self) -> u64 {
        self.tag
    }
}

impl Coll {
    /// This handle's collectives, each carrying `tag`, the caller's identity of the
    /// call (see [`TaggedColl`]). Allocates nothing.
    #[inline]
    pub fn tagged(&self, tag: u64) -> TaggedColl<'_> {
        TaggedColl { coll: self, tag }
    }
}

/// The buffers of a call: out of place (input, output) or in place.
#[derive(Clone, Copy)]
enum Buffers<'a> {
    OutOfPlace(&'a SymmBuffer, &'a SymmBuffer),
    InPlace(&'a SymmBuffer),
}
use Buffers::{InPlace, OutOfPlace};

/// The size error of an out-of-place call: `what` is not `factor` × the other side's
/// `per_bytes` (out of line: the error path).
#[cold]
#[inline(never)]
fn size_mismatch(
    op: &'static str,
    what: &str,
    got_bytes: u64,
    factor: u64,
    per_bytes: u64,
) -> Error {
    invalid(
        op,
        format!("{what} has {got_bytes} bytes, expected {factor} x {per_bytes} bytes"),
    )
}

/// Refuse a reduction the backend's NCCL does not have (`ncclAvg` before 2.10).
#[cold]
#[inline(never)]
fn missing_op(op: &'static str, version: crate::error::NcclVersion) -> Error {
    invalid(
        op,
        format!("ReduceOp::Avg needs NCCL {AVG} or later (ncclAvg); this is NCCL {version}"),
    )
}

mod sealed {
    /// The handle and tag a [`CollectiveCalls`](super::CollectiveCalls) type calls with.
    pub trait Handle {
        /// The collectives handle and the tag of the calls (`None`: untagged).
        fn coll_and_tag(&self) -> (&super::Coll, Option<u64>);
    }
}

impl sealed::Handle for Coll {
    #[inline(always)]
    fn coll_and_tag(&self) -> (&Coll, Option<u64>) {
        (self, None)
    }
}

impl sealed::Handle for TaggedColl<'_> {
    #[inline(always)]
    fn coll_and_tag(&self) -> (&Coll, Option<u64>) {
        (self.coll, Some(self.tag))
    }
}

impl CollectiveCalls for Coll {}
impl CollectiveCalls for TaggedColl<'_> {}

/// The collective calls of a [`Coll`] handle, carrying a tag on a [`TaggedColl`]
/// (`coll.tagged(tag)`), untagged on the handle itself (refused unless the pool accepts
/// them: [`PoolConfig::untagged_collectives`](crate::PoolConfig::untagged_collectives));
/// bring the trait into scope to call them (`use symmpool::CollectiveCalls`). Sealed:
/// only those two types implement it.
///
/// # Collective
/// Every method is collective: every rank makes the same calls, in the same order,
/// with the same sizes, operation and tag.
pub trait CollectiveCalls: sealed::Handle {
    /// Out-of-place all-gather: every rank's `input` (N elements of `T`) lands at
    /// `rank * N` in every rank's `output` (world × N elements), on `stream`.
    ///
    /// # Collective
    /// Every rank, same order, same sizes (and tag).
    ///
    /// # Errors
    /// [`Error::ForeignBuffer`] if the buffers come from different pools (or another
    /// handle's pool); [`Error::PoolClosed`]; [`Error::InvalidCollective`] if `T` does
    /// not divide the input or `output` is not exactly world × `input` bytes; backend
    /// errors (on the host backends also [`Error::Timeout`]);
    /// [`Error::CollectiveDivergence`] when the pool's collective check finds the ranks
    /// disagree (see "Checked collectives" in [`coll`](crate::coll); a different tag
    /// is named as the field `tag`), and on every later call after that;
    /// [`Error::Untagged`] for an untagged call on a pool that does not accept them
    /// (nothing ran); [`Error::PeerLost`] when a peer is lost during the
    /// call (every survivor may then [`SymmPool::shrink`](crate::SymmPool::shrink)),
    /// and [`Error::PoolBroken`] from later calls after a collective timed out or lost
    /// a peer; [`Error::Shrunk`] for a handle or buffer of a pool that a shrink
    /// replaced (allocate anew from the new pool).
    #[inline]
    fn all_gather<T: Element>(
        &self,
        input: &SymmBuffer,
        output: &SymmBuffer,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, AllGather, OutOfPlace(input, output), stream)
    }

    /// In-place all-gather, FSDP style: `buffer` holds world × N elements of `T`, this
    /// rank's N at `rank * N`; afterwards every rank has all of them.
    ///
    /// # Collective
    /// Every rank, same order, same sizes (and tag).
    ///
    /// # Errors
    /// [`Error::InvalidCollective`] unless the length is a positive multiple of
    /// world × `size_of::<T>()`; otherwise as [`all_gather`](Self::all_gather).
    #[inline]
    fn all_gather_in_place<T: Element>(
        &self,
        buffer: &SymmBuffer,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, AllGather, InPlace(buffer), stream)
    }

    /// Out-of-place reduce-scatter: `output` (N elements of `T`) gets the reduction over
    /// ranks of elements `[rank * N, (rank + 1) * N)` of every rank's `input`
    /// (world × N elements). `Sum` may run NCCL's symmetric kernel; other operations run
    /// NCCL's ordinary kernels.
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation (and tag).
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather), with `input` exactly world × `output` bytes.
    #[inline]
    fn reduce_scatter<T: Element>(
        &self,
        input: &SymmBuffer,
        output: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, ReduceScatter(op), OutOfPlace(input, output), stream)
    }

    /// In-place reduce-scatter: `buffer` holds world × N elements of `T`; afterwards
    /// this rank's chunk `[rank * N, (rank + 1) * N)` holds the reduction over ranks.
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation (and tag).
    ///
    /// # Errors
    /// As [`all_gather_in_place`](Self::all_gather_in_place).
    #[inline]
    fn reduce_scatter_in_place<T: Element>(
        &self,
        buffer: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, ReduceScatter(op), InPlace(buffer), stream)
    }

    /// Out-of-place all-reduce: every rank's `output` (N elements of `T`) gets the
    /// reduction `op` over ranks of every rank's `input` (N elements of `T`), in the
    /// element type's arithmetic. `Sum` (and `Avg` from NCCL 2.30) on `f32`, `f16`
    /// and `bf16` may run NCCL's symmetric kernel; everything else runs NCCL's
    /// ordinary kernels (`ncclAllReduce` either way).
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation (and tag).
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather), with `output` exactly `input`'s bytes;
    /// [`Error::InvalidCollective`] also for `Avg` under an NCCL older than 2.10.
    #[inline]
    fn all_reduce<T: Element>(
        &self,
        input: &SymmBuffer,
        output: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, AllReduce(op), OutOfPlace(input, output), stream)
    }

    /// In-place all-reduce: `buffer` (N elements of `T`) becomes the reduction `op`
    /// over ranks of every rank's `buffer`.
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation (and tag).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    #[inline]
    fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        call::<T>(self, AllReduce(op), InPlace(buffer), stream)
    }
}

/// The one body of the public collectives: check the buffers for `coll`, then
/// [`Coll::dispatch`] on the handle with its tag. Out of place, the side of N
/// elements is the all-gather's input, the reduce-scatter's output and the
/// all-reduce's input, the other side world × N (N for all-reduce); in place, the
/// all-gather sends and the reduce-scatter receives this rank's chunk of the
/// buffer, the all-reduce uses the whole. Inlined into each public call, so the
/// operation's choices (its name in errors among them) fold away.
#[inline(always)]
fn call<T: Element>(
    handle: &(impl sealed::Handle + ?Sized),
    coll: CollOp,
    bufs: Buffers<'_>,
    stream: &Stream,
) -> Result<CollectiveReport> {
    let (handle, tag) = handle.coll_and_tag();
    let name = match (coll, bufs) {
        (AllGather, OutOfPlace(..)) => "all_gather",
        (AllGather, InPlace(_)) => "all_gather_in_place",
        (ReduceScatter(_), OutOfPlace(..)) => "reduce_scatter",
        (ReduceScatter(_), InPlace(_)) => "reduce_scatter_in_place",
        (AllReduce(_), OutOfPlace(..)) => "all_reduce",
        (AllReduce(_), InPlace(_)) => "all_reduce_in_place",
    };
    // The handle's entry and the tag rule first: a refused call touches nothing.
    let (OutOfPlace(first, _) | InPlace(first)) = bufs;
    let Some(entry) = handle.entry(first.pool()) else {
        let pool = first.pool();
        let error = match pool.check_open() {
            // A buffer of a pool that a shrink replaced: say so, not only "foreign".
            Err(e @ Error::Shrunk { .. }) => e,
            _ => Error::ForeignBuffer {
                allocation_seq: first.allocation_seq(),
            },
        };
        return Err(failed(pool, error));
    };
    // A call without an identity, unless the pool was made for them.
    if tag.is_none() && !entry.pool.config().untagged_collectives {
        return Err(failed(first.pool(), untagged(name, first.pool())));
    }
    let pool = match bufs {
        OutOfPlace(input, output) => prepare(&[input, output], stream)?,
        InPlace(buffer) => prepare(&[buffer], stream)?,
    };
    if let AllReduce(ReduceOp::Avg) = coll {
        let version = pool.backend().nccl_version();
        if version < AVG {
            return Err(missing_op(name, version));
        }
    }
    let world = pool.world_size() as u64;
    let (send, recv, count) = match bufs {
        OutOfPlace(input, output) => {
            // (the side of N elements, its name, the other side, its name, world or 1)
            let (per, per_name, all, all_name, factor) = match coll {
                AllGather => (input, "input", output, "output", world),
                ReduceScatter(_) => (output, "output", input, "input", world),
                AllReduce(_) => (input, "input", output, "output", 1),
            };
            let count = elements::<T>(name, per_name, per.len_bytes())?;
            if per.len_bytes().checked_mul(factor) != Some(all.len_bytes()) {
                let (got, per_bytes) = (all.len_bytes(), per.len_bytes());
                return Err(size_mismatch(name, all_name, got, factor, per_bytes));
            }
            ((input, input.region()?), (output, output.region()?), count)
        }
        InPlace(buffer) => {
            let whole = buffer.region()?;
            let (own, count) = match coll {
                AllReduce(_) => (whole, elements::<T>(name, "buffer", buffer.len_bytes())?),
                _ => own_chunk::<T>(name, pool, buffer, whole)?,
            };
            let (send, recv) = match coll {
                AllGather => (own, whole),
                _ => (whole, own),
            };
            ((buffer, send), (buffer, recv), count)
        }
    };
    handle.dispatch(entry, coll, send, recv, count, T::DTYPE, stream, None, tag)
}

/// The error of an untagged collective on a pool that refuses them (out of line: the
/// error path).
#[cold]
#[inline(never)]
fn untagged(op: &'static str, pool: &SymmPool) -> Error {
    Error::Untagged {
        op,
        pool: pool.config().name.clone(),
    }
}

impl Coll {
    /// Pick the path and run one collective: the one dispatch of the public collectives
    /// and of calibration. `force` replaces the policy's preference for this call.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch(
        &self,
        entry: &PoolColl,
        coll: CollOp,
        (send_buf, send): Side<'_>,
        (recv_buf, recv): Side<'_>,
        count: u64,
        dtype: DType,
        stream: &Stream,
        force: Option<Path>,
        tag: Option<u64>,
    ) -> Result<CollectiveReport> {
        let pool = &entry.pool;
        let backend = pool.backend();
        let bytes_per_rank = count.checked_mul(dtype.size_bytes()).ok_or_else(|| {
            invalid(
                "collective",
                format!("{count} elements overflow a byte count"),
            )
        })?;
        let registered = |c: usize| (send_buf.in_window(c), recv_buf.in_window(c));
        let (ledger, mode) = (pool.ledger(), pool.check_mode());
        if let Err(e) = ledger.check() {
            return Err(failed(pool, e));
        }
        // The policy is read in place, without a lock or a reference count; only a
        // forced path, which calibration uses, builds one of its own.
        // A call like one of this thread's last few takes its path again, unchosen.
        let key = (
            entry as *const PoolColl as usize,
            coll,
            dtype,
            bytes_per_rank,
        );
        let segments = (send_buf.segment().0, recv_buf.segment().0);
        let (comm, path) = self.inner.policy.choice((key, segments, force), |shared| {
            let forced = force.map(|p| shared.forcing(p));
            select(&Inputs {
                coll,
                bytes_per_rank,
                dtype,
                version: backend.nccl_version(),
                world_size: backend.world_size(),
                nodes: backend.info().nodes,
                comms: backend.communicators(),
                registered: &registered,
                policy: forced.as_ref().unwrap_or(shared),
            })
        });
        let op = coll.reduction();
        let windows = if path == Path::PlainKernel {
            (None, None)
        } else {
            (send_buf.window(comm), recv_buf.window(comm))
        };
        // The call's one deadline, for its check and its backend's waits alike; the
        // clock is read only if one of them waits.
        let deadline = CallDeadline::from_first_wait(pool.group().config().timeout);
        let args = CollArgs::new(
            comm, send, recv, count, dtype, op, stream, windows, deadline,
        )
        .with_caller(pool.channel().ordinal());
        // The record and the launch are one step on this handle (Strict: the record's
        // round; Async: its post), so that the records' order is the launches' order
        // even when several threads of a rank call.
        let launch = (mode != CheckMode::Off).then(|| ledger.launch_lock());
        if mode != CheckMode::Off {
            // This rank's record, counting the collective on its pool and communicator.
            let (collective, reduction) = match coll {
                AllGather => (CollKind::AllGather, None),
                ReduceScatter(op) => (CollKind::ReduceScatter, Some(op as u8)),
                AllReduce(op) => (CollKind::AllReduce, Some(op as u8)),
            };
            let comm_seqs = self.inner.comm_seqs.get(comm);
            let comm_seq = comm_seqs.map_or(0, |c| c.fetch_add(1, Ordering::Relaxed) + 1);
            // The pool's call count and hash, in one lock-free read.
            let (call_seq, call_hash) = pool.call_head();
            let record = CollectiveRecord {
                kind: RecordKind::Collective,
                pool: pool.channel().ordinal(),
                tag,
                pool_collective: entry.collectives.fetch_add(1, Ordering::Relaxed) + 1,
                collective,
                dtype: Some(dtype as u8),
                reduction,
                count,
                comm: comm as u64,
                comm_seq,
                path: Some(path as u8),
                input: buffer_record(send_buf),
                output: buffer_record(recv_buf),
                call_seq,
                call_hash,
            };
            if let Err(e) = ledger.submit(mode, record, || args.deadline()) {
                return Err(failed(pool, e));
            }
        }
        let ran = match coll {
            AllGather => backend.collectives().all_gather(&args),
            ReduceScatter(_) => backend.collectives().reduce_scatter(&args),
            AllReduce(_) => backend.collectives().all_reduce(&args),
        };
        drop(launch);
        if let Err(e) = ran {
            // A call ended by a failed check reports the divergence (found by the
            // call's deadline).
            return Err(failed(pool, ledger.call_failed(e, || args.deadline())));
        }
        let report = CollectiveReport {
            path,
            comm,
            role: backend.communicators()[comm].role,
            bytes_per_rank,
        };
        entry.counters.add(path as usize, bytes_per_rank);
        if tracing::level_enabled!(tracing::Level::DEBUG) {
            path::collective(pool, coll, &report);
        }
        Ok(report)
    }
}
