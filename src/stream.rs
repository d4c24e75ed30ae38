//! Streams, as the pool sees them.

use crate::core::StreamId;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// A stream of device work that buffers are allocated on and collectives run on.
///
/// Cheap to clone. On the host backend a stream is only a tag (host work is
/// synchronous); on the NCCL backend it wraps a cudarc `CudaStream`
/// (`cudarc::driver::CudaStream`). Each `Stream` value made by a constructor gets a
/// process-unique id; clones share it. Two `Stream`s made with [`Stream::cuda`] from
/// the same CUDA stream have different ids, which only costs a redundant device-side
/// wait; [`Stream::from_raw_cuda`] gives one id per raw handle.
#[derive(Clone)]
pub struct Stream {
    id: StreamId,
    pub(crate) inner: StreamInner,
}

#[derive(Clone)]
pub(crate) enum StreamInner {
    Host,
    #[cfg(feature = "nccl")]
    Cuda(std::sync::Arc<cudarc::driver::CudaStream>),
}

impl Stream {
    fn fresh_id() -> StreamId {
        StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// A host stream (for the host backend).
    pub fn host() -> Self {
        Stream {
            id: Self::fresh_id(),
            inner: StreamInner::Host,
        }
    }

    /// Wrap a cudarc stream (for the NCCL backend). Use non-blocking streams: NCCL
    /// 2.28's copy-engine collectives fail on the legacy NULL stream.
    #[cfg(feature = "nccl")]
    pub fn cuda(stream: std::sync::Arc<cudarc::driver::CudaStream>) -> Self {
        Stream {
            id: Self::fresh_id(),
            inner: StreamInner::Cuda(stream),
        }
    }

    /// The stream of a runtime without cudarc, by its raw `CUstream` (for example
    /// PyTorch's `torch.cuda.current_stream().cuda_stream`), on an NCCL backend. The same
    /// handle always gives the same stream, with the same [`id`](Self::id), so there are
    /// no spurious cross-stream waits. See `NcclBackend::stream_from_raw`.
    ///
    /// # Safety
    /// `cu_stream` is a live stream of `backend`'s device, in its primary context, and
    /// stays alive until the backend is dropped.
    ///
    /// # Errors
    /// [`Error::WrongStream`](crate::Error::WrongStream) for a backend that is not an
    /// NCCL backend; the errors of `NcclBackend::stream_from_raw`.
    #[cfg(feature = "nccl")]
    pub unsafe fn from_raw_cuda(
        backend: &crate::Backend,
        cu_stream: cudarc::driver::sys::CUstream,
    ) -> crate::Result<Self> {
        let nccl = backend
            .downcast_ref::<crate::backend::NcclBackend>()
            .ok_or(crate::Error::WrongStream)?;
        // SAFETY: the caller's contract is the one of `stream_from_raw`.
        unsafe { nccl.stream_from_raw(cu_stream) }
    }

    /// The raw `CUstream` handle, if this is a CUDA stream (for a runtime that enqueues
    /// its own work on it).
    #[cfg(feature = "nccl")]
    pub fn raw_cuda(&self) -> Option<cudarc::driver::sys::CUstream> {
        self.cuda_stream().map(|s| s.cu_stream())
    }

    /// The id the allocator core tags blocks with.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The wrapped cudarc stream, if this is a CUDA stream.
    #[cfg(feature = "nccl")]
    pub fn cuda_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        match &self.inner {
            StreamInner::Cuda(s) => Some(s),
            StreamInner::Host => None,
        }
    }

    /// Whether this is a host stream.
    pub fn is_host(&self) -> bool {
        matches!(self.inner, StreamInner::Host)
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_host() { "host" } else { "cuda" };
        write!(f, "Stream({kind}, {})", self.id.0)
    }
}
