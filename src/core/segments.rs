//! Segments in and out of the allocator: growth (as asked for, shared, planned) and
//! release.

use super::Allocator;
use super::allocator::{Block, BlockUse, Fences, Segment};
use super::config::GrowthPolicy;
use super::error::AllocError;
use super::types::{Growth, SegmentId, SizeClass};

impl Allocator {
    /// Add a segment, as asked for by [`AllocError::NeedsGrowth`] (or to pre-grow).
    /// Its id is the next in sequence; it starts as one free block. Under
    /// [`GrowthPolicy::Caching`] a large segment larger than `large_segment_bytes` is
    /// dedicated; under [`GrowthPolicy::Registered`] every segment is shared.
    ///
    /// # Errors
    /// [`AllocError::BadSegmentSize`] unless the size is a non-zero multiple of the
    /// granularity (and, for a small segment, at least `small_request_max_bytes`);
    /// [`AllocError::OutOfMemory`] past `max_reserved_bytes`; [`AllocError::Exhausted`]
    /// after 2³² - 1 segments.
    pub fn add_segment(&mut self, growth: Growth) -> Result<SegmentId, AllocError> {
        self.insert_segment(growth, self.dedicates(growth))
    }

    /// Whether [`add_segment`](Self::add_segment) makes the segment of `growth`
    /// dedicated.
    pub(super) fn dedicates(&self, growth: Growth) -> bool {
        self.config.growth == GrowthPolicy::Caching
            && growth.class == SizeClass::Large
            && growth.segment_bytes > self.config.large_segment_bytes
    }

    /// Add a large segment of `size_bytes` that any large request may use (no
    /// dedicated-segment rule): what [`SymmPool::reserve`](crate::SymmPool::reserve)
    /// pre-grows.
    ///
    /// # Errors
    /// As [`add_segment`](Self::add_segment).
    pub fn add_shared_segment(&mut self, size_bytes: u64) -> Result<SegmentId, AllocError> {
        self.insert_segment(
            Growth {
                class: SizeClass::Large,
                segment_bytes: size_bytes,
            },
            false,
        )
    }

    /// The id the next added segment will get.
    pub fn next_segment_id(&self) -> SegmentId {
        SegmentId(self.next_segment)
    }

    pub(super) fn insert_segment(
        &mut self,
        growth: Growth,
        dedicated: bool,
    ) -> Result<SegmentId, AllocError> {
        let size = growth.segment_bytes;
        if size == 0
            || size > super::config::MAX_SEGMENT_BYTES
            || !size.is_multiple_of(self.config.granularity_bytes)
            || (growth.class == SizeClass::Small && size < self.config.small_request_max_bytes)
        {
            return Err(AllocError::BadSegmentSize { size_bytes: size });
        }
        self.check_reserve(size)?;
        if self.next_segment == u32::MAX || self.blocks.len() >= u32::MAX as usize {
            return Err(AllocError::Exhausted);
        }
        let id = SegmentId(self.next_segment);
        self.next_segment += 1;
        let slot = self.blocks.insert(Block {
            segment: id,
            class: growth.class,
            offset: 0,
            size,
            prev: None,
            next: None,
            usage: BlockUse::Free {
                fences: Fences::new(),
                fenced: false,
            },
        }) as u32;
        self.segments.insert(
            id,
            Segment {
                class: growth.class,
                size,
                first: slot,
                dedicated,
            },
        );
        self.insert_free(slot, growth.class);
        let s = &mut self.stats;
        s.reserved_bytes.add(size);
        s.segments.add(1);
        let c = s.class_mut(growth.class);
        c.reserved_bytes.add(size);
        c.segments.add(1);
        s.free_blocks += 1;
        s.num_growths += 1;
        Ok(id)
    }

    /// Remove every segment that is entirely free, in ascending id order, and return
    /// them with their sizes. The caller releases their memory.
    pub fn release_free_segments(&mut self) -> Vec<(SegmentId, u64)> {
        let empty: Vec<SegmentId> = self
            .segments
            .iter()
            .filter_map(|(id, seg)| self.entirely_free(seg).then_some(*id))
            .collect();
        empty
            .into_iter()
            .filter_map(|id| Some((id, self.release_segment(id).ok()?)))
            .collect()
    }

    /// Remove one entirely free segment and return its size in bytes.
    ///
    /// # Errors
    /// [`AllocError::UnknownSegment`] if the segment does not exist or is not entirely
    /// free. Nothing changes then.
    pub fn release_segment(&mut self, id: SegmentId) -> Result<u64, AllocError> {
        let releasable = self.segments.get(&id).filter(|s| self.entirely_free(s));
        let seg = releasable.cloned().ok_or(AllocError::UnknownSegment(id))?;
        self.segments.remove(&id);
        self.remove_free(seg.first, seg.class);
        self.blocks.remove(seg.first as usize);
        let s = &mut self.stats;
        s.reserved_bytes.sub(seg.size);
        s.segments.sub(1);
        let c = s.class_mut(seg.class);
        c.reserved_bytes.sub(seg.size);
        c.segments.sub(1);
        s.free_blocks -= 1;
        s.num_releases += 1;
        self.refresh_active();
        Ok(seg.size)
    }
}
