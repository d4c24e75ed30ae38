//! The deterministic best-fit caching allocator.

use super::align::{align_up, is_pow2};
use super::config::CoreConfig;
use super::error::AllocError;
use super::free_index::FreeIndex;
use super::stats::{BlockSnapshot, BlockState, CoreStats, SegmentSnapshot, Snapshot};
use super::types::{AllocRequest, BlockId, Fence, Placement, SegmentId, SizeClass, StreamId, Wait};
use slab::Slab;
use smallvec::SmallVec;
use std::collections::BTreeMap;

/// Key of the ordered free index: best fit is the first key ≥ (size, 0, 0); ties are
/// broken by (segment, offset). The slab slot rides along and never decides order,
/// because (segment, offset) is unique.
pub(super) type FreeKey = (u64, SegmentId, u64, u32);

/// Released segments with their sizes in bytes.
pub(super) type Released = Vec<(SegmentId, u64)>;

/// Fences kept on a free block: at most one per stream (the latest), sorted by stream.
pub(super) type Fences = SmallVec<[Wait; 2]>;

/// The other streams a live block is used on.
type Others = SmallVec<[StreamId; 2]>;

#[derive(Debug, Clone)]
pub(super) enum BlockUse {
    Allocated {
        seq: u64,
        requested_bytes: u64,
        stream: StreamId,
        others: Others,
    },
    Free {
        fences: Fences,
        /// Carries a fence above the completion watermark of its stream.
        fenced: bool,
    },
}

#[derive(Debug, Clone)]
pub(super) struct Block {
    pub(super) segment: SegmentId,
    /// The class of the segment (kept here so that `free` needs no segment lookup).
    pub(super) class: SizeClass,
    pub(super) offset: u64,
    pub(super) size: u64,
    /// Slab slots of the address-order neighbours in the same segment.
    pub(super) prev: Option<u32>,
    pub(super) next: Option<u32>,
    pub(super) usage: BlockUse,
}

impl Block {
    pub(super) fn is_free(&self) -> bool {
        matches!(self.usage, BlockUse::Free { .. })
    }

    fn key(&self, slot: u32) -> FreeKey {
        (self.size, self.segment, self.offset, slot)
    }
}

#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub(super) class: SizeClass,
    pub(super) size: u64,
    /// Slot of the block at offset 0.
    pub(super) first: u32,
    /// Made for one large request: serves only requests of at least
    /// 1/`dedicated_reuse_ratio` of its size.
    pub(super) dedicated: bool,
}

/// The deterministic caching allocator: carves blocks out of segments given to it
/// (see the core's module documentation, `src/core/mod.rs`, for the algorithm).
///
/// It never allocates device memory. Every decision (which block, which offset, when
/// to grow and by how much) is a pure function of the sequence of calls made on it:
/// ordered containers only, ties broken by (segment, offset), no clocks, no hashing,
/// and fence completion ([`complete_fences`](Self::complete_fences)) only updates the
/// `active_bytes` statistic.
#[derive(Debug, Clone)]
pub struct Allocator {
    pub(super) config: CoreConfig,
    pub(super) blocks: Slab<Block>,
    pub(super) segments: BTreeMap<SegmentId, Segment>,
    pub(super) free: [FreeIndex; 2],
    pub(super) next_segment: u32,
    pub(super) next_seq: u64,
    pub(super) stats: CoreStats,
    /// Bytes of free blocks whose `fenced` flag is set.
    pub(super) fenced_free_bytes: u64,
    /// Largest fence reported complete, per stream.
    pub(super) completed: BTreeMap<StreamId, Fence>,
    /// `next_seq` at the last `reset_peak` (1 before any): blocks with a smaller
    /// sequence number were allocated before the current peak window.
    pub(super) window_seq: u64,
}

impl Allocator {
    /// An empty allocator (no segments).
    ///
    /// # Errors
    /// [`AllocError::Config`] if `config` fails [`CoreConfig::validate`].
    pub fn new(config: CoreConfig) -> Result<Self, AllocError> {
        config.validate()?;
        Ok(Allocator {
            config,
            blocks: Slab::new(),
            segments: BTreeMap::new(),
            free: Default::default(),
            next_segment: 0,
            next_seq: 1,
            stats: CoreStats::default(),
            fenced_free_bytes: 0,
            completed: BTreeMap::new(),
            window_seq: 1,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// Current statistics.
    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// Reset every peak (the per-class ones too) to its current value, and start a new
    /// window for [`plan_fit_to_peak`](Self::plan_fit_to_peak).
    pub fn reset_peak(&mut self) {
        for (_, stat) in self.stats.gauges_mut() {
            stat.reset_peak();
        }
        self.window_seq = self.next_seq;
    }

    /// Effective alignment of a request, checked.
    fn effective_align(&self, align_bytes: u64) -> Result<u64, AllocError> {
        if !is_pow2(align_bytes) || align_bytes > self.config.granularity_bytes {
            return Err(AllocError::BadAlignment {
                align_bytes,
                max_align_bytes: self.config.granularity_bytes,
            });
        }
        Ok(align_bytes.max(self.config.min_block_bytes))
    }

    /// Place a request in a free block (best fit), or say how to grow.
    ///
    /// On success the returned [`Placement`] names the block and lists the device-side
    /// waits the caller must enqueue on `req.stream` before using the memory: one per
    /// other stream that used the memory before it was freed. Placement never depends
    /// on the stream or on fence completion.
    ///
    /// # Errors
    /// - [`AllocError::ZeroSize`], [`AllocError::TooLarge`], [`AllocError::BadAlignment`]
    ///   for bad requests;
    /// - [`AllocError::NeedsGrowth`] when no free block fits: add the segment it names
    ///   with [`add_segment`](Self::add_segment) and call again;
    /// - [`AllocError::OutOfMemory`] when that growth would exceed `max_reserved_bytes`;
    /// - [`AllocError::Exhausted`] if sequence numbers or slots run out.
    ///
    /// The allocator is unchanged on error, except the `num_misses` counter.
    pub fn alloc(&mut self, req: AllocRequest) -> Result<Placement, AllocError> {
        let align = self.effective_align(req.align_bytes)?;
        let size = self.config.round_request(req.size_bytes)?;
        let class = self.config.class_of(size);
        let Some((key, pad)) = self.find_fit(class, size, align) else {
            self.stats.num_misses += 1;
            // Only the registered policy sizes segments from the class's live bytes (a
            // walk of the class's free index, off the cache-hit path).
            let class_allocated = if self.config.growth.is_registered() {
                self.class_allocated_bytes(class)
            } else {
                0
            };
            let growth = self.config.growth_with(size, class_allocated)?;
            self.check_reserve(growth.segment_bytes)?;
            return Err(AllocError::NeedsGrowth(growth));
        };
        let seq = self.next_seq;
        let next_seq = seq.checked_add(1).ok_or(AllocError::Exhausted)?;
        // Up to two new blocks (front padding, remainder): make sure slots can be made.
        if self.blocks.len() > (u32::MAX - 3) as usize {
            return Err(AllocError::Exhausted);
        }
        self.next_seq = next_seq;
        Ok(self.carve(key, pad, size, class, seq, req))
    }

    /// First free block of `class` (in index order) that holds `size` bytes at an
    /// offset aligned to `align`. Returns its key and the padding in front.
    // `#[inline]` (with the free index's methods) so that the search inlines into
    // `alloc` whatever the codegen-unit split: see `free_index.rs`.
    #[inline]
    fn find_fit(&self, class: SizeClass, size: u64, align: u64) -> Option<(FreeKey, u64)> {
        let ratio = self.config.dedicated_reuse_ratio;
        self.free[class.index()].find_first(
            (size, SegmentId(0), 0, 0),
            |&(bsize, segment, offset, _)| {
                // The dedicated-segment rule holds for every block of a dedicated segment,
                // whatever the block's size; small and shared segments are never dedicated.
                if ratio > 0 && class == SizeClass::Large {
                    let seg = &self.segments[&segment];
                    if seg.dedicated && size.saturating_mul(ratio) < seg.size {
                        return None;
                    }
                }
                let pad = align_up(offset, align)? - offset;
                pad.checked_add(size)
                    .is_some_and(|need| need <= bsize)
                    .then_some(pad)
            },
        )
    }

    /// Check that a new segment of `segment_bytes` keeps reserved memory within
    /// `max_reserved_bytes`.
    ///
    /// # Errors
    /// [`AllocError::OutOfMemory`] if it does not.
    pub(crate) fn check_reserve(&self, segment_bytes: u64) -> Result<(), AllocError> {
        let would = self.stats.reserved_bytes.current.checked_add(segment_bytes);
        match would {
            Some(w) if w <= self.config.max_reserved_bytes => Ok(()),
            _ => Err(AllocError::OutOfMemory {
                segment_bytes,
                would_reserve_bytes: would.unwrap_or(u64::MAX),
                max_reserved_bytes: self.config.max_reserved_bytes,
            }),
        }
    }

    /// Whether `seg` is one free block, all of it.
    pub(super) fn entirely_free(&self, seg: &Segment) -> bool {
        let b = &self.blocks[seg.first as usize];
        b.is_free() && b.size == seg.size
    }

    /// The blocks of `seg`, in address order.
    pub(super) fn blocks_of<'a>(&'a self, seg: &Segment) -> impl Iterator<Item = &'a Block> {
        std::iter::successors(Some(&self.blocks[seg.first as usize]), |b| {
            b.next.map(|n| &self.blocks[n as usize])
        })
    }

    fn carve(
        &mut self,
        key: FreeKey,
        pad: u64,
        size: u64,
        class: SizeClass,
        seq: u64,
        req: AllocRequest,
    ) -> Placement {
        let (mut len, segment, mut start, mut slot) = key;
        self.free[class.index()].remove(&key);
        let (fences, fenced) = match &self.blocks[slot as usize].usage {
            BlockUse::Free { fences, fenced } => (Fences::from_slice(fences), *fenced),
            BlockUse::Allocated { .. } => unreachable!("free index names an allocated block"),
        };
        if fenced {
            self.fenced_free_bytes -= len;
        }
        if pad > 0 {
            // Keep the padding in front as its own free block; `slot` keeps it.
            let new = self.split_off_tail(slot, pad, &fences, fenced);
            self.insert_free(slot, class);
            slot = new;
            start += pad;
            len -= pad;
            self.stats.num_splits += 1;
        }
        let remainder = len - size;
        // The split threshold of the class: the smallest remainder worth keeping.
        let split_min = match class {
            SizeClass::Small => self.config.min_block_bytes,
            SizeClass::Large => self.config.large_split_min_bytes,
        };
        let block_len = if remainder >= split_min && remainder > 0 {
            let tail = self.split_off_tail(slot, size, &fences, fenced);
            self.insert_free(tail, class);
            self.stats.num_splits += 1;
            size
        } else {
            len
        };
        let (waits, own_fence): (SmallVec<[Wait; 2]>, _) = if fences.is_empty() {
            (SmallVec::new(), None)
        } else {
            let own = fences.iter().find(|w| w.stream == req.stream);
            let others = fences.iter().filter(|w| w.stream != req.stream);
            (others.copied().collect(), own.map(|w| w.fence))
        };
        let block = &mut self.blocks[slot as usize];
        block.usage = BlockUse::Allocated {
            seq,
            requested_bytes: req.size_bytes,
            stream: req.stream,
            others: SmallVec::new(),
        };
        let s = &mut self.stats;
        s.allocated_bytes.add(block_len);
        s.requested_bytes.add(req.size_bytes);
        s.allocated_blocks.add(1);
        s.free_blocks -= 1;
        s.num_allocs += 1;
        s.num_waits += waits.len() as u64;
        self.refresh_active();
        Placement {
            block: BlockId { slot, seq },
            segment,
            offset_bytes: start,
            size_bytes: block_len,
            waits,
            own_fence,
        }
    }

    /// Cut block `slot` (free, not in the index) at `at` bytes; the tail becomes a new
    /// free block with the given fences, linked after it. Returns the tail's slot.
    pub(super) fn split_off_tail(
        &mut self,
        slot: u32,
        at: u64,
        fences: &Fences,
        fenced: bool,
    ) -> u32 {
        let (segment, class, offset, size, next) = {
            let b = &self.blocks[slot as usize];
            (b.segment, b.class, b.offset, b.size, b.next)
        };
        debug_assert!(at > 0 && at < size);
        let tail = Block {
            segment,
            class,
            offset: offset + at,
            size: size - at,
            prev: Some(slot),
            next,
            usage: BlockUse::Free {
                fences: Fences::from_slice(fences),
                fenced,
            },
        };
        let tail_slot = self.blocks.insert(tail) as u32;
        if let Some(n) = next {
            self.blocks[n as usize].prev = Some(tail_slot);
        }
        let b = &mut self.blocks[slot as usize];
        b.size = at;
        b.next = Some(tail_slot);
        self.stats.free_blocks += 1;
        tail_slot
    }

    /// Put a free block into the free index and account for its fence state.
    pub(super) fn insert_free(&mut self, slot: u32, class: SizeClass) {
        let b = &self.blocks[slot as usize];
        if let BlockUse::Free { fenced: true, .. } = b.usage {
            self.fenced_free_bytes += b.size;
        }
        self.free[class.index()].insert(b.key(slot));
    }

    /// Take a free block out of the free index, undoing its fence accounting.
    pub(super) fn remove_free(&mut self, slot: u32, class: SizeClass) {
        let b = &self.blocks[slot as usize];
        if let BlockUse::Free { fenced: true, .. } = b.usage {
            self.fenced_free_bytes -= b.size;
        }
        let removed = self.free[class.index()].remove(&b.key(slot));
        debug_assert!(removed, "free block missing from the index");
    }

    pub(super) fn refresh_active(&mut self) {
        let active = self.stats.allocated_bytes.current + self.fenced_free_bytes;
        let a = &mut self.stats.active_bytes;
        a.current = active;
        a.peak = a.peak.max(active);
    }

    /// A live block and its allocation's requested bytes, stream and other streams.
    fn live(&self, id: BlockId) -> Result<(&Block, u64, StreamId, &Others), AllocError> {
        match self.blocks.get(id.slot as usize) {
            Some(
                b @ Block {
                    usage:
                        BlockUse::Allocated {
                            seq,
                            requested_bytes,
                            stream,
                            others,
                        },
                    ..
                },
            ) if *seq == id.seq => Ok((b, *requested_bytes, *stream, others)),
            _ => Err(AllocError::StaleBlock(id)),
        }
    }

    /// The streams that used a live block: the allocating stream first, then the
    /// streams recorded with [`record_stream`](Self::record_stream), in recording order.
    /// The caller records one fence on each before [`free`](Self::free).
    ///
    /// # Errors
    /// [`AllocError::StaleBlock`] if `id` is not a live block.
    pub fn streams_of(&self, id: BlockId) -> Result<SmallVec<[StreamId; 3]>, AllocError> {
        let (_, _, stream, others) = self.live(id)?;
        Ok(std::iter::once(stream)
            .chain(others.iter().copied())
            .collect())
    }

    /// Note that a live block is also used on `stream` (like PyTorch's
    /// `Tensor.record_stream`). Recording the allocating stream, or a stream already
    /// recorded, changes nothing.
    ///
    /// # Errors
    /// [`AllocError::StaleBlock`] if `id` is not a live block.
    pub fn record_stream(&mut self, id: BlockId, stream: StreamId) -> Result<(), AllocError> {
        self.live(id)?;
        if let BlockUse::Allocated {
            stream: own,
            others,
            ..
        } = &mut self.blocks[id.slot as usize].usage
            && *own != stream
            && !others.contains(&stream)
        {
            others.push(stream);
        }
        Ok(())
    }

    /// Free a live block. `fences` gives, for the streams that used it (see
    /// [`streams_of`](Self::streams_of)), the point after which they no longer touch it;
    /// they are returned as waits when the memory is handed out on another stream.
    /// Duplicates keep the largest fence per stream. The block merges with free
    /// neighbours in its segment.
    ///
    /// # Errors
    /// [`AllocError::StaleBlock`] if `id` is not a live block (double free, stale or
    /// foreign handle). Nothing changes then.
    pub fn free(&mut self, id: BlockId, fences: &[Wait]) -> Result<(), AllocError> {
        let (block, requested, ..) = self.live(id)?;
        let (size, class) = (block.size, block.class);
        let mut own = Fences::new();
        for w in fences {
            merge_fence(&mut own, *w);
        }
        let fenced = outstanding(&self.completed, &own);
        let mut slot = id.slot;
        self.blocks[slot as usize].usage = BlockUse::Free {
            fences: own,
            fenced,
        };
        let s = &mut self.stats;
        s.allocated_bytes.sub(size);
        s.requested_bytes.sub(requested);
        s.allocated_blocks.sub(1);
        s.free_blocks += 1;
        s.num_frees += 1;
        if let Some(p) = self.blocks[slot as usize].prev
            && self.blocks[p as usize].is_free()
        {
            self.remove_free(p, class);
            self.absorb_next(p);
            slot = p;
        }
        if let Some(n) = self.blocks[slot as usize].next
            && self.blocks[n as usize].is_free()
        {
            self.remove_free(n, class);
            self.absorb_next(slot);
        }
        self.insert_free(slot, class);
        self.refresh_active();
        Ok(())
    }

    /// Merge the (free, unindexed) successor of `slot` into it. `slot` must be free
    /// and unindexed too.
    fn absorb_next(&mut self, slot: u32) {
        let Some(n) = self.blocks[slot as usize].next else {
            debug_assert!(false, "absorb_next needs a successor");
            return;
        };
        let next_block = self.blocks.remove(n as usize);
        if let Some(nn) = next_block.next {
            self.blocks[nn as usize].prev = Some(slot);
        }
        let BlockUse::Free {
            fences: nf,
            fenced: nfd,
        } = next_block.usage
        else {
            unreachable!("absorbing an allocated block")
        };
        let b = &mut self.blocks[slot as usize];
        b.size += next_block.size;
        b.next = next_block.next;
        if let BlockUse::Free { fences, fenced } = &mut b.usage {
            for w in nf {
                merge_fence(fences, w);
            }
            *fenced |= nfd;
        }
        self.stats.free_blocks -= 1;
        self.stats.num_merges += 1;
    }

    /// Report that all work on `stream` up to `fence` has finished.
    ///
    /// This only updates the `active_bytes` statistic: placement and the waits returned
    /// by [`alloc`](Self::alloc) never depend on it. It scans the free blocks (O(free)).
    pub fn complete_fences(&mut self, stream: StreamId, fence: Fence) {
        let w = self.completed.entry(stream).or_insert(fence);
        *w = (*w).max(fence);
        let mut fenced_bytes = 0;
        let completed = &self.completed;
        for (_, b) in self.blocks.iter_mut() {
            if let BlockUse::Free { fences, fenced } = &mut b.usage {
                if *fenced {
                    *fenced = outstanding(completed, fences);
                }
                if *fenced {
                    fenced_bytes += b.size;
                }
            }
        }
        self.fenced_free_bytes = fenced_bytes;
        self.refresh_active();
    }

    /// The segments in id order, with class and size in bytes.
    pub fn segments(&self) -> impl Iterator<Item = (SegmentId, SizeClass, u64)> + '_ {
        self.segments.iter().map(|(id, s)| (*id, s.class, s.size))
    }

    /// Where a live block is: (segment, offset in bytes, block size in bytes).
    ///
    /// # Errors
    /// [`AllocError::StaleBlock`] if `id` is not a live block.
    pub fn locate(&self, id: BlockId) -> Result<(SegmentId, u64, u64), AllocError> {
        let (b, ..) = self.live(id)?;
        Ok((b.segment, b.offset, b.size))
    }

    /// A copy of every segment and block, in id and address order.
    pub fn snapshot(&self) -> Snapshot {
        let segments = self
            .segments
            .iter()
            .map(|(id, seg)| {
                let blocks = self.blocks_of(seg).map(|b| {
                    let (state, requested_bytes, stream, other_streams) = match &b.usage {
                        BlockUse::Allocated {
                            requested_bytes,
                            stream,
                            others,
                            ..
                        } => (
                            BlockState::Allocated,
                            *requested_bytes,
                            Some(*stream),
                            others.to_vec(),
                        ),
                        BlockUse::Free { fences, .. } => (
                            BlockState::Free,
                            0,
                            fences.first().map(|w| w.stream),
                            fences.iter().skip(1).map(|w| w.stream).collect(),
                        ),
                    };
                    BlockSnapshot {
                        offset_bytes: b.offset,
                        size_bytes: b.size,
                        requested_bytes,
                        state,
                        stream,
                        other_streams,
                    }
                });
                SegmentSnapshot {
                    id: *id,
                    class: seg.class,
                    size_bytes: seg.size,
                    blocks: blocks.collect(),
                }
            })
            .collect();
        Snapshot {
            segments,
            stats: self.stats,
        }
    }
}

/// Whether a fence of `fences` is above its stream's `completed` one.
fn outstanding(completed: &BTreeMap<StreamId, Fence>, fences: &[Wait]) -> bool {
    fences
        .iter()
        .any(|w| completed.get(&w.stream).is_none_or(|&c| w.fence > c))
}

/// Insert `w` into a stream-sorted fence list, keeping the largest fence per stream.
/// Out of line: inlined, its `SmallVec` insert crowds `free`'s registers (≈ 9
/// instructions more per free without fences, callgrind).
#[inline(never)]
fn merge_fence(fences: &mut Fences, w: Wait) {
    match fences.binary_search_by_key(&w.stream, |x| x.stream) {
        Ok(i) => fences[i].fence = fences[i].fence.max(w.fence),
        Err(i) => fences.insert(i, w),
    }
}
