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
    let what = what.into();
    Err(InvariantViolation { what, segment })
}

impl Allocator {
    /// Recount everything and compare with the allocator's own bookkeeping.
    ///
    /// Checks, per segment: blocks tile `[0, size)` in address order with consistent
    /// neighbour links, no overlap and no gap (so live + free = capacity); offsets and
    /// sizes are multiples of the minimum block size; no two free blocks are adjacent
    /// (free ranges are coalesced). Globally: the free index holds exactly the free
    /// blocks, each under its own size class; every slab slot belongs to exactly one
    /// segment; and every statistic equals a recount.
    ///
    /// Cost: O(blocks · log blocks). Meant for tests, fuzzing and debugging.
    ///
    /// # Errors
    /// The first [`InvariantViolation`] found.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let unit = self.config.min_block_bytes;
        let mut seen_slots = BTreeSet::new();
        let mut expected_free = [BTreeSet::new(), BTreeSet::new()];
        let (mut allocated, mut requested, mut reserved, mut fenced) = (0u64, 0u64, 0u64, 0u64);
        let (mut nalloc, mut nfree) = (0u64, 0u64);
        // Per class: (segments, reserved, allocated).
        let mut by_class = [(0u64, 0u64, 0u64); 2];
        for (&id, seg) in &self.segments {
            let sid = Some(id);
            if seg.size == 0 || !seg.size.is_multiple_of(self.config.granularity_bytes) {
                return fail("segment size not a multiple of the granularity", sid);
            }
            reserved += seg.size;
            let mut cur = Some(seg.first);
            let mut prev: Option<u32> = None;
            let mut offset = 0u64;
            let mut prev_free = false;
            let (mut live_bytes, mut free_bytes) = (0u64, 0u64);
            while let Some(slot) = cur {
                let Some(b) = self.blocks.get(slot as usize) else {
                    return fail(format!("link to empty slot {slot}"), sid);
                };
                if !seen_slots.insert(slot) {
                    return fail(format!("slot {slot} reached twice"), sid);
                }
                if b.segment != id || b.class != seg.class {
                    return fail(format!("slot {slot} names another segment or class"), sid);
                }
                if b.prev != prev {
                    return fail(format!("slot {slot} has a wrong prev link"), sid);
                }
                if b.offset != offset {
                    let what = format!("gap or overlap at offset {offset} (block at {})", b.offset);
                    return fail(what, sid);
                }
                if b.size == 0 || !b.size.is_multiple_of(unit) || !b.offset.is_multiple_of(unit) {
                    return fail(format!("block at {} not in whole units", b.offset), sid);
                }
                match &b.usage {
                    BlockUse::Free {
                        fences,
                        fenced: is_fenced,
                    } => {
                        if prev_free {
                            return fail(format!("adjacent free blocks at {}", b.offset), sid);
                        }
                        if !fences.windows(2).all(|w| w[0].stream < w[1].stream) {
                            return fail("fences not sorted by stream", sid);
                        }
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
                        if *requested_bytes == 0 || *requested_bytes > b.size {
                            return fail("requested bytes outside (0, block size]", sid);
                        }
                        if *seq == 0 || *seq >= self.next_seq {
                            return fail("allocation sequence number out of range", sid);
                        }
                        live_bytes += b.size;
                        requested += requested_bytes;
                        nalloc += 1;
                        prev_free = false;
                    }
                }
                offset = match offset.checked_add(b.size) {
                    Some(o) => o,
                    None => return fail("offset overflow", sid),
                };
                prev = Some(slot);
                cur = b.next;
            }
            if offset != seg.size || live_bytes + free_bytes != seg.size {
                let (size, live, free) = (seg.size, live_bytes, free_bytes);
                let what =
                    format!("blocks cover {offset} of {size} bytes (live {live} + free {free})");
                return fail(what, sid);
            }
            allocated += live_bytes;
            let c = &mut by_class[seg.class.index()];
            c.0 += 1;
            c.1 += seg.size;
            c.2 += live_bytes;
        }
        if seen_slots.len() != self.blocks.len() {
            let n = self.blocks.len() - seen_slots.len();
            return fail(format!("{n} slab slots belong to no segment"), None);
        }
        for (class, expected) in expected_free.iter().enumerate() {
            let indexed = match self.free[class].to_set() {
                Ok(set) => set,
                Err(what) => return fail(what, None),
            };
            if *expected != indexed {
                let what = format!("free index of class {class} differs from the free blocks");
                return fail(what, None);
            }
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
        let checks =
            (checks.into_iter()).map(|(name, have, want)| (format!("stat {name}"), have, want));
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
            if have != want {
                return fail(format!("{name} is {have}, recount {want}"), None);
            }
        }
        // A copy of the statistics, read through the one list of their gauges.
        let mut gauges = *s;
        for (name, stat) in gauges.gauges_mut() {
            if stat.peak < stat.current {
                return fail(format!("peak of {name} below current"), None);
            }
        }
        if s.num_allocs - s.num_frees != nalloc {
            return fail("allocs - frees differs from live blocks", None);
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "../../tests/unit/core/invariants.rs"]
mod tests;
