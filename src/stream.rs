//! Streams, as the pool sees them.

use crate::core::StreamId;
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// A stream of device work that buffers are allocated on and collectives run on.
///
/// Cheap to clone. On the host backends a stream is only a tag (host work is
/// synchronous); on a device backend it also carries that backend's stream handle,
/// which only the backend reads (the NCCL backend's constructors and accessors, such
/// as `Stream::cuda`, are defined beside it). Each `Stream` value made by a
/// constructor gets a process-unique id; clones share it.
#[derive(Clone)]
pub struct Stream {
    id: StreamId,
    device: Option<DevicePart>,
}

/// The device backend's part of a stream: opaque here, read back by the backend that
/// made it.
#[derive(Clone)]
struct DevicePart {
    /// What kind of stream it is, for `Debug` (for example `"cuda"`).
    kind: &'static str,
    handle: Arc<dyn Any + Send + Sync>,
}

impl Stream {
    fn fresh_id() -> StreamId {
        StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// A host stream (for the host backends).
    pub fn host() -> Self {
        Stream {
            id: Self::fresh_id(),
            device: None,
        }
    }

    /// A device stream with a fresh id, carrying `handle`: the device backend's own
    /// stream value, which only that backend reads back (with [`device`](Self::device)).
    /// `kind` names it in `Debug` (for example `"cuda"`). For a backend's constructors;
    /// the NCCL backend's is `Stream::cuda`.
    pub fn on_device<T: Any + Send + Sync>(kind: &'static str, handle: T) -> Self {
        Stream {
            id: Self::fresh_id(),
            device: Some(DevicePart {
                kind,
                handle: Arc::new(handle),
            }),
        }
    }

    /// The device backend's handle, if this is a device stream carrying a `T` (`None`
    /// for a host stream or another backend's).
    pub fn device<T: Any>(&self) -> Option<&T> {
        self.device.as_ref()?.handle.downcast_ref::<T>()
    }

    /// The id the allocator core tags blocks with.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// Whether this is a host stream.
    pub fn is_host(&self) -> bool {
        self.device.is_none()
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.device.as_ref().map_or("host", |d| d.kind);
        write!(f, "Stream({kind}, {})", self.id.0)
    }
}
