//! Fuzz target for the allocator core: arbitrary call sequences on an allocator with
//! one of a few configurations (or an arbitrary one that passes `validate()`).
//!
//! After every step: `check_invariants()` passes, the ranges of live blocks never
//! overlap and lie inside their segments, the byte and block statistics equal the
//! harness's own sums, and each call's result is the one its arguments call for
//! (refusals for bad requests, `StaleBlock` for stale handles, no second growth after
//! adding the segment the core asked for). At the end everything is freed, reserved
//! bytes equal the sum of the segments, and every segment can be released.

#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use symmpool::__core::{
    AllocError, AllocRequest, Allocator, BlockId, CoreConfig, Fence, Growth, SegmentId, SizeClass,
    StreamId, Wait,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A size: tiny, at a class or policy boundary, near `u64::MAX`, or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Tiny(u16),
    /// One of the configuration's boundaries, plus or minus a little.
    Boundary {
        which: u8,
        delta: i16,
    },
    /// A power of two plus or minus a little.
    Pow2 {
        log2: u8,
        delta: i16,
    },
    NearMax(u16),
    Any(u64),
}

impl Size {
    fn bytes(self, c: &CoreConfig) -> u64 {
        match self {
            Size::Tiny(x) => u64::from(x),
            Size::Boundary { which, delta } => {
                let base = [
                    c.min_block_bytes,
                    c.small_request_max_bytes,
                    c.small_segment_bytes,
                    c.dedicated_min_bytes,
                    c.large_segment_bytes,
                    c.large_split_min_bytes,
                    c.granularity_bytes,
                    c.max_request_bytes,
                    c.max_reserved_bytes,
                ][usize::from(which) % 9];
                base.saturating_add_signed(i64::from(delta))
            }
            Size::Pow2 { log2, delta } => {
                (1u64 << (log2 % 64)).saturating_add_signed(i64::from(delta))
            }
            Size::NearMax(x) => u64::MAX - u64::from(x),
            Size::Any(x) => x,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// `align_log2` below 64 is a power of two (possibly above the granularity);
    /// 64 is alignment 0; above, a value that is not a power of two.
    Alloc {
        size: Size,
        align_log2: u8,
        stream: u8,
    },
    /// Free the `index`-th live block; bit i of `fences` gives a fence on its i-th
    /// stream, `dup` adds an older duplicate.
    Free {
        index: u16,
        fences: u8,
        dup: bool,
    },
    /// Use the `index`-th stale handle (or a foreign one if there is none).
    FreeStale {
        index: u16,
    },
    RecordStream {
        index: u16,
        stream: u8,
    },
    CompleteFences {
        stream: u8,
        fence: u16,
    },
    ReleaseFree,
    ReleaseSegment {
        id: u8,
    },
    ResetPeak,
    /// Add a segment of arbitrary size, which may be refused.
    AddSegment {
        small: bool,
        size: Size,
    },
    /// Plan a fit to the peak and carry it out.
    FitToPeak,
}

/// Arbitrary configuration fields, mapped to sizes that are often valid.
#[derive(Arbitrary, Debug)]
struct RawConfig {
    min_log2: u8,
    gran_shift: u8,
    small_seg_grans: u8,
    small_max_units: u16,
    large_seg_grans: u8,
    dedicated_min: u32,
    large_split_units: u8,
    ratio: u8,
    steps_log2: u8,
    max_request: Size,
    max_reserved: Size,
    /// `Some` selects the registered growth policy: (min chunk in granules, max chunk
    /// in granules above it, growth percent, fit headroom percent).
    registered: Option<(u8, u8, u16, u8)>,
}

#[derive(Arbitrary, Debug)]
enum ConfigChoice {
    Default,
    /// `CoreConfig::registered()`.
    Registered,
    /// Small segments (16 KiB / 128 KiB) and a 4 MiB reserve limit.
    Small,
    Raw(RawConfig),
}

impl ConfigChoice {
    fn build(&self) -> CoreConfig {
        match self {
            ConfigChoice::Default => CoreConfig::default(),
            ConfigChoice::Registered => CoreConfig::registered(),
            ConfigChoice::Small => {
                let mut c = CoreConfig::default()
                    .with_granularity_bytes(16 * KIB)
                    .with_small(4 * KIB, 16 * KIB)
                    .with_large_segment_bytes(128 * KIB)
                    .with_dedicated_min_bytes(64 * KIB)
                    .with_max_request_bytes(2 * MIB)
                    .with_max_reserved_bytes(4 * MIB);
                c.large_split_min_bytes = 8 * KIB;
                c
            }
            ConfigChoice::Raw(r) => {
                let min = 1u64 << (6 + r.min_log2 % 8);
                let gran = min << (r.gran_shift % 10);
                let small_seg = gran * (1 + u64::from(r.small_seg_grans % 8));
                let small_max = min * (1 + u64::from(r.small_max_units) % (small_seg / min));
                let large_seg = gran * (1 + u64::from(r.large_seg_grans % 16));
                let dedicated = small_max
                    + u64::from(r.dedicated_min) % (large_seg.max(small_max) - small_max + 1);
                let mut c = CoreConfig::default()
                    .with_granularity_bytes(gran)
                    .with_small(small_max, small_seg)
                    .with_large_segment_bytes(large_seg)
                    .with_dedicated_min_bytes(dedicated);
                c.min_block_bytes = min;
                c.large_split_min_bytes = min * u64::from(r.large_split_units % 64);
                c.dedicated_reuse_ratio = u64::from(r.ratio % 8);
                c.dedicated_round_steps = match r.steps_log2 % 10 {
                    0 => 0,
                    k => 1 << (k - 1),
                };
                if let Some((lo, hi, pct, head)) = r.registered {
                    let min_chunk = gran * (1 + u64::from(lo % 32));
                    c = c
                        .with_chunk_bytes(min_chunk, min_chunk + gran * u64::from(hi))
                        .with_growth_percent(u64::from(pct) % 400)
                        .with_fit_headroom_percent(u64::from(head % 128));
                }
                let c = c.with_max_request_bytes(r.max_request.bytes(&c));
                c.with_max_reserved_bytes(r.max_reserved.bytes(&c))
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    config: ConfigChoice,
    ops: Vec<Op>,
}

struct Live {
    id: BlockId,
    segment: SegmentId,
    offset: u64,
    size: u64,
    requested: u64,
}

struct Harness {
    core: Allocator,
    cfg: CoreConfig,
    live: Vec<Live>,
    stale: Vec<BlockId>,
    /// Live ranges by (segment, offset) -> end.
    ranges: BTreeMap<(SegmentId, u64), u64>,
    /// Segments the harness added and has not released: id -> (class, size).
    segments: BTreeMap<SegmentId, (SizeClass, u64)>,
    clock: u64,
}

impl Harness {
    fn stats_match(&self) {
        let s = self.core.stats();
        let allocated: u128 = self.live.iter().map(|l| u128::from(l.size)).sum();
        let requested: u128 = self.live.iter().map(|l| u128::from(l.requested)).sum();
        let reserved: u128 = self.segments.values().map(|s| u128::from(s.1)).sum();
        assert_eq!(u128::from(s.allocated_bytes.current), allocated);
        assert_eq!(u128::from(s.requested_bytes.current), requested);
        assert_eq!(u128::from(s.reserved_bytes.current), reserved);
        assert_eq!(s.allocated_blocks.current, self.live.len() as u64);
        assert_eq!(s.segments.current, self.segments.len() as u64);
    }

    fn check(&self) {
        if let Err(e) = self.core.check_invariants() {
            panic!("{e}");
        }
        self.stats_match();
    }

    fn insert_range(&mut self, segment: SegmentId, offset: u64, size: u64) {
        let seg_size = self.segments[&segment].1;
        let end = offset.checked_add(size).expect("block end overflows");
        assert!(
            end <= seg_size,
            "block {offset}+{size} outside {segment} of {seg_size}"
        );
        if let Some((&(s, o), &e)) = self.ranges.range(..=(segment, offset)).next_back() {
            assert!(
                s != segment || e <= offset,
                "overlaps live block at {o}..{e}"
            );
        }
        if let Some((&(s, o), _)) = self.ranges.range((segment, offset)..).next() {
            assert!(s != segment || end <= o, "overlaps live block at {o}");
        }
        self.ranges.insert((segment, offset), end);
    }

    fn alloc(&mut self, size: u64, align: u64, stream: StreamId) {
        let req = AllocRequest::new(size, stream).with_align(align);
        let bad_align = !align.is_power_of_two() || align > self.cfg.granularity_bytes;
        let bad_size = size == 0 || size > self.cfg.max_request_bytes;
        let before = self.core.stats();
        let mut result = self.core.alloc(req);
        if let Err(AllocError::NeedsGrowth(g)) = result {
            let rounded = self.cfg.round_request(size).unwrap();
            assert_eq!(Ok(g), self.cfg.growth_with(rounded, 0));
            let id = self
                .core
                .add_segment(g)
                .expect("adding the segment the core asked for");
            self.segments.insert(id, (g.class, g.segment_bytes));
            self.check();
            result = self.core.alloc(req);
            assert!(
                !matches!(result, Err(AllocError::NeedsGrowth(_))),
                "no fit after adding the segment the core asked for: {req:?} {g:?}"
            );
        }
        let failed = result.is_err();
        match result {
            Ok(p) => {
                assert!(!bad_align && !bad_size, "accepted a bad request {req:?}");
                assert_eq!(p.offset_bytes % align.max(self.cfg.min_block_bytes), 0);
                assert_eq!(p.size_bytes % self.cfg.min_block_bytes, 0);
                assert!(p.size_bytes >= size);
                assert!(p.waits.windows(2).all(|w| w[0].stream < w[1].stream));
                assert!(p.waits.iter().all(|w| w.stream != stream));
                self.insert_range(p.segment, p.offset_bytes, p.size_bytes);
                self.live.push(Live {
                    id: p.block,
                    segment: p.segment,
                    offset: p.offset_bytes,
                    size: p.size_bytes,
                    requested: size,
                });
            }
            Err(AllocError::BadAlignment { .. }) => assert!(bad_align),
            Err(AllocError::ZeroSize) => assert_eq!(size, 0),
            Err(AllocError::TooLarge { .. }) => {
                // Too large for the limit, or for rounding to the granularity.
                assert!(
                    bad_size || size > u64::MAX / 2,
                    "{req:?} refused as too large"
                );
            }
            Err(AllocError::OutOfMemory {
                segment_bytes,
                would_reserve_bytes,
                max_reserved_bytes,
            }) => {
                assert!(!bad_align && !bad_size);
                assert_eq!(max_reserved_bytes, self.cfg.max_reserved_bytes);
                // The sum saturates at u64::MAX when it overflows.
                let reserved = self.core.stats().reserved_bytes.current;
                let would = reserved.checked_add(segment_bytes);
                assert_eq!(would.unwrap_or(u64::MAX), would_reserve_bytes);
                assert!(would.is_none() || would_reserve_bytes > max_reserved_bytes);
            }
            Err(e) => panic!("unexpected {e:?} for {req:?}"),
        }
        if failed {
            let mut after = self.core.stats();
            after.num_misses = before.num_misses;
            if after.num_growths == before.num_growths {
                assert_eq!(after, before, "a refused request changed the stats");
            }
        }
    }

    fn free(&mut self, index: u16, mask: u8, dup: bool) {
        if self.live.is_empty() {
            return;
        }
        let l = self.live.swap_remove(usize::from(index) % self.live.len());
        assert_eq!(self.core.locate(l.id), Ok((l.segment, l.offset, l.size)));
        let streams = self.core.streams_of(l.id).unwrap();
        let mut fences: Vec<Wait> = streams
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << (i % 8)) != 0)
            .map(|(i, &stream)| Wait {
                stream,
                fence: Fence(self.clock + 1 + i as u64),
            })
            .collect();
        if dup && let Some(&w) = fences.first() {
            fences.push(Wait {
                stream: w.stream,
                fence: Fence(w.fence.0 - 1),
            });
        }
        self.clock += streams.len() as u64;
        self.core.free(l.id, &fences).unwrap();
        assert_eq!(
            self.ranges.remove(&(l.segment, l.offset)),
            Some(l.offset + l.size)
        );
        self.stale.push(l.id);
    }

    fn stale(&mut self, index: u16) {
        let id = if self.stale.is_empty() {
            BlockId {
                slot: u32::from(index),
                seq: u64::MAX - u64::from(index),
            }
        } else {
            self.stale[usize::from(index) % self.stale.len()]
        };
        let before = self.core.stats();
        let stale = Err(AllocError::StaleBlock(id));
        assert_eq!(self.core.free(id, &[]), stale);
        assert_eq!(self.core.record_stream(id, StreamId(1)), stale);
        assert_eq!(self.core.locate(id), Err(AllocError::StaleBlock(id)));
        assert_eq!(self.core.streams_of(id), Err(AllocError::StaleBlock(id)));
        assert_eq!(self.core.stats(), before);
    }

    fn add_segment(&mut self, small: bool, size: u64) {
        let class = if small {
            SizeClass::Small
        } else {
            SizeClass::Large
        };
        let bad = size == 0
            || size > symmpool::__core::MAX_SEGMENT_BYTES
            || !size.is_multiple_of(self.cfg.granularity_bytes)
            || (small && size < self.cfg.small_request_max_bytes);
        let reserved = self.core.stats().reserved_bytes.current;
        match self.core.add_segment(Growth {
            class,
            segment_bytes: size,
        }) {
            Ok(id) => {
                assert!(!bad);
                assert!(
                    reserved
                        .checked_add(size)
                        .is_some_and(|r| r <= self.cfg.max_reserved_bytes)
                );
                assert!(self.segments.keys().all(|&s| s < id), "segment id reused");
                self.segments.insert(id, (class, size));
            }
            Err(AllocError::BadSegmentSize { size_bytes }) => {
                assert!(bad);
                assert_eq!(size_bytes, size);
            }
            Err(AllocError::OutOfMemory { .. }) => {
                assert!(!bad);
                assert!(
                    reserved
                        .checked_add(size)
                        .is_none_or(|r| r > self.cfg.max_reserved_bytes)
                );
            }
            Err(e) => panic!("unexpected {e:?} adding {size} bytes"),
        }
    }

    fn release_free(&mut self) {
        let released = self.core.release_free_segments();
        let mut prev = None;
        for &(id, size) in &released {
            assert!(prev < Some(id), "not in id order");
            prev = Some(id);
            assert_eq!(self.segments.remove(&id).map(|s| s.1), Some(size));
            assert!(self.ranges.range((id, 0)..=(id, u64::MAX)).next().is_none());
        }
        // Every segment left holds a live block.
        for &id in self.segments.keys() {
            assert!(self.ranges.range((id, 0)..=(id, u64::MAX)).next().is_some());
        }
    }

    fn fit_to_peak(&mut self) {
        let plan = self.core.plan_fit_to_peak();
        let released = match self.core.release_planned(&plan) {
            Ok(r) => r,
            Err(e) => panic!("fresh plan refused: {e:?}"),
        };
        assert_eq!(released, plan.release);
        for &(id, size) in &released {
            assert_eq!(self.segments.remove(&id).map(|s| s.1), Some(size));
            assert!(self.ranges.range((id, 0)..=(id, u64::MAX)).next().is_none());
        }
        for &g in &plan.add {
            match self.core.add_planned(g) {
                Ok(id) => {
                    self.segments.insert(id, (g.class, g.segment_bytes));
                }
                Err(AllocError::OutOfMemory { .. }) => break,
                Err(e) => panic!("planned segment refused: {e:?}"),
            }
        }
        // Live blocks never move.
        for l in &self.live {
            assert_eq!(self.core.locate(l.id), Ok((l.segment, l.offset, l.size)));
        }
    }

    fn release_one(&mut self, id: SegmentId) {
        let empty = self.segments.contains_key(&id)
            && self.ranges.range((id, 0)..=(id, u64::MAX)).next().is_none();
        match self.core.release_segment(id) {
            Ok(size) => {
                assert!(empty);
                assert_eq!(self.segments.remove(&id).map(|s| s.1), Some(size));
            }
            Err(AllocError::UnknownSegment(s)) => {
                assert!(!empty);
                assert_eq!(s, id);
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
}

fuzz_target!(|input: Input| {
    let cfg = input.config.build();
    let core = match Allocator::new(cfg) {
        Ok(core) => core,
        Err(e) => {
            assert!(matches!(e, AllocError::Config(_)));
            assert!(cfg.validate().is_err());
            return;
        }
    };
    let mut h = Harness {
        core,
        cfg,
        live: Vec::new(),
        stale: Vec::new(),
        ranges: BTreeMap::new(),
        segments: BTreeMap::new(),
        clock: 0,
    };
    for op in input.ops {
        match op {
            Op::Alloc {
                size,
                align_log2,
                stream,
            } => {
                let align = match align_log2 {
                    0..=63 => 1u64 << align_log2,
                    64 => 0,
                    x => u64::from(x) * 1000 + 3,
                };
                h.alloc(size.bytes(&cfg), align, StreamId(u64::from(stream % 8)));
            }
            Op::Free { index, fences, dup } => h.free(index, fences, dup),
            Op::FreeStale { index } => h.stale(index),
            Op::RecordStream { index, stream } => {
                if !h.live.is_empty() {
                    let id = h.live[usize::from(index) % h.live.len()].id;
                    let stream = StreamId(u64::from(stream % 8));
                    let before = h.core.streams_of(id).unwrap();
                    h.core.record_stream(id, stream).unwrap();
                    let after = h.core.streams_of(id).unwrap();
                    assert!(after.contains(&stream));
                    assert_eq!(
                        after.len(),
                        before.len() + usize::from(!before.contains(&stream))
                    );
                }
            }
            Op::CompleteFences { stream, fence } => {
                let before = h.core.snapshot();
                h.core
                    .complete_fences(StreamId(u64::from(stream % 8)), Fence(u64::from(fence)));
                let mut after = h.core.snapshot();
                after.stats.active_bytes = before.stats.active_bytes;
                assert_eq!(
                    after, before,
                    "fence completion changed more than active bytes"
                );
            }
            Op::ReleaseFree => h.release_free(),
            Op::ReleaseSegment { id } => h.release_one(SegmentId(u32::from(id))),
            Op::ResetPeak => h.core.reset_peak(),
            Op::FitToPeak => h.fit_to_peak(),
            Op::AddSegment { small, size } => h.add_segment(small, size.bytes(&cfg)),
        }
        h.check();
    }
    // Free everything: reserved is the sum of the segments, and all can be released.
    while !h.live.is_empty() {
        h.free(0, 0xff, false);
    }
    h.check();
    let s = h.core.stats();
    let segments: u128 = h.core.segments().map(|(_, _, size)| u128::from(size)).sum();
    assert_eq!(u128::from(s.reserved_bytes.current), segments);
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(s.requested_bytes.current, 0);
    assert_eq!(s.free_blocks, s.segments.current);
    h.release_free();
    assert!(h.segments.is_empty());
    assert_eq!(h.core.stats().reserved_bytes.current, 0);
    h.check();
});
