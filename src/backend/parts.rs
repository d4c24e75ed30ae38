//! Three of a backend's parts, one trait per job: segments ([`SegmentProvider`]),
//! streams ([`StreamOps`]) and data ([`DataMover`]); the fourth, [`Collectives`](super::Collectives),
//! sits with its arguments in the module root.

use super::{Refused, Region, Segment, Window};
use crate::core::{Fence, StreamId};
use crate::deadline::Deadline;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::stream::Stream;
use std::fmt;

/// Where segments come from and how they become windows.
///
/// # Collective
/// [`register`](Self::register) is collective on its communicator: every rank
/// registers the same segments in the same order (NCCL pairs windows by call order).
/// Everything else is local.
pub trait SegmentProvider: Send + Sync + fmt::Debug {
    /// Allocate a segment of `size_bytes` (a non-zero multiple of the granularity).
    ///
    /// # Errors
    /// [`Error::DeviceOutOfMemory`] or [`Error::PoolLimit`] if the memory is not there;
    /// [`Error::Cuda`] / [`Error::Nccl`] otherwise. Nothing is allocated on error.
    fn allocate(&self, size_bytes: u64) -> Result<Segment>;

    /// Register the whole segment as a symmetric window on communicator `comm`.
    /// `Ok(None)`: the communicator cannot do symmetric memory (NCCL returned a NULL
    /// window); the segment is not registered there.
    ///
    /// # Collective
    /// Every rank registers the same segments on `comm` in the same order.
    ///
    /// # Safety
    /// - every rank makes this call for its own segment of the same size at the same
    ///   point of its sequence of registrations on `comm` (else NCCL pairs the wrong
    ///   buffers, or hangs);
    /// - `segment` is not registered on `comm` yet (one window per segment and
    ///   communicator: NCCL ≥ 2.30.7 makes a second one undefined behaviour);
    /// - no stream of this device is capturing a CUDA graph.
    ///
    /// # Errors
    /// [`Error::Timeout`] (or [`Error::NcclTimeout`]) if peers have not registered by
    /// `deadline`, the caller's; [`Error::Nccl`]; [`Error::RegistrationMismatch`]
    /// where the provider can see that ranks passed different sizes.
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> Result<Option<Window>>;

    /// Deregister a window (local in NCCL), waiting inside the provider (NCCL's call,
    /// an abort still running) until `deadline` at most, the caller's. The default
    /// drops it: enough for a provider whose windows own everything they hold.
    ///
    /// # Safety
    /// `window` was made by this provider's [`register`](Self::register), and no work
    /// that uses its segment through that communicator is pending on the device.
    ///
    /// # Errors
    /// The window back, with [`Error::Nccl`] (or [`Error::NcclTimeout`] past
    /// `deadline`).
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        let _ = deadline;
        drop(window);
        Ok(())
    }

    /// Free a segment. The default drops it, as [`deregister`](Self::deregister) does.
    ///
    /// # Safety
    /// `segment` was made by this provider's [`allocate`](Self::allocate), no window
    /// covers it any more, and no pending device work uses it.
    ///
    /// # Errors
    /// The segment back, with [`Error::Cuda`] / [`Error::Nccl`].
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        drop(segment);
        Ok(())
    }
}

/// Streams, fences and device-side ordering.
pub trait StreamOps: Send + Sync + fmt::Debug {
    /// A new stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    fn new_stream(&self) -> Result<Stream>;
    /// Record a fence on `stream`: a point after all work enqueued so far. Fences on
    /// one stream increase.
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a stream of another backend kind; [`Error::Cuda`].
    fn record_fence(&self, stream: &Stream) -> Result<Fence>;
    /// Make `stream` wait (device-side) for `fence` recorded on stream `on`.
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()>;
    /// The latest fence on `stream` known to be complete, if any (a cheap query that
    /// never waits). Only statistics use it: placement never depends on completion.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>>;
    /// Whether `stream` is capturing a CUDA graph.
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    fn is_capturing(&self, stream: &Stream) -> Result<bool>;
    /// Whether any stream of this device that the backend knows (streams that
    /// recorded fences, streams adopted from raw handles) is capturing a CUDA graph:
    /// what a registration asks when it has no stream of its own (`reserve` on a pool
    /// that never allocated). The default: none (host work is never captured).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    fn any_capturing(&self) -> Result<bool> {
        Ok(false)
    }
    /// Wait on the host until all work enqueued so far on every stream this device has
    /// recorded fences on is done, or `deadline` passes: `Ok(true)` if it drained,
    /// `Ok(false)` at the deadline. Never waits past the deadline (it polls; it does
    /// not block in the driver).
    ///
    /// # Errors
    /// [`Error::Cuda`] (a failed device: its work will never drain).
    fn drain(&self, deadline: Deadline) -> Result<bool>;
}

/// Copies between the host and segments, and timing of device work.
pub trait DataMover: Send + Sync + fmt::Debug {
    /// Copy `data` into `region` (its first `data.len()` bytes), ordered on `stream`;
    /// returns once `data` may be reused.
    ///
    /// # Errors
    /// [`Error::BadView`] if `data` is longer than the region; [`Error::WrongStream`];
    /// [`Error::Cuda`].
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()>;
    /// Copy `region` (its first `out.len()` bytes) into `out`, ordered on `stream`, and
    /// wait for it.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()>;
    /// Time the device work `f` enqueues on `stream`, in milliseconds (CUDA events on
    /// the NCCL backend; the default, for synchronous host work: the wall clock). Waits
    /// for it.
    ///
    /// # Errors
    /// [`Error::Cuda`], or the first error of `f`.
    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let _ = stream;
        let start = std::time::Instant::now();
        f()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}
