//! [`CudaView`] and [`CudaViewMut`]: typed views of a pool buffer as cudarc device
//! slices, and how the buffer orders their uses across streams.
//!
//! A write view needs the buffer borrowed mutably, so safe code never holds two write
//! views of one buffer, nor a write view beside a read view:
//!
//! ```compile_fail,E0499
//! fn two_writers(b: &mut symmpool::SymmBuffer) {
//!     let w1 = b.cuda_mut::<f32>().unwrap();
//!     let w2 = b.cuda_mut::<f32>().unwrap(); // error[E0499]
//!     let _live = (w1, w2);
//! }
//! ```
//!
//! ```compile_fail,E0502
//! fn reader_and_writer(b: &mut symmpool::SymmBuffer) {
//!     let r = b.view::<f32>().unwrap().cuda().unwrap();
//!     let w = b.cuda_mut::<f32>().unwrap(); // error[E0502]
//!     let _live = (r, w);
//! }
//! ```
//!
//! and a read view is no `DevicePtrMut`:
//!
//! ```compile_fail,E0277
//! fn write(_: &mut impl cudarc::driver::DevicePtrMut<f32>) {}
//! fn through_a_reader(b: &symmpool::SymmBuffer) {
//!     write(&mut b.view::<f32>().unwrap().cuda().unwrap()); // error[E0277]
//! }
//! ```

use super::{SymmBuffer, TypedView};
use crate::backend::NcclBackend;
use crate::backend::nccl::{cuda_key, same_cuda_stream};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::stream::Stream;
use cudarc::driver::{CudaEvent, CudaStream, DeviceSlice, SyncOnDrop, sys::CUdeviceptr};
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

/// How many streams other than its own a buffer keeps an event for; a view's use on
/// one more synchronises that stream instead.
pub(super) const FOREIGN_STREAMS: usize = 4;

/// The buffer's `last_stream` while uses through views on other streams are not yet
/// joined by its own stream (no stream has this id).
pub(super) const PENDING: u64 = u64::MAX;

/// The event recorded after each use through a view on one stream other than the
/// buffer's.
pub(super) struct Foreign {
    /// The stream's context and raw handle.
    key: (usize, usize),
    event: CudaEvent,
}

impl<'a, T: Element> TypedView<'a, T> {
    /// This view as a cudarc device slice to read ([`cudarc::driver::DevicePtr`]),
    /// for cuBLAS, kernels and cudarc's own calls, with no raw address in the caller's
    /// code. Its stream is the buffer's allocating stream; cudarc may use it on any
    /// stream (see [`CudaView`]). To write, see [`SymmBuffer::cuda_mut`].
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

impl SymmBuffer {
    /// The whole buffer as a cudarc device slice to write
    /// ([`cudarc::driver::DevicePtrMut`]; to read too), borrowing the buffer
    /// exclusively; [`CudaViewMut::split_at_mut`] cuts it.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T`'s size does not divide `len_bytes()`;
    /// [`Error::WrongStream`] for a buffer of a host pool.
    pub fn cuda_mut<T: Element>(&mut self) -> Result<CudaViewMut<'_, T>> {
        // The buffer is borrowed mutably for the view's life: no other view of it
        // exists meanwhile.
        self.view::<T>()?.cuda().map(CudaViewMut)
    }

    /// cudarc asks for the memory on `cs` (to write, if `write`) through a view whose
    /// home is the buffer's stream `home`: order the use (see [`CudaView`]); what to
    /// do once it is enqueued.
    #[inline]
    fn cuda_use<'b>(
        &'b self,
        home: &CudaStream,
        cs: &'b CudaStream,
        write: bool,
    ) -> SyncOnDrop<'b> {
        if same_cuda_stream(home, cs) && self.last_stream.load(Ordering::Acquire) != PENDING {
            return SyncOnDrop::Sync(None);
        }
        self.cuda_use_elsewhere(home, cs, write)
    }

    #[cold]
    #[inline(never)]
    fn cuda_use_elsewhere<'b>(
        &'b self,
        home: &CudaStream,
        cs: &'b CudaStream,
        write: bool,
    ) -> SyncOnDrop<'b> {
        // The caller took over the ordering between streams (cudarc's unsafe
        // `disable_event_tracking`): nothing, as cudarc's own views do.
        if !cs.context().is_event_tracking() {
            return SyncOnDrop::Sync(None);
        }
        if same_cuda_stream(home, cs) {
            self.join_views_cuda(cs);
            return SyncOnDrop::Sync(None);
        }
        if self.capturing(cs) {
            // No event crosses a capture's edge. A stream a `Stream` wraps is recorded
            // as a collective's is: the free fences it, after graphs launched there.
            if let Some(stream) = Stream::known_cuda(cs)
                && let Err(e) = self.note_stream(&stream)
            {
                self.view_failed("recording a captured use", e);
            }
            return SyncOnDrop::Sync(None);
        }
        // After the buffer's stream's work so far: the pool's calls, the memory's
        // earlier users (the allocation waited for them there), and what it joined.
        if !self.capturing(home)
            && let Err(e) = NcclBackend::join_cuda(cs, home)
        {
            self.view_failed("ordering a use after the buffer's stream", e);
        }
        // cudarc records nothing in single-stream mode; the per-thread default stream
        // is a different stream on each thread.
        let key = cuda_key(cs).filter(|_| cs.context().is_managing_stream_synchronization());
        let own = key.and_then(|key| self.foreign_slot(key, cs));
        // A write after every use elsewhere; a read after the last write. The slot's
        // last record may be from an earlier stream with this handle (destroyed since):
        // waited for too, so that the next record covers it.
        let (writer, own_i) = (self.writer.load(Ordering::Acquire), own.map(|o| o.0));
        self.wait_foreign(cs, |i| write || Some(i) == own_i || i + 1 == writer);
        let Some((i, foreign)) = own else {
            return SyncOnDrop::Sync(Some(cs));
        };
        if write {
            self.writer.store(i + 1, Ordering::Release);
        }
        self.last_stream.store(PENDING, Ordering::Release);
        SyncOnDrop::Record(Some((&foreign.event, cs)))
    }

    /// Whether `cs` captures a CUDA graph (a failure to ask is recorded: no).
    fn capturing(&self, cs: &CudaStream) -> bool {
        (NcclBackend::capturing_cuda(cs))
            .unwrap_or_else(|e| self.view_failed("asking whether a stream captures", e))
    }

    /// `cs` waits (device-side) for the events of the slots `which` picks.
    fn wait_foreign(&self, cs: &CudaStream, which: impl Fn(usize) -> bool) {
        let Some(slots) = self.foreign.get() else {
            return;
        };
        for (_, slot) in slots.iter().enumerate().filter(|(i, _)| which(*i)) {
            if let Some(f) = slot.get()
                && let Err(e) = NcclBackend::wait_event(cs, &f.event)
            {
                self.view_failed("ordering a use after uses on other streams", e);
            }
        }
    }

    /// A use on the buffer's stream (`cs`, or a stream a collective runs on) after
    /// uses through views on other streams: it waits for them all, unless it captures.
    /// Only the buffer's own stream clears the mark: a later use there must wait for
    /// the views' uses whichever other streams joined them.
    pub(super) fn join_views_cuda(&self, cs: &CudaStream) {
        if self.last_stream.load(Ordering::Acquire) != PENDING || self.capturing(cs) {
            return;
        }
        if self
            .stream
            .cuda_stream()
            .is_some_and(|h| same_cuda_stream(h, cs))
        {
            (self.last_stream).store(self.stream.id().0, Ordering::Release);
        }
        self.wait_foreign(cs, |_| true);
    }

    /// The slot and event for uses on the stream `key` (made in `cs`'s context if
    /// new); `None` when every slot holds another stream's or no event can be made.
    fn foreign_slot(&self, key: (usize, usize), cs: &CudaStream) -> Option<(usize, &Foreign)> {
        let slots = self
            .foreign
            .get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        for (i, slot) in slots.iter().enumerate() {
            if let Some(f) = slot.get() {
                if f.key == key {
                    return Some((i, f));
                }
                continue;
            }
            let event = (NcclBackend::event_for(cs))
                .map_err(|e| self.view_failed("making an event", e))
                .ok()?;
            // Another thread may take this slot first (the event made here goes).
            let f = slot.get_or_init(|| Foreign { key, event });
            if f.key == key {
                return Some((i, f));
            }
        }
        None
    }

    /// Before the buffer is freed: its stream waits for the uses on other streams, so
    /// that the fence recorded on it at the free covers them.
    pub(super) fn join_foreign(&self) {
        if let Some(home) = self.stream.cuda_stream() {
            self.wait_foreign(home, |_| true);
        }
    }

    /// A failure while ordering a view's use: returned by the pool's next call.
    #[cold]
    fn view_failed(&self, what: &str, e: Error) -> bool {
        let during = format!("{what} (allocation #{})", self.block.seq);
        self.pool.record_deferred_error(during, e);
        false
    }
}

/// A typed view of a pool buffer as a cudarc device slice to read
/// ([`cudarc::driver::DevicePtr`]); made by [`TypedView::cuda`]. It borrows the
/// buffer, so the memory outlives it. [`CudaViewMut`] writes.
///
/// # Streams
///
/// cudarc asks for the memory on the stream `S` its call runs on, and the view orders
/// that use as cudarc's `CudaSlice` does with its read and write events, every use,
/// with the buffer's stream `H` as the hub:
///
/// - On `H`: nothing (a comparison of two handles), unless views were used on other
///   streams since `H` last joined them: then `H` waits for those uses first. The
///   pool's own calls on the buffer (collectives, `write`, `read`) join them alike.
/// - On another stream `S`:
///   1. `S` waits (device-side) for the work enqueued on `H` so far (an event
///      recorded there): the pool's calls, the memory's earlier users (which `H`
///      waited for at the allocation), and the uses `H` joined.
///   2. A read waits for the last write through a view on another stream; a write
///      for every use on other streams (reads and writes).
///   3. An event is recorded on `S` after the use (cudarc's `SyncOnDrop::Record`):
///      later uses wait for it as above, and `H` waits for it before the fence of the
///      buffer's free, so that the memory is reused only after it. This holds for up
///      to four such streams per buffer; a use on a fifth, on the per-thread default
///      stream, or in cudarc's single-stream mode (where cudarc records no events)
///      synchronises `S` after the use instead (`SyncOnDrop::Sync`): correct but
///      blocking.
///
/// # CUDA graphs
///
/// CUDA refuses a capturing stream's wait for an event recorded outside its capture,
/// and any use outside it of an event last recorded in it (cudarc waits and records
/// regardless, which breaks the capture unless its event tracking is disabled). So
/// while `S` captures, the use neither waits for nor records the buffer's events: it
/// is ordered inside the graph by the capture's streams, and against the buffer's
/// other uses by the stream the graph is launched on (the caller's). It is recorded as
/// a collective's use is: when a [`Stream`] wraps `S`, the buffer's free fences `S`,
/// so the memory is reused after the graph launches enqueued on `S` before the free
/// (keep the buffer alive while a launch elsewhere may run). Likewise `S` does not
/// wait for `H` while `H` captures, and `H` joins no use while it captures.
///
/// Not ordered, so the caller's to order:
/// - any use once cudarc's event tracking is disabled
///   (`CudaContext::disable_event_tracking`, whose `unsafe` contract puts the ordering
///   between streams on the caller), as for cudarc's own views;
/// - a use on `S` after a collective on a third stream `X` (`S` joins `H`, not `X`;
///   a collective on `X` does wait for the views' uses, and `H` still joins them);
/// - a use on `S` while `H` captures (`S` cannot wait for `H` then, so not for the
///   memory's earlier users either), and the drop, while `H` captures, of a buffer used
///   on other streams (`H`'s wait for those uses breaks the capture: an error, not a
///   silent race);
/// - views of one buffer used from several threads at once (two halves of
///   [`CudaViewMut::split_at_mut`] written on two threads, say): the events that order
///   them are recorded when cudarc's call returns, so a use racing another's record
///   may miss it, as two threads writing one slice need the caller's ordering.
///
/// Failures of the device calls above are returned by the pool's next call
/// ([`Error::Deferred`]).
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a, T> {
    buf: &'a SymmBuffer,
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _view: PhantomData<&'a [T]>,
}

/// A typed view of a pool buffer as a cudarc device slice to write and read
/// ([`cudarc::driver::DevicePtrMut`] and [`cudarc::driver::DevicePtr`]); made by
/// [`SymmBuffer::cuda_mut`], which borrows the buffer exclusively. Its uses are
/// ordered as [`CudaView`] says.
#[derive(Debug)]
pub struct CudaViewMut<'a, T>(CudaView<'a, T>);

impl<'a, T> CudaViewMut<'a, T> {
    /// Elements `[0, mid)` and `[mid, len)`, each a write view.
    ///
    /// # Errors
    /// [`Error::BadView`] if `mid` is beyond the view.
    pub fn split_at_mut(self, mid: usize) -> Result<(Self, Self)> {
        let v = self.0;
        if mid > v.len {
            return Err(Error::BadView(format!("split at {mid} beyond {}", v.len)));
        }
        let ptr = v.ptr + (mid * size_of::<T>()) as u64;
        let tail = CudaView {
            ptr,
            len: v.len - mid,
            ..v
        };
        Ok((CudaViewMut(CudaView { len: mid, ..v }), CudaViewMut(tail)))
    }
}

impl<T> DeviceSlice<T> for CudaView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DeviceSlice<T> for CudaViewMut<'_, T> {
    fn len(&self) -> usize {
        self.0.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.0.stream
    }
}

/// The pointer, with the read on `stream` ordered as [`CudaView`] says.
impl<T> cudarc::driver::DevicePtr<T> for CudaView<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.buf.cuda_use(self.stream, stream, false))
    }
}

/// As [`CudaView`]'s.
impl<T> cudarc::driver::DevicePtr<T> for CudaViewMut<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        self.0.device_ptr(stream)
    }
}

/// The pointer, with the write on `stream` ordered as [`CudaView`] says.
impl<T> cudarc::driver::DevicePtrMut<T> for CudaViewMut<'_, T> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        let v = &self.0;
        (v.ptr, v.buf.cuda_use(v.stream, stream, true))
    }
}
