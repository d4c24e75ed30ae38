//! Host ranks whose streams report a CUDA graph's capture on demand: the capture
//! checks of the pool's registrations, tested without a GPU.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use symmpool::backend::StreamOps;
use symmpool::{Fence, Group, GroupConfig, HostBackend, HostConfig, Result, Stream, StreamId};

/// The value of the cell that makes every stream report capture (0: none; stream
/// ids start at 1).
pub const EVERY_STREAM: u64 = u64::MAX;

/// Stream operations that report the stream whose id is in `capturing` capturing
/// (every stream for [`EVERY_STREAM`]).
#[derive(Debug)]
struct Capturing {
    inner: Arc<dyn StreamOps>,
    capturing: Arc<AtomicU64>,
}

impl StreamOps for Capturing {
    fn new_stream(&self) -> Result<Stream> {
        self.inner.new_stream()
    }
    fn record_fence(&self, s: &Stream) -> Result<Fence> {
        self.inner.record_fence(s)
    }
    fn wait_fence(&self, s: &Stream, on: StreamId, f: Fence) -> Result<()> {
        self.inner.wait_fence(s, on, f)
    }
    fn completed_fence(&self, s: StreamId) -> Result<Option<Fence>> {
        self.inner.completed_fence(s)
    }
    fn is_capturing(&self, s: &Stream) -> Result<bool> {
        let c = self.capturing.load(Ordering::SeqCst);
        Ok(c == EVERY_STREAM || c == s.id().0 || self.inner.is_capturing(s)?)
    }
    fn drain(&self, deadline: symmpool::Deadline) -> Result<bool> {
        self.inner.drain(deadline)
    }
}

/// The groups of `world` host ranks (threads) with `config`, whose streams report
/// capture as the returned cell says (0 at first: none).
pub fn capturing_groups(world: usize, config: &GroupConfig) -> (Arc<AtomicU64>, Vec<Group>) {
    let capturing = Arc::new(AtomicU64::new(0));
    let backends = (HostBackend::world(HostConfig::new(world))
        .unwrap()
        .into_iter())
    .map(|b| {
        let capturing = capturing.clone();
        b.with_streams(move |inner| Arc::new(Capturing { inner, capturing }))
    })
    .collect();
    (capturing, Group::world(backends, config).unwrap())
}
