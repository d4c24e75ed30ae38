//! [`SymmPool`]: the allocator core, a backend, and the segment entries that own the
//! memory and its windows. [`SymmPool::alloc`] is served from the core's cache (a
//! mutex, a best-fit lookup, no NCCL call) and grows the pool when nothing fits
//! (`growth.rs`); a dropped [`SymmBuffer`] frees its block (`free.rs`: never a
//! collective, never a wait); memory is released by the collective [`SymmPool::trim`]
//! and [`SymmPool::close`] (`release.rs`), or locally when the last handle to a pool
//! that was not closed goes. A failure inside `Drop` is returned by the next fallible
//! call; a panic under the pool's lock breaks it ([`Error::PoolBroken`]).

mod buffer;
mod catch_up;
mod config;
pub(crate) mod events;
mod fit;
mod free;
mod growth;
mod history;
mod regroup;
mod release;
mod scope;
mod state;
mod stats;

#[cfg(feature = "nccl")]
pub use buffer::{CudaView, CudaViewMut};
pub use buffer::{SymmBuffer, TypedView};
pub use config::{MAX_HISTORY, PoolConfig};
pub(crate) use events::role_name;
pub use fit::FitReport;
pub(crate) use history::MemoryHistory;
pub use history::{MemoryAction, MemoryEvent};
pub use regroup::{GrowReport, ShrinkReport};
pub use scope::{alloc, alloc_aligned, current};
pub use stats::{MemoryStats, StatValue};

use crate::backend::Backend;
use crate::control::ChannelId;
use crate::core::{AllocError, AllocRequest, Allocator, BlockId, Wait};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{CallHead, CallKind, CheckMode, History, Ledger};
use crate::group::{Group, GroupConfig};
use crate::stream::Stream;
use parking_lot::Mutex as PlMutex;
use smallvec::SmallVec;
pub(crate) use state::{Counters, PoolCounters, PoolState, SegmentEntry};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

type DeferredFree = (BlockId, SmallVec<[Wait; 3]>);

pub(crate) struct PoolInner {
    /// The communicator set, shared with the other pools over it: the backend, the
    /// ledger (its agreements and its collectives' records, one verdict: a failure
    /// there breaks the pool, copied into the state's `broken` by `state()`), the
    /// timeout.
    pub(crate) group: Group,
    /// The group's backend, here too: one pointer less on every collective's path.
    backend: Backend,
    /// Mirrors `PoolState::closed` for lock-free checks on the collectives' path.
    closed: AtomicBool,
    /// Frees made by `Drop` while the state was busy; applied by the next call.
    deferred: PlMutex<Vec<DeferredFree>>,
    /// A failure inside a `Drop`, returned by the next fallible call.
    deferred_error: PlMutex<Option<Error>>,
    /// The configuration in effect.
    config: PoolConfig,
    /// The exchange channel of this pool's agreements.
    pub(crate) channel: ChannelId,
    /// How its collectives are checked: the group's mode (calibration's temporary
    /// pool: [`CheckMode::Off`](crate::CheckMode::Off)).
    mode: crate::CheckMode,
    /// The call count and running hash, read without the state's lock.
    call_head: Arc<CallHead>,
    /// Lock-free counters for [`SymmPool::memory_stats`].
    pub(crate) counters: PoolCounters,
    state: Mutex<PoolState>,
    /// The pool a shrink made of this one (`shrink.rs`): it holds the core now, so
    /// the frees of this pool's buffers go there.
    successor: OnceLock<SymmPool>,
}

/// A symmetric-memory caching pool for one rank.
///
/// Cheap to clone (a handle); buffers keep their pool alive. Every rank of a
/// communicator set owns one pool in its [`Group`], and the ranks make the same sequence
/// of pool calls; placement then agrees on every rank, which NCCL's symmetric kernels
/// and copy engines require (they address peers at the local offset). The
/// [crate documentation](crate) shows one pool per rank.
///
/// # Two pools, two streams
///
/// FSDP gathers parameters on one stream and reduce-scatters gradients on another,
/// each driven by a thread of its own: give each thread's pool a group of its own,
/// over communicators of its own ([`Group::split`]): pools that share communicators
/// must make their growths and collectives in the same order on every rank, which two
/// threads do not (the failures say so: [`Error::SharedCommunicators`]).
///
/// ```
/// use symmpool::{Coll, CollectiveCalls, Group, GroupConfig, PoolConfig, ReduceOp, Stream, SymmPool};
///
/// let groups = Group::host(2, &GroupConfig::default())?;
/// std::thread::scope(|s| {
///     for group in groups {
///         s.spawn(move || {
///             // Every rank makes both groups and pools, in the same order.
///             let (g0, g1) = (group.split("params").unwrap(), group.split("grads").unwrap());
///             let params = SymmPool::new(&g0, PoolConfig::default().with_name("params")).unwrap();
///             let grads = SymmPool::new(&g1, PoolConfig::default().with_name("grads")).unwrap();
///             let (gather, reduce) = (Coll::new(&params).unwrap(), Coll::new(&grads).unwrap());
///             std::thread::scope(|t| {
///                 // The all-gather stream's thread: parameters.
///                 t.spawn(|| {
///                     let stream = Stream::host();
///                     let full = params.alloc(2 * 4 * 1024, &stream).unwrap();
///                     gather.tagged(0).all_gather_in_place::<f32>(&full, &stream).unwrap();
///                 });
///                 // The reduce-scatter stream's thread: gradients.
///                 t.spawn(|| {
///                     let stream = Stream::host();
///                     let g = grads.alloc(2 * 4 * 1024, &stream).unwrap();
///                     let shard = grads.alloc(4 * 1024, &stream).unwrap();
///                     let grad0 = reduce.tagged(0); // layer 0's gradients
///                     grad0.reduce_scatter::<f32>(&g, &shard, ReduceOp::Sum, &stream).unwrap();
///                 });
///             });
///             gather.end_step().unwrap();
///             reduce.end_step().unwrap();
///         });
///     }
/// });
/// # Ok::<(), symmpool::Error>(())
/// ```
#[derive(Clone)]
pub struct SymmPool {
    pub(crate) inner: Arc<PoolInner>,
}

impl fmt::Debug for SymmPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SymmPool")
            .field("backend", &self.inner.backend)
            .finish_non_exhaustive()
    }
}

impl SymmPool {
    /// A pool in one rank's communicator set.
    ///
    /// # Collective
    /// Every rank creates its pools in the same order with the same names: the ranks
    /// agree on the pool's ordinal and name (and open the pool's own exchange channel,
    /// so that rounds of different pools never pair). With ranks as threads of one
    /// process, create them concurrently ([`SymmPool::world`]).
    ///
    /// The pool shares `group`'s settings (timeout, check mode) and ledger with the
    /// other pools in it; pools used from different threads need groups of their own
    /// ([`Group::split`]).
    ///
    /// # Errors
    /// [`Error::Config`] if `history_len` exceeds [`MAX_HISTORY`]; [`Error::Core`] if
    /// the core configuration (with the backend's granularity) is invalid;
    /// [`Error::ChannelMismatch`] on every rank if the ranks create pools in different
    /// orders, with different names or [`PoolConfig::untagged_collectives`];
    /// [`Error::Timeout`] / [`Error::PeerLost`] if a rank does not create its pool in time.
    pub fn new(group: &Group, config: PoolConfig) -> Result<Self> {
        let (rank, name) = (group.rank(), config.name.clone());
        Self::create(group, config, group.check_mode()).inspect_err(|error| {
            tracing::debug!(target: "symmpool", rank, pool = %name, op = "new", error = %error,
                "symmpool call failed");
        })
    }

    /// As [`new`](Self::new), its collectives checked under `mode` (calibration's
    /// temporary pool: unchecked).
    pub(crate) fn create(group: &Group, mut config: PoolConfig, mode: CheckMode) -> Result<Self> {
        if config.history_len > MAX_HISTORY {
            return Err(Error::config(
                "PoolConfig::history_len",
                config.history_len.to_string(),
                "at most MAX_HISTORY (65 536) calls",
            ));
        }
        let granularity = group.backend().granularity_bytes();
        config.core = config.core.with_granularity_bytes(granularity);
        config.core.small_segment_bytes = config.core.small_segment_bytes.max(granularity);
        let core = Allocator::new(config.core)?;
        let history = History::new(config.history_len);
        let deadline = group.deadline();
        Self::over(group.clone(), config, mode, deadline, || (core, history))
    }

    /// A pool in `group`, its collectives checked under `mode`: the pool's channel
    /// (the ranks waited for until `deadline`), and its state with the core and
    /// history that `state` gives once nothing can fail any more.
    ///
    /// # Collective
    /// As [`new`](Self::new).
    pub(crate) fn over(
        group: Group,
        config: PoolConfig,
        mode: CheckMode,
        deadline: Deadline,
        state: impl FnOnce() -> (Allocator, History),
    ) -> Result<Self> {
        let comms = group.backend().communicators().len();
        // The untagged opt-out is part of the name: ranks that set it differently
        // fail here.
        let untagged = if config.untagged_collectives {
            ":untagged_collectives"
        } else {
            ""
        };
        let channel = group
            .backend()
            .exchange()
            .open_channel(&format!("pool:{}{untagged}", config.name), deadline)?;
        group.note_user(channel.ordinal(), &config.name, false);
        let (core, history) = state();
        let call_head = history.head();
        let state = PoolState::new(core, history, comms);
        Ok(SymmPool {
            inner: Arc::new(PoolInner {
                state: Mutex::new(state),
                backend: group.backend().clone(),
                group,
                closed: AtomicBool::new(false),
                deferred: PlMutex::new(Vec::new()),
                deferred_error: PlMutex::new(None),
                counters: Default::default(),
                channel,
                mode,
                call_head,
                successor: OnceLock::new(),
                config,
            }),
        })
    }

    /// One pool per rank of a new host world of `world_size` ranks (threads), with
    /// the default group settings, in rank order: the embedded default where there is
    /// no GPU.
    ///
    /// # Errors
    /// As [`Group::host`] and [`SymmPool::new`].
    pub fn host_group(world_size: usize, config: PoolConfig) -> Result<Vec<SymmPool>> {
        Self::world(&Group::host(world_size, &GroupConfig::default())?, &config)
    }

    /// One pool per group, for ranks that are threads of this process: the pools are
    /// created concurrently (creation is collective), in rank order.
    ///
    /// # Errors
    /// The first rank's error, as [`SymmPool::new`].
    pub fn world(groups: &[Group], config: &PoolConfig) -> Result<Vec<SymmPool>> {
        crate::error::in_threads(groups.to_vec(), "a pool-creating thread", |g| {
            SymmPool::new(&g, config.clone())
        })
    }

    /// The communicator set the pool is in.
    pub fn group(&self) -> &Group {
        &self.inner.group
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.backend.world_size()
    }

    /// The configuration in effect (the core's granularity is the backend's).
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A new stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn new_stream(&self) -> Result<Stream> {
        let out = self.inner.backend.streams().new_stream();
        out.inspect_err(|e| events::call_failed(self, "new_stream", e))
    }

    /// The exchange channel of this pool's agreements.
    pub(crate) fn channel(&self) -> ChannelId {
        self.inner.channel
    }

    /// The pool's call count and running hash, in one lock-free read (what a
    /// collective's record carries; see `group::CallHead`).
    #[inline]
    pub(crate) fn call_head(&self) -> (u64, u64) {
        self.inner.call_head.load()
    }

    /// The ledger of the pool's communicators.
    #[inline]
    pub(crate) fn ledger(&self) -> &Ledger {
        self.inner.group.ledger()
    }

    /// How the pool's collectives are checked: the group's
    /// [`check_mode`](Group::check_mode).
    #[inline]
    pub(crate) fn check_mode(&self) -> crate::CheckMode {
        self.inner.mode
    }

    /// Whether two handles are the same pool.
    pub fn same_pool(&self, other: &SymmPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The pool's state, with the frees that `Drop` deferred applied first. A lock
    /// poisoned by a panic marks the pool broken (the core may be half-mutated and
    /// place blocks differently from the peers); callers check it.
    pub(crate) fn state(&self) -> MutexGuard<'_, PoolState> {
        let mut st = self.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        if st.broken.is_none() {
            st.broken = self.ledger().failure();
        }
        self.apply_deferred(&mut st);
        st
    }

    /// Allocate `size_bytes` on `stream`, with the default alignment (512 B).
    ///
    /// The block is at least `size_bytes` long, at an offset in its segment that every
    /// rank gets for the same call sequence. If the memory was last used on other
    /// streams, device-side waits for that work are enqueued on `stream` first.
    ///
    /// # Collective
    /// Usually local (a cache hit). When it grows the pool it is collective: every rank
    /// must make the same sequence of pool calls, so that all reach the same growth.
    ///
    /// # Errors
    /// [`Error::ZeroSize`]; [`Error::TooLarge`]; [`Error::PoolClosed`] ([`Error::Shrunk`]
    /// after a shrink); [`Error::PoolBroken`]; [`Error::WrongStream`];
    /// [`Error::Deferred`] (an earlier failure inside a drop; nothing else was done); on
    /// growth also [`Error::PoolLimit`], [`Error::DeviceOutOfMemory`],
    /// [`Error::PeerOutOfMemory`], [`Error::Divergence`], [`Error::Timeout`],
    /// [`Error::GraphCapture`], [`Error::NoSymmetricSupport`],
    /// [`Error::RegistrationBroken`] and backend errors. Nothing is allocated on error.
    pub fn alloc(&self, size_bytes: u64, stream: &Stream) -> Result<SymmBuffer> {
        self.alloc_aligned(size_bytes, 1, stream)
    }

    /// Allocate with an explicit alignment: a power of two up to the segment
    /// granularity (2 MiB); values below 512 B mean 512 B.
    ///
    /// # Collective
    /// As [`alloc`](Self::alloc).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), and [`Error::BadAlignment`].
    pub fn alloc_aligned(
        &self,
        size_bytes: u64,
        align_bytes: u64,
        stream: &Stream,
    ) -> Result<SymmBuffer> {
        let out = self.alloc_unlogged(size_bytes, align_bytes, stream);
        out.inspect_err(|e| events::call_failed(self, "alloc", e))
    }

    fn alloc_unlogged(
        &self,
        size_bytes: u64,
        align_bytes: u64,
        stream: &Stream,
    ) -> Result<SymmBuffer> {
        self.inner.backend.check_stream(stream)?;
        let mut st = self.lock_open()?;
        st.check_usable()?;
        if !st.known_streams.iter().any(|s| s.id() == stream.id()) {
            st.known_streams.push(stream.clone());
        }
        let req = AllocRequest::new(size_bytes, stream.id()).with_align(align_bytes);
        // Record the alignment that takes effect, so that `alloc(n)` and
        // `alloc_aligned(n, 512)` count as the same call on different ranks.
        let effective_align = align_bytes.max(st.core.config().min_block_bytes);
        let first = st.core.alloc(req);
        // A call that the core refuses (a bad request, the pool's limit) is not recorded.
        if matches!(first, Ok(_) | Err(AllocError::NeedsGrowth(_))) {
            st.history
                .record(CallKind::Alloc, size_bytes, effective_align);
        }
        let placement = match first {
            Err(AllocError::NeedsGrowth(growth)) => {
                // One deadline for the whole growth (made only when it grows: a cache
                // hit does not read the clock).
                let deadline = self.group().deadline();
                self.grow_segment(&mut st, growth, deadline)?;
                st.core.alloc(req)?
            }
            out => out?,
        };
        let Some(entry) = st.segments.get(&placement.segment).cloned() else {
            return Err(st.broken_by(format!("segment {} has no entry", placement.segment.0)));
        };
        st.counters.allocated_bytes_total += placement.size_bytes;
        st.counters.requested_bytes_total += size_bytes;
        if let Some(h) = st.memory_history.as_deref_mut() {
            h.alloc(
                &placement,
                entry.segment.device_ptr(),
                size_bytes,
                stream.id(),
            );
        }
        drop(st);
        if tracing::level_enabled!(tracing::Level::TRACE) {
            tracing::trace!(target: "symmpool::pool", rank = self.rank(), size_bytes,
                segment = placement.segment.0, offset_bytes = placement.offset_bytes,
                allocation = placement.block.seq, "alloc");
        }
        let waits = placement.waits.clone();
        // The buffer exists before the waits are enqueued: if enqueuing fails, dropping
        // it returns the block through the normal path instead of leaking it.
        let buffer = SymmBuffer::new(self.clone(), entry, placement, size_bytes, stream.clone());
        for w in &waits {
            (self.inner.backend.streams()).wait_fence(stream, w.stream, w.fence)?;
        }
        Ok(buffer)
    }

    /// Whether [`close`](Self::close) has completed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Fail if the pool is closed (lock-free).
    #[inline]
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            Err(self.closed_error())
        } else {
            Ok(())
        }
    }

    /// Fail unless the pool's buffers may be read and written on this rank: the pool is
    /// open, or a shrink replaced it (the memory lives on in the new pool).
    pub(crate) fn check_memory(&self) -> Result<()> {
        if self.is_closed() && self.inner.successor.get().is_none() {
            Err(Error::PoolClosed)
        } else {
            Ok(())
        }
    }

    /// Why a closed pool refuses calls: closed, or replaced by a shrink.
    #[cold]
    pub(crate) fn closed_error(&self) -> Error {
        match self.inner.successor.get() {
            Some(_) => Error::Shrunk { what: "a pool" },
            None => Error::PoolClosed,
        }
    }
}
