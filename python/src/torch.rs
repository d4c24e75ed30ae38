//! The snapshot and the allocation history in PyTorch's format: the dictionary
//! `torch.cuda.memory._snapshot()` returns, which PyTorch's memory viewer
//! (`pytorch.org/memory_viz`, `torch/cuda/_memory_viz.py`) reads once pickled.
//!
//! Built from the public types of `symmpool::observe` only
//! ([`SymmPool::memory_snapshot_with_history`](symmpool::SymmPool::memory_snapshot_with_history));
//! `python/tests/torch_snapshot.rs` includes this file to test it against PyTorch's
//! format.

use serde::{Deserialize, Serialize};
use symmpool::observe::{BlockStatus, MemoryAction, MemoryEvent, PoolSnapshot};
use symmpool::{SegmentId, SizeClass};

/// A stack frame. The crate records none (`frames` are empty lists); the type is there
/// so that the lists have PyTorch's element type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchFrame {
    /// Source file.
    pub filename: String,
    /// Line number.
    pub line: u64,
    /// Function name.
    pub name: String,
}

/// A block of a [`TorchSegment`] (PyTorch's `Block`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchBlock {
    /// Address: the segment's address plus the block's offset.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes the caller asked for (0 for free blocks).
    pub requested_size: u64,
    /// `active_allocated`, `active_awaiting_free` (free, with a fence not yet known
    /// complete) or `inactive`.
    pub state: String,
    /// Always empty.
    pub frames: Vec<TorchFrame>,
}

/// A segment (PyTorch's `Segment`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchSegment {
    /// The device index given to [`torch_snapshot`].
    pub device: u64,
    /// The segment's device address (NCCL backend), or a stand-in on the host
    /// backends: `(segment id + 1) · 2⁴⁴`, distinct for every segment of the pool.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Always 0: a segment serves every stream.
    pub stream: u64,
    /// `small` or `large`.
    pub segment_type: String,
    /// `(0, 0)`, PyTorch's id of its default pool (one pool per snapshot here).
    pub segment_pool_id: (u64, u64),
    /// Bytes of its allocated blocks.
    pub allocated_size: u64,
    /// Bytes of its allocated blocks and of free blocks awaiting a fence.
    pub active_size: u64,
    /// Bytes the callers asked for, over its allocated blocks.
    pub requested_size: u64,
    /// Always `false`.
    pub is_expandable: bool,
    /// Blocks tiling the segment in address order.
    pub blocks: Vec<TorchBlock>,
}

/// An entry of the allocation history (PyTorch's `TraceEntry`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchTraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc` or
    /// `segment_free` (a free of the pool is both `free_requested` and
    /// `free_completed`, one after the other).
    pub action: String,
    /// Address of the block or the segment.
    pub addr: u64,
    /// Bytes: the request for `alloc` and frees (as PyTorch records it), the segment's
    /// size for segment events.
    pub size: u64,
    /// The block's stream id (0 for segment events).
    pub stream: u64,
    /// Always empty.
    pub frames: Vec<TorchFrame>,
    /// Wall-clock time, in microseconds since the Unix epoch.
    pub time_us: u64,
}

/// The dictionary `torch.cuda.memory._snapshot()` returns, for one rank's pool: its
/// `segments` and, at the index of the device, the `device_traces` of the recorded
/// history. Serialise it to JSON and `pickle.dump` the loaded dictionary (the Python
/// package does that): PyTorch's memory viewer opens the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchSnapshot {
    /// Every segment, in id order.
    pub segments: Vec<TorchSegment>,
    /// One list per device index up to the snapshot's device; the snapshot's device's
    /// list holds the history, oldest first.
    pub device_traces: Vec<Vec<TorchTraceEntry>>,
}

/// The stand-in address of a segment that has no device address.
fn stand_in_address(id: SegmentId) -> u64 {
    (u64::from(id.0) + 1).saturating_mul(1 << 44)
}

fn class_name(class: SizeClass) -> &'static str {
    match class {
        SizeClass::Small => "small",
        SizeClass::Large => "large",
    }
}

/// The snapshot `snap` and the `history` in PyTorch's format (as
/// [`SymmPool::memory_snapshot_with_history`](symmpool::SymmPool::memory_snapshot_with_history)
/// returns them), reported as CUDA device `device` (the device the rank uses, at most
/// 127; PyTorch's viewer shows one device at a time). No stack frames are recorded.
/// O(blocks + history).
pub fn torch_snapshot(snap: &PoolSnapshot, history: &[MemoryEvent], device: u64) -> TorchSnapshot {
    let segments = snap
        .segments
        .iter()
        .map(|s| {
            let base = s.address.unwrap_or_else(|| stand_in_address(s.id));
            let mut seg = TorchSegment {
                device,
                address: base,
                total_size: s.size_bytes,
                stream: 0,
                segment_type: class_name(s.class).into(),
                segment_pool_id: (0, 0),
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                is_expandable: false,
                blocks: Vec::with_capacity(s.blocks.len()),
            };
            for b in &s.blocks {
                let state = match b.state {
                    BlockStatus::Allocated => {
                        seg.allocated_size += b.size_bytes;
                        seg.active_size += b.size_bytes;
                        seg.requested_size += b.requested_bytes;
                        "active_allocated"
                    }
                    BlockStatus::FreeFenced => {
                        seg.active_size += b.size_bytes;
                        "active_awaiting_free"
                    }
                    BlockStatus::Free => "inactive",
                };
                seg.blocks.push(TorchBlock {
                    address: base.saturating_add(b.offset_bytes),
                    size: b.size_bytes,
                    requested_size: b.requested_bytes,
                    state: state.into(),
                    frames: Vec::new(),
                });
            }
            seg
        })
        .collect();
    let mut trace = Vec::with_capacity(history.len());
    for e in history {
        let base = e
            .segment_address
            .unwrap_or_else(|| stand_in_address(e.segment));
        let entry = |action: &str, size: u64| TorchTraceEntry {
            action: action.into(),
            addr: base.saturating_add(e.offset_bytes),
            size,
            stream: e.stream.map_or(0, |s| s.0),
            frames: Vec::new(),
            time_us: e.time_us,
        };
        // PyTorch records the request's size for allocations and frees.
        let request = if e.requested_bytes > 0 {
            e.requested_bytes
        } else {
            e.size_bytes
        };
        match e.action {
            MemoryAction::Alloc => trace.push(entry("alloc", request)),
            MemoryAction::Free => {
                trace.push(entry("free_requested", request));
                trace.push(entry("free_completed", request));
            }
            MemoryAction::SegmentAlloc => trace.push(entry("segment_alloc", e.size_bytes)),
            MemoryAction::SegmentFree => trace.push(entry("segment_free", e.size_bytes)),
            // An event of a kind PyTorch's trace has no action for: left out.
            _ => {}
        }
    }
    // A CUDA device index (PyTorch's is an `int8_t`): a larger one lists the trace
    // under the last index PyTorch can have rather than allocating one list per index.
    let device_index = usize::try_from(device.min(MAX_DEVICE)).unwrap_or(0);
    let mut device_traces: Vec<Vec<TorchTraceEntry>> = vec![Vec::new(); device_index];
    device_traces.push(trace);
    TorchSnapshot {
        segments,
        device_traces,
    }
}

/// The largest device index an export lists a trace under (PyTorch's device index is
/// an `int8_t`).
const MAX_DEVICE: u64 = i8::MAX as u64;
