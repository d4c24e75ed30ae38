//! [`CudaView`]: a typed view of a pool buffer as a cudarc device slice, and how the
//! buffer orders its uses on other streams than its own.

use super::{SymmBuffer, TypedView};
use crate::backend::NcclBackend;
use crate::error::{Error, Result};
use crate::stream::Stream;
use cudarc::driver::{CudaEvent, CudaStream, SyncOnDrop, sys::CUdeviceptr};
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

/// How many streams that no [`Stream`] wraps a buffer records [`CudaView`] uses on
/// with events; a use on one more synchronises that stream instead.
pub(super) const FOREIGN_STREAMS: usize = 4;

/// An event recorded after the uses through [`CudaView`]s on one stream that no
/// [`Stream`] wraps.
pub(super) struct Foreign {
    /// The stream's context and raw handle.
    key: (usize, usize),
    event: CudaEvent,
}

impl<'a, T: crate::dtype::Element> TypedView<'a, T> {
    /// This view as a cudarc device slice ([`cudarc::driver::DevicePtr`] /
    /// [`cudarc::driver::DevicePtrMut`]), for cuBLAS, kernels and cudarc's own calls,
    /// with no raw address in the caller's code. Its stream is the buffer's
    /// allocating stream; cudarc may use it on any stream (see [`CudaView`]).
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a buffer of a host pool.
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
}

/// Uses through [`CudaView`]s on other streams than the buffer's.
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
    pub(super) fn join_foreign(&self) {
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
#[derive(Debug)]
pub struct CudaView<'a, T> {
    buf: &'a SymmBuffer,
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _view: PhantomData<&'a [T]>,
}

impl<T> cudarc::driver::DeviceSlice<T> for CudaView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

/// The pointer, with the use on `stream` ordered as [`CudaView`] says.
impl<T> cudarc::driver::DevicePtr<T> for CudaView<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.buf.cuda_use(self.stream, stream))
    }
}

/// As [`DevicePtr`](cudarc::driver::DevicePtr): reads and writes are ordered alike.
impl<T> cudarc::driver::DevicePtrMut<T> for CudaView<'_, T> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.buf.cuda_use(self.stream, stream))
    }
}
