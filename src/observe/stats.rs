//! The flat statistics map of [`SymmPool::memory_stats`](crate::SymmPool::memory_stats).

use super::snapshot::{BlockStatus, SegmentView};
use crate::backend::CommInfo;
use crate::core::{CoreStats, SizeClass};
use crate::pool::{Counters, MemoryStats, PoolCounters, StatValue, role_name};
use std::sync::atomic::Ordering::Relaxed;

/// The figures of one size class (`None`: every class) counted from the blocks,
/// each with the name of its key; the three that the map has for every class too
/// (`active`, `inactive_split`, `inactive_split_bytes`) last.
fn count(segments: &[SegmentView], class: Option<SizeClass>) -> [(&'static str, u64); 9] {
    let [mut allocated_bytes, mut requested_bytes, mut reserved_bytes] = [0; 3];
    let [mut active_bytes, mut segment, mut allocation] = [0; 3];
    let [mut active, mut inactive_split, mut inactive_split_bytes] = [0; 3];
    for s in segments
        .iter()
        .filter(|s| class.is_none_or(|k| s.class == k))
    {
        segment += 1;
        reserved_bytes += s.size_bytes;
        let split = s.blocks.len() > 1;
        for b in &s.blocks {
            match b.state {
                BlockStatus::Allocated => {
                    allocated_bytes += b.size_bytes;
                    requested_bytes += b.requested_bytes;
                    allocation += 1;
                    active_bytes += b.size_bytes;
                    active += 1;
                }
                BlockStatus::FreeFenced => {
                    active_bytes += b.size_bytes;
                    active += 1;
                }
                BlockStatus::Free => {}
            }
            if b.state != BlockStatus::Allocated && split {
                inactive_split_bytes += b.size_bytes;
                inactive_split += 1;
            }
        }
    }
    [
        ("allocated_bytes", allocated_bytes),
        ("requested_bytes", requested_bytes),
        ("reserved_bytes", reserved_bytes),
        ("active_bytes", active_bytes),
        ("segment", segment),
        ("allocation", allocation),
        ("active", active),
        ("inactive_split", inactive_split),
        ("inactive_split_bytes", inactive_split_bytes),
    ]
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
    for (name, v) in &count(segments, None)[6..] {
        put(format!("{name}.all.current"), *v);
    }
    for (pool, class) in [
        ("small_pool", SizeClass::Small),
        ("large_pool", SizeClass::Large),
    ] {
        for (name, v) in count(segments, Some(class)) {
            put(format!("{name}.{pool}.current"), v);
        }
    }
    for (key, v) in [
        // PyTorch's meaning: failed device allocations followed by a cache flush and
        // a retry. The pool never flushes its cache to retry a growth, so it is 0;
        // the allocations that missed the cache (and grew the pool, or failed) are
        // `num_cache_misses`.
        ("num_alloc_retries", 0),
        ("num_cache_misses", core.num_misses),
        ("num_ooms", counters.ooms.load(Relaxed)),
        ("num_device_alloc", core.num_growths),
        ("num_device_free", core.num_releases),
        ("num_splits", core.num_splits),
        ("num_merges", core.num_merges),
        ("num_stream_waits", core.num_waits),
        ("deferred_frees", counters.deferred_frees.load(Relaxed)),
        ("agreements", totals.agreements),
        ("calls", calls),
        ("active_bytes.all.current", core.active_bytes.current),
        ("active_bytes.all.peak", core.active_bytes.peak),
    ] {
        put(key.into(), v);
    }
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
