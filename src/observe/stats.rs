//! The flat statistics map of [`SymmPool::memory_stats`](crate::SymmPool::memory_stats).

use super::snapshot::{BlockStatus, SegmentView};
use crate::backend::CommInfo;
use crate::core::{CoreStats, SizeClass};
use crate::pool::{Counters, MemoryStats, PoolCounters, StatValue, role_name};
use std::sync::atomic::Ordering::Relaxed;

/// Per size class (`all`, `small_pool`, `large_pool`), counted from the blocks.
#[derive(Default, Clone, Copy)]
struct ClassCount {
    allocated_bytes: u64,
    requested_bytes: u64,
    reserved_bytes: u64,
    active_bytes: u64,
    inactive_split_bytes: u64,
    segments: u64,
    allocations: u64,
    active: u64,
    inactive_split: u64,
}

fn count(segments: &[SegmentView], class: Option<SizeClass>) -> ClassCount {
    let mut c = ClassCount::default();
    for s in segments
        .iter()
        .filter(|s| class.is_none_or(|k| s.class == k))
    {
        c.segments += 1;
        c.reserved_bytes += s.size_bytes;
        let split = s.blocks.len() > 1;
        for b in &s.blocks {
            match b.state {
                BlockStatus::Allocated => {
                    c.allocated_bytes += b.size_bytes;
                    c.requested_bytes += b.requested_bytes;
                    c.allocations += 1;
                    c.active_bytes += b.size_bytes;
                    c.active += 1;
                }
                BlockStatus::FreeFenced => {
                    c.active_bytes += b.size_bytes;
                    c.active += 1;
                }
                BlockStatus::Free => {}
            }
            if b.state != BlockStatus::Allocated && split {
                c.inactive_split_bytes += b.size_bytes;
                c.inactive_split += 1;
            }
        }
    }
    c
}

/// The flat map, from the core's statistics, the pool's counters and call count
/// (`totals`, `calls`, read under its lock), its segments, the windows its segment
/// entries hold per communicator (with a segment the core let go of whose release
/// timed out), and its lock-free counters.
pub(crate) fn build_stats(
    core: &CoreStats,
    (totals, calls): (&Counters, u64),
    segments: &[SegmentView],
    windows: &[u64],
    comms: &[CommInfo],
    counters: &PoolCounters,
) -> MemoryStats {
    let mut m = MemoryStats::new();
    let mut put = |k: String, v: u64| {
        m.insert(k, StatValue::Count(v));
    };
    // Gauges with peaks and cumulative totals, PyTorch style.
    for (name, s, total) in [
        (
            "allocated_bytes",
            core.allocated_bytes,
            totals.allocated_bytes_total,
        ),
        (
            "requested_bytes",
            core.requested_bytes,
            totals.requested_bytes_total,
        ),
        (
            "reserved_bytes",
            core.reserved_bytes,
            totals.reserved_bytes_total,
        ),
        ("segment", core.segments, core.num_growths),
        ("allocation", core.allocated_blocks, core.num_allocs),
    ] {
        put(format!("{name}.all.current"), s.current);
        put(format!("{name}.all.peak"), s.peak);
        put(format!("{name}.all.allocated"), total);
        put(format!("{name}.all.freed"), total.saturating_sub(s.current));
    }
    put("active_bytes.all.current".into(), core.active_bytes.current);
    put("active_bytes.all.peak".into(), core.active_bytes.peak);
    let all = count(segments, None);
    put("active.all.current".into(), all.active);
    put("inactive_split.all.current".into(), all.inactive_split);
    put(
        "inactive_split_bytes.all.current".into(),
        all.inactive_split_bytes,
    );
    for (pool, class) in [
        ("small_pool", SizeClass::Small),
        ("large_pool", SizeClass::Large),
    ] {
        let c = count(segments, Some(class));
        for (name, v) in [
            ("allocated_bytes", c.allocated_bytes),
            ("requested_bytes", c.requested_bytes),
            ("reserved_bytes", c.reserved_bytes),
            ("active_bytes", c.active_bytes),
            ("inactive_split_bytes", c.inactive_split_bytes),
            ("segment", c.segments),
            ("allocation", c.allocations),
            ("active", c.active),
            ("inactive_split", c.inactive_split),
        ] {
            put(format!("{name}.{pool}.current"), v);
        }
    }
    // PyTorch's meaning: failed device allocations followed by a cache flush and a
    // retry. The pool never flushes its cache to retry a growth, so it is 0; the
    // allocations that missed the cache (and grew the pool, or failed) are
    // `num_cache_misses`.
    put("num_alloc_retries".into(), 0);
    put("num_cache_misses".into(), core.num_misses);
    put("num_ooms".into(), counters.ooms.load(Relaxed));
    put("num_device_alloc".into(), core.num_growths);
    put("num_device_free".into(), core.num_releases);
    put("num_splits".into(), core.num_splits);
    put("num_merges".into(), core.num_merges);
    put("num_stream_waits".into(), core.num_waits);
    put(
        "deferred_frees".into(),
        counters.deferred_frees.load(Relaxed),
    );
    put("agreements".into(), totals.agreements);
    put("calls".into(), calls);
    // Per communicator role (communicators of one role add up).
    for (c, info) in comms.iter().enumerate() {
        let role = role_name(info.role);
        let at = |counts: &[u64]| counts.get(c).copied().unwrap_or(0);
        for (name, v) in [
            ("registrations", at(&totals.registrations)),
            ("deregistrations", at(&totals.deregistrations)),
            ("windows", at(windows)),
        ] {
            let slot = m
                .entry(format!("{name}.{role}"))
                .or_insert(StatValue::Count(0));
            if let StatValue::Count(x) = slot {
                *x += v;
            }
        }
    }
    m.insert(
        "growth_seconds".into(),
        StatValue::Real(totals.growth_time.as_secs_f64()),
    );
    m
}
