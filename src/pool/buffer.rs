//! [`SymmBuffer`]: an RAII block of a pool, and typed views of it.

use super::{SegmentEntry, SymmPool};
#[cfg(feature = "nccl")]
use crate::backend::NcclBackend;
use crate::backend::{Region, Window};
use crate::core::{BlockId, Placement, SegmentId};
#[cfg(feature = "nccl")]
use crate::core::{StreamId, Wait};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::stream::Stream;
#[cfg(feature = "nccl")]
use cudarc::driver::{CudaEvent, CudaStream, SyncOnDrop, sys::CUdeviceptr};
use parking_lot::Mutex;
#[cfg(feature = "nccl")]
use smallvec::SmallVec;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
#[cfg(feature = "nccl")]
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A block of symmetric memory from a [`SymmPool`].
///
/// Dropping it returns the block to the pool's cache (never a collective, never a
/// wait); it keeps its pool alive. The buffer is `len_bytes()` long; its block may be
/// larger (rounded to 512 B). Its offset in its segment is the same on every rank
/// that made the same pool calls.
pub struct SymmBuffer {
    /// The segment's entry: its memory and windows (fixed while the buffer lives:
    /// segments are only released when all their blocks are free). Declared before
    /// `pool` so that it is dropped first: when this buffer holds the last handle to
    /// a pool that was not closed, the pool's teardown must find the entry unshared,
    /// or it leaks the segment and its windows.
    entry: Arc<SegmentEntry>,
    pool: SymmPool,
    pub(crate) block: BlockId,
    segment: SegmentId,
    offset_bytes: u64,
    len_bytes: u64,
    block_bytes: u64,
    stream: Stream,
    others: Mutex<Vec<Stream>>,
    /// The id of the stream a collective last used the buffer on (at first its own
    /// stream): a collective on it again has nothing to record and takes no lock.
    last_stream: AtomicU64,
    /// Where the memory's earlier users were done: the fences the allocation waited
    /// for, and the allocating stream's own. A use through a [`CudaView`] on another
    /// stream waits for them first.
    #[cfg(feature = "nccl")]
    before: SmallVec<[Wait; 2]>,
    /// The streams that [`CudaView`]s used the buffer on, with [`Stream`]s of theirs
    /// (recorded in `others`, and ordered after `before`).
    #[cfg(feature = "nccl")]
    view_streams: Mutex<SmallVec<[StreamId; 2]>>,
    /// Uses through [`CudaView`]s on streams that no [`Stream`] wraps: an event per
    /// stream, recorded after each use, that the buffer's stream waits for when the
    /// buffer is freed (made at the first such use).
    #[cfg(feature = "nccl")]
    foreign: OnceLock<Box<[OnceLock<Foreign>; FOREIGN_STREAMS]>>,
}

/// How many streams that no [`Stream`] wraps a buffer records [`CudaView`] uses on
/// with events; a use on one more synchronises that stream instead.
#[cfg(feature = "nccl")]
const FOREIGN_STREAMS: usize = 4;

/// An event recorded after the uses through [`CudaView`]s on one stream that no
/// [`Stream`] wraps.
#[cfg(feature = "nccl")]
struct Foreign {
    /// The stream's context and raw handle.
    key: (usize, usize),
    event: CudaEvent,
}

impl fmt::Debug for SymmBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SymmBuffer")
            .field("segment", &self.segment.0)
            .field("offset_bytes", &self.offset_bytes)
            .field("len_bytes", &self.len_bytes)
            .field("stream", &self.stream)
            .finish()
    }
}

impl SymmBuffer {
    pub(crate) fn new(
        pool: SymmPool,
        entry: Arc<SegmentEntry>,
        p: Placement,
        len_bytes: u64,
        stream: Stream,
    ) -> Self {
        SymmBuffer {
            entry,
            pool,
            block: p.block,
            segment: p.segment,
            offset_bytes: p.offset_bytes,
            len_bytes,
            block_bytes: p.size_bytes,
            last_stream: AtomicU64::new(stream.id().0),
            #[cfg(feature = "nccl")]
            before: (p.waits.iter().copied())
                .chain(p.own_fence.map(|fence| Wait {
                    stream: stream.id(),
                    fence,
                }))
                .collect(),
            #[cfg(feature = "nccl")]
            view_streams: Mutex::new(SmallVec::new()),
            #[cfg(feature = "nccl")]
            foreign: OnceLock::new(),
            stream,
            others: Mutex::new(Vec::new()),
        }
    }

    /// The pool it came from.
    pub fn pool(&self) -> &SymmPool {
        &self.pool
    }

    /// Requested length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// Size of the underlying block in bytes (≥ `len_bytes`, a multiple of 512).
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The segment holding it.
    pub fn segment(&self) -> SegmentId {
        self.segment
    }

    /// Offset from the segment's start, in bytes (identical across ranks).
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// The stream it was allocated on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The allocation's sequence number in its pool (same on every rank).
    pub fn allocation_seq(&self) -> u64 {
        self.block.seq
    }

    /// The whole buffer as a region of its segment.
    ///
    /// # Errors
    /// [`Error::Internal`] if the block does not lie inside its segment (a bug).
    #[inline]
    pub(crate) fn region(&self) -> Result<Region<'_>> {
        self.entry
            .segment
            .region(self.offset_bytes, self.len_bytes)
            .map_err(|e| self.broken_region(e))
    }

    #[cold]
    #[inline(never)]
    fn broken_region(&self, e: Error) -> Error {
        Error::Internal {
            what: format!("allocation #{}: {e}", self.block.seq),
        }
    }

    /// The segment's window on communicator `comm`, if it is registered there.
    pub(crate) fn window(&self, comm: usize) -> Option<&Window> {
        self.entry.window(comm)
    }

    /// Note that the buffer is also used on `stream` (like PyTorch's
    /// `Tensor.record_stream`): when it is freed, a fence is recorded there too, and
    /// the memory is handed to other streams only after a device-side wait for it.
    ///
    /// # Errors
    /// [`Error::ForeignBuffer`] if the pool no longer knows the block (after `close`:
    /// [`Error::PoolClosed`]; after a shrink replaced the pool: [`Error::Shrunk`]).
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.pool.backend().check_stream(stream)?;
        let mut st = self.pool.state();
        if st.closed {
            // Closed, or replaced by a shrink (`Shrunk`): say which.
            return Err(self.pool.closed_error());
        }
        st.check_usable()?;
        st.core.record_stream(self.block, stream.id())?;
        drop(st);
        let mut others = self.others.lock();
        if stream.id() != self.stream.id() && !others.iter().any(|s| s.id() == stream.id()) {
            others.push(stream.clone());
        }
        Ok(())
    }

    /// Note that a collective uses the buffer on `stream`, as
    /// [`record_stream`](Self::record_stream) does, without a lock when the stream is
    /// the one the buffer was last used on (its own stream, at first): only the first
    /// call on a stream the buffer was never used on takes the pool's lock.
    ///
    /// # Errors
    /// As [`record_stream`](Self::record_stream).
    #[inline]
    pub(crate) fn use_on(&self, stream: &Stream) -> Result<()> {
        if stream.id().0 == self.last_stream.load(Ordering::Acquire) {
            return Ok(());
        }
        self.use_on_another(stream)
    }

    /// A collective on a stream other than the last one: record it, unless it was
    /// recorded before (then only the buffer's own lock is taken).
    #[cold]
    #[inline(never)]
    fn use_on_another(&self, stream: &Stream) -> Result<()> {
        let id = stream.id();
        let known = id == self.stream.id() || self.others.lock().iter().any(|s| s.id() == id);
        if !known {
            self.record_stream(stream)?;
        }
        self.last_stream.store(stream.id().0, Ordering::Release);
        Ok(())
    }

    /// The allocating stream and the recorded ones.
    pub(crate) fn streams(&self) -> Vec<Stream> {
        let mut v = vec![self.stream.clone()];
        v.extend(self.others.lock().iter().cloned());
        v
    }

    /// Device address of the first byte (NCCL backend); `None` on the host backend.
    pub fn device_ptr(&self) -> Option<u64> {
        let segment_ptr = self.entry.segment.device_ptr();
        segment_ptr.map(|p| p + self.offset_bytes)
    }

    /// Whether the buffer's segment has a symmetric window on communicator `comm`.
    /// A buffer of a pool replaced by [`SymmPool::shrink`] answers for the old pool's
    /// communicators (windows kept; that pool's collectives fail with [`Error::Shrunk`]).
    pub fn in_window(&self, comm: usize) -> bool {
        self.entry.window(comm).is_some()
    }

    /// A typed view of the whole buffer.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T`'s size does not divide `len_bytes()`.
    pub fn view<T: Element>(&self) -> Result<TypedView<'_, T>> {
        let (size, len) = (std::mem::size_of::<T>() as u64, self.len_bytes);
        if !len.is_multiple_of(size) {
            let why = format!("{len} bytes is not a whole number of {size}-byte elements");
            return Err(Error::BadView(why));
        }
        Ok(TypedView {
            buf: self,
            offset_bytes: 0,
            len: (self.len_bytes / size) as usize,
            _t: PhantomData,
        })
    }

    /// Copy `data` into the buffer from its start, ordered on the buffer's stream.
    ///
    /// # Errors
    /// [`Error::BadView`] if `data` is longer than the buffer; [`Error::PoolClosed`];
    /// backend errors.
    pub fn write<T: Element>(&self, data: &[T]) -> Result<()> {
        self.view::<u8>()?
            .copy_from_host(bytemuck::cast_slice(data))
    }

    /// Copy the whole buffer to a host vector of `T`, waiting for the buffer's stream.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T` does not divide the length; [`Error::PoolClosed`];
    /// backend errors.
    pub fn read<T: Element>(&self) -> Result<Vec<T>> {
        self.view::<T>()?.to_vec()
    }
}

impl Drop for SymmBuffer {
    fn drop(&mut self) {
        #[cfg(feature = "nccl")]
        self.join_foreign();
        self.pool.release_block(self);
    }
}

/// Uses through [`CudaView`]s on other streams than the buffer's.
#[cfg(feature = "nccl")]
impl SymmBuffer {
    /// cudarc asks for the memory on `cs` through a view whose home is the buffer's
    /// stream `home`: order the use (see [`CudaView`]); what to do once it is enqueued.
    #[inline]
    fn cuda_use<'b>(&'b self, home: &CudaStream, cs: &'b CudaStream) -> SyncOnDrop<'b> {
        if crate::backend::nccl::same_cuda_stream(home, cs) {
            return SyncOnDrop::Sync(None);
        }
        self.cuda_use_elsewhere(home, cs)
    }

    #[cold]
    #[inline(never)]
    fn cuda_use_elsewhere<'b>(&'b self, home: &CudaStream, cs: &'b CudaStream) -> SyncOnDrop<'b> {
        // The caller took over the ordering between streams (cudarc's unsafe
        // `disable_event_tracking`): nothing, as cudarc's own views do.
        if !cs.context().is_event_tracking() {
            return SyncOnDrop::Sync(None);
        }
        let home_ctx = home.context().cu_ctx();
        let wrapped = (cs.context().cu_ctx() == home_ctx)
            .then(|| Stream::known_cuda_id(cs))
            .flatten();
        // A stream of this device that a `Stream` wraps, already recorded and ordered.
        if let Some(id) = wrapped
            && self.view_streams.lock().contains(&id)
        {
            return SyncOnDrop::Sync(None);
        }
        let Some(nccl) = self.pool.backend().downcast_ref::<NcclBackend>() else {
            // Not the NCCL backend's memory (no fences to wait for): synchronise.
            return SyncOnDrop::Sync(Some(cs));
        };
        match NcclBackend::capturing_cuda(cs) {
            // Captured work runs when its graph is launched, not now: nothing to order.
            Ok(true) => return SyncOnDrop::Sync(None),
            Ok(false) => {}
            Err(e) => self.view_failed("asking whether a stream captures", e),
        }
        // Never touch the memory while its earlier users may still use it.
        if let Err(e) = nccl.wait_fences_on(cs, &self.before) {
            self.view_failed("waiting for the memory's earlier users", e);
        }
        if wrapped.is_some()
            && let Some(stream) = Stream::known_cuda(cs)
            && self.record_stream(&stream).is_ok()
        {
            // Freed, the buffer fences this stream; the memory is reused after it.
            let mut seen = self.view_streams.lock();
            if !seen.contains(&stream.id()) {
                seen.push(stream.id());
            }
            return SyncOnDrop::Sync(None);
        }
        self.foreign_use(cs)
    }

    /// A use on `cs`, a stream no [`Stream`] wraps: an event recorded after it
    /// (cudarc's `SyncOnDrop::Record`), which the buffer's stream waits for when it is
    /// freed; or, where that cannot be, a synchronisation of `cs` after the use.
    fn foreign_use<'b>(&'b self, cs: &'b CudaStream) -> SyncOnDrop<'b> {
        // cudarc records nothing in single-stream mode; the per-thread default stream
        // is a different stream on each thread.
        let key = crate::backend::nccl::cuda_key(cs);
        let Some(key) = key.filter(|_| cs.context().is_managing_stream_synchronization()) else {
            return SyncOnDrop::Sync(Some(cs));
        };
        let Some(foreign) = self.foreign_slot(key, cs) else {
            return SyncOnDrop::Sync(Some(cs));
        };
        // The event's last record may be from an earlier stream with this handle
        // (destroyed since): this one waits for it, so that the next record covers it.
        if let Err(e) = NcclBackend::wait_event(cs, &foreign.event) {
            self.view_failed("ordering a stream after earlier uses", e);
            return SyncOnDrop::Sync(Some(cs));
        }
        SyncOnDrop::Record(Some((&foreign.event, cs)))
    }

    /// The event for uses on the stream `key` (made in `cs`'s context if new); `None`
    /// when every slot holds another stream's or no event can be made.
    fn foreign_slot(&self, key: (usize, usize), cs: &CudaStream) -> Option<&Foreign> {
        let slots = self
            .foreign
            .get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        for slot in slots.iter() {
            if let Some(f) = slot.get() {
                if f.key == key {
                    return Some(f);
                }
                continue;
            }
            let event = match NcclBackend::event_for(cs) {
                Ok(e) => e,
                Err(e) => {
                    self.view_failed("making an event", e);
                    return None;
                }
            };
            // Another thread may take this slot first (the event made here goes).
            let f = slot.get_or_init(|| Foreign { key, event });
            if f.key == key {
                return Some(f);
            }
        }
        None
    }

    /// Before the buffer is freed: its stream waits for the uses on streams that no
    /// [`Stream`] wraps, so that the fence recorded on it at the free covers them.
    fn join_foreign(&self) {
        let (Some(slots), Some(home)) = (self.foreign.get(), self.stream.cuda_stream()) else {
            return;
        };
        for f in slots.iter().filter_map(OnceLock::get) {
            if let Err(e) = NcclBackend::wait_event(home, &f.event) {
                self.view_failed("ordering the free after uses on other streams", e);
            }
        }
    }

    /// A failure while ordering a view's use: returned by the pool's next call.
    #[cold]
    fn view_failed(&self, what: &str, e: Error) {
        let during = format!("{what} (allocation #{})", self.block.seq);
        self.pool.record_deferred_error(during, e);
    }
}

/// A view of a [`SymmBuffer`] as `len()` elements of `T`.
#[derive(Clone, Copy)]
pub struct TypedView<'a, T: Element> {
    buf: &'a SymmBuffer,
    offset_bytes: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> fmt::Debug for TypedView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypedView")
            .field("dtype", &T::DTYPE)
            .field("offset_bytes", &self.offset_bytes)
            .field("len", &self.len)
            .finish()
    }
}

impl<'a, T: Element> TypedView<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer it views.
    pub fn buffer(&self) -> &'a SymmBuffer {
        self.buf
    }

    /// Elements `[start, start + len)` of this view.
    ///
    /// # Errors
    /// [`Error::BadView`] if the range is out of bounds.
    pub fn slice(&self, start: usize, len: usize) -> Result<TypedView<'a, T>> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            let beyond = format!("{start}..{start}+{len} beyond {}", self.len);
            return Err(Error::BadView(beyond));
        }
        Ok(TypedView {
            buf: self.buf,
            offset_bytes: self.offset_bytes + (start * std::mem::size_of::<T>()) as u64,
            len,
            _t: PhantomData,
        })
    }

    /// Device address of the first element (NCCL backend).
    pub fn device_ptr(&self) -> Option<u64> {
        self.buf.device_ptr().map(|p| p + self.offset_bytes)
    }

    /// This view as a cudarc device slice ([`cudarc::driver::DevicePtr`] /
    /// [`cudarc::driver::DevicePtrMut`]), for cuBLAS, kernels and cudarc's own calls,
    /// with no raw address in the caller's code. Its stream is the buffer's
    /// allocating stream; cudarc may use it on any stream (see [`CudaView`]).
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a buffer of a host pool.
    #[cfg(feature = "nccl")]
    pub fn cuda(&self) -> Result<CudaView<'a, T>> {
        let stream = self.buf.stream.cuda_stream().ok_or(Error::WrongStream)?;
        let ptr = self.device_ptr().ok_or(Error::WrongStream)?;
        Ok(CudaView {
            buf: self.buf,
            ptr,
            len: self.len,
            stream,
            _view: PhantomData,
        })
    }

    /// The viewed bytes as a region of the buffer's segment.
    ///
    /// # Errors
    /// [`Error::Internal`] if the view leaves its segment (a bug).
    pub(crate) fn region(&self) -> Result<Region<'a>> {
        let len_bytes = (self.len * std::mem::size_of::<T>()) as u64;
        (self.buf.region()?)
            .sub(self.offset_bytes, len_bytes)
            .map_err(|e| Error::Internal {
                what: format!("a view of allocation #{}: {e}", self.buf.block.seq),
            })
    }

    /// Copy `data` into the first `data.len()` elements, ordered on the buffer's stream.
    ///
    /// # Errors
    /// [`Error::BadView`] if `data` is longer than the view; [`Error::PoolClosed`];
    /// backend errors.
    pub fn copy_from_host(&self, data: &[T]) -> Result<()> {
        let data: &[u8] = bytemuck::cast_slice(data);
        self.buf.pool.check_memory()?;
        let region = self.region()?;
        let target = region.sub(0, data.len() as u64).map_err(|_| {
            let (n, len) = (data.len(), region.len_bytes());
            Error::BadView(format!("writing {n} bytes at 0 into a view of {len} bytes"))
        })?;
        let mover = self.buf.pool.backend().data();
        mover.write(target, data, &self.buf.stream)
    }

    /// Copy the view to a host vector, waiting for the buffer's stream.
    ///
    /// # Errors
    /// [`Error::PoolClosed`]; backend errors.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.buf.pool.check_memory()?;
        let mut out = vec![T::zeroed(); self.len];
        self.buf.pool.backend().data().read(
            self.region()?,
            bytemuck::cast_slice_mut(&mut out),
            &self.buf.stream,
        )?;
        Ok(out)
    }
}

/// A typed view of a pool buffer as a cudarc device slice; made by
/// [`TypedView::cuda`]. It borrows the buffer, so the memory outlives it.
///
/// # Streams
///
/// cudarc asks for the memory on the stream its call runs on, and the view orders that
/// use as cudarc's own slices do, with the pool's fences:
///
/// - On the buffer's own stream: nothing to do (the pool orders the memory's reuse on
///   that stream already). This is the cheap path: a comparison of two handles.
/// - On another stream `S` of the device, the first time:
///   1. `S` waits (device-side) for the memory's earlier users: the fences the
///      allocation waited for, and the buffer's stream's own. So `S` never touches
///      memory that another stream still uses from before this allocation.
///   2. The use is recorded so that the memory is reused only after it. When a
///      [`Stream`] wraps `S` ([`Stream::cuda`] or `Stream::from_raw_cuda`, still
///      alive), as [`SymmBuffer::record_stream`] records it: a fence on `S` when the
///      buffer is freed, device-side waits at reuse. Later uses on `S` cost a lookup.
///   3. Otherwise (a cudarc stream never wrapped, or one of another device), an event
///      is recorded on `S` after each use (cudarc's `SyncOnDrop::Record`), and the
///      buffer's stream waits for it when the buffer is freed, so that the free's
///      fence covers the use (what cudarc's `CudaSlice` does when dropped). This holds
///      for up to four such streams per buffer; a use on a fifth, on the per-thread
///      default stream, or in cudarc's single-stream mode (where cudarc records no
///      events) synchronises `S` after the use instead (`SyncOnDrop::Sync`): correct
///      but blocking. Wrap long-lived streams with [`Stream::cuda`] to avoid both.
///
/// Not ordered: uses while `S` captures a CUDA graph (captured work runs when the graph
/// is launched: keep the buffer alive while it may be), and any use once cudarc's event
/// tracking is disabled (`CudaContext::disable_event_tracking`, whose `unsafe`
/// contract puts the ordering between streams on the caller), as for cudarc's own
/// views. Ordering between live uses of the buffer on different streams (a kernel on
/// `S` reading what a collective on the buffer's stream writes) stays the caller's, as
/// for the collectives: CUDA events or stream waits. Failures of the device calls
/// above are returned by the pool's next call ([`Error::Deferred`]).
#[cfg(feature = "nccl")]
#[derive(Debug)]
pub struct CudaView<'a, T> {
    buf: &'a SymmBuffer,
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _view: PhantomData<&'a [T]>,
}

#[cfg(feature = "nccl")]
impl<T> cudarc::driver::DeviceSlice<T> for CudaView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

/// The pointer, with the use on `stream` ordered as [`CudaView`] says.
#[cfg(feature = "nccl")]
impl<T> cudarc::driver::DevicePtr<T> for CudaView<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.buf.cuda_use(self.stream, stream))
    }
}

/// As [`DevicePtr`](cudarc::driver::DevicePtr): reads and writes are ordered alike.
#[cfg(feature = "nccl")]
impl<T> cudarc::driver::DevicePtrMut<T> for CudaView<'_, T> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.buf.cuda_use(self.stream, stream))
    }
}
