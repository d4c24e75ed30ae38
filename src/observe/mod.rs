//! Observability: `tracing` spans and events, flat statistics, snapshots and the
//! allocation history. This module only reads the pool (see docs/ARCHITECTURE.md):
//! the history's ring buffer and the statistics' value types live in the pool, and
//! are re-exported here.
//!
//! # Tracing
//!
//! The crate reports through [`tracing`](https://docs.rs/tracing) (and, through its
//! `log` feature, to a `log` logger when no tracing subscriber is installed). Targets
//! start with `symmpool`, so `RUST_LOG=symmpool=debug` with `tracing-subscriber`'s
//! `EnvFilter` shows the pool's life. Nothing is recorded on the cache-hit `alloc`
//! and the collective dispatch but `trace!`/`debug!` events, which cost a level check
//! when off (and reach tracing subscribers only, not the `log` fallback); spans exist
//! only on the slow, collective paths.
//!
//! | what | kind | level | fields |
//! |---|---|---|---|
//! | `growth` (an `alloc` that grows the pool) | span | info | `rank`, `pool`, `class`, `segment_bytes`, `seconds` |
//! | `reserve`, `trim`, `close` | span, and an event with the result or the error | info | `rank`, `pool`, `size_bytes` |
//! | `agreement` (one round among the ranks) | span | debug | `rank`, `during`, `size` |
//! | `ranks agreed` | event | debug | `rank`, `during`, `world`, `seconds` |
//! | `window registered` (per communicator) | event | info | `rank`, `comm`, `role`, `segment_bytes`, `seconds`, `window` |
//! | `segment allocated` | event | info | `rank`, `pool`, `segment`, `class`, `segment_bytes`, `windows`, `reserved_bytes` |
//! | `releasing segment` | event | info | `rank`, `segment`, `segment_bytes` |
//! | `alloc` (a cache hit or after growth) | event | trace | `rank`, `size_bytes`, `segment`, `offset_bytes`, `allocation` |
//! | `free deferred` / `deferred frees applied` | event | debug | `rank`, `allocation` / `count` |
//! | `collective` (path choice) | event | debug | `rank`, `pool`, `op`, `path`, `comm`, `bytes_per_rank` |
//! | `symmpool call failed` (before a public pool or collective call returns an error: the caller decides what it deserves) | event | debug | `rank`, `pool`, `op`, `error` |
//! | `collective check failed` (the ranks' collectives differ; also returned by the pools' calls) | event | warn | `divergence` |
//! | `pool broken` (a loss or a failure broke the pools' checks; returned by their calls) | event | debug | `reason` |
//! | `pool shrunk` ([`SymmPool::shrink`](crate::SymmPool::shrink)) | event | info | `pool`, `old_rank`, `rank`, `world_size`, `lost`, `seconds` |
//! | `POOL DROPPED WITHOUT close()` | event | warn (and standard error when neither `tracing` nor `log` is set up) | `rank`, `pool`, `segments`, `bytes` |
//! | `broken pool dropped (…)` (a broken pool, which cannot be closed) | event | warn (and standard error likewise) | `rank`, `pool`, `segments`, `bytes` |
//!
//! # Statistics
//!
//! [`SymmPool::memory_stats`](crate::SymmPool::memory_stats) returns a flat map
//! ([`MemoryStats`]), with the key names of PyTorch's `torch.cuda.memory_stats` where
//! they mean the same thing. Sizes are bytes; `STAT.all.*` covers both size classes,
//! `STAT.small_pool.current` / `STAT.large_pool.current` one each (requests up to
//! 1 MiB live in small segments, larger ones in large segments). `.current` is the
//! value now, `.peak` the largest since creation or
//! [`reset_peak`](crate::SymmPool::reset_peak), `.allocated` the cumulative
//! increase and `.freed` the cumulative decrease (`allocated - freed = current`).
//!
//! | key | meaning |
//! |---|---|
//! | `allocated_bytes.all.{current,peak,allocated,freed}` | bytes in allocated blocks (requests rounded up to 512 B) |
//! | `requested_bytes.all.{current,peak,allocated,freed}` | bytes the callers asked for |
//! | `reserved_bytes.all.{current,peak,allocated,freed}` | bytes in segments (device allocations, each registered as a window) |
//! | `active_bytes.all.{current,peak}` | allocated bytes plus free bytes device work may still use (fenced) |
//! | `inactive_split_bytes.all.current` | free bytes in segments that are split (not releasable by `trim`) |
//! | `segment.all.{current,peak,allocated,freed}` | segments |
//! | `allocation.all.{current,peak,allocated,freed}` | allocated blocks (live buffers) |
//! | `active.all.current` | allocated blocks plus fenced free blocks |
//! | `inactive_split.all.current` | free blocks in split segments |
//! | `{allocated_bytes,requested_bytes,reserved_bytes,active_bytes,inactive_split_bytes,segment,allocation,active,inactive_split}.{small_pool,large_pool}.current` | the same per size class |
//! | `num_cache_misses` | allocations that found no free block and grew the pool (or failed) |
//! | `num_alloc_retries` | as in PyTorch, failed device allocations followed by a cache flush and a retry: always 0 (the pool never flushes its cache to retry; a failed growth is an error) |
//! | `num_ooms` | allocations that failed for want of memory (pool limit, device, a peer) |
//! | `num_device_alloc`, `num_device_free` | segments allocated / released (growths, `reserve`; `trim`, `close`) |
//! | `num_splits`, `num_merges` | blocks split to serve a request / freed blocks merged with a neighbour |
//! | `num_stream_waits` | device-side waits enqueued for cross-stream reuse |
//! | `deferred_frees` | frees queued because the pool was busy (applied by the next call) |
//! | `registrations.ROLE`, `deregistrations.ROLE` | window registrations / deregistrations on the communicators of `ROLE` (`symmetric`, `copy_engine`, `plain`) |
//! | `windows.ROLE` | windows currently registered there |
//! | `collectives.PATH.count`, `collectives.PATH.bytes` | only in [`Coll::memory_stats`](crate::coll::Coll::memory_stats): collectives that ran on `PATH` (`copy_engine`, `symmetric_kernel`, `plain_kernel`) through the handle, and their bytes per rank (all-gather input, reduce-scatter output) |
//! | `agreements` | agreement rounds among the ranks (each round of a growth, reserve, trim, close, `fit_to_peak` or shrink) |
//! | `calls` | pool calls recorded in the call history (alloc, free, reserve, trim, close) |
//! | `growth_seconds` (real) | time spent allocating and registering segments |
//!
//! # Snapshots
//!
//! [`SymmPool::memory_snapshot`](crate::SymmPool::memory_snapshot) returns a
//! [`PoolSnapshot`]: every segment with its size class, device address and window per
//! communicator, every block with its allocation number, requested and rounded
//! size, stream and state ([`BlockStatus`]), and the statistics. It serialises with
//! serde (JSON, say) and loads back. The `memory_map` example (and the Python
//! package's `memory_map_svg`) draws one as a self-contained SVG, or every rank's side
//! by side with differing blocks outlined in red.
//!
//! ```
//! use symmpool::{PoolConfig, Stream, SymmPool};
//!
//! let pool = SymmPool::host_group(1, PoolConfig::default())?.remove(0);
//! let buf = pool.alloc(3 << 20, &Stream::host())?;
//! let stats = pool.memory_stats();
//! assert_eq!(stats["allocated_bytes.all.current"].as_u64(), Some(3 << 20));
//! let snapshot = pool.memory_snapshot();
//! assert_eq!(snapshot.segments[0].blocks[0].allocation_seq, Some(buf.allocation_seq()));
//! let json = serde_json::to_string(&snapshot).unwrap();
//! assert!(json.contains("allocation_seq"));
//! # drop(buf); pool.close()?;
//! # Ok::<(), symmpool::Error>(())
//! ```
//!
//! # History and PyTorch's memory viewer
//!
//! [`SymmPool::record_memory_history`](crate::SymmPool::record_memory_history) starts
//! PyTorch's `_record_memory_history(max_entries=…)`: a ring buffer of this rank's
//! allocation events ([`MemoryEvent`]), read with
//! [`memory_history`](crate::SymmPool::memory_history), or with the snapshot taken
//! under the same lock by
//! [`memory_snapshot_with_history`](crate::SymmPool::memory_snapshot_with_history).
//! The Python package's `torch_memory_snapshot()` exports that pair as the dictionary
//! `torch.cuda.memory._snapshot()` returns (`segments` with their `blocks`,
//! `device_traces`): pickled, `pytorch.org/memory_viz` opens it.
//! [`gather_memory_snapshots`](crate::SymmPool::gather_memory_snapshots) brings every
//! rank's snapshot to every rank in one collective call, to draw them side by side.

mod gather;
mod snapshot;
mod stats;

pub use crate::pool::{MemoryAction, MemoryEvent, MemoryStats, StatValue};
pub use snapshot::{BlockStatus, BlockView, PoolSnapshot, SegmentView, WindowView};
