//! An allocator's [`Layout`]: everything its next placement decisions depend on, to
//! hand to a rank that joins a grown group.
//!
//! After a rank was lost and the survivors shrank, a replacement rank joins with the
//! survivors' layout ([`Allocator::layout`] on any of them: they are identical) and
//! builds its allocator with [`Allocator::from_layout`]. Fed the same calls from then
//! on, it makes the survivors' decisions: the same segment, offset, size and sequence
//! number for every block, the same growth requests and the same fit plans.
//!
//! What placement reads, all in the layout: the segments (id, class, size, whether
//! dedicated), their blocks in address order (the free ones are the free index), the
//! live blocks' sequence numbers (against `window_seq`, in
//! [`plan_fit_to_peak`](Allocator::plan_fit_to_peak)), `next_segment`, `next_seq`
//! and the statistics (growth checks `reserved_bytes` against the limit, the
//! registered policy sizes chunks from a class's reserved bytes, fit plans read the
//! peaks). The live blocks' requested bytes come along for the `requested_bytes`
//! statistic.
//!
//! Left out, as per rank and never read by placement: streams (a newcomer's live blocks
//! are on the stream it names, with no other streams recorded), and fences with their
//! completion (the free blocks' fences and `fenced` flags, the completed fences): they
//! decide only the waits that allocations return and the `active_bytes` statistic. A
//! newcomer's memory has no pending work, so its free blocks carry no fences and its
//! `active_bytes` is its `allocated_bytes`; its waits, `num_waits` and `active_bytes`
//! then differ from the survivors', its placements do not. Slab slots are per rank as
//! well: a newcomer's [`BlockId`](super::BlockId)s have the survivors' `seq`, not
//! their `slot`.

use super::allocator::{BlockUse, Fences};
use super::types::{Growth, SegmentId, SizeClass, StreamId};
use super::{AllocError, Allocator, CoreConfig, CoreStats};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::BTreeSet;

/// What an allocator's placement decisions depend on, and nothing per rank (see the
/// module documentation, `src/core/layout.rs`): [`Allocator::layout`] takes it,
/// [`Allocator::from_layout`] rebuilds an allocator that decides the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Every segment, in ascending id order.
    pub segments: Vec<SegmentLayout>,
    /// The id the next added segment gets (above every segment's).
    pub next_segment: SegmentId,
    /// The sequence number of the next allocation (above every live block's).
    pub next_seq: u64,
    /// `next_seq` at the last [`reset_peak`](Allocator::reset_peak) (1 before any):
    /// [`plan_fit_to_peak`](Allocator::plan_fit_to_peak) counts the live blocks with
    /// a smaller sequence number as allocated before its window.
    pub window_seq: u64,
    /// The statistics, peaks and counters included (fit plans read the peaks).
    pub stats: CoreStats,
}

/// One segment of a [`Layout`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentLayout {
    /// The segment.
    pub id: SegmentId,
    /// Its size class.
    pub class: SizeClass,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Made for one large request: serves only requests of at least
    /// 1/`dedicated_reuse_ratio` of its size.
    pub dedicated: bool,
    /// Blocks tiling `[0, size_bytes)`, in address order.
    pub blocks: Vec<BlockLayout>,
}

/// One block of a [`SegmentLayout`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    /// Offset from the segment's start, in bytes.
    pub offset_bytes: u64,
    /// Block size in bytes.
    pub size_bytes: u64,
    /// The allocation of a live block; `None` for a free one.
    pub live: Option<LiveBlock>,
}

/// The allocation a live block of a [`Layout`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveBlock {
    /// Its sequence number ([`BlockId::seq`](super::BlockId::seq)).
    pub seq: u64,
    /// Bytes the caller asked for (before rounding).
    pub requested_bytes: u64,
}

const TILING: &str = "blocks not tiling their segment in non-zero multiples of min_block_bytes";

impl Allocator {
    /// The allocator's [`Layout`]: what its placement decisions depend on, for a rank
    /// joining a grown group ([`from_layout`](Self::from_layout)). O(blocks).
    pub fn layout(&self) -> Layout {
        let segments = self.segments.iter().map(|(&id, seg)| SegmentLayout {
            id,
            class: seg.class,
            size_bytes: seg.size,
            dedicated: seg.dedicated,
            blocks: self
                .blocks_of(seg)
                .map(|b| BlockLayout {
                    offset_bytes: b.offset,
                    size_bytes: b.size,
                    live: match b.usage {
                        BlockUse::Allocated {
                            seq,
                            requested_bytes,
                            ..
                        } => Some(LiveBlock {
                            seq,
                            requested_bytes,
                        }),
                        BlockUse::Free { .. } => None,
                    },
                })
                .collect(),
        });
        Layout {
            segments: segments.collect(),
            next_segment: self.next_segment_id(),
            next_seq: self.next_seq,
            window_seq: self.window_seq,
            stats: self.stats,
        }
    }

    /// The allocator a rank joining a grown group starts from: `layout` (the
    /// survivors') under `config` (the survivors' too). Its live blocks are allocated on
    /// `stream`, with no other streams: they belong to buffers only the survivors hold.
    /// Its free blocks carry no fences, so `active_bytes` is `allocated_bytes` (the
    /// layout's peak kept); every other statistic, peaks and counters included, is the
    /// layout's. O(blocks · log blocks).
    ///
    /// # Errors
    /// - [`AllocError::Config`] if `config` fails [`CoreConfig::validate`];
    /// - [`AllocError::BadSegmentSize`], [`AllocError::OutOfMemory`] for a segment
    ///   [`add_segment`](Self::add_segment) would refuse under `config`;
    /// - [`AllocError::BadLayout`] naming the first rule broken: segment ids ascending
    ///   and below `next_segment`; `dedicated` only where `add_segment` would dedicate;
    ///   blocks tiling their segment in non-zero multiples of `min_block_bytes`; no two
    ///   adjacent free blocks; a live block's requested bytes, rounded, within the block
    ///   and of the segment's class; live blocks' sequence numbers distinct, in
    ///   `[1, next_seq)`; `window_seq` in `[1, next_seq]`; statistics that agree with
    ///   [`check_invariants`](Self::check_invariants) (current values as recounted from
    ///   the blocks, `active_bytes` aside; no peak below its current value;
    ///   `num_allocs + 1 = next_seq`; `num_allocs - num_frees` live blocks).
    pub fn from_layout(
        config: CoreConfig,
        layout: &Layout,
        stream: StreamId,
    ) -> Result<Self, AllocError> {
        let mut core = Allocator::new(config)?;
        let bad = |what| Err(AllocError::BadLayout(what));
        if !(1..=layout.next_seq).contains(&layout.window_seq) {
            return bad("window_seq outside [1, next_seq]");
        }
        let mut seqs = BTreeSet::new();
        for seg in &layout.segments {
            if seg.id.0 < core.next_segment || seg.id >= layout.next_segment {
                return bad("segment ids not ascending below next_segment");
            }
            let growth = Growth {
                class: seg.class,
                segment_bytes: seg.size_bytes,
            };
            if seg.dedicated && !core.dedicates(growth) {
                return bad("a dedicated segment that add_segment would not dedicate");
            }
            core.next_segment = seg.id.0;
            core.insert_segment(growth, seg.dedicated)?;
            // Cut the segment's one free block (out of the index) block by block.
            let first = core.segments[&seg.id].first;
            core.remove_free(first, seg.class);
            let mut rest = Some(first);
            let mut prev_free = false;
            for b in &seg.blocks {
                let size = b.size_bytes;
                let Some(slot) = rest else {
                    return bad(TILING);
                };
                let cur = &core.blocks[slot as usize];
                if cur.offset != b.offset_bytes
                    || size == 0
                    || size > cur.size
                    || !size.is_multiple_of(config.min_block_bytes)
                {
                    return bad(TILING);
                }
                rest = (size < cur.size)
                    .then(|| core.split_off_tail(slot, size, &Fences::new(), false));
                match b.live {
                    None if prev_free => return bad("two adjacent free blocks"),
                    None => core.insert_free(slot, seg.class),
                    Some(LiveBlock {
                        seq,
                        requested_bytes,
                    }) => {
                        let rounded = config.round_request(requested_bytes).ok();
                        if rounded.filter(|&r| r <= size).map(|r| config.class_of(r))
                            != Some(seg.class)
                        {
                            return bad(
                                "a live block's requested bytes outside the block or its segment's class",
                            );
                        }
                        if !(1..layout.next_seq).contains(&seq) || !seqs.insert(seq) {
                            return bad(
                                "live blocks' sequence numbers not distinct in [1, next_seq)",
                            );
                        }
                        core.blocks[slot as usize].usage = BlockUse::Allocated {
                            seq,
                            requested_bytes,
                            stream,
                            others: SmallVec::new(),
                        };
                    }
                }
                prev_free = b.live.is_none();
            }
            if rest.is_some() {
                return bad(TILING);
            }
        }
        core.next_segment = layout.next_segment.0;
        core.next_seq = layout.next_seq;
        core.window_seq = layout.window_seq;
        core.stats = layout.stats;
        core.stats.active_bytes.current = layout.stats.allocated_bytes.current;
        (core.check_invariants().map(|()| core))
            .or(bad("statistics disagreeing with the blocks or next_seq"))
    }
}

#[cfg(test)]
#[path = "../../tests/unit/core/layout.rs"]
mod tests;
