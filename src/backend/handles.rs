//! The owned handles a provider hands out: [`Segment`] (with its [`SegmentMemory`]),
//! [`Window`], the byte [`Region`] of a segment, and [`Refused`] for a release that
//! gave the handle back.

use crate::error::{Error, Result};
use std::any::Any;
use std::fmt;

/// The memory behind a [`Segment`], as a provider made it.
pub trait SegmentMemory: Send + Sync + fmt::Debug + Any {
    /// Size in bytes: a non-zero multiple of the backend's granularity, constant for
    /// the memory's life ([`Segment::new`] reads it once).
    fn size_bytes(&self) -> u64;
    /// The device address of the first byte (NCCL), `None` for host memory.
    fn device_ptr(&self) -> Option<u64>;
}

/// An owned segment: one whole allocation of a provider (one `ncclMemAlloc`), at
/// least one granularity long.
///
/// The pool's segment entry is its single owner. Give it back with the provider's
/// [`free`](super::SegmentProvider::free); dropping it instead leaks device memory on
/// purpose (host memory is released), which is what a pool does when its device
/// cannot drain in time.
#[derive(Debug)]
pub struct Segment {
    /// Shared only between a pool and the pool a shrink makes of it (the same memory,
    /// registered on the new communicators): see [`share`](Self::share).
    memory: std::sync::Arc<dyn SegmentMemory>,
    /// `memory.size_bytes()`, read once: every collective call checks its regions.
    size_bytes: u64,
}

impl Segment {
    /// Wrap a provider's memory.
    pub fn new(memory: Box<dyn SegmentMemory>) -> Self {
        Segment {
            size_bytes: memory.size_bytes(),
            memory: memory.into(),
        }
    }

    /// The same memory, for the pool that a shrink makes of this segment's pool: the
    /// two entries then hold it together, and it may be freed only once the other
    /// holder is gone ([`is_shared`](Self::is_shared)).
    pub(crate) fn share(&self) -> Segment {
        Segment {
            memory: self.memory.clone(),
            ..*self
        }
    }

    /// Whether another [`Segment`] holds the same memory (the pool a shrink made and
    /// a buffer of the pool before it): a provider must not free it then.
    pub fn is_shared(&self) -> bool {
        std::sync::Arc::strong_count(&self.memory) > 1
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The device address of the first byte, `None` for host memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.memory.device_ptr()
    }

    /// The provider's memory, as its own type.
    pub fn memory<T: SegmentMemory>(&self) -> Option<&T> {
        (&*self.memory as &dyn Any).downcast_ref::<T>()
    }

    /// The `len_bytes` bytes at `offset_bytes`, checked against the segment.
    ///
    /// # Errors
    /// [`Error::BadView`] if the range leaves the segment.
    #[inline]
    pub fn region(&self, offset_bytes: u64, len_bytes: u64) -> Result<Region<'_>> {
        within(offset_bytes, len_bytes, "segment", self.size_bytes)?;
        Ok(Region {
            segment: self,
            offset_bytes,
            len_bytes,
        })
    }
}

/// An owned window: one segment registered on one communicator
/// (`ncclCommWindowRegister(.., NCCL_WIN_COLL_SYMMETRIC)`). The pool's segment entry
/// owns it beside its segment; give it back with
/// [`deregister`](super::SegmentProvider::deregister) before the segment is freed.
#[derive(Debug)]
pub struct Window {
    comm: usize,
    ordinal: u64,
    handle: Box<dyn Any + Send + Sync>,
}

impl Window {
    /// A provider's window on communicator `comm`, its `ordinal`-th registration there
    /// (1-based), with the provider's own handle.
    pub fn new(comm: usize, ordinal: u64, handle: Box<dyn Any + Send + Sync>) -> Self {
        Window {
            comm,
            ordinal,
            handle,
        }
    }

    /// The communicator, an index into [`BackendInfo::communicators`](super::BackendInfo::communicators).
    pub fn comm(&self) -> usize {
        self.comm
    }

    /// Its position among the registrations on its communicator (1-based): NCCL pairs
    /// windows across ranks by this order.
    pub fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// The provider's handle, as its own type.
    pub fn handle<T: Any>(&self) -> Option<&T> {
        self.handle.downcast_ref::<T>()
    }

    /// Take the provider's handle out, as its own type (or the window back).
    ///
    /// # Errors
    /// The window, unchanged, if the handle is of another type.
    pub fn into_handle<T: Any>(self) -> std::result::Result<Box<T>, Window> {
        (self.handle.downcast::<T>()).map_err(|handle| Window { handle, ..self })
    }
}

/// A release a provider could not do: the handle comes back with the reason, so the
/// caller can try again later instead of losing track of the memory.
#[derive(Debug)]
pub struct Refused<T> {
    /// The handle, still owned.
    pub handle: T,
    /// Why.
    pub error: Error,
}

/// A byte range of a segment. Made only through [`Segment::region`], so it always lies
/// inside its segment.
#[derive(Debug, Clone, Copy)]
pub struct Region<'a> {
    segment: &'a Segment,
    offset_bytes: u64,
    pub(super) len_bytes: u64,
}

impl<'a> Region<'a> {
    /// The segment.
    pub fn segment(&self) -> &'a Segment {
        self.segment
    }

    /// Offset from the segment start, in bytes.
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The device address of the first byte (NCCL), `None` for host memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.segment.device_ptr().map(|p| p + self.offset_bytes)
    }

    /// The `len_bytes` bytes that start `offset_bytes` into this region.
    ///
    /// # Errors
    /// [`Error::BadView`] if they leave the region.
    #[inline]
    pub fn sub(&self, offset_bytes: u64, len_bytes: u64) -> Result<Region<'a>> {
        within(offset_bytes, len_bytes, "region", self.len_bytes)?;
        Ok(Region {
            segment: self.segment,
            offset_bytes: self.offset_bytes + offset_bytes,
            len_bytes,
        })
    }
}

/// Whether the `len_bytes` bytes at `offset_bytes` lie inside a `what` of `size_bytes`
/// bytes (every collective call checks its regions).
///
/// # Errors
/// [`Error::BadView`] if they leave it.
#[inline]
pub(super) fn within(offset_bytes: u64, len_bytes: u64, what: &str, size_bytes: u64) -> Result<()> {
    match offset_bytes.checked_add(len_bytes) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(outside(offset_bytes, len_bytes, what, size_bytes)),
    }
}

/// The error of a range that leaves a `what` of `size_bytes` (out of line: the checks
/// above run on every collective call).
#[cold]
#[inline(never)]
fn outside(offset_bytes: u64, len_bytes: u64, what: &str, size_bytes: u64) -> Error {
    Error::BadView(format!(
        "range {offset_bytes}+{len_bytes} outside a {what} of {size_bytes} bytes"
    ))
}
