//! Streams, fences and events on the NCCL backend: [`Stream`]'s CUDA constructors
//! and accessors, fences as CUDA events, drains, and the copies and timing that wait
//! on a stream.

use super::comm::Device;
use super::health::poll_until;
use super::{CUstream, NcclBackend, ffi};
use crate::backend::{Backend, DataMover, Region, StreamOps};
use crate::core::{Fence, StreamId};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::stream::Stream;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What [`Stream`] carries on the NCCL backend, and how `Debug` names it.
const KIND: &str = "cuda";

/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream, a different
/// stream on each thread.
const PER_THREAD: usize = 0x2;

/// A stream of the NCCL backend: a cudarc `CudaStream`, keyed by its context and raw
/// handle, so that one CUDA stream has one [`id`](Stream::id) however often it is
/// wrapped, as long as a wrapper of it lives ([`Stream::on_device`] says why that is
/// sound: a cudarc stream lives while its `Arc` does, a raw one outlives its backend).
impl Stream {
    /// Wrap a cudarc stream (for the NCCL backend). Use non-blocking streams: NCCL
    /// 2.28's copy-engine collectives fail on the legacy NULL stream. The per-thread
    /// default stream (`CU_STREAM_PER_THREAD`) gets a new [`id`](Self::id) each time.
    pub fn cuda(stream: Arc<CudaStream>) -> Self {
        Stream::on_device(KIND, cuda_key(&stream), stream)
    }

    /// The live [`Stream`] of a cudarc stream, if a wrapper of it lives (made by
    /// [`Stream::cuda`] or [`Stream::from_raw_cuda`], and not dropped since).
    pub(crate) fn known_cuda(stream: &CudaStream) -> Option<Stream> {
        Stream::find::<CudaStream>(KIND, cuda_key(stream)?)
    }

    /// The stream of a runtime without cudarc, by its raw `CUstream`, on an NCCL
    /// backend: [`NcclBackend::stream_from_raw`].
    ///
    /// # Safety
    /// `cu_stream` is a live stream of `backend`'s device, in its primary context, and
    /// stays alive until the backend is dropped.
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a backend that is not an NCCL backend; the errors of
    /// [`NcclBackend::stream_from_raw`].
    pub unsafe fn from_raw_cuda(backend: &Backend, cu_stream: CUstream) -> Result<Self> {
        let nccl = backend
            .downcast_ref::<NcclBackend>()
            .ok_or(Error::WrongStream)?;
        // SAFETY: the caller's contract is the one of `stream_from_raw`.
        unsafe { nccl.stream_from_raw(cu_stream) }
    }

    /// The raw `CUstream` handle, if this is a CUDA stream (for a runtime that enqueues
    /// its own work on it).
    pub fn raw_cuda(&self) -> Option<CUstream> {
        self.cuda_stream().map(|s| s.cu_stream())
    }

    /// The wrapped cudarc stream, if this is a CUDA stream.
    pub fn cuda_stream(&self) -> Option<&Arc<CudaStream>> {
        self.device::<Arc<CudaStream>>()
    }
}

/// What names a CUDA stream across its wrappers: its context and raw handle (`None`
/// for the per-thread default stream, which names a different stream on each thread).
pub(crate) fn cuda_key(stream: &CudaStream) -> Option<(usize, usize)> {
    let raw = stream.cu_stream() as usize;
    (raw != PER_THREAD).then(|| (stream.context().cu_ctx() as usize, raw))
}

/// Whether `a` and `b` are the same CUDA stream (the same handle in the same context).
pub(crate) fn same_cuda_stream(a: &CudaStream, b: &CudaStream) -> bool {
    a.cu_stream() == b.cu_stream() && a.context().cu_ctx() == b.context().cu_ctx()
}

/// Fences as CUDA events, garbage-collected once known complete; and the streams
/// that have recorded any, for draining.
#[derive(Default)]
pub(super) struct FenceTable {
    next: BTreeMap<StreamId, u64>,
    pub(super) events: BTreeMap<(StreamId, u64), CudaEvent>,
    /// Largest fence known complete, per stream: waits on it or earlier are skipped.
    done: BTreeMap<StreamId, u64>,
    streams: BTreeMap<StreamId, Arc<CudaStream>>,
    spare: Vec<CudaEvent>,
}

impl FenceTable {
    /// After fence `done` of stream `sid` was seen complete: recycle its events and
    /// every earlier one, and remember it.
    fn collect(&mut self, sid: StreamId, done: u64) {
        let mut old = self.events.split_off(&(sid, 0));
        self.events.append(&mut old.split_off(&(sid, done + 1)));
        self.spare.extend(old.into_values());
        let w = self.done.entry(sid).or_insert(0);
        *w = (*w).max(done);
    }

    /// The newest fence of `sid` whose event is complete.
    fn newest_complete(&self, sid: StreamId) -> Option<u64> {
        (self.events.range((sid, 0)..=(sid, u64::MAX)).rev())
            .find(|(_, e)| e.is_complete())
            .map(|(k, _)| k.1)
    }
}

/// Events kept per stream before completed ones are collected.
const FENCES_PER_STREAM: usize = 64;

/// Poll `events` until all are complete (`true`) or `deadline` passes (`false`).
/// Never blocks in the driver: a peer stuck in a collective would hold a blocking
/// synchronise forever.
///
/// # Errors
/// [`Error::Cuda`] when a query fails (a failed device, a faulted kernel): that is not
/// "still running".
pub(super) fn all_complete(events: &[CudaEvent], deadline: Deadline) -> Result<bool> {
    let answer = poll_until(deadline, || {
        let first = events
            .iter()
            .map(CudaEvent::try_is_complete)
            .find(|r| r != &Ok(true));
        match first {
            None => Some(Ok(())),
            Some(Ok(_)) => None,
            Some(Err(err)) => Some(Err(ffi::cuda("cuEventQuery")(err))),
        }
    });
    answer.transpose().map(|done| done.is_some())
}

impl NcclBackend {
    /// A new non-blocking cudarc stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn cuda_stream(&self) -> Result<Arc<CudaStream>> {
        self.context()
            .new_stream()
            .map_err(ffi::cuda("cuStreamCreate"))
    }

    /// A [`Stream`] for a runtime's own CUDA stream (for example PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`), for runtimes without cudarc. The same
    /// raw handle always gives the same stream (the same [`StreamId`]), so buffers
    /// allocated through different calls on one raw stream never wait on each other.
    ///
    /// Prefer non-blocking streams: NCCL 2.28's copy-engine collectives fail on the
    /// legacy default stream (handle 0).
    ///
    /// # Safety
    /// `cu_stream` is a live stream of this backend's device, in its primary context
    /// (the one PyTorch and cudarc use), and it stays alive until this backend is
    /// dropped (its handle must not be destroyed and reused for another stream while
    /// the backend may still see it).
    ///
    /// # Errors
    /// [`Error::WrongStream`] if the stream belongs to another context than the primary
    /// context of this backend's device; [`Error::Cuda`];
    /// the backend's error once it is broken.
    pub unsafe fn stream_from_raw(&self, cu_stream: CUstream) -> Result<Stream> {
        self.shared.health.check()?;
        let mut streams = self.raw_streams.lock();
        if let Some(s) = streams.get(&(cu_stream as usize)) {
            return Ok(s.clone());
        }
        self.bind()?;
        // SAFETY: the caller guarantees a live stream handle.
        let ctx = unsafe { ffi::stream_context(cu_stream) }?;
        if ctx != self.context().cu_ctx() {
            // A stream of another context (not the primary context of this device).
            return Err(Error::WrongStream);
        }
        // SAFETY: the stream belongs to this context (checked above) and the caller keeps
        // it alive as long as this backend, which holds every wrapper it hands out.
        let wrapped = unsafe { self.context().wrap_borrowed_stream(cu_stream) };
        let stream = Stream::cuda(wrapped);
        streams.insert(cu_stream as usize, stream.clone());
        Ok(stream)
    }

    /// Make `cs` wait (device-side) for the work enqueued on `on` so far (see
    /// `CudaView`).
    pub(crate) fn join_cuda(cs: &CudaStream, on: &CudaStream) -> Result<()> {
        cs.join(on).map_err(ffi::cuda("cuStreamWaitEvent"))
    }

    /// Whether `cs` is capturing a CUDA graph.
    pub(crate) fn capturing_cuda(cs: &CudaStream) -> Result<bool> {
        ffi::bind(cs.context())?;
        ffi::is_capturing(cs)
    }

    /// A new event (without timing) in `cs`'s context, to record on `cs`.
    pub(crate) fn event_for(cs: &CudaStream) -> Result<CudaEvent> {
        (cs.context().new_event(None)).map_err(ffi::cuda("cuEventCreate"))
    }

    /// Make `cs` wait (device-side) for `event`'s last record.
    pub(crate) fn wait_event(cs: &CudaStream, event: &CudaEvent) -> Result<()> {
        cs.wait(event).map_err(ffi::cuda("cuStreamWaitEvent"))
    }

    /// The cudarc stream of `stream`, or [`Error::WrongStream`] for a host stream.
    pub(super) fn cuda_of<'s>(&self, stream: &'s Stream) -> Result<&'s Arc<CudaStream>> {
        stream.cuda_stream().ok_or(Error::WrongStream)
    }

    /// The cudarc stream of `stream`, once the work enqueued on it so far is done
    /// (this rank's device bound). Polls, and fails with [`Error::Timeout`] naming `op`
    /// after [`NcclConfig::call_timeout`](super::NcclConfig::call_timeout): a stream
    /// stuck behind a collective whose peer died must not hold the caller forever.
    fn idle<'s>(&self, stream: &'s Stream, op: &'static str) -> Result<&'s Arc<CudaStream>> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        let started = Instant::now();
        if self
            .shared
            .device
            .wait_idle(cs, self.shared.call_deadline())?
        {
            return Ok(cs);
        }
        Err(Error::timeout_since(op, started, &[]))
    }
}

impl StreamOps for NcclBackend {
    fn new_stream(&self) -> Result<Stream> {
        self.shared.health.check()?;
        Ok(Stream::cuda(self.cuda_stream()?))
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        let cs = self.cuda_of(stream)?;
        let mut t = self.fences.lock();
        let event = self.shared.device.record(cs, t.spare.pop())?;
        let sid = stream.id();
        t.streams.entry(sid).or_insert_with(|| cs.clone());
        let next = t.next.entry(sid).or_insert(0);
        *next += 1;
        let fence = *next;
        t.events.insert((sid, fence), event);
        // Collect this stream's completed events once there are many: completion of
        // fence k means every earlier fence on the stream is complete too.
        let range = (sid, 0)..=(sid, u64::MAX);
        if t.events.range(range).count() > FENCES_PER_STREAM
            && let Some(done) = t.newest_complete(sid)
        {
            t.collect(sid, done);
        }
        Ok(Fence(fence))
    }

    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()> {
        let cs = self.cuda_of(stream)?;
        let t = self.fences.lock();
        if t.done.get(&on).is_some_and(|&d| fence.0 <= d) {
            return Ok(());
        }
        // Only collected events are missing, and those are complete.
        t.events
            .get(&(on, fence.0))
            .map_or(Ok(()), |e| Self::wait_event(cs, e))
    }

    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>> {
        let t = self.fences.lock();
        let collected = t.done.get(&stream).copied();
        Ok(t.newest_complete(stream).max(collected).map(Fence))
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        ffi::is_capturing(cs)
    }

    fn any_capturing(&self) -> Result<bool> {
        self.bind()?;
        let fenced: Vec<_> = self.fences.lock().streams.values().cloned().collect();
        let adopted: Vec<_> = self.raw_streams.lock().values().cloned().collect();
        let mut streams = fenced
            .iter()
            .chain(adopted.iter().filter_map(Stream::cuda_stream));
        streams.try_fold(false, |any, cs| Ok(any || ffi::is_capturing(cs)?))
    }

    fn drain(&self, deadline: Deadline) -> Result<bool> {
        self.bind()?;
        // A broken backend's communicators are revoked and aborted, so their kernels
        // end at once; work still running after `DROP_DRAIN_WAIT` waits on a lost peer
        // by means no abort ends (a copy-engine all-gather's stream memory waits on its
        // peers' flags, NCCL 2.28+) and never drains: do not wait the caller's timeout.
        let deadline = if self.shared.health.is_broken() {
            deadline.cap(super::DROP_DRAIN_WAIT)
        } else {
            deadline
        };
        // One event after everything enqueued so far on every stream that fenced.
        let streams: Vec<_> = self.fences.lock().streams.values().cloned().collect();
        let events = streams
            .iter()
            .map(|s| s.record_event(None).map_err(ffi::cuda("cuEventRecord")))
            .collect::<Result<Vec<CudaEvent>>>()?;
        let drained = all_complete(&events, deadline);
        if matches!(drained, Ok(false)) {
            (self.drain_timed_out).store(true, Ordering::Relaxed);
        }
        drained
    }
}

impl DataMover for NcclBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        let dst = Self::ptr(&region.sub(0, data.len() as u64)?)?;
        let cs = self.idle(stream, "writing to a buffer (its stream is busy)")?;
        // SAFETY: `dst..dst+len` lies inside a live segment of this device (the region
        // is checked against its segment, which the caller's buffer keeps alive); the
        // stream is idle, so the copy waits for nothing but itself.
        unsafe { ffi::copy_to_device(dst, data, cs) }
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        let src = Self::ptr(&region.sub(0, out.len() as u64)?)?;
        let cs = self.idle(stream, "reading a buffer (its stream is busy)")?;
        // SAFETY: as in `write`.
        unsafe { ffi::copy_to_host(src, out, cs) }
    }

    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        f()?;
        let end = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        self.idle(stream, "timing device work")?;
        start
            .elapsed_ms(&end)
            .map(f64::from)
            .map_err(ffi::cuda("cuEventElapsedTime"))
    }
}
