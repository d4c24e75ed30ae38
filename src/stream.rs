//! Streams, as the pool sees them.

use crate::core::StreamId;
use parking_lot::Mutex;
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// What names one device stream: its kind and two words its backend derives from it
/// (for CUDA, the context and the raw stream handle).
type StreamKey = (&'static str, usize, usize);

/// The id of a device stream, while any wrapper made for it lives.
struct Known {
    id: StreamId,
    /// The device values wrapped under this key (weakly; usually one).
    wrappers: Vec<Weak<dyn Any + Send + Sync>>,
}

impl Known {
    fn alive(&self) -> bool {
        self.wrappers.iter().any(|w| w.strong_count() > 0)
    }
}

/// Device streams by key, one id per stream however often it is wrapped. An entry whose
/// wrappers are all gone is dead ([`Stream::on_device`]), gone when a stream is added.
static KNOWN: Mutex<BTreeMap<StreamKey, Known>> = Mutex::new(BTreeMap::new());

/// A stream of device work that buffers are allocated on and collectives run on.
///
/// Cheap to clone (clones share the id). On the host backends a stream is only a tag
/// (host work is synchronous): each [`Stream::host`] gets a process-unique id. On a
/// device backend it also carries that backend's stream handle (the NCCL backend's
/// constructors and accessors, such as `Stream::cuda`, are defined beside it), and its
/// id names the device stream: wrapping one device stream twice gives the same id.
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

    /// A device stream carrying `stream`, the device backend's own stream value, which
    /// only that backend reads back (as `Arc<S>`, with [`device`](Self::device)); `kind`
    /// names it in `Debug` (for example `"cuda"`). For a backend's constructors.
    ///
    /// `key` names the device stream within `kind` (for CUDA: the context and the raw
    /// handle): while any value wrapped under a key lives, every wrapping under that
    /// key gets the same [`id`](Self::id). So the value must hold its stream alive (a
    /// borrowed one must by its contract outlive its wrappers); a handle destroyed and
    /// reused for a new stream then finds no live wrapper, and gets a new id. `None`
    /// (no single stream, such as CUDA's per-thread default stream) gives a fresh id.
    pub fn on_device<S: Any + Send + Sync>(
        kind: &'static str,
        key: Option<(usize, usize)>,
        stream: Arc<S>,
    ) -> Self {
        let wrapped: Weak<S> = Arc::downgrade(&stream);
        let wrapped: Weak<dyn Any + Send + Sync> = wrapped;
        let id = match key {
            Some((a, b)) => Self::id_for((kind, a, b), wrapped),
            None => Self::fresh_id(),
        };
        Self::with_handle(id, kind, stream)
    }

    fn with_handle<S: Any + Send + Sync>(id: StreamId, kind: &'static str, stream: Arc<S>) -> Self {
        Stream {
            id,
            device: Some(DevicePart {
                kind,
                handle: Arc::new(stream),
            }),
        }
    }

    /// The id of the stream named `key`, noting `wrapped` as one more of its wrappers.
    fn id_for(key: StreamKey, wrapped: Weak<dyn Any + Send + Sync>) -> StreamId {
        let mut known = KNOWN.lock();
        if let Some(k) = known.get_mut(&key) {
            k.wrappers.retain(|w| w.strong_count() > 0);
            if !k.wrappers.is_empty() {
                if !k.wrappers.iter().any(|w| w.ptr_eq(&wrapped)) {
                    k.wrappers.push(wrapped);
                }
                return k.id;
            }
        }
        known.retain(|_, k| k.alive());
        let id = Self::fresh_id();
        known.insert(
            key,
            Known {
                id,
                wrappers: vec![wrapped],
            },
        );
        id
    }

    /// The id of the device stream named `key`, if a value wrapped under it lives.
    #[cfg(test)]
    pub(crate) fn known_id(kind: &'static str, key: (usize, usize)) -> Option<StreamId> {
        let known = KNOWN.lock();
        let k = known.get(&(kind, key.0, key.1))?;
        k.alive().then_some(k.id)
    }

    /// A stream for the device stream named `key`, made from a live value wrapped
    /// under it (`None` if none lives, or it is not an `S`).
    #[cfg(any(feature = "nccl", test))]
    pub(crate) fn find<S: Any + Send + Sync>(
        kind: &'static str,
        key: (usize, usize),
    ) -> Option<Stream> {
        let known = KNOWN.lock();
        let k = known.get(&(kind, key.0, key.1))?;
        let handle = k.wrappers.iter().find_map(Weak::upgrade)?;
        Some(Self::with_handle(k.id, kind, handle.downcast::<S>().ok()?))
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

#[cfg(test)]
#[path = "../tests/unit/stream.rs"]
mod tests;
