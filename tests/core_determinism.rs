//! Determinism of the allocator core: allocators fed the same call sequence make the
//! same decisions, whenever their fences complete.
//!
//! Every rank runs its own `Allocator`, and symmetric memory only works if all of them
//! place every block at the same offset. Ranks see their device work finish at different
//! times, so fence completion (`complete_fences`) happens at different points of the
//! call sequence on each. The property: two allocators fed the same random calls, with
//! completions at independent random points, return identical placements (block,
//! segment, offset, size), identical waits, identical growth and identical errors for
//! every call, and identical `snapshot()`s except the active-bytes statistic. A third
//! allocator sees the same calls with its stream ids renamed (stream ids need not agree
//! across ranks) and must place every block identically too.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::FileFailurePersistence;
use symmpool::__core::{
    AllocError, AllocRequest, Allocator, BlockId, CoreConfig, Fence, Placement, Snapshot, StreamId,
    Wait,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const STREAMS: u64 = 4;

/// Small segments so that blocks collide, with a reserve limit so that some requests
/// fail with `OutOfMemory`.
fn small_config() -> CoreConfig {
    let mut c = CoreConfig::default()
        .with_granularity_bytes(16 * KIB)
        .with_small(4 * KIB, 16 * KIB)
        .with_large_segment_bytes(128 * KIB)
        .with_dedicated_min_bytes(64 * KIB)
        .with_max_request_bytes(MIB)
        .with_max_reserved_bytes(2 * MIB);
    c.large_split_min_bytes = 8 * KIB;
    c
}

#[derive(Debug, Clone)]
enum Call {
    Alloc {
        size: u64,
        align: u64,
        stream: u64,
    },
    /// Free a live block; bit i of `mask` gives a fence on the block's i-th stream.
    Free {
        pick: Index,
        mask: u8,
    },
    Record {
        pick: Index,
        stream: u64,
    },
    ReleaseFree,
    ResetPeak,
    /// Plan a fit to the peak and carry it out.
    FitToPeak,
}

fn calls(max_size: u64, max_align: u64) -> impl Strategy<Value = Vec<Call>> {
    let size = prop_oneof![
        4 => 1..=8 * KIB,
        2 => 1..=max_size / 8,
        1 => 1..=max_size,
        1 => Just(0u64),
    ];
    let align = prop_oneof![
        6 => Just(1u64),
        3 => (9..=max_align.trailing_zeros()).prop_map(|l| 1u64 << l),
        1 => Just(3u64),
    ];
    let call = prop_oneof![
        10 => (size, align, 0..STREAMS)
            .prop_map(|(size, align, stream)| Call::Alloc { size, align, stream }),
        7 => (any::<Index>(), any::<u8>()).prop_map(|(pick, mask)| Call::Free { pick, mask }),
        2 => (any::<Index>(), 0..STREAMS).prop_map(|(pick, stream)| Call::Record { pick, stream }),
        1 => Just(Call::ReleaseFree),
        1 => Just(Call::ResetPeak),
        1 => Just(Call::FitToPeak),
    ];
    proptest::collection::vec(call, 1..300)
}

/// Fence completions to make before each call: (stream, fence).
type Completions = Vec<Vec<(u64, u64)>>;

fn completions(n: usize) -> impl Strategy<Value = Completions> {
    // Fences count up by at most STREAMS per call, so 0..=4n covers all of them.
    let fence = 0..=(4 * n as u64 + 4);
    proptest::collection::vec(
        prop_oneof![
            3 => Just(Vec::new()),
            1 => proptest::collection::vec((0..STREAMS, fence), 1..3),
        ],
        n,
    )
}

/// One rank: an allocator, how it names streams, and the blocks it holds.
struct Rank {
    core: Allocator,
    rename: fn(u64) -> StreamId,
    live: Vec<BlockId>,
}

/// What one call returned, in the rank's own stream names.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Alloc {
        growth: Option<symmpool::__core::Growth>,
        result: Result<Placement, AllocError>,
    },
    Free(Vec<StreamId>),
    Record(Vec<StreamId>),
    Released(Vec<(symmpool::__core::SegmentId, u64)>),
    Fitted(symmpool::__core::FitPlan, Vec<symmpool::__core::SegmentId>),
    None,
}

impl Rank {
    fn new(cfg: CoreConfig, rename: fn(u64) -> StreamId) -> Self {
        Rank {
            core: Allocator::new(cfg).unwrap(),
            rename,
            live: Vec::new(),
        }
    }

    fn call(&mut self, call: &Call, clock: &mut u64) -> Outcome {
        match *call {
            Call::Alloc {
                size,
                align,
                stream,
            } => {
                let req = AllocRequest::new(size, (self.rename)(stream)).with_align(align);
                let mut growth = None;
                let result = match self.core.alloc(req) {
                    Err(AllocError::NeedsGrowth(g)) => {
                        growth = Some(g);
                        let before: Vec<_> =
                            self.live.iter().map(|&id| self.core.locate(id)).collect();
                        self.core.add_segment(g).unwrap();
                        let after: Vec<_> =
                            self.live.iter().map(|&id| self.core.locate(id)).collect();
                        assert_eq!(before, after, "a growth moved a live block");
                        self.core.alloc(req)
                    }
                    other => other,
                };
                if let Ok(p) = &result {
                    self.live.push(p.block);
                }
                Outcome::Alloc { growth, result }
            }
            Call::Free { pick, mask } => {
                if self.live.is_empty() {
                    return Outcome::None;
                }
                let id = self.live.swap_remove(pick.index(self.live.len()));
                let streams = self.core.streams_of(id).unwrap().to_vec();
                let fences: Vec<Wait> = streams
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(i, &stream)| Wait {
                        stream,
                        fence: Fence(*clock + 1 + i as u64),
                    })
                    .collect();
                *clock += streams.len() as u64;
                self.core.free(id, &fences).unwrap();
                Outcome::Free(streams)
            }
            Call::Record { pick, stream } => {
                if self.live.is_empty() {
                    return Outcome::None;
                }
                let id = self.live[pick.index(self.live.len())];
                self.core.record_stream(id, (self.rename)(stream)).unwrap();
                Outcome::Record(self.core.streams_of(id).unwrap().to_vec())
            }
            Call::ReleaseFree => Outcome::Released(self.core.release_free_segments()),
            Call::ResetPeak => {
                self.core.reset_peak();
                Outcome::None
            }
            Call::FitToPeak => {
                let plan = self.core.plan_fit_to_peak();
                let before: Vec<_> = self.live.iter().map(|&id| self.core.locate(id)).collect();
                let added = match self.core.apply_fit_plan(&plan) {
                    Ok((_, added)) => added,
                    Err(AllocError::OutOfMemory { .. }) => Vec::new(),
                    Err(e) => panic!("{e}"),
                };
                let after: Vec<_> = self.live.iter().map(|&id| self.core.locate(id)).collect();
                assert_eq!(before, after, "fit-to-peak moved a live block");
                Outcome::Fitted(plan, added)
            }
        }
    }

    fn complete(&mut self, done: &[(u64, u64)]) {
        for &(stream, fence) in done {
            self.core
                .complete_fences((self.rename)(stream), Fence(fence));
        }
    }
}

fn same_stream(s: u64) -> StreamId {
    StreamId(s)
}

/// A non-monotone renaming, so that even the order of stream ids differs.
fn renamed_stream(s: u64) -> StreamId {
    StreamId([0xdead_beef, 7, u64::MAX, 1_000][s as usize])
}

fn inverse(s: StreamId) -> StreamId {
    StreamId(
        (0..STREAMS)
            .find(|&i| renamed_stream(i) == s)
            .expect("a renamed stream"),
    )
}

/// An outcome of the renamed rank, translated back to the common stream names.
fn translate(o: Outcome) -> Outcome {
    let names = |v: Vec<StreamId>| v.into_iter().map(inverse).collect();
    match o {
        Outcome::Alloc { growth, result } => Outcome::Alloc {
            growth,
            result: result.map(|mut p| {
                let mut waits: Vec<Wait> = p
                    .waits
                    .iter()
                    .map(|w| Wait {
                        stream: inverse(w.stream),
                        fence: w.fence,
                    })
                    .collect();
                waits.sort();
                p.waits = waits.into_iter().collect();
                p
            }),
        },
        Outcome::Free(v) => Outcome::Free(names(v)),
        Outcome::Record(v) => Outcome::Record(names(v)),
        other => other,
    }
}

/// The snapshot without the active-bytes statistic, which depends on completion.
fn without_active(mut s: Snapshot) -> Snapshot {
    s.stats.active_bytes = Default::default();
    s
}

/// (offset, size, requested, allocated?) of a block.
type BlockLayout = (u64, u64, u64, bool);

/// The layout only: segments and (offset, size, requested, state) of every block.
fn layout(s: &Snapshot) -> Vec<(u32, u64, Vec<BlockLayout>)> {
    s.segments
        .iter()
        .map(|seg| {
            (
                seg.id.0,
                seg.size_bytes,
                seg.blocks
                    .iter()
                    .map(|b| {
                        (
                            b.offset_bytes,
                            b.size_bytes,
                            b.requested_bytes,
                            b.state == symmpool::__core::BlockState::Allocated,
                        )
                    })
                    .collect(),
            )
        })
        .collect()
}

fn run(cfg: CoreConfig, calls: &[Call], done: [&Completions; 3]) -> Result<(), TestCaseError> {
    let mut a = Rank::new(cfg, same_stream);
    let mut b = Rank::new(cfg, same_stream);
    let mut c = Rank::new(cfg, renamed_stream);
    let (mut clock_a, mut clock_b, mut clock_c) = (0, 0, 0);
    for (i, call) in calls.iter().enumerate() {
        a.complete(&done[0][i]);
        b.complete(&done[1][i]);
        c.complete(&done[2][i]);
        let oa = a.call(call, &mut clock_a);
        let ob = b.call(call, &mut clock_b);
        let oc = translate(c.call(call, &mut clock_c));
        prop_assert_eq!(&oa, &ob, "call {} {:?}", i, call);
        prop_assert_eq!(&oa, &oc, "call {} {:?} (renamed streams)", i, call);
        let (sa, sb, sc) = (a.core.snapshot(), b.core.snapshot(), c.core.snapshot());
        prop_assert_eq!(layout(&sa), layout(&sc));
        prop_assert_eq!(without_active(sa), without_active(sb), "after call {}", i);
    }
    for r in [&a, &b, &c] {
        if let Err(e) = r.core.check_invariants() {
            return Err(TestCaseError::fail(e.to_string()));
        }
    }
    Ok(())
}

fn case(
    max_size: u64,
    max_align: u64,
) -> impl Strategy<Value = (Vec<Call>, Completions, Completions, Completions)> {
    calls(max_size, max_align).prop_flat_map(|calls| {
        let n = calls.len();
        (Just(calls), completions(n), completions(n), completions(n))
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 128 },
        // Failing seeds in tests/core_determinism.proptest-regressions, run first
        // (commit the file).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        .. ProptestConfig::default()
    })]

    /// Small segments and a reserve limit: many splits, merges, growths and refusals.
    #[test]
    fn same_calls_same_decisions_small_segments(
        (calls, d0, d1, d2) in case(MIB, 16 * KIB)
    ) {
        run(small_config(), &calls, [&d0, &d1, &d2])?;
    }

    /// The default configuration, requests from 1 B to 64 MiB.
    #[test]
    fn same_calls_same_decisions_default_config(
        (calls, d0, d1, d2) in case(64 * MIB, 2 * MIB)
    ) {
        run(CoreConfig::default(), &calls, [&d0, &d1, &d2])?;
    }

    /// The registered growth policy, with small chunks and the reserve limit.
    #[test]
    fn same_calls_same_decisions_registered_small(
        (calls, d0, d1, d2) in case(MIB, 16 * KIB)
    ) {
        let cfg = small_config().with_chunk_bytes(64 * KIB, 512 * KIB);
        run(cfg, &calls, [&d0, &d1, &d2])?;
    }

    /// The registered policy with its defaults, requests from 1 B to 64 MiB.
    #[test]
    fn same_calls_same_decisions_registered(
        (calls, d0, d1, d2) in case(64 * MIB, 2 * MIB)
    ) {
        run(CoreConfig::registered(), &calls, [&d0, &d1, &d2])?;
    }
}
