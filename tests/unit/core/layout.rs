use super::super::{AllocRequest, BlockId, Fence, Placement, Wait};
use super::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn alloc(c: &mut Allocator, size_bytes: u64) -> BlockId {
    let req = AllocRequest::new(size_bytes, S0);
    let p = match c.alloc(req) {
        Err(AllocError::NeedsGrowth(g)) => {
            c.add_segment(g).unwrap();
            c.alloc(req).unwrap()
        }
        other => other.unwrap(),
    };
    p.block
}

/// An allocator with a small, a shared large and a dedicated segment, the id gap of a
/// released one, live and free blocks in each, a reset peak, and no fence pending.
fn sample() -> Allocator {
    let mut c = Allocator::new(CoreConfig::default()).unwrap();
    let a = alloc(&mut c, 4 * KIB); // segment 0, small
    alloc(&mut c, 8 * KIB + 1);
    let gone = alloc(&mut c, 40 * MIB); // segment 1, dedicated
    alloc(&mut c, 3 * MIB); // segment 2, shared large
    c.free(gone, &[]).unwrap();
    assert_eq!(c.release_free_segments().len(), 1);
    alloc(&mut c, 30 * MIB + 1); // segment 3, dedicated (32 MiB)
    c.free(
        a,
        &[Wait {
            stream: S1,
            fence: Fence(3),
        }],
    )
    .unwrap();
    c.complete_fences(S1, Fence(3));
    c.reset_peak();
    alloc(&mut c, KIB); // in a's hole: a split
    alloc(&mut c, 5 * MIB);
    c
}

#[test]
fn sample_has_every_kind_of_segment_and_block() {
    let l = sample().layout();
    let ids: Vec<u32> = l.segments.iter().map(|s| s.id.0).collect();
    assert_eq!(ids, [0, 2, 3]);
    assert_eq!(l.next_segment, SegmentId(4));
    let dedicated: Vec<bool> = l.segments.iter().map(|s| s.dedicated).collect();
    assert_eq!(dedicated, [false, false, true]);
    for s in &l.segments {
        assert!(s.blocks.iter().any(|b| b.live.is_none()), "{s:?}");
        assert!(s.blocks.iter().any(|b| b.live.is_some()), "{s:?}");
    }
    assert!(1 < l.window_seq && l.window_seq < l.next_seq);
}

#[test]
fn from_layout_round_trips_and_decides_the_same() {
    let mut a = sample();
    let l = a.layout();
    let mut b = Allocator::from_layout(*a.config(), &l, S1).unwrap();
    b.check_invariants().unwrap();
    assert_eq!(b.layout(), l);
    assert_eq!(b.plan_fit_to_peak(), a.plan_fit_to_peak());
    // The live blocks are on the newcomer's stream.
    let live = b.blocks.iter().find(|(_, blk)| !blk.is_free()).unwrap();
    let BlockUse::Allocated { seq, .. } = live.1.usage else {
        unreachable!()
    };
    let id = BlockId {
        slot: live.0 as u32,
        seq,
    };
    assert_eq!(b.streams_of(id).unwrap().as_slice(), &[S1]);
    for size in [512, 6 * KIB, 2 * MIB, 16 * MIB, 64 * MIB] {
        let req = AllocRequest::new(size, S0);
        let (pa, pb) = (a.alloc(req), b.alloc(req));
        match (pa, pb) {
            (Ok(pa), Ok(pb)) => {
                let at = |p: &Placement| (p.segment, p.offset_bytes, p.size_bytes, p.block.seq);
                assert_eq!(at(&pa), at(&pb), "{size} B");
            }
            (Err(AllocError::NeedsGrowth(ga)), Err(AllocError::NeedsGrowth(gb))) => {
                assert_eq!(ga, gb, "{size} B");
                assert_eq!(a.add_segment(ga), b.add_segment(gb));
            }
            other => panic!("{size} B: {other:?}"),
        }
        assert_eq!(decided(a.layout()), decided(b.layout()));
    }
}

/// A layout less what the fences the newcomer lacks decide: `num_waits` (a's hole of
/// the sample keeps its fence, a wait for every later use) and `active_bytes`.
fn decided(mut l: Layout) -> Layout {
    l.stats.num_waits = 0;
    l.stats.active_bytes = Default::default();
    l
}

#[test]
fn pending_fences_stay_behind() {
    let mut a = sample();
    let id = alloc(&mut a, 100 * KIB);
    let fence = Wait {
        stream: S1,
        fence: Fence(9),
    };
    a.free(id, &[fence]).unwrap();
    let l = a.layout();
    assert!(l.stats.active_bytes.current > l.stats.allocated_bytes.current);
    let mut b = Allocator::from_layout(*a.config(), &l, S0).unwrap();
    let mut expect = l.clone();
    expect.stats.active_bytes.current = l.stats.allocated_bytes.current;
    assert_eq!(b.layout(), expect);
    // The same block comes back, with the wait on the survivor only.
    let req = AllocRequest::new(100 * KIB, S0);
    let (pa, pb) = (a.alloc(req).unwrap(), b.alloc(req).unwrap());
    assert_eq!(
        (pa.offset_bytes, pa.block.seq),
        (pb.offset_bytes, pb.block.seq)
    );
    assert_eq!(
        (pa.waits.as_slice(), pb.waits.as_slice()),
        (&[fence][..], &[][..])
    );
}

#[test]
fn a_layout_survives_postcard() {
    let l = sample().layout();
    let bytes = postcard::to_allocvec(&l).unwrap();
    let back: Layout = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, l);
    let b = Allocator::from_layout(CoreConfig::default(), &back, S0).unwrap();
    assert_eq!(b.layout(), l);
}

/// The error of `from_layout` under `config` for the sample's layout changed by `edit`.
fn refused(config: CoreConfig, edit: impl FnOnce(&mut Layout)) -> AllocError {
    let mut l = sample().layout();
    edit(&mut l);
    Allocator::from_layout(config, &l, S0).unwrap_err()
}

/// Assert a [`AllocError::BadLayout`] whose rule mentions `rule`.
#[track_caller]
fn breaks(e: AllocError, rule: &str) {
    assert!(
        matches!(e, AllocError::BadLayout(what) if what.contains(rule)),
        "{e:?} does not name {rule:?}"
    );
}

fn refused_by_default(edit: impl FnOnce(&mut Layout)) -> AllocError {
    refused(CoreConfig::default(), edit)
}

#[test]
fn blocks_that_do_not_tile_are_refused() {
    let tiling = |edit: fn(&mut Vec<BlockLayout>)| {
        let e = refused_by_default(|l| edit(&mut l.segments[1].blocks));
        assert_eq!(e, AllocError::BadLayout(TILING));
    };
    tiling(|b| b[0].size_bytes += 512); // overlap
    tiling(|b| b[2].size_bytes -= 512); // short of the end
    tiling(|b| b[1].offset_bytes += 512);
    tiling(|b| b.truncate(2));
    tiling(|b| b.clear());
    tiling(|b| {
        let mut past = b.last().unwrap().clone();
        past.offset_bytes += past.size_bytes;
        b.push(past);
    });
    tiling(|b| {
        let zero = BlockLayout {
            offset_bytes: 0,
            size_bytes: 0,
            live: None,
        };
        b.insert(0, zero);
    });
    tiling(|b| {
        // A boundary off the 512 B unit.
        b[0].size_bytes -= 256;
        b[1].offset_bytes -= 256;
        b[1].size_bytes += 256;
    });
    // The sample's blocks under a coarser unit.
    let coarse = CoreConfig {
        min_block_bytes: 64 * KIB,
        ..CoreConfig::default()
    };
    assert_eq!(refused(coarse, |_| ()), AllocError::BadLayout(TILING));
}

#[test]
fn adjacent_free_blocks_are_refused() {
    let e = refused_by_default(|l| {
        let blocks = &mut l.segments[1].blocks;
        let last = blocks.last_mut().unwrap();
        assert!(last.live.is_none());
        last.size_bytes /= 2;
        let mut half = last.clone();
        half.offset_bytes += half.size_bytes;
        blocks.push(half);
    });
    breaks(e, "adjacent free");
}

#[test]
fn segment_ids_must_ascend_below_next_segment() {
    breaks(refused_by_default(|l| l.segments.swap(0, 1)), "segment ids");
    breaks(
        refused_by_default(|l| l.segments[1].id = l.segments[0].id),
        "segment ids",
    );
    breaks(
        refused_by_default(|l| l.next_segment = SegmentId(3)),
        "segment ids",
    );
}

#[test]
fn segments_must_be_what_the_config_makes() {
    let e = refused_by_default(|l| l.segments[1].size_bytes = 3 * MIB);
    assert_eq!(
        e,
        AllocError::BadSegmentSize {
            size_bytes: 3 * MIB
        }
    );
    let limited = CoreConfig::default().with_max_reserved_bytes(40 * MIB);
    assert!(matches!(
        refused(limited, |_| ()),
        AllocError::OutOfMemory { .. }
    ));
    let invalid = CoreConfig {
        min_block_bytes: 0,
        ..CoreConfig::default()
    };
    assert!(matches!(refused(invalid, |_| ()), AllocError::Config(_)));
    breaks(
        refused_by_default(|l| l.segments[1].dedicated = true),
        "dedicated",
    );
    breaks(refused(CoreConfig::registered(), |_| ()), "dedicated");
    // A small segment's blocks in a large one.
    breaks(
        refused_by_default(|l| l.segments[0].class = SizeClass::Large),
        "class",
    );
}

/// The `i`-th live block of the sample's layout.
fn live(l: &mut Layout, i: usize) -> &mut LiveBlock {
    let blocks = l.segments.iter_mut().flat_map(|s| &mut s.blocks);
    blocks.filter_map(|b| b.live.as_mut()).nth(i).unwrap()
}

#[test]
fn live_blocks_must_be_consistent() {
    let class = |edit: fn(&mut LiveBlock)| {
        breaks(refused_by_default(|l| edit(live(l, 3))), "requested bytes");
    };
    class(|b| b.requested_bytes = 0);
    class(|b| b.requested_bytes = 4 * KIB); // small, in a large segment
    class(|b| b.requested_bytes = 64 * MIB); // beyond its block
    let seq = "sequence numbers";
    breaks(refused_by_default(|l| live(l, 0).seq = 0), seq);
    breaks(refused_by_default(|l| live(l, 0).seq = l.next_seq), seq);
    breaks(refused_by_default(|l| live(l, 1).seq = live(l, 0).seq), seq);
    breaks(refused_by_default(|l| l.window_seq = 0), "window_seq");
    breaks(
        refused_by_default(|l| l.window_seq = l.next_seq + 1),
        "window_seq",
    );
}

#[test]
fn statistics_must_agree_with_the_blocks() {
    let stats = |edit: fn(&mut CoreStats)| {
        breaks(refused_by_default(|l| edit(&mut l.stats)), "statistics");
    };
    stats(|s| s.allocated_bytes.current += 512);
    stats(|s| s.requested_bytes.current -= 1);
    stats(|s| s.large.reserved_bytes.current += 2 * MIB);
    stats(|s| s.free_blocks += 1);
    stats(|s| s.segments.peak = 0);
    stats(|s| s.active_bytes.peak = 0);
    stats(|s| s.num_frees = s.num_allocs + 1);
    stats(|s| s.num_allocs += 1);
    // Counters placement never reads are the layout's, whatever they are.
    let mut l = sample().layout();
    (l.stats.num_waits, l.stats.num_misses) = (123, 7);
    let b = Allocator::from_layout(CoreConfig::default(), &l, S0).unwrap();
    assert_eq!(b.layout(), l);
}
