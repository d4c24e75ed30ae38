//! Model-based test of the allocator core with `proptest-state-machine`.
//!
//! The reference model is deliberately simple: a `BTreeMap` of live blocks by
//! allocation sequence number with their (segment, offset, size, requested, streams),
//! the segments with their class and size, and the free ranges *between* live blocks
//! (each with the fences freed into it). It has no size-class index, no slab and no
//! neighbour links: best fit is a sort of all free ranges on every call, and it follows
//! the algorithm and growth table written in the allocator core's documentation (`src/core/`).
//!
//! Every transition is checked twice: against properties that need no model (ranges
//! aligned, inside their segment, disjoint from every live range; waits never name the
//! allocating stream; refused calls change nothing; `check_invariants()` passes), and
//! against the model (exact placement, growth, waits, errors, layout and every
//! statistic).

use proptest::prelude::*;
use proptest::sample;
use proptest::strategy::Union;
use proptest::test_runner::FileFailurePersistence;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use std::collections::{BTreeMap, BTreeSet};
use symmpool::__core::{
    AllocError, AllocRequest, Allocator, BlockId, BlockSnapshot, BlockState, CoreConfig, CoreStats,
    Fence, FitPlan, Growth, SegmentId, SegmentSnapshot, SizeClass, Stat, StreamId, Wait,
};

const KIB: u64 = 1 << 10;
const UNIT: u64 = 512;
const GRAN: u64 = 16 * KIB;
const SMALL_MAX: u64 = 4 * KIB;
const SMALL_SEG: u64 = 16 * KIB;
const LARGE_SEG: u64 = 128 * KIB;
const DEDICATED_MIN: u64 = 64 * KIB;
const LARGE_SPLIT_MIN: u64 = 8 * KIB;
const REUSE_RATIO: u64 = 4;
const ROUND_STEPS: u64 = 16;
const MAX_REQUEST: u64 = 1024 * KIB;
const MAX_RESERVED: u64 = 2 * 1024 * KIB;
/// Registered policy: chunk bounds, growth and fit headroom.
const MIN_CHUNK: u64 = 64 * KIB;
const MAX_CHUNK: u64 = 512 * KIB;
const GROWTH_PCT: u64 = 100;
const HEADROOM_PCT: u64 = 10;
/// Streams used by the test: 0..STREAMS.
const STREAMS: u64 = 4;

/// A small configuration (16 KiB small segments, 128 KiB large ones, dedicated
/// segments above 64 KiB, 2 MiB reserve limit) so that blocks collide, split, merge,
/// fill segments and hit the reserve limit within a few hundred calls.
fn config(registered: bool) -> CoreConfig {
    let mut c = CoreConfig::default()
        .with_granularity_bytes(GRAN)
        .with_small(SMALL_MAX, SMALL_SEG)
        .with_large_segment_bytes(LARGE_SEG)
        .with_dedicated_min_bytes(DEDICATED_MIN)
        .with_max_request_bytes(MAX_REQUEST)
        .with_max_reserved_bytes(MAX_RESERVED);
    c.large_split_min_bytes = LARGE_SPLIT_MIN;
    c.dedicated_reuse_ratio = REUSE_RATIO;
    c.dedicated_round_steps = ROUND_STEPS;
    if registered {
        c = c
            .with_chunk_bytes(MIN_CHUNK, MAX_CHUNK)
            .with_growth_percent(GROWTH_PCT)
            .with_fit_headroom_percent(HEADROOM_PCT);
    }
    c
}

/// The registered policy's rows of the table: `small_chunk`, or `max(chunk, fit)`;
/// `class_allocated` is the live bytes of the request's class.
fn documented_registered_growth(rounded: u64, class_allocated: u64) -> Growth {
    if rounded <= SMALL_MAX {
        let chunk = (class_allocated * GROWTH_PCT)
            .div_ceil(100)
            .clamp(SMALL_SEG, MAX_CHUNK.max(SMALL_SEG))
            .next_multiple_of(GRAN);
        return Growth {
            class: SizeClass::Small,
            segment_bytes: chunk,
        };
    }
    let large_allocated = class_allocated;
    let fit = if rounded <= DEDICATED_MIN {
        rounded.next_multiple_of(GRAN)
    } else {
        documented_growth(rounded).segment_bytes
    };
    let chunk = (large_allocated * GROWTH_PCT)
        .div_ceil(100)
        .clamp(MIN_CHUNK, MAX_CHUNK)
        .next_multiple_of(GRAN);
    Growth {
        class: SizeClass::Large,
        segment_bytes: chunk.max(fit),
    }
}

/// The growth table of `CoreConfig`'s documentation, written out independently.
fn documented_growth(rounded: u64) -> Growth {
    if rounded <= SMALL_MAX {
        Growth {
            class: SizeClass::Small,
            segment_bytes: SMALL_SEG,
        }
    } else if rounded <= DEDICATED_MIN {
        Growth {
            class: SizeClass::Large,
            segment_bytes: LARGE_SEG,
        }
    } else {
        let octave = 1u64 << (63 - rounded.leading_zeros());
        let step = (octave / ROUND_STEPS).max(GRAN);
        Growth {
            class: SizeClass::Large,
            segment_bytes: rounded.div_ceil(step) * step,
        }
    }
}

// ---------------------------------------------------------------------------------
// Reference model
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
struct LiveBlock {
    segment: u32,
    offset: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
    others: Vec<StreamId>,
}

impl LiveBlock {
    fn streams(&self) -> Vec<StreamId> {
        let mut v = vec![self.stream];
        v.extend(self.others.iter().copied());
        v
    }
}

/// A maximal free range of a segment and the fences freed into it (sorted by stream,
/// the latest per stream).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FreeRange {
    size: u64,
    fences: Vec<Wait>,
}

/// What the system under test must observe for the last transition.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expect {
    Nothing,
    /// The request is refused with one of these errors (the model does not fix the
    /// order in which a request with several faults is checked).
    AllocErr(Vec<AllocError>),
    AllocOk {
        growth: Option<(Growth, SegmentId)>,
        seq: u64,
        segment: SegmentId,
        offset: u64,
        size: u64,
        waits: Vec<Wait>,
    },
    /// A live block freed; its streams before the free.
    Freed {
        streams: Vec<StreamId>,
    },
    Stale,
    Recorded {
        streams: Vec<StreamId>,
    },
    Released(Vec<(SegmentId, u64)>),
    ReleasedOne(Result<u64, AllocError>),
    /// The fit-to-peak plan, and the ids of the segments it adds.
    Fitted(FitPlan, Vec<SegmentId>),
}

#[derive(Debug, Clone)]
struct Model {
    /// Registered growth policy (else caching).
    registered: bool,
    /// `next_seq` at the last peak reset.
    window_seq: u64,
    /// Large segments added by a fit-to-peak plan: shared, whatever their size.
    shared: BTreeSet<u32>,
    /// Segment id -> (class, size).
    segments: BTreeMap<u32, (SizeClass, u64)>,
    next_segment: u32,
    /// Live blocks by allocation sequence number.
    live: BTreeMap<u64, LiveBlock>,
    /// Free ranges by (segment, offset); always the gaps between live blocks.
    free: BTreeMap<(u32, u64), FreeRange>,
    /// Handles freed so far (stale).
    freed: BTreeSet<u64>,
    next_seq: u64,
    completed: BTreeMap<StreamId, Fence>,
    /// Largest fence handed out so far (fences increase over time).
    clock: u64,
    stats: CoreStats,
    /// Allocated bytes per class (small, large): not in `CoreStats`, the allocator
    /// computes them on demand.
    class_allocated: [u64; 2],
    expect: Expect,
}

fn stat_add(s: &mut Stat, x: u64) {
    s.current += x;
    s.peak = s.peak.max(s.current);
}

fn stat_sub(s: &mut Stat, x: u64) {
    s.current -= x;
}

fn class_stats(s: &mut CoreStats, class: SizeClass) -> &mut symmpool::__core::ClassStats {
    match class {
        SizeClass::Small => &mut s.small,
        SizeClass::Large => &mut s.large,
    }
}

fn class_index(class: SizeClass) -> usize {
    match class {
        SizeClass::Small => 0,
        SizeClass::Large => 1,
    }
}

fn merge_fence(fences: &mut Vec<Wait>, w: Wait) {
    match fences.iter_mut().find(|x| x.stream == w.stream) {
        Some(x) => x.fence = x.fence.max(w.fence),
        None => {
            fences.push(w);
            fences.sort();
        }
    }
}

impl Model {
    fn new(registered: bool) -> Self {
        Model {
            registered,
            window_seq: 1,
            class_allocated: [0; 2],
            shared: BTreeSet::new(),
            segments: BTreeMap::new(),
            next_segment: 0,
            live: BTreeMap::new(),
            free: BTreeMap::new(),
            freed: BTreeSet::new(),
            next_seq: 1,
            completed: BTreeMap::new(),
            clock: 0,
            stats: CoreStats::default(),
            expect: Expect::Nothing,
        }
    }

    fn is_fenced(&self, fences: &[Wait]) -> bool {
        fences
            .iter()
            .any(|w| self.completed.get(&w.stream).is_none_or(|c| w.fence > *c))
    }

    /// Recompute `active_bytes` and the counts that are plain recounts.
    fn refresh(&mut self) {
        let fenced: u64 = self
            .free
            .values()
            .filter(|r| self.is_fenced(&r.fences))
            .map(|r| r.size)
            .sum();
        let active = self.stats.allocated_bytes.current + fenced;
        let a = &mut self.stats.active_bytes;
        a.current = active;
        a.peak = a.peak.max(active);
        self.stats.free_blocks = self.free.len() as u64;
    }

    /// Best fit as documented: among the free blocks of the class that are at least
    /// `size` long, ordered by (size, segment, offset), the first that holds `size`
    /// bytes at an `align`-aligned offset; a dedicated segment (larger than
    /// `large_segment_bytes`) serves only requests of at least 1/ratio of its size.
    fn find_fit(&self, class: SizeClass, size: u64, align: u64) -> Option<((u32, u64), u64)> {
        let mut cands: Vec<(u64, u32, u64)> = self
            .free
            .iter()
            .filter(|((seg, _), r)| self.segments[seg].0 == class && r.size >= size)
            .map(|(&(seg, off), r)| (r.size, seg, off))
            .collect();
        cands.sort_unstable();
        cands.into_iter().find_map(|(bsize, seg, off)| {
            let seg_size = self.segments[&seg].1;
            if !self.registered
                && !self.shared.contains(&seg)
                && class == SizeClass::Large
                && seg_size > LARGE_SEG
                && size * REUSE_RATIO < seg_size
            {
                return None;
            }
            let pad = off.next_multiple_of(align) - off;
            (pad + size <= bsize).then_some(((seg, off), pad))
        })
    }

    fn alloc(&mut self, size: u64, align: u64, stream: StreamId) -> Expect {
        let mut errs = Vec::new();
        if !align.is_power_of_two() || align > GRAN {
            errs.push(AllocError::BadAlignment {
                align_bytes: align,
                max_align_bytes: GRAN,
            });
        }
        if size == 0 {
            errs.push(AllocError::ZeroSize);
        } else if size > MAX_REQUEST {
            errs.push(AllocError::TooLarge {
                requested_bytes: size,
                max_bytes: MAX_REQUEST,
            });
        }
        if !errs.is_empty() {
            return Expect::AllocErr(errs);
        }
        let align = align.max(UNIT);
        let rounded = size.next_multiple_of(UNIT);
        let class = if rounded <= SMALL_MAX {
            SizeClass::Small
        } else {
            SizeClass::Large
        };
        let mut growth = None;
        let fit = match self.find_fit(class, rounded, align) {
            Some(fit) => fit,
            None => {
                self.stats.num_misses += 1;
                let g = if self.registered {
                    documented_registered_growth(rounded, self.class_allocated[class_index(class)])
                } else {
                    documented_growth(rounded)
                };
                let would = self.stats.reserved_bytes.current + g.segment_bytes;
                if would > MAX_RESERVED {
                    return Expect::AllocErr(vec![AllocError::OutOfMemory {
                        segment_bytes: g.segment_bytes,
                        would_reserve_bytes: would,
                        max_reserved_bytes: MAX_RESERVED,
                    }]);
                }
                // The caller adds the segment asked for and retries.
                let id = self.add_segment(g);
                growth = Some((g, SegmentId(id)));
                self.find_fit(class, rounded, align)
                    .expect("a fresh segment of the documented growth size fits the request")
            }
        };
        let ((seg, off), pad) = fit;
        let range = self.free.remove(&(seg, off)).unwrap();
        let mut start = off;
        let mut len = range.size;
        if pad > 0 {
            self.free.insert(
                (seg, off),
                FreeRange {
                    size: pad,
                    fences: range.fences.clone(),
                },
            );
            self.stats.num_splits += 1;
            start += pad;
            len -= pad;
        }
        let split_min = match class {
            SizeClass::Small => UNIT,
            SizeClass::Large => LARGE_SPLIT_MIN,
        };
        let remainder = len - rounded;
        let block = if remainder > 0 && remainder >= split_min {
            self.free.insert(
                (seg, start + rounded),
                FreeRange {
                    size: remainder,
                    fences: range.fences.clone(),
                },
            );
            self.stats.num_splits += 1;
            rounded
        } else {
            len
        };
        let waits: Vec<Wait> = range
            .fences
            .iter()
            .filter(|w| w.stream != stream)
            .copied()
            .collect();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.live.insert(
            seq,
            LiveBlock {
                segment: seg,
                offset: start,
                size: block,
                requested: size,
                stream,
                others: Vec::new(),
            },
        );
        let s = &mut self.stats;
        self.class_allocated[class_index(class)] += block;
        stat_add(&mut s.allocated_bytes, block);
        stat_add(&mut s.requested_bytes, size);
        stat_add(&mut s.allocated_blocks, 1);
        s.num_allocs += 1;
        s.num_waits += waits.len() as u64;
        Expect::AllocOk {
            growth,
            seq,
            segment: SegmentId(seg),
            offset: start,
            size: block,
            waits,
        }
    }

    fn free(&mut self, seq: u64, given: &[Wait]) -> Expect {
        let b = self.live.remove(&seq).expect("precondition: live");
        self.freed.insert(seq);
        let streams = b.streams();
        let mut fences = Vec::new();
        for w in given {
            merge_fence(&mut fences, *w);
            self.clock = self.clock.max(w.fence.0);
        }
        let mut start = b.offset;
        let mut size = b.size;
        let left = self
            .free
            .range(..(b.segment, b.offset))
            .next_back()
            .filter(|(k, r)| k.0 == b.segment && k.1 + r.size == b.offset)
            .map(|(k, _)| *k);
        if let Some(k) = left {
            let r = self.free.remove(&k).unwrap();
            start = k.1;
            size += r.size;
            for w in r.fences {
                merge_fence(&mut fences, w);
            }
            self.stats.num_merges += 1;
        }
        if let Some(r) = self.free.remove(&(b.segment, b.offset + b.size)) {
            size += r.size;
            for w in r.fences {
                merge_fence(&mut fences, w);
            }
            self.stats.num_merges += 1;
        }
        self.free
            .insert((b.segment, start), FreeRange { size, fences });
        let class = self.segments[&b.segment].0;
        let s = &mut self.stats;
        self.class_allocated[class_index(class)] -= b.size;
        stat_sub(&mut s.allocated_bytes, b.size);
        stat_sub(&mut s.requested_bytes, b.requested);
        stat_sub(&mut s.allocated_blocks, 1);
        s.num_frees += 1;
        Expect::Freed { streams }
    }

    fn is_empty_segment(&self, id: u32) -> bool {
        let size = self.segments[&id].1;
        self.free.get(&(id, 0)).is_some_and(|r| r.size == size)
    }

    fn add_segment(&mut self, g: Growth) -> u32 {
        let id = self.next_segment;
        self.next_segment += 1;
        self.segments.insert(id, (g.class, g.segment_bytes));
        self.free.insert(
            (id, 0),
            FreeRange {
                size: g.segment_bytes,
                fences: Vec::new(),
            },
        );
        stat_add(&mut self.stats.reserved_bytes, g.segment_bytes);
        stat_add(&mut self.stats.segments, 1);
        let c = class_stats(&mut self.stats, g.class);
        stat_add(&mut c.reserved_bytes, g.segment_bytes);
        stat_add(&mut c.segments, 1);
        self.stats.num_growths += 1;
        id
    }

    /// The fit-to-peak plan as documented on `Allocator::plan_fit_to_peak`, applied.
    fn fit_to_peak(&mut self) -> Expect {
        let mut plan = FitPlan::default();
        // Bytes of the blocks live now and allocated before the window, per class.
        let old = |class: SizeClass| -> u64 {
            self.live
                .iter()
                .filter(|(seq, b)| **seq < self.window_seq && self.segments[&b.segment].0 == class)
                .map(|(_, b)| b.size)
                .sum()
        };
        let old_all = old(SizeClass::Small) + old(SizeClass::Large);
        for class in [SizeClass::Small, SizeClass::Large] {
            let ids: Vec<u32> = self
                .segments
                .iter()
                .filter(|(_, s)| s.0 == class)
                .map(|(&id, _)| id)
                .collect();
            let release: Vec<(SegmentId, u64)> = ids
                .iter()
                .filter(|&&id| self.is_empty_segment(id))
                .map(|&id| (SegmentId(id), self.segments[&id].1))
                .collect();
            if release.is_empty() {
                continue;
            }
            plan.release.extend(release);
            // need = min(P - L, R - L_c); with the headroom, at most R - L_c.
            let reserved_peak = match class {
                SizeClass::Small => self.stats.small.reserved_bytes.peak,
                SizeClass::Large => self.stats.large.reserved_bytes.peak,
            };
            let held = reserved_peak.saturating_sub(old(class));
            let need = (self.stats.allocated_bytes.peak.saturating_sub(old_all)).min(held);
            if need == 0 {
                continue;
            }
            let headroom = if self.registered { HEADROOM_PCT } else { 0 };
            let mut size = (need + need * headroom / 100)
                .min(held)
                .next_multiple_of(GRAN);
            if class == SizeClass::Small {
                size = size.max(SMALL_SEG);
            }
            plan.add.push(Growth {
                class,
                segment_bytes: size,
            });
        }
        plan.release.sort();
        for &(id, _) in &plan.release {
            self.remove_segment(id.0);
        }
        // Added in order until one would pass the reserve limit.
        let mut added = Vec::new();
        for &g in &plan.add {
            if self.stats.reserved_bytes.current + g.segment_bytes > MAX_RESERVED {
                break;
            }
            let id = self.add_segment(g);
            self.shared.insert(id);
            added.push(SegmentId(id));
        }
        Expect::Fitted(plan, added)
    }

    fn remove_segment(&mut self, id: u32) -> u64 {
        let (class, size) = self.segments.remove(&id).unwrap();
        self.free.remove(&(id, 0)).unwrap();
        stat_sub(&mut self.stats.reserved_bytes, size);
        stat_sub(&mut self.stats.segments, 1);
        let c = class_stats(&mut self.stats, class);
        stat_sub(&mut c.reserved_bytes, size);
        stat_sub(&mut c.segments, 1);
        self.stats.num_releases += 1;
        size
    }

    fn reset_peak(&mut self) {
        let s = &mut self.stats;
        for stat in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.active_bytes,
            &mut s.segments,
            &mut s.allocated_blocks,
            &mut s.small.segments,
            &mut s.small.reserved_bytes,
            &mut s.large.segments,
            &mut s.large.reserved_bytes,
        ] {
            stat.peak = stat.current;
        }
        self.window_seq = self.next_seq;
    }

    /// The layout the allocator's `snapshot()` must show.
    fn layout(&self) -> Vec<SegmentSnapshot> {
        let mut blocks: BTreeMap<(u32, u64), BlockSnapshot> = BTreeMap::new();
        for b in self.live.values() {
            blocks.insert(
                (b.segment, b.offset),
                BlockSnapshot {
                    offset_bytes: b.offset,
                    size_bytes: b.size,
                    requested_bytes: b.requested,
                    state: BlockState::Allocated,
                    stream: Some(b.stream),
                    other_streams: b.others.clone(),
                },
            );
        }
        for (&(seg, off), r) in &self.free {
            blocks.insert(
                (seg, off),
                BlockSnapshot {
                    offset_bytes: off,
                    size_bytes: r.size,
                    requested_bytes: 0,
                    state: BlockState::Free,
                    stream: r.fences.first().map(|w| w.stream),
                    other_streams: r.fences.iter().skip(1).map(|w| w.stream).collect(),
                },
            );
        }
        self.segments
            .iter()
            .map(|(&id, &(class, size))| SegmentSnapshot {
                id: SegmentId(id),
                class,
                size_bytes: size,
                blocks: blocks
                    .range((id, 0)..=(id, u64::MAX))
                    .map(|(_, b)| b.clone())
                    .collect(),
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------
// Transitions
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        size: u64,
        align: u64,
        stream: StreamId,
    },
    /// Free a live block with the given fences.
    Free {
        seq: u64,
        fences: Vec<Wait>,
    },
    /// Free (and query) a stale handle; `None` is a handle that never existed.
    FreeStale {
        seq: Option<u64>,
    },
    RecordStream {
        seq: u64,
        stream: StreamId,
    },
    CompleteFences {
        stream: StreamId,
        fence: Fence,
    },
    ReleaseFree,
    ReleaseSegment {
        segment: u32,
    },
    ResetPeak,
    FitToPeak,
}

fn size_strategy() -> BoxedStrategy<u64> {
    prop_oneof![
        // Small, mostly not multiples of 512.
        5 => 1..=SMALL_MAX,
        2 => (1..=SMALL_MAX / UNIT).prop_map(|k| k * UNIT),
        // Class and policy boundaries.
        2 => sample::select(vec![
            SMALL_MAX - 1, SMALL_MAX, SMALL_MAX + 1, SMALL_MAX + UNIT, DEDICATED_MIN,
            DEDICATED_MIN + 1, LARGE_SEG - 1, LARGE_SEG, LARGE_SEG + 1, MAX_REQUEST,
        ]),
        // Large, shared segments.
        3 => SMALL_MAX + 1..=DEDICATED_MIN,
        // Large, dedicated segments.
        1 => DEDICATED_MIN + 1..=MAX_REQUEST / 2,
        // Refused: zero and too large.
        1 => prop_oneof![
            Just(0),
            Just(MAX_REQUEST + 1),
            Just(u64::MAX),
            Just(u64::MAX - 511),
            MAX_REQUEST + 1..=u64::MAX,
        ],
    ]
    .boxed()
}

fn align_strategy() -> BoxedStrategy<u64> {
    prop_oneof![
        8 => Just(1),
        4 => sample::select(vec![2, 256, 512, 1024, 4096, 8192, GRAN]),
        // Refused: zero, not powers of two, above the granularity.
        1 => sample::select(vec![0, 3, 1000, 6144, GRAN + UNIT, 2 * GRAN, 1 << 63, u64::MAX]),
    ]
    .boxed()
}

fn stream_strategy() -> BoxedStrategy<StreamId> {
    (0..STREAMS).prop_map(StreamId).boxed()
}

struct CoreModel;

impl ReferenceStateMachine for CoreModel {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        any::<bool>().prop_map(Model::new).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        let mut options: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (
                12,
                (size_strategy(), align_strategy(), stream_strategy())
                    .prop_map(|(size, align, stream)| Op::Alloc {
                        size,
                        align,
                        stream,
                    })
                    .boxed(),
            ),
            (
                2,
                (stream_strategy(), 0..=state.clock + 2)
                    .prop_map(|(stream, f)| Op::CompleteFences {
                        stream,
                        fence: Fence(f),
                    })
                    .boxed(),
            ),
            (1, Just(Op::ReleaseFree).boxed()),
            (
                1,
                (0..=state.next_segment)
                    .prop_map(|segment| Op::ReleaseSegment { segment })
                    .boxed(),
            ),
            (1, Just(Op::ResetPeak).boxed()),
            (1, Just(Op::FitToPeak).boxed()),
            (1, Just(Op::FreeStale { seq: None }).boxed()),
        ];
        if !state.live.is_empty() {
            let blocks: Vec<(u64, Vec<StreamId>)> = state
                .live
                .iter()
                .map(|(&seq, b)| (seq, b.streams()))
                .collect();
            let clock = state.clock;
            let free = sample::select(blocks)
                .prop_flat_map(move |(seq, streams)| {
                    let n = streams.len();
                    (
                        Just(seq),
                        Just(streams),
                        proptest::collection::vec(proptest::option::weighted(0.8, 1..4u64), n),
                        any::<bool>(),
                        any::<bool>(),
                    )
                })
                .prop_map(move |(seq, streams, deltas, duplicate, reverse)| {
                    let mut fences: Vec<Wait> = streams
                        .iter()
                        .zip(deltas)
                        .filter_map(|(&stream, d)| {
                            d.map(|d| Wait {
                                stream,
                                fence: Fence(clock + d),
                            })
                        })
                        .collect();
                    if duplicate && let Some(&w) = fences.first() {
                        // An older fence on the same stream: the latest must win.
                        fences.push(Wait {
                            stream: w.stream,
                            fence: Fence(w.fence.0 - 1),
                        });
                    }
                    if reverse {
                        fences.reverse();
                    }
                    Op::Free { seq, fences }
                });
            options.push((6, free.boxed()));
            let seqs: Vec<u64> = state.live.keys().copied().collect();
            options.push((
                3,
                (sample::select(seqs), stream_strategy())
                    .prop_map(|(seq, stream)| Op::RecordStream { seq, stream })
                    .boxed(),
            ));
        }
        if !state.freed.is_empty() {
            let freed: Vec<u64> = state.freed.iter().copied().collect();
            options.push((
                2,
                sample::select(freed)
                    .prop_map(|seq| Op::FreeStale { seq: Some(seq) })
                    .boxed(),
            ));
        }
        Union::new_weighted(options).boxed()
    }

    fn preconditions(state: &Model, op: &Op) -> bool {
        match op {
            Op::Free { seq, .. } | Op::RecordStream { seq, .. } => state.live.contains_key(seq),
            Op::FreeStale { seq: Some(seq) } => state.freed.contains(seq),
            _ => true,
        }
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        state.expect = match *op {
            Op::Alloc {
                size,
                align,
                stream,
            } => state.alloc(size, align, stream),
            Op::Free { seq, ref fences } => state.free(seq, fences),
            Op::FreeStale { .. } => Expect::Stale,
            Op::RecordStream { seq, stream } => {
                let b = state.live.get_mut(&seq).unwrap();
                if b.stream != stream && !b.others.contains(&stream) {
                    b.others.push(stream);
                }
                Expect::Recorded {
                    streams: b.streams(),
                }
            }
            Op::CompleteFences { stream, fence } => {
                let c = state.completed.entry(stream).or_insert(fence);
                *c = (*c).max(fence);
                Expect::Nothing
            }
            Op::ReleaseFree => {
                let empty: Vec<u32> = state
                    .segments
                    .keys()
                    .copied()
                    .filter(|&id| state.is_empty_segment(id))
                    .collect();
                Expect::Released(
                    empty
                        .into_iter()
                        .map(|id| (SegmentId(id), state.remove_segment(id)))
                        .collect(),
                )
            }
            Op::ReleaseSegment { segment } => Expect::ReleasedOne(
                if state.segments.contains_key(&segment) && state.is_empty_segment(segment) {
                    Ok(state.remove_segment(segment))
                } else {
                    Err(AllocError::UnknownSegment(SegmentId(segment)))
                },
            ),
            Op::ResetPeak => {
                state.reset_peak();
                Expect::Nothing
            }
            Op::FitToPeak => state.fit_to_peak(),
        };
        state.refresh();
        state
    }
}

// ---------------------------------------------------------------------------------
// System under test
// ---------------------------------------------------------------------------------

struct Sut {
    core: Allocator,
    /// Live handles by sequence number, with the range the core gave them.
    live: BTreeMap<u64, (BlockId, SegmentId, u64, u64)>,
    /// Handles already freed.
    stale: BTreeMap<u64, BlockId>,
}

impl Sut {
    fn segment_size(&self, id: SegmentId) -> u64 {
        self.core
            .segments()
            .find(|(s, _, _)| *s == id)
            .map(|(_, _, size)| size)
            .expect("placement names an existing segment")
    }

    /// Checks that need no model: the new range is aligned, whole units, inside its
    /// segment and disjoint from every live range; the waits are sorted, one per
    /// stream, and never name the allocating stream.
    fn check_placement(&self, req: AllocRequest, p: &symmpool::__core::Placement) {
        let align = req.align_bytes.max(UNIT);
        assert_eq!(p.offset_bytes % align, 0, "misaligned: {p:?} for {req:?}");
        assert_eq!(p.size_bytes % UNIT, 0, "{p:?}");
        assert!(p.size_bytes >= req.size_bytes, "block too small: {p:?}");
        let end = p.offset_bytes + p.size_bytes;
        assert!(
            end <= self.segment_size(p.segment),
            "outside segment: {p:?}"
        );
        for &(id, seg, off, size) in self.live.values() {
            assert!(
                seg != p.segment || end <= off || off + size <= p.offset_bytes,
                "{p:?} overlaps live block {id:?} at {off}+{size} in {seg}"
            );
        }
        assert!(
            p.waits.windows(2).all(|w| w[0].stream < w[1].stream),
            "waits not sorted by stream, one per stream: {:?}",
            p.waits
        );
        assert!(
            p.waits.iter().all(|w| w.stream != req.stream),
            "wait on the allocating stream: {:?}",
            p.waits
        );
        assert!(!self.stale.contains_key(&p.block.seq) && !self.live.contains_key(&p.block.seq));
        assert_eq!(
            self.core.locate(p.block),
            Ok((p.segment, p.offset_bytes, p.size_bytes))
        );
        assert_eq!(
            self.core.streams_of(p.block).unwrap().as_slice(),
            &[req.stream]
        );
    }

    fn alloc(&mut self, req: AllocRequest, expect: &Expect) {
        let before = self.core.snapshot();
        let mut added = None;
        let result = match self.core.alloc(req) {
            Err(AllocError::NeedsGrowth(g)) => {
                // The core asks for exactly the documented policy's segment.
                let rounded = self.core.config().round_request(req.size_bytes).unwrap();
                let class = self.core.config().class_of(rounded);
                let large = self.core.class_allocated_bytes(class);
                assert_eq!(Ok(g), self.core.config().growth_with(rounded, large));
                if self.core.config().growth.is_registered() {
                    assert_eq!(g, documented_registered_growth(rounded, large));
                } else {
                    assert_eq!(g, documented_growth(rounded));
                }
                assert_eq!(self.core.snapshot().segments, before.segments);
                let id = self.core.add_segment(g).expect("growth the core asked for");
                self.core.check_invariants().unwrap();
                // A growth never moves a live block.
                for &(bid, seg, off, size) in self.live.values() {
                    assert_eq!(self.core.locate(bid), Ok((seg, off, size)));
                }
                added = Some((g, id));
                let retry = self.core.alloc(req);
                assert!(
                    !matches!(retry, Err(AllocError::NeedsGrowth(_))),
                    "still no fit after adding the segment the core asked for: {retry:?}"
                );
                retry
            }
            other => other,
        };
        match (result, expect) {
            (Ok(p), Expect::AllocOk { .. }) => {
                self.check_placement(req, &p);
                let got = Expect::AllocOk {
                    growth: added,
                    seq: p.block.seq,
                    segment: p.segment,
                    offset: p.offset_bytes,
                    size: p.size_bytes,
                    waits: p.waits.to_vec(),
                };
                assert_eq!(&got, expect, "placement differs from the model for {req:?}");
                self.live.insert(
                    p.block.seq,
                    (p.block, p.segment, p.offset_bytes, p.size_bytes),
                );
            }
            (Err(e), Expect::AllocErr(allowed)) => {
                assert!(added.is_none());
                assert!(allowed.contains(&e), "{e:?} not in {allowed:?} for {req:?}");
                // A refused request changes nothing but the miss counter.
                let mut after = self.core.snapshot();
                assert_eq!(after.segments, before.segments);
                after.stats.num_misses = before.stats.num_misses;
                assert_eq!(after.stats, before.stats);
            }
            (got, _) => panic!("alloc {req:?} gave {got:?}, model expects {expect:?}"),
        }
    }

    fn stale(&mut self, seq: Option<u64>) {
        let id = match seq {
            Some(seq) => self.stale[&seq],
            None => BlockId {
                slot: u32::MAX - 1,
                seq: u64::MAX,
            },
        };
        let before = self.core.snapshot();
        let err = Err(AllocError::StaleBlock(id));
        assert_eq!(self.core.free(id, &[]), err);
        let fence = Wait {
            stream: StreamId(1),
            fence: Fence(1),
        };
        assert_eq!(self.core.free(id, &[fence]), err);
        assert_eq!(self.core.record_stream(id, StreamId(2)), err);
        assert_eq!(self.core.streams_of(id), Err(AllocError::StaleBlock(id)));
        assert_eq!(self.core.locate(id), Err(AllocError::StaleBlock(id)));
        assert_eq!(
            self.core.snapshot(),
            before,
            "a stale handle changed the state"
        );
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = CoreModel;

    fn init_test(model: &Model) -> Sut {
        Sut {
            core: Allocator::new(config(model.registered)).unwrap(),
            live: BTreeMap::new(),
            stale: BTreeMap::new(),
        }
    }

    fn apply(mut sut: Sut, model: &Model, op: Op) -> Sut {
        let expect = &model.expect;
        match op {
            Op::Alloc {
                size,
                align,
                stream,
            } => sut.alloc(AllocRequest::new(size, stream).with_align(align), expect),
            Op::Free { seq, fences } => {
                let (id, ..) = sut.live.remove(&seq).unwrap();
                let Expect::Freed { streams } = expect else {
                    panic!("model expects {expect:?}")
                };
                assert_eq!(sut.core.streams_of(id).unwrap().as_slice(), &streams[..]);
                sut.core.free(id, &fences).unwrap();
                assert_eq!(sut.core.free(id, &fences), Err(AllocError::StaleBlock(id)));
                sut.stale.insert(seq, id);
            }
            Op::FreeStale { seq } => sut.stale(seq),
            Op::RecordStream { seq, stream } => {
                let id = sut.live[&seq].0;
                sut.core.record_stream(id, stream).unwrap();
                let Expect::Recorded { streams } = expect else {
                    panic!("model expects {expect:?}")
                };
                assert_eq!(sut.core.streams_of(id).unwrap().as_slice(), &streams[..]);
            }
            Op::CompleteFences { stream, fence } => {
                let before = sut.core.snapshot();
                sut.core.complete_fences(stream, fence);
                // Completion only moves the active-bytes statistic.
                let mut after = sut.core.snapshot();
                after.stats.active_bytes = before.stats.active_bytes;
                assert_eq!(after, before);
            }
            Op::ReleaseFree => {
                let released = sut.core.release_free_segments();
                assert_eq!(Expect::Released(released), *expect);
            }
            Op::ReleaseSegment { segment } => {
                let before = sut.core.snapshot();
                let r = sut.core.release_segment(SegmentId(segment));
                if r.is_err() {
                    assert_eq!(sut.core.snapshot(), before);
                }
                assert_eq!(Expect::ReleasedOne(r), *expect);
            }
            Op::ResetPeak => sut.core.reset_peak(),
            Op::FitToPeak => {
                let plan = sut.core.plan_fit_to_peak();
                let released = sut.core.release_planned(&plan).unwrap();
                assert_eq!(released, plan.release);
                let mut added = Vec::new();
                for &g in &plan.add {
                    match sut.core.add_planned(g) {
                        Ok(id) => added.push(id),
                        Err(AllocError::OutOfMemory { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                // Planned segments never move a live block.
                for &(bid, seg, off, size) in sut.live.values() {
                    assert_eq!(sut.core.locate(bid), Ok((seg, off, size)));
                }
                assert_eq!(Expect::Fitted(plan, added), *expect);
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        if let Err(e) = sut.core.check_invariants() {
            panic!("{e}");
        }
        let snap = sut.core.snapshot();
        assert_eq!(snap.stats, model.stats, "stats differ from the model");
        for class in [SizeClass::Small, SizeClass::Large] {
            assert_eq!(
                sut.core.class_allocated_bytes(class),
                model.class_allocated[class_index(class)],
                "{class:?} allocated bytes differ from the model"
            );
        }
        assert_eq!(
            snap.segments,
            model.layout(),
            "layout differs from the model"
        );
        // The handles the test holds are exactly the model's live blocks.
        let held: Vec<(u64, u32, u64, u64)> = sut
            .live
            .iter()
            .map(|(&seq, &(_, seg, off, size))| (seq, seg.0, off, size))
            .collect();
        let modelled: Vec<(u64, u32, u64, u64)> = model
            .live
            .iter()
            .map(|(&seq, b)| (seq, b.segment, b.offset, b.size))
            .collect();
        assert_eq!(held, modelled);
        for (&(id, seg, off, size), b) in sut.live.values().zip(model.live.values()) {
            assert_eq!(sut.core.locate(id), Ok((seg, off, size)));
            assert!(b.requested <= size);
        }
    }

    fn teardown(mut sut: Sut) {
        // Free everything: every segment is then entirely free and can be released.
        for (_, (id, ..)) in std::mem::take(&mut sut.live) {
            sut.core.free(id, &[]).unwrap();
        }
        sut.core.check_invariants().unwrap();
        let segments: u64 = sut.core.segments().map(|(_, _, size)| size).sum();
        let s = sut.core.stats();
        assert_eq!(s.reserved_bytes.current, segments);
        assert_eq!(s.allocated_bytes.current, 0);
        assert_eq!(s.free_blocks, s.segments.current);
        let released = sut.core.release_free_segments();
        assert_eq!(released.iter().map(|r| r.1).sum::<u64>(), segments);
        assert_eq!(sut.core.stats().reserved_bytes.current, 0);
        sut.core.check_invariants().unwrap();
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        // Few cases, long sequences; far fewer under miri, which is ~1000x slower.
        cases: if cfg!(miri) { 2 } else { 128 },
        max_shrink_iters: 4096,
        // Failing seeds in tests/core_model.proptest-regressions, run first (commit the file).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        .. ProptestConfig::default()
    })]

    /// Random call sequences against the model.
    #[test]
    fn core_matches_model(sequential 1..200 => Sut);
}

#[test]
fn model_config_is_valid_and_as_documented() {
    let c = config(false);
    c.validate().unwrap();
    for rounded in (UNIT..=MAX_REQUEST).step_by(UNIT as usize) {
        assert_eq!(c.growth_with(rounded, 0), Ok(documented_growth(rounded)));
    }
    let r = config(true);
    r.validate().unwrap();
    for large in [0, GRAN, MIN_CHUNK, 3 * MIN_CHUNK, MAX_CHUNK, 4 * MAX_CHUNK] {
        for rounded in (UNIT..=MAX_REQUEST).step_by(UNIT as usize) {
            assert_eq!(
                r.growth_with(rounded, large),
                Ok(documented_registered_growth(rounded, large))
            );
        }
    }
}
