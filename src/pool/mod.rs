//! [`SymmPool`]: the allocator core, a backend, and the registry of windows.
//!
//! # Life of a pool
//!
//! - **Allocation** ([`SymmPool::alloc`]) is served from the core's cache: a mutex, a
//!   best-fit lookup, no NCCL call. When nothing fits, the pool *grows*: the ranks
//!   agree (call count, requested size, running hash of all calls; see
//!   [`Error::Divergence`]), each allocates the segment, they confirm every rank got
//!   it, then each registers it as a symmetric window on every communicator that
//!   registers, in the backend's order.
//! - **Free** happens when a [`SymmBuffer`] is dropped: the block goes back to the
//!   cache with one fence per stream that used it. Never a collective.
//! - **Reuse across streams**: a block last used on other streams comes with device-side
//!   waits that the pool enqueues on the allocating stream (`cuStreamWaitEvent`).
//! - **Release** only through the collective calls [`SymmPool::trim`] and
//!   [`SymmPool::close`]: drain, deregister, free (the order of DESIGN.md §2). Dropping
//!   the last handle to a pool that was not closed releases its memory locally
//!   (deregistration and free are local in NCCL) and logs a warning.

mod agreement;
mod buffer;
mod scope;

pub use buffer::{SymmBuffer, TypedView};
pub use scope::{alloc, alloc_aligned, current};

use crate::backend::{Backend, HostBackend, HostConfig, Registration, SegmentKey};
use crate::coll::PathPolicy;
use crate::core::{
    AllocError, AllocRequest, Allocator, CoreConfig, CoreStats, Fence, Growth, SegmentId, Snapshot,
    StreamId, Wait,
};
use crate::error::{Error, Result};
use crate::stream::Stream;
use agreement::{CallKind, History, agree, op};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Settings of a pool.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PoolConfig {
    /// The allocator core's sizes. Its granularity is replaced by the backend's.
    pub core: CoreConfig,
    /// How long an agreement waits for the other ranks (default 60 s).
    pub timeout: Duration,
    /// How many recent calls the agreement carries to name a divergence (default 64,
    /// at most [`MAX_HISTORY`]).
    pub history_len: usize,
    /// Whether segments are registered as windows (default `true`). A pool that does
    /// not register hands out plain buffers: the baseline its collectives run on
    /// NCCL's ring/tree kernels.
    pub register: bool,
    /// Fail growth with [`Error::NoSymmetricSupport`] when a communicator returns no
    /// window, instead of carrying on with unregistered segments (default `false`).
    pub require_symmetric: bool,
    /// Size thresholds of the collectives' path selection.
    pub paths: PathPolicy,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            core: CoreConfig::default(),
            timeout: Duration::from_secs(60),
            history_len: 64,
            register: true,
            require_symmetric: false,
            paths: PathPolicy::default(),
        }
    }
}

impl PoolConfig {
    /// Set the agreement timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set whether segments are registered.
    pub fn with_register(mut self, register: bool) -> Self {
        self.register = register;
        self
    }

    /// Set whether a missing symmetric window is an error.
    pub fn with_require_symmetric(mut self, require: bool) -> Self {
        self.require_symmetric = require;
        self
    }

    /// Set the core's configuration.
    pub fn with_core(mut self, core: CoreConfig) -> Self {
        self.core = core;
        self
    }

    /// Set the collectives' path thresholds.
    pub fn with_paths(mut self, paths: PathPolicy) -> Self {
        self.paths = paths;
        self
    }
}

/// Counters of a pool, beside the core's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolStats {
    /// The allocator core's statistics.
    pub core: CoreStats,
    /// The role of each communicator, in the backend's order: the index of the
    /// per-communicator counts below.
    pub roles: Vec<crate::backend::CommRole>,
    /// Window registrations made, per communicator (index into the backend's list).
    pub registrations: Vec<u64>,
    /// Windows currently registered (non-NULL), per communicator.
    pub windows: Vec<u64>,
    /// Deregistrations made, per communicator.
    pub deregistrations: Vec<u64>,
    /// Agreements among ranks (growth, reserve, trim, close).
    pub agreements: u64,
    /// Time spent allocating and registering segments, in seconds.
    pub growth_seconds: f64,
    /// Pool calls recorded in the history.
    pub calls: u64,
}

#[derive(Debug)]
pub(crate) struct SegmentEntry {
    /// Per communicator: `Some` once registration was attempted.
    pub(crate) windows: Vec<Option<Registration>>,
    /// Bit `c` set: a symmetric window on communicator `c` (what buffers cache).
    pub(crate) mask: u64,
}

impl SegmentEntry {
    fn new(windows: Vec<Option<Registration>>) -> Self {
        let mask = windows
            .iter()
            .enumerate()
            .filter(|(c, w)| *c < 64 && **w == Some(Registration::Symmetric))
            .fold(0u64, |m, (c, _)| m | (1 << c));
        SegmentEntry { windows, mask }
    }
}

/// Readiness flags carried in the growth agreement.
const READY: u64 = 1;
const NOT_READY_CAPTURING: u64 = 2;
const NOT_READY_BROKEN: u64 = 3;

pub(crate) struct PoolState {
    pub(crate) core: Allocator,
    history: History,
    /// Segments this rank holds memory (and windows) for. Usually the core's segments;
    /// after a failed release also ones the core has dropped, until a retry succeeds.
    pub(crate) segments: BTreeMap<SegmentId, SegmentEntry>,
    closed: bool,
    broken: Option<(SegmentId, String)>,
    /// Set once an agreement found the ranks diverged: later allocations fail.
    diverged: Option<Box<crate::error::Divergence>>,
    registrations: Vec<u64>,
    deregistrations: Vec<u64>,
    agreements: u64,
    growth_time: Duration,
}

/// Largest accepted [`PoolConfig::history_len`].
pub const MAX_HISTORY: usize = 1 << 16;

static NEXT_POOL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

pub(crate) struct PoolInner {
    pub(crate) backend: Arc<dyn Backend>,
    /// Mirrors `PoolState::closed` for lock-free checks on the collectives' path.
    closed: std::sync::atomic::AtomicBool,
    /// The collectives' path thresholds (starts as `config.paths`).
    paths: std::sync::RwLock<PathPolicy>,
    /// Frees made by `Drop` while the state was busy; applied by the next call.
    deferred: Mutex<Vec<(crate::core::BlockId, smallvec::SmallVec<[Wait; 3]>)>>,
    /// This pool's number in its backend's segment keys.
    number: u32,
    pub(crate) config: PoolConfig,
    state: Mutex<PoolState>,
}

/// A symmetric-memory caching pool for one rank.
///
/// Cheap to clone (a handle); buffers keep their pool alive. Every rank of a
/// communicator owns one pool over its backend, and the ranks make the same sequence
/// of pool calls; placement then agrees on every rank, which NCCL's symmetric kernels
/// and copy engines require (they address peers at the local offset).
///
/// # Example
///
/// ```
/// use symmpool::{PoolConfig, Stream, SymmPool};
///
/// // Two ranks as threads, on the host backend.
/// let pools = SymmPool::host_group(2, PoolConfig::default())?;
/// std::thread::scope(|s| {
///     for pool in &pools {
///         s.spawn(move || {
///             let stream = Stream::host();
///             let buf = pool.scope(|| symmpool::alloc(1 << 20, &stream)).unwrap();
///             assert_eq!((buf.segment().0, buf.offset_bytes()), (0, 0)); // same on both ranks
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
    /// A pool over one rank's backend.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the core configuration (with the backend's
    /// granularity) is invalid, or `history_len` exceeds [`MAX_HISTORY`].
    pub fn new(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Self> {
        if config.history_len > MAX_HISTORY {
            return Err(Error::InvalidConfig(format!(
                "history_len {} exceeds {MAX_HISTORY}",
                config.history_len
            )));
        }
        let mut core_config = config
            .core
            .with_granularity_bytes(backend.granularity_bytes());
        core_config.small_segment_bytes = core_config
            .small_segment_bytes
            .max(backend.granularity_bytes());
        let core = Allocator::new(core_config)?;
        let n = backend.communicators().len();
        Ok(SymmPool {
            inner: Arc::new(PoolInner {
                state: Mutex::new(PoolState {
                    core,
                    history: History::new(config.history_len),
                    segments: BTreeMap::new(),
                    closed: false,
                    broken: None,
                    diverged: None,
                    registrations: vec![0; n],
                    deregistrations: vec![0; n],
                    agreements: 0,
                    growth_time: Duration::ZERO,
                }),
                backend,
                closed: std::sync::atomic::AtomicBool::new(false),
                paths: std::sync::RwLock::new(config.paths.clone()),
                deferred: Mutex::new(Vec::new()),
                number: NEXT_POOL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                config,
            }),
        })
    }

    /// The backend's key for one of this pool's segments.
    pub(crate) fn key(&self, id: SegmentId) -> SegmentKey {
        SegmentKey::new(self.inner.number, id)
    }

    /// One pool per rank of a new host world of `world_size` ranks (threads), in rank
    /// order: the embedded default where there is no GPU.
    ///
    /// # Errors
    /// As [`HostBackend::world`] and [`SymmPool::new`].
    pub fn host_group(world_size: usize, config: PoolConfig) -> Result<Vec<SymmPool>> {
        let host = HostConfig::new(world_size).with_timeout(config.timeout);
        Self::host_group_with(host, config)
    }

    /// As [`host_group`](Self::host_group), with explicit host settings.
    ///
    /// # Errors
    /// As [`HostBackend::world`] and [`SymmPool::new`].
    pub fn host_group_with(host: HostConfig, config: PoolConfig) -> Result<Vec<SymmPool>> {
        HostBackend::world(host)?
            .into_iter()
            .map(|b| SymmPool::new(Arc::new(b), config.clone()))
            .collect()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
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

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A new stream on this rank's device.
    ///
    /// # Errors
    /// A backend error.
    pub fn new_stream(&self) -> Result<Stream> {
        self.inner.backend.new_stream()
    }

    /// The pool's state, with the frees that `Drop` deferred applied first.
    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        self.apply_deferred(&mut st);
        st
    }

    /// Apply frees that found the state busy, in the order they were made.
    fn apply_deferred(&self, st: &mut PoolState) {
        let pending = std::mem::take(
            &mut *self
                .inner
                .deferred
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for (block, fences) in pending {
            Self::apply_free(st, block, &fences);
        }
    }

    fn apply_free(st: &mut PoolState, block: crate::core::BlockId, fences: &[Wait]) {
        if st.closed {
            return;
        }
        match st.core.free(block, fences) {
            Ok(()) => {
                st.history.record(CallKind::Free, block.seq, 0);
            }
            Err(e) => log::error!("symmpool: freeing a block failed: {e}"),
        }
    }

    /// Whether two handles are the same pool.
    pub fn same_pool(&self, other: &SymmPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
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
    /// [`Error::ZeroSize`]; [`Error::TooLarge`]; [`Error::PoolClosed`];
    /// [`Error::WrongStream`]; [`Error::OutOfMemory`]; on growth also [`Error::Divergence`], [`Error::Timeout`],
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
        self.check_stream(stream)?;
        let mut st = self.lock();
        if st.closed {
            return Err(Error::PoolClosed);
        }
        if let Some(d) = &st.diverged {
            // The ranks' allocators differ: a cache hit would place this buffer at an
            // offset the peers do not share, which NCCL would not notice.
            return Err(Error::Divergence(d.clone()));
        }
        let req = AllocRequest::new(size_bytes, stream.id()).with_align(align_bytes);
        // Record the alignment that takes effect, so that `alloc(n)` and
        // `alloc_aligned(n, 512)` count as the same call on different ranks.
        let effective_align = align_bytes.max(st.core.config().min_block_bytes);
        let placement = match st.core.alloc(req) {
            Ok(p) => {
                st.history
                    .record(CallKind::Alloc, size_bytes, effective_align);
                p
            }
            Err(AllocError::NeedsGrowth(growth)) => {
                st.history
                    .record(CallKind::Alloc, size_bytes, effective_align);
                self.grow(&mut st, growth, stream)?;
                st.core.alloc(req)?
            }
            Err(e) => return Err(e.into()),
        };
        let windows = st.segments.get(&placement.segment).map_or(0, |e| e.mask);
        drop(st);
        let device_ptr = self.inner.backend.device_ptr(crate::backend::Region {
            segment: self.key(placement.segment),
            offset_bytes: placement.offset_bytes,
            len_bytes: size_bytes,
            device_ptr: None,
        });
        let waits = placement.waits.clone();
        // The buffer exists before the waits are enqueued: if enqueuing fails, dropping
        // it returns the block through the normal path instead of leaking it.
        let buffer = SymmBuffer::new(
            self.clone(),
            placement,
            size_bytes,
            stream.clone(),
            windows,
            device_ptr,
        );
        for w in &waits {
            self.inner.backend.wait_fence(stream, w.stream, w.fence)?;
        }
        Ok(buffer)
    }

    /// Grow by one segment: agree, allocate, confirm, register, add to the core.
    fn grow(&self, st: &mut PoolState, growth: Growth, stream: &Stream) -> Result<SegmentId> {
        let ready = self.readiness(st, Some(stream))?;
        let flags = self.agree(st, op::GROW, "growth", growth.segment_bytes, ready)?;
        Self::all_ready(st, &flags)?;
        let id = st.core.next_segment_id();
        self.provide_segment(st, id, growth.segment_bytes)?;
        let added = st.core.add_segment(growth);
        self.finish_segment(st, id, added)
    }

    /// This rank's readiness to grow, carried in the agreement so that a rank-local
    /// obstacle fails every rank the same way instead of leaving the others to time out.
    fn readiness(&self, st: &PoolState, stream: Option<&Stream>) -> Result<u64> {
        if st.broken.is_some() {
            return Ok(NOT_READY_BROKEN);
        }
        if let Some(s) = stream
            && self.inner.backend.is_capturing(s)?
        {
            return Ok(NOT_READY_CAPTURING);
        }
        Ok(READY)
    }

    /// Turn the ranks' readiness flags into the same error on every rank.
    fn all_ready(st: &PoolState, flags: &[u64]) -> Result<()> {
        if flags.contains(&NOT_READY_CAPTURING) {
            return Err(Error::GraphCapture);
        }
        if let Some(rank) = flags.iter().position(|&f| f == NOT_READY_BROKEN) {
            let reason = match &st.broken {
                Some((_, why)) => why.clone(),
                None => format!("a registration failed earlier on rank {rank}"),
            };
            return Err(Error::RegistrationBroken { rank, reason });
        }
        Ok(())
    }

    fn agree(
        &self,
        st: &mut PoolState,
        op: u64,
        during: &'static str,
        size: u64,
        extra: u64,
    ) -> Result<Vec<u64>> {
        st.agreements += 1;
        let c = st.core.stats();
        let state = agreement::state_digest(&[
            u64::from(st.core.next_segment_id().0),
            c.reserved_bytes.current,
            c.allocated_bytes.current,
            c.num_allocs,
            c.num_frees,
        ]);
        let out = agree(
            self.inner.backend.exchange(),
            &st.history,
            op,
            during,
            size,
            state,
            extra,
            self.inner.config.timeout,
        );
        if let Err(Error::Divergence(d)) = &out {
            st.diverged = Some(d.clone());
        }
        out
    }

    /// Allocate segment `id` on this rank, confirm every rank did, and register it.
    fn provide_segment(&self, st: &mut PoolState, id: SegmentId, size: u64) -> Result<()> {
        let backend = &self.inner.backend;
        let started = Instant::now();
        let local = backend.alloc_segment(self.key(id), size);
        // Second round: nobody registers unless everybody has the memory, so one
        // rank's failure is an error on all ranks instead of a hang in registration.
        let ok = self.agree(
            st,
            op::GROW,
            "growth confirmation",
            size,
            local.is_ok() as u64,
        );
        let all_ok = match &ok {
            Ok(flags) => flags.iter().all(|&f| f == 1),
            Err(_) => false,
        };
        if !all_ok {
            if local.is_ok() {
                let _ = backend.free_segment(self.key(id));
            }
            local?;
            ok?;
            return Err(Error::OutOfMemory {
                segment_bytes: size,
                reason: "another rank could not allocate the segment".into(),
            });
        }
        let mut windows = vec![None; backend.communicators().len()];
        if self.inner.config.register {
            for (c, info) in backend.communicators().iter().enumerate() {
                if !info.registers {
                    continue;
                }
                match backend.register(self.key(id), c) {
                    Ok(reg) => {
                        st.registrations[c] += 1;
                        windows[c] = Some(reg);
                        if reg == Registration::Unsupported && self.inner.config.require_symmetric {
                            self.undo_segment(st, id, &windows);
                            return Err(Error::NoSymmetricSupport { comm: c });
                        }
                    }
                    Err(e) => {
                        self.undo_segment(st, id, &windows);
                        st.broken = Some((id, e.to_string()));
                        return Err(e);
                    }
                }
            }
        }
        st.segments.insert(id, SegmentEntry::new(windows));
        st.growth_time += started.elapsed();
        Ok(())
    }

    fn finish_segment(
        &self,
        st: &mut PoolState,
        id: SegmentId,
        added: std::result::Result<SegmentId, AllocError>,
    ) -> Result<SegmentId> {
        match added {
            Ok(got) => {
                debug_assert_eq!(got, id, "core and pool agree on segment ids");
                Ok(got)
            }
            Err(e) => {
                if let Some(entry) = st.segments.remove(&id) {
                    self.undo_segment(st, id, &entry.windows);
                }
                Err(e.into())
            }
        }
    }

    /// Deregister and free a segment that the core does not hold (failed growth).
    fn undo_segment(&self, st: &mut PoolState, id: SegmentId, windows: &[Option<Registration>]) {
        let backend = &self.inner.backend;
        for (c, w) in windows.iter().enumerate() {
            if w.is_some() {
                let _ = backend.deregister(self.key(id), c);
                st.deregistrations[c] += 1;
            }
        }
        let _ = backend.free_segment(self.key(id));
    }

    /// Deregister and free segments the core has released; drains the device first.
    /// Deregister and free the segments this rank still holds but the core no longer
    /// does (released by `trim`/`close`, or left over from a failed release); drains
    /// the device first. A segment whose release fails stays listed, and the next
    /// `trim`, `close` or drop of the pool tries again.
    fn release_segments(&self, st: &mut PoolState) -> Result<()> {
        let held: std::collections::BTreeSet<SegmentId> =
            st.core.segments().map(|(id, _, _)| id).collect();
        let gone: Vec<SegmentId> = st
            .segments
            .keys()
            .filter(|id| !held.contains(id))
            .copied()
            .collect();
        if gone.is_empty() {
            return Ok(());
        }
        let backend = &self.inner.backend;
        backend.synchronize()?;
        let mut first_err = None;
        for id in gone {
            let entry = st.segments.get_mut(&id).expect("listed above");
            let mut failed = false;
            for (c, w) in entry.windows.iter_mut().enumerate() {
                if w.is_some() {
                    match backend.deregister(self.key(id), c) {
                        Ok(()) => {
                            *w = None;
                            st.deregistrations[c] += 1;
                        }
                        Err(e) => {
                            failed = true;
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
            if failed {
                continue;
            }
            match backend.free_segment(self.key(id)) {
                Ok(()) => {
                    st.segments.remove(&id);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Pre-grow the pool by one segment of `size_bytes` (rounded up to the granularity)
    /// that any large request (over 1 MiB) may use, so that later allocations hit the
    /// cache and nothing registers on the hot path or during CUDA-graph capture.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence with the same size.
    ///
    /// # Errors
    /// [`Error::ZeroSize`], [`Error::TooLarge`], [`Error::PoolClosed`], and the growth
    /// errors of [`alloc`](Self::alloc).
    pub fn reserve(&self, size_bytes: u64) -> Result<SegmentId> {
        let mut st = self.lock();
        if st.closed {
            return Err(Error::PoolClosed);
        }
        let config = *st.core.config();
        if size_bytes == 0 {
            return Err(Error::ZeroSize);
        }
        let size = crate::core::align_up(size_bytes, config.granularity_bytes)
            .filter(|_| size_bytes <= config.max_request_bytes)
            .ok_or(Error::TooLarge {
                requested_bytes: size_bytes,
                max_bytes: config.max_request_bytes,
            })?;
        // The reserve limit is the same on every rank: check it before agreeing.
        let reserved = st.core.stats().reserved_bytes.current;
        if reserved
            .checked_add(size)
            .is_none_or(|r| r > config.max_reserved_bytes)
        {
            return Err(Error::OutOfMemory {
                segment_bytes: size,
                reason: format!(
                    "would reserve more than the limit of {} bytes ({reserved} reserved)",
                    config.max_reserved_bytes
                ),
            });
        }
        st.history.record(CallKind::Reserve, size_bytes, 0);
        let ready = self.readiness(&st, None)?;
        let flags = self.agree(&mut st, op::RESERVE, "reserve", size, ready)?;
        Self::all_ready(&st, &flags)?;
        let id = st.core.next_segment_id();
        self.provide_segment(&mut st, id, size)?;
        let added = st.core.add_shared_segment(size);
        self.finish_segment(&mut st, id, added)
    }

    /// Release every entirely free segment: drain the device, deregister its windows,
    /// free it. Returns the bytes released.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence (the ranks agree
    /// first, so they release the same segments).
    ///
    /// # Errors
    /// [`Error::PoolClosed`], [`Error::Divergence`], [`Error::Timeout`], backend errors.
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.lock();
        if st.closed {
            return Err(Error::PoolClosed);
        }
        st.history.record(CallKind::Trim, 0, 0);
        self.agree(&mut st, op::TRIM, "trim", 0, 0)?;
        let released = st.core.release_free_segments();
        self.release_segments(&mut st)?;
        Ok(released.iter().map(|(_, b)| b).sum())
    }

    /// Close the pool: drain the device, deregister every window, free every segment.
    /// Later calls fail with [`Error::PoolClosed`]; closing again is a no-op.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence. If any rank still
    /// has live buffers, every rank gets [`Error::BuffersAlive`] and nothing is
    /// released (the pool stays usable).
    ///
    /// # Errors
    /// [`Error::BuffersAlive`], [`Error::Divergence`], [`Error::Timeout`], backend
    /// errors.
    pub fn close(&self) -> Result<()> {
        let mut st = self.lock();
        if st.closed {
            return Ok(());
        }
        st.history.record(CallKind::Close, 0, 0);
        let live = st.core.stats().allocated_blocks.current;
        let live_per_rank = self.agree(&mut st, op::CLOSE, "close", 0, live)?;
        if live_per_rank.iter().any(|&l| l > 0) {
            return Err(Error::BuffersAlive { live_per_rank });
        }
        st.core.release_free_segments();
        st.closed = true;
        self.inner
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        // If this fails, the segments stay listed and dropping the pool retries.
        self.release_segments(&mut st)
    }

    /// Whether [`close`](Self::close) has completed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Statistics of the pool and its core.
    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        let mut windows = vec![0; st.registrations.len()];
        for entry in st.segments.values() {
            for (c, w) in entry.windows.iter().enumerate() {
                if *w == Some(Registration::Symmetric) {
                    windows[c] += 1;
                }
            }
        }
        PoolStats {
            roles: self
                .inner
                .backend
                .communicators()
                .iter()
                .map(|c| c.role)
                .collect(),
            core: st.core.stats(),
            registrations: st.registrations.clone(),
            windows,
            deregistrations: st.deregistrations.clone(),
            agreements: st.agreements,
            growth_seconds: st.growth_time.as_secs_f64(),
            calls: st.history.seq(),
        }
    }

    /// Reset the peaks of the core's statistics.
    pub fn reset_peak(&self) {
        self.lock().core.reset_peak();
    }

    /// Every segment and block (serialisable with serde).
    pub fn snapshot(&self) -> Snapshot {
        self.lock().core.snapshot()
    }

    /// Run the core's invariant check (for tests and debugging).
    ///
    /// # Errors
    /// The violation found.
    pub fn check_invariants(&self) -> std::result::Result<(), crate::core::InvariantViolation> {
        self.lock().core.check_invariants()
    }

    /// Return a block to the cache (from `SymmBuffer::drop`): record a fence on every
    /// stream that used it. Never collective. Errors are logged: a drop cannot fail.
    pub(crate) fn release_block(&self, buf: &SymmBuffer) {
        if self.inner.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut fences: smallvec::SmallVec<[Wait; 3]> = smallvec::SmallVec::new();
        for s in &buf.streams() {
            match self.inner.backend.record_fence(s) {
                Ok(f) => fences.push(Wait {
                    stream: s.id(),
                    fence: f,
                }),
                Err(e) => {
                    // The device is failing (a fence is an event record). Free the block
                    // anyway, so that this rank's calls stay in step with its peers';
                    // never block in a drop.
                    log::error!("symmpool: recording a fence failed ({e}); block freed without it");
                }
            }
        }
        // Never wait for the state: another thread may hold it through a whole
        // agreement (up to the timeout). Then the free is queued and applied, in
        // order, by the next pool call.
        match self.inner.state.try_lock() {
            Ok(mut st) => {
                self.apply_deferred(&mut st);
                Self::apply_free(&mut st, buf.block, &fences);
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                let mut st = p.into_inner();
                self.apply_deferred(&mut st);
                Self::apply_free(&mut st, buf.block, &fences);
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                self.inner
                    .deferred
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((buf.block, fences));
            }
        }
    }

    /// The path thresholds the collectives use now.
    pub fn path_policy(&self) -> PathPolicy {
        self.inner
            .paths
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the path thresholds (for example with the result of
    /// [`coll::calibrate`](crate::coll::calibrate)).
    ///
    /// # Collective
    /// Every rank must use the same policy (a different choice of communicator on two
    /// ranks hangs the collective); `calibrate` returns the same policy on every rank.
    pub fn set_path_policy(&self, policy: PathPolicy) {
        *self.inner.paths.write().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    pub(crate) fn with_paths<R>(&self, f: impl FnOnce(&PathPolicy) -> R) -> R {
        f(&self.inner.paths.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Fail if `stream` is not of the backend's kind.
    pub(crate) fn check_stream(&self, stream: &Stream) -> Result<()> {
        let host = self.inner.backend.kind() == crate::backend::BackendKind::Host;
        if stream.is_host() != host {
            return Err(Error::WrongStream);
        }
        Ok(())
    }

    /// Fail if the pool is closed.
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.inner.closed.load(std::sync::atomic::Ordering::Acquire) {
            Err(Error::PoolClosed)
        } else {
            Ok(())
        }
    }

    /// Note that `fence` on `stream` completed (only moves the `active_bytes` stat).
    pub fn complete_fences(&self, stream: StreamId, fence: Fence) {
        self.lock().core.complete_fences(stream, fence);
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if st.segments.is_empty() {
            return;
        }
        if !st.closed {
            log::warn!(
                "symmpool: pool dropped without close(); releasing {} segments locally",
                st.segments.len()
            );
        }
        // Never wait without bound in a drop: if the device does not drain in time
        // (a peer died in a collective, say), leave the memory to the backend.
        match self.backend.synchronize_within(self.config.timeout) {
            Ok(true) => {}
            Ok(false) => {
                log::error!(
                    "symmpool: the device did not drain within {:?}; {} segments left to the backend",
                    self.config.timeout,
                    st.segments.len()
                );
                return;
            }
            Err(e) => {
                log::error!(
                    "symmpool: synchronize failed while dropping the pool ({e}); segments left to the backend"
                );
                return;
            }
        }
        for (id, entry) in std::mem::take(&mut st.segments) {
            let key = SegmentKey::new(self.number, id);
            for (c, w) in entry.windows.iter().enumerate() {
                if w.is_some() {
                    let _ = self.backend.deregister(key, c);
                }
            }
            let _ = self.backend.free_segment(key);
        }
    }
}
