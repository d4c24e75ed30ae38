//! [`SymmBuffer`]: an RAII block of a pool, and typed views of it.

use super::{SegmentEntry, SymmPool};
use crate::backend::{Region, Window};
use crate::core::{BlockId, Placement, SegmentId};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::stream::Stream;
use parking_lot::Mutex;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
#[cfg(feature = "nccl")]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "nccl")]
mod cuda;
#[cfg(feature = "nccl")]
pub use cuda::{CudaView, CudaViewMut};
#[cfg(feature = "nccl")]
use cuda::{FOREIGN_STREAMS, Foreign, PENDING};
#[cfg(feature = "nccl")]
use std::sync::OnceLock;

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
    /// `PENDING` while uses through [`CudaView`]s on other streams wait to be joined.
    last_stream: AtomicU64,
    /// Uses through [`CudaView`]s on streams other than the buffer's: an event per
    /// stream, recorded after each use (made at the first such use).
    #[cfg(feature = "nccl")]
    foreign: OnceLock<Box<[OnceLock<Foreign>; FOREIGN_STREAMS]>>,
    /// 1 + the slot of `foreign` that the last write on another stream recorded (0:
    /// none).
    #[cfg(feature = "nccl")]
    writer: AtomicUsize,
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
            foreign: OnceLock::new(),
            #[cfg(feature = "nccl")]
            writer: AtomicUsize::new(0),
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
        Error::internal(format!("allocation #{}: {e}", self.block.seq))
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

    /// A collective on a stream other than the last one, or after uses through views
    /// on other streams: join those, and record the stream unless it was recorded
    /// before (then only the buffer's own lock is taken).
    #[cold]
    #[inline(never)]
    fn use_on_another(&self, stream: &Stream) -> Result<()> {
        self.join_views(stream);
        self.note_stream(stream)?;
        #[cfg(feature = "nccl")]
        if self.last_stream.load(Ordering::Acquire) == PENDING {
            return Ok(()); // not joined by the buffer's stream: `stream` is another, or captures
        }
        self.last_stream.store(stream.id().0, Ordering::Release);
        Ok(())
    }

    /// [`record_stream`](Self::record_stream), unless the stream is known already.
    fn note_stream(&self, stream: &Stream) -> Result<()> {
        let id = stream.id();
        let known = id == self.stream.id() || self.others.lock().iter().any(|s| s.id() == id);
        if known {
            Ok(())
        } else {
            self.record_stream(stream)
        }
    }

    /// Make `stream` wait for the uses through [`CudaView`]s on other streams that the
    /// buffer's stream has not joined yet (see [`CudaView`]).
    #[inline]
    fn join_views(&self, stream: &Stream) {
        #[cfg(feature = "nccl")]
        if let Some(cs) = stream.cuda_stream() {
            self.join_views_cuda(cs);
        }
        #[cfg(not(feature = "nccl"))]
        let _ = stream;
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
        let (size, len) = (size_of::<T>() as u64, self.len_bytes);
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
            offset_bytes: self.offset_bytes + (start * size_of::<T>()) as u64,
            len,
            _t: PhantomData,
        })
    }

    /// Device address of the first element (NCCL backend).
    pub fn device_ptr(&self) -> Option<u64> {
        self.buf.device_ptr().map(|p| p + self.offset_bytes)
    }

    /// The viewed bytes as a region of the buffer's segment.
    ///
    /// # Errors
    /// [`Error::Internal`] if the view leaves its segment (a bug).
    pub(crate) fn region(&self) -> Result<Region<'a>> {
        let len_bytes = (self.len * size_of::<T>()) as u64;
        (self.buf.region()?)
            .sub(self.offset_bytes, len_bytes)
            .map_err(|e| {
                Error::internal(format!("a view of allocation #{}: {e}", self.buf.block.seq))
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
        self.buf.join_views(&self.buf.stream);
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
        self.buf.join_views(&self.buf.stream);
        self.buf.pool.backend().data().read(
            self.region()?,
            bytemuck::cast_slice_mut(&mut out),
            &self.buf.stream,
        )?;
        Ok(out)
    }
}
