//! Hand-over of an allocator's layout to a newcomer rank (`Allocator::layout`,
//! `Allocator::from_layout`).
//!
//! `newcomer_decides_as_the_survivor_*`: a survivor runs random calls (allocs of small
//! and large sizes and alignments on a few streams, frees with fences, recorded streams,
//! fence completions, peak resets, trims, fits to the peak). At a random point its
//! layout goes through postcard to a newcomer built with `from_layout`; from then on
//! both get the same calls, frees only of blocks allocated after the hand-over (the
//! blocks live at the hand-over stay allocated on both: the pool pins them). After
//! every step both pass `check_invariants`, every call has the same outcome (placement
//! as segment, offset, size and sequence number; growth; errors; released segments;
//! fit plans) and the layouts are equal, less `num_waits` and `active_bytes`: the
//! survivor's free blocks keep the fences of its earlier frees (more waits, and active
//! bytes until completion), the newcomer's have none.
//!
//! `garbage_layouts_are_refused_or_reproduced`: one edit anywhere in a layout (a
//! number moved or set to an extreme, a flag or class flipped, a block or segment
//! dropped, duplicated or made free or live): `from_layout` must not panic, and what it
//! accepts passes `check_invariants` and has exactly the edited layout (less the
//! recomputed `active_bytes`).

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::FileFailurePersistence;
use serde_json::Value;
use symmpool::__core::{
    AllocError, AllocRequest, Allocator, BlockId, CoreConfig, Fence, FitPlan, Growth, Layout,
    SegmentId, StreamId, Wait,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const STREAMS: u64 = 3;

/// Small segments so that blocks collide, with a reserve limit so that some requests
/// fail with `OutOfMemory` (as in `tests/core_determinism.rs`).
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
    /// Free a block; bit i of `mask` gives a fence on the block's i-th stream.
    Free {
        pick: Index,
        mask: u8,
    },
    Record {
        pick: Index,
        stream: u64,
    },
    Complete {
        stream: u64,
        fence: u64,
    },
    ReleaseFree,
    ResetPeak,
    FitToPeak,
}

fn calls(max_size: u64, max_align: u64) -> impl Strategy<Value = Vec<Call>> {
    let size = prop_oneof![
        4 => 1..=8 * KIB,
        2 => 1..=max_size / 8,
        1 => 1..=max_size,
    ];
    let align = prop_oneof![
        3 => Just(1u64),
        1 => (9..=max_align.trailing_zeros()).prop_map(|l| 1u64 << l),
    ];
    let call = prop_oneof![
        10 => (size, align, 0..STREAMS)
            .prop_map(|(size, align, stream)| Call::Alloc { size, align, stream }),
        7 => (any::<Index>(), any::<u8>()).prop_map(|(pick, mask)| Call::Free { pick, mask }),
        1 => (any::<Index>(), 0..STREAMS).prop_map(|(pick, stream)| Call::Record { pick, stream }),
        2 => (0..STREAMS, 0..400u64).prop_map(|(stream, fence)| Call::Complete { stream, fence }),
        1 => Just(Call::ReleaseFree),
        1 => Just(Call::ResetPeak),
        1 => Just(Call::FitToPeak),
    ];
    proptest::collection::vec(call, 1..160)
}

/// What a call decided, the same on every rank.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Alloc {
        growth: Option<Growth>,
        /// (segment, offset, size, seq) of the block.
        placed: Result<(SegmentId, u64, u64, u64), AllocError>,
    },
    Released(Vec<(SegmentId, u64)>),
    Fitted(FitPlan, Vec<SegmentId>),
    None,
}

/// One rank: its allocator, the blocks it may free, and its fence clock.
struct Rank {
    core: Allocator,
    live: Vec<BlockId>,
    clock: u64,
}

impl Rank {
    fn call(&mut self, call: &Call) -> Outcome {
        match *call {
            Call::Alloc {
                size,
                align,
                stream,
            } => {
                let req = AllocRequest::new(size, StreamId(stream)).with_align(align);
                let mut growth = None;
                let result = match self.core.alloc(req) {
                    Err(AllocError::NeedsGrowth(g)) => {
                        growth = Some(g);
                        self.core.add_segment(g).unwrap();
                        self.core.alloc(req)
                    }
                    other => other,
                };
                if let Ok(p) = &result {
                    self.live.push(p.block);
                }
                let placed = result.map(|p| (p.segment, p.offset_bytes, p.size_bytes, p.block.seq));
                Outcome::Alloc { growth, placed }
            }
            Call::Free { pick, mask } if !self.live.is_empty() => {
                let id = self.live.swap_remove(pick.index(self.live.len()));
                let streams = self.core.streams_of(id).unwrap();
                let fences: Vec<Wait> = (streams.iter().enumerate())
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(i, &stream)| Wait {
                        stream,
                        fence: Fence(self.clock + i as u64),
                    })
                    .collect();
                self.clock += streams.len() as u64;
                self.core.free(id, &fences).unwrap();
                Outcome::None
            }
            Call::Record { pick, stream } if !self.live.is_empty() => {
                let id = self.live[pick.index(self.live.len())];
                self.core.record_stream(id, StreamId(stream)).unwrap();
                Outcome::None
            }
            Call::Free { .. } | Call::Record { .. } => Outcome::None,
            Call::Complete { stream, fence } => {
                self.core.complete_fences(StreamId(stream), Fence(fence));
                Outcome::None
            }
            Call::ReleaseFree => Outcome::Released(self.core.release_free_segments()),
            Call::ResetPeak => {
                self.core.reset_peak();
                Outcome::None
            }
            Call::FitToPeak => {
                let plan = self.core.plan_fit_to_peak();
                let added = match self.core.apply_fit_plan(&plan) {
                    Ok((_, added)) => added,
                    Err(AllocError::OutOfMemory { .. }) => Vec::new(),
                    Err(e) => panic!("{e}"),
                };
                Outcome::Fitted(plan, added)
            }
        }
    }
}

/// A layout less what the fences decide: `num_waits` and `active_bytes`.
fn decided(mut l: Layout) -> Layout {
    l.stats.num_waits = 0;
    l.stats.active_bytes = Default::default();
    l
}

fn check(core: &Allocator, who: &str) -> Result<(), TestCaseError> {
    (core.check_invariants()).map_err(|e| TestCaseError::fail(format!("{who}: {e}")))
}

fn run(cfg: CoreConfig, calls: &[Call], handover: Index) -> Result<(), TestCaseError> {
    let at = handover.index(calls.len());
    let mut a = Rank {
        core: Allocator::new(cfg).unwrap(),
        live: Vec::new(),
        clock: 1,
    };
    for call in &calls[..at] {
        a.call(call);
    }
    check(&a.core, "survivor")?;
    let bytes = postcard::to_allocvec(&a.core.layout()).unwrap();
    let layout: Layout = postcard::from_bytes(&bytes).unwrap();
    prop_assert_eq!(&layout, &a.core.layout());
    let mut b = Rank {
        core: Allocator::from_layout(cfg, &layout, StreamId(0)).unwrap(),
        live: Vec::new(),
        clock: 1,
    };
    check(&b.core, "newcomer")?;
    prop_assert_eq!(decided(b.core.layout()), decided(layout));
    // The blocks live at the hand-over stay allocated on both.
    a.live.clear();
    for (i, call) in calls[at..].iter().enumerate() {
        let (oa, ob) = (a.call(call), b.call(call));
        prop_assert_eq!(oa, ob, "call {} after the hand-over: {:?}", i, call);
        check(&a.core, "survivor")?;
        check(&b.core, "newcomer")?;
        let (la, lb) = (decided(a.core.layout()), decided(b.core.layout()));
        prop_assert_eq!(la, lb, "after call {} after the hand-over", i);
    }
    Ok(())
}

/// One edit of a layout's serde tree.
#[derive(Debug, Clone)]
enum Edit {
    Add(u64),
    Sub(u64),
    Set(u64),
    /// Flip a bool or a size class, make a free block live (seq, requested bytes) or a
    /// live block free.
    Flip(u64, u64),
    Remove(Index),
    Duplicate(Index),
}

fn edits() -> impl Strategy<Value = Edit> {
    let amount = prop_oneof![
        Just(1u64),
        Just(512),
        Just(16 * KIB),
        Just(MIB),
        any::<u64>()
    ];
    let big = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::from(u32::MAX))
    ];
    prop_oneof![
        amount.clone().prop_map(Edit::Add),
        amount.prop_map(Edit::Sub),
        big.prop_map(Edit::Set),
        (0..40u64, 1..=64 * KIB).prop_map(|(s, r)| Edit::Flip(s, r)),
        any::<Index>().prop_map(Edit::Remove),
        any::<Index>().prop_map(Edit::Duplicate),
    ]
}

/// JSON pointers of every node of `v`, depth first.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(fields) => {
            for (k, x) in fields {
                pointers(x, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

/// `node` changed by `edit`, where the edit fits its kind.
fn edited(node: &Value, edit: &Edit) -> Option<Value> {
    match (node, edit) {
        (Value::Number(n), Edit::Add(d)) => n.as_u64().map(|n| n.wrapping_add(*d).into()),
        (Value::Number(n), Edit::Sub(d)) => n.as_u64().map(|n| n.wrapping_sub(*d).into()),
        (Value::Number(_), Edit::Set(x)) => Some((*x).into()),
        (Value::Bool(b), Edit::Flip(..)) => Some((!b).into()),
        (Value::String(s), Edit::Flip(..)) => {
            Some(if s == "Small" { "Large" } else { "Small" }.into())
        }
        (Value::Null, Edit::Flip(seq, requested)) => {
            Some(serde_json::json!({ "seq": seq, "requested_bytes": requested }))
        }
        (Value::Object(o), Edit::Flip(..)) if o.contains_key("seq") => Some(Value::Null),
        (Value::Array(items), Edit::Remove(i)) if !items.is_empty() => {
            let mut items = items.clone();
            items.remove(i.index(items.len()));
            Some(items.into())
        }
        (Value::Array(items), Edit::Duplicate(i)) if !items.is_empty() => {
            let mut items = items.clone();
            let i = i.index(items.len());
            items.insert(i, items[i].clone());
            Some(items.into())
        }
        _ => None,
    }
}

fn garbage(cfg: CoreConfig, calls: &[Call], node: Index, edit: &Edit) -> Result<(), TestCaseError> {
    let mut a = Rank {
        core: Allocator::new(cfg).unwrap(),
        live: Vec::new(),
        clock: 1,
    };
    for call in calls {
        a.call(call);
    }
    let mut tree = serde_json::to_value(a.core.layout()).unwrap();
    let mut all = Vec::new();
    pointers(&tree, String::new(), &mut all);
    // The nodes the edit fits (an array to shorten needs a segment, or a block).
    let fits: Vec<(String, Value)> = (all.into_iter())
        .filter_map(|at| {
            let new = edited(tree.pointer(&at)?, edit)?;
            Some((at, new))
        })
        .collect();
    if fits.is_empty() {
        return Ok(());
    }
    let (at, new) = &fits[node.index(fits.len())];
    *tree.pointer_mut(at).unwrap() = new.clone();
    // Edits that leave the type (a segment id past u32) are not layouts at all.
    let Ok(layout) = serde_json::from_value::<Layout>(tree) else {
        return Ok(());
    };
    if let Ok(b) = Allocator::from_layout(cfg, &layout, StreamId(0)) {
        check(&b, "accepted garbage")?;
        let mut expect = layout.clone();
        expect.stats.active_bytes.current = layout.stats.allocated_bytes.current;
        prop_assert_eq!(b.layout(), expect, "edit {:?} at {}", edit, at);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 128 },
        // Failing seeds in tests/core_layout.proptest-regressions, run first (commit
        // the file).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        .. ProptestConfig::default()
    })]

    /// Small segments and a reserve limit: many splits, merges, growths and refusals.
    #[test]
    fn newcomer_decides_as_the_survivor_small_segments(
        calls in calls(MIB, 16 * KIB), at in any::<Index>()
    ) {
        run(small_config(), &calls, at)?;
    }

    /// The default configuration (dedicated segments), requests from 1 B to 64 MiB.
    #[test]
    fn newcomer_decides_as_the_survivor_default_config(
        calls in calls(64 * MIB, 2 * MIB), at in any::<Index>()
    ) {
        run(CoreConfig::default(), &calls, at)?;
    }

    /// The registered growth policy (chunks from the live bytes, fit headroom), with
    /// small chunks and the reserve limit.
    #[test]
    fn newcomer_decides_as_the_survivor_registered(
        calls in calls(MIB, 16 * KIB), at in any::<Index>()
    ) {
        run(small_config().with_chunk_bytes(64 * KIB, 512 * KIB), &calls, at)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 512 },
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        .. ProptestConfig::default()
    })]

    #[test]
    fn garbage_layouts_are_refused_or_reproduced(
        calls in calls(MIB, 16 * KIB), node in any::<Index>(), edit in edits()
    ) {
        garbage(small_config(), &calls, node, &edit)?;
    }
}
