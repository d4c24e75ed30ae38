//! `check_invariants`: a full recount of the allocator's state, for tests and fuzzers.

use super::allocator::{Allocator, BlockUse};
use super::types::{SegmentId, SizeClass};
use std::collections::BTreeSet;

/// A broken invariant, naming what was found. Any of these is a bug in the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allocator invariant broken: {what} ({segment:?})")]
pub struct InvariantViolation {
    /// What is wrong.
    pub what: String,
    /// The segment concerned, if any.
    pub segment: Option<SegmentId>,
}

fn fail<T>(what: impl Into<String>, segment: Option<SegmentId>) -> Result<T, InvariantViolation> {
    Err(InvariantViolation {
        what: what.into(),
        segment,
    })
}

/// Return the [`InvariantViolation`] `what` (formatted) about `segment` unless `ok`.
macro_rules! ensure {
    ($ok:expr, $segment:expr, $($what:tt)+) => {
        if !$ok {
            return fail(format!($($what)+), $segment);
        }
    };
}

impl Allocator {
    /// Recount everything and compare with the allocator's own bookkeeping.
    ///
    /// Checks, per segment: blocks tile `[0, size)` in address order with consistent
    /// neighbour links, no overlap and no gap (so live + free = capacity); offsets and
    /// sizes are multiples of the minimum block size; no two free blocks are adjacent
    /// (free ranges are coalesced). Globally: the free index holds exactly the free
    /// blocks, each under its own size class; every slab slot belongs to exactly one
    /// segment; every statistic equals a recount; `num_allocs` is the number of
    /// sequence numbers handed out and `num_allocs - num_frees` that of live blocks.
    ///
    /// Cost: O(blocks · log blocks). Meant for tests, fuzzing and debugging, and for
    /// [`from_layout`](Self::from_layout)'s check of a layout's statistics.
    ///
    /// # Errors
    /// The first [`InvariantViolation`] found.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let unit = self.config.min_block_bytes;
        let mut seen_slots = BTreeSet::new();
        let mut expected_free = [BTreeSet::new(), BTreeSet::new()];
        let [mut allocated, mut requested, mut reserved, mut fenced] = [0u64; 4];
        let [mut nalloc, mut nfree] = [0u64; 2];
        // Per class: (segments, reserved, allocated).
        let mut by_class = [(0u64, 0u64, 0u64); 2];
        for (&id, seg) in &self.segments {
            let sid = Some(id);
            ensure!(
                seg.size != 0 && seg.size.is_multiple_of(self.config.granularity_bytes),
                sid,
                "segment size not a multiple of the granularity"
            );
            reserved += seg.size;
            let mut cur = Some(seg.first);
            let mut prev: Option<u32> = None;
            let mut offset = 0u64;
            let mut prev_free = false;
            let [mut live_bytes, mut free_bytes] = [0u64; 2];
            while let Some(slot) = cur {
                let Some(b) = self.blocks.get(slot as usize) else {
                    return fail(format!("link to empty slot {slot}"), sid);
                };
                ensure!(seen_slots.insert(slot), sid, "slot {slot} reached twice");
                ensure!(
                    b.segment == id && b.class == seg.class,
                    sid,
                    "slot {slot} names another segment or class"
                );
                ensure!(b.prev == prev, sid, "slot {slot} has a wrong prev link");
                let at = b.offset;
                ensure!(
                    at == offset,
                    sid,
                    "gap or overlap at offset {offset} (block at {at})"
                );
                ensure!(
                    b.size != 0 && b.size.is_multiple_of(unit) && at.is_multiple_of(unit),
                    sid,
                    "block at {at} not in whole units"
                );
                match &b.usage {
                    BlockUse::Free {
                        fences,
                        fenced: is_fenced,
                    } => {
                        ensure!(!prev_free, sid, "adjacent free blocks at {at}");
                        ensure!(
                            fences.windows(2).all(|w| w[0].stream < w[1].stream),
                            sid,
                            "fences not sorted by stream"
                        );
                        expected_free[seg.class.index()].insert((b.size, id, b.offset, slot));
                        free_bytes += b.size;
                        nfree += 1;
                        if *is_fenced {
                            fenced += b.size;
                        }
                        prev_free = true;
                    }
                    BlockUse::Allocated {
                        requested_bytes,
                        seq,
                        ..
                    } => {
                        ensure!(
                            (1..=b.size).contains(requested_bytes),
                            sid,
                            "requested bytes outside (0, block size]"
                        );
                        ensure!(
                            (1..self.next_seq).contains(seq),
                            sid,
                            "allocation sequence number out of range"
                        );
                        live_bytes += b.size;
                        requested += requested_bytes;
                        nalloc += 1;
                        prev_free = false;
                    }
                }
                let Some(next) = offset.checked_add(b.size) else {
                    return fail("offset overflow", sid);
                };
                offset = next;
                prev = Some(slot);
                cur = b.next;
            }
            ensure!(
                offset == seg.size && live_bytes + free_bytes == seg.size,
                sid,
                "blocks cover {offset} of {} bytes (live {live_bytes} + free {free_bytes})",
                seg.size
            );
            allocated += live_bytes;
            let c = &mut by_class[seg.class.index()];
            c.0 += 1;
            c.1 += seg.size;
            c.2 += live_bytes;
        }
        let n = self.blocks.len() - seen_slots.len();
        ensure!(n == 0, None, "{n} slab slots belong to no segment");
        for (class, expected) in expected_free.iter().enumerate() {
            let indexed = self.free[class].to_set().or_else(|what| fail(what, None))?;
            ensure!(
                indexed == *expected,
                None,
                "free index of class {class} differs from the free blocks"
            );
        }
        let s = &self.stats;
        let checks = [
            ("allocated_bytes", s.allocated_bytes.current, allocated),
            ("requested_bytes", s.requested_bytes.current, requested),
            ("reserved_bytes", s.reserved_bytes.current, reserved),
            ("active_bytes", s.active_bytes.current, allocated + fenced),
            ("fenced free bytes", self.fenced_free_bytes, fenced),
            ("segments", s.segments.current, self.segments.len() as u64),
            ("allocated_blocks", s.allocated_blocks.current, nalloc),
            ("free_blocks", s.free_blocks, nfree),
        ];
        let checks = checks
            .into_iter()
            .map(|(name, have, want)| (format!("stat {name}"), have, want));
        let class_checks = [SizeClass::Small, SizeClass::Large]
            .into_iter()
            .flat_map(|class| {
                let (c, (segments, reserved, allocated)) =
                    (s.class(class), by_class[class.index()]);
                [
                    ("segments", c.segments.current, segments),
                    ("reserved_bytes", c.reserved_bytes.current, reserved),
                    (
                        "allocated bytes",
                        self.class_allocated_bytes(class),
                        allocated,
                    ),
                ]
                .map(|(name, have, want)| (format!("{class:?} {name}"), have, want))
            });
        for (name, have, want) in checks.chain(class_checks) {
            ensure!(have == want, None, "{name} is {have}, recount {want}");
        }
        // A copy of the statistics, read through the one list of their gauges.
        let mut gauges = *s;
        for (name, stat) in gauges.gauges_mut() {
            ensure!(
                stat.peak >= stat.current,
                None,
                "peak of {name} below current"
            );
        }
        ensure!(
            s.num_allocs.checked_sub(s.num_frees) == Some(nalloc),
            None,
            "allocs - frees differs from live blocks"
        );
        ensure!(
            s.num_allocs.checked_add(1) == Some(self.next_seq),
            None,
            "allocs + 1 differs from the next sequence number"
        );
        Ok(())
    }
}

#[cfg(test)]
#[path = "../../tests/unit/core/invariants.rs"]
mod tests;
