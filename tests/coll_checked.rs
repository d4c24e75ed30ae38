//! Checked collectives on 2, 4 and 8 ranks as threads (host backend): every way the
//! ranks can disagree about a collective's buffers is reported on every rank, before
//! any data moves under `Strict`, within the stated bound under `Async`; under `Off`
//! it is silent, as documented. Plus a property test: random call sequences with one
//! perturbation on one rank are always reported, unperturbed ones never.
//!
//! The last rank is the perturbed one. Timeouts are a few hundred ms; nothing sleeps.

use proptest::prelude::*;
use std::thread;
use std::time::Duration;
use symmpool::coll::{self, CollectiveReport, PathPolicy};
use symmpool::{
    CheckMode, Error, HostBackend, HostConfig, PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool,
};

/// Records an async pool may have posted and not yet seen compared.
const Q: usize = 4;
const TIMEOUT: Duration = Duration::from_millis(400);

fn config(mode: CheckMode) -> PoolConfig {
    PoolConfig::default()
        .with_timeout(TIMEOUT)
        .with_check(mode)
        .with_check_queue(Q)
}

fn backends(world: usize) -> Vec<symmpool::Backend> {
    HostBackend::world(HostConfig::new(world).with_timeout(TIMEOUT)).unwrap()
}

/// What one rank saw.
#[derive(Debug, Default)]
struct Seen {
    /// Collectives attempted, and the first failing one (1-based) with its error.
    calls: usize,
    first: Option<(usize, Error)>,
    /// Whether the failing call's buffers still held what was written before it.
    untouched: bool,
    /// `wait_checks` at the end (on the first pool).
    after: Option<Error>,
}

impl Seen {
    /// Run one collective on `bufs` (written with a rank pattern first); false once a
    /// call has failed.
    fn call(
        &mut self,
        rank: usize,
        bufs: &[&SymmBuffer],
        f: impl FnOnce() -> symmpool::Result<CollectiveReport>,
    ) -> bool {
        if self.first.is_some() {
            return false;
        }
        self.calls += 1;
        let before: Vec<Vec<u8>> = bufs
            .iter()
            .map(|b| {
                let pattern: Vec<u8> = (0..b.len_bytes() as usize)
                    .map(|i| ((rank * 37 + i + self.calls) % 251) as u8 + 1)
                    .collect();
                b.write(&pattern).unwrap();
                pattern
            })
            .collect();
        match f() {
            Ok(_) => true,
            Err(e) => {
                self.untouched = bufs
                    .iter()
                    .zip(&before)
                    .all(|(b, p)| b.read::<u8>().unwrap() == *p);
                self.first = Some((self.calls, e));
                false
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Scenario {
    /// A free and an allocation in a different order on one rank: a later cache hit
    /// lands at another offset.
    FreeOrder,
    /// One rank skips one all-gather of a layer loop.
    Skip,
    /// Two pools on one backend, used in crossed order on one rank.
    CrossedPools,
    /// Two threads of one rank allocate in the other order (a race's outcome).
    Threads,
    /// Reduce-scatter with sum on some ranks, max on one (different communicators).
    SumMax,
    /// An all-gather size that picks the copy engine on one rank only.
    CopyEngineSize,
}

impl Scenario {
    /// The field the records differ in first.
    fn field(self, mode: CheckMode) -> &'static str {
        match (self, mode) {
            (Scenario::FreeOrder, _) => "input offset",
            (Scenario::Skip | Scenario::Threads, _) => "input allocation",
            (Scenario::CrossedPools, _) => "communicator sequence number",
            (Scenario::SumMax, _) => "reduction",
            (Scenario::CopyEngineSize, _) => "count",
        }
    }

    /// The collective (1-based, per rank) at which the strict check fails.
    fn strict_at(self) -> usize {
        match self {
            Scenario::Skip => 2,
            _ => 1,
        }
    }
}

/// Enough collectives after the divergence for the async bound to be reached.
const MORE: usize = Q + 3;

fn rank_body(s: Scenario, pools: &[SymmPool], perturbed: bool) -> Seen {
    let stream = Stream::host();
    let pool = &pools[0];
    let rank = pool.rank();
    let world = pool.world_size() as u64;
    let mut seen = Seen::default();
    let ag = |b: &SymmBuffer| coll::all_gather_in_place::<f32>(b, &stream);
    // Grow together first (a small segment serves every size below).
    drop(pool.alloc(1 << 20, &stream).unwrap());
    if s == Scenario::CrossedPools {
        drop(pools[1].alloc(1 << 20, &stream).unwrap());
    }
    match s {
        Scenario::FreeOrder => {
            let a = pool.alloc(4096, &stream).unwrap();
            let b = pool.alloc(8192, &stream).unwrap();
            let _x = pool.alloc(4096, &stream).unwrap();
            drop(a);
            let c = if perturbed {
                let c = pool.alloc(8192, &stream).unwrap();
                drop(b);
                c
            } else {
                drop(b);
                pool.alloc(8192, &stream).unwrap()
            };
            for _ in 0..MORE {
                if !seen.call(rank, &[&c], || ag(&c)) {
                    break;
                }
            }
        }
        Scenario::Skip => {
            for layer in 0..MORE + 2 {
                // Under Async a detected divergence fails the next allocation too.
                let buf = match pool.alloc(8192, &stream) {
                    Ok(b) => b,
                    Err(e) => {
                        seen.calls += 1;
                        seen.first = Some((seen.calls, e));
                        break;
                    }
                };
                if perturbed && layer == 1 {
                    continue;
                }
                if !seen.call(rank, &[&buf], || ag(&buf)) {
                    break;
                }
            }
        }
        Scenario::CrossedPools => {
            let a = pools[0].alloc(8192, &stream).unwrap();
            let b = pools[1].alloc(8192, &stream).unwrap();
            'outer: for i in 0..MORE {
                let order = if perturbed && i == 0 {
                    [&b, &a]
                } else {
                    [&a, &b]
                };
                for buf in order {
                    if !seen.call(rank, &[buf], || ag(buf)) {
                        break 'outer;
                    }
                }
            }
        }
        Scenario::Threads => {
            // Warm up together (one growth), then the two threads allocate.
            drop(pool.alloc(16384, &stream).unwrap());
            let alloc = |bytes| {
                thread::scope(|s| s.spawn(|| pool.alloc(bytes, &Stream::host())).join())
                    .unwrap()
                    .unwrap()
            };
            let (params, grads) = if perturbed {
                let g = alloc(4096);
                (alloc(8192), g)
            } else {
                let p = alloc(8192);
                (p, alloc(4096))
            };
            'outer: for _ in 0..MORE {
                for buf in [&params, &grads] {
                    if !seen.call(rank, &[buf], || ag(buf)) {
                        break 'outer;
                    }
                }
            }
        }
        Scenario::SumMax => {
            let buf = pool.alloc(world * 1024 * 4, &stream).unwrap();
            let op = if perturbed {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            for _ in 0..MORE {
                let f = || coll::reduce_scatter_in_place::<f32>(&buf, op, &stream);
                if !seen.call(rank, &[&buf], f) {
                    break;
                }
            }
        }
        Scenario::CopyEngineSize => {
            coll::set_path_policy(
                pool,
                PathPolicy::default().with_ce_all_gather_min_bytes(64 << 10),
            )
            .unwrap();
            let per_rank = if perturbed { 128 << 10 } else { 8 << 10 };
            let buf = pool.alloc(world * per_rank, &stream).unwrap();
            for _ in 0..MORE {
                if !seen.call(rank, &[&buf], || ag(&buf)) {
                    break;
                }
            }
        }
    }
    seen.after = coll::wait_checks(pool).err();
    seen
}

fn run(world: usize, mode: CheckMode, s: Scenario) -> Vec<Seen> {
    let bs = backends(world);
    let mut groups = vec![SymmPool::group(bs.clone(), &config(mode).with_name("a")).unwrap()];
    if s == Scenario::CrossedPools {
        groups.push(SymmPool::group(bs, &config(mode).with_name("b")).unwrap());
    }
    let per_rank: Vec<Vec<SymmPool>> = (0..world)
        .map(|r| groups.iter().map(|g| g[r].clone()).collect())
        .collect();
    thread::scope(|sc| {
        let hs: Vec<_> = per_rank
            .iter()
            .enumerate()
            .map(|(r, pools)| sc.spawn(move || rank_body(s, pools, r == world - 1)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn check_strict(world: usize, s: Scenario) {
    for (rank, seen) in run(world, CheckMode::Strict, s).into_iter().enumerate() {
        let (at, e) = seen
            .first
            .unwrap_or_else(|| panic!("{s:?} world {world} rank {rank}: no error"));
        assert_eq!(at, s.strict_at(), "{s:?} world {world} rank {rank}: {e}");
        assert!(
            seen.untouched,
            "{s:?} world {world} rank {rank}: data moved"
        );
        match (&e, s) {
            (Error::CollectiveDivergence(d), _) => {
                assert_eq!(d.field, s.field(CheckMode::Strict), "{e}");
                assert_eq!(d.values.len(), world, "{e}");
            }
            // Crossed pools: each rank waits in the other pool's check round, so the
            // strict check ends in a timeout, before any data moves.
            (Error::Timeout { .. } | Error::GroupBroken { .. }, Scenario::CrossedPools) => {}
            _ => panic!("{s:?} world {world} rank {rank}: {e:?}"),
        }
    }
}

fn check_async(world: usize, s: Scenario) {
    // The bound: the divergent collective (at most the second of this rank's calls,
    // counted over both pools for crossed pools) plus the queue plus one; crossed
    // pools spread this rank's calls over two queues.
    let bound = match s {
        Scenario::CrossedPools => 2 * (2 + Q + 1),
        _ => 2 + Q + 1,
    };
    for (rank, seen) in run(world, CheckMode::Async, s).into_iter().enumerate() {
        let (at, e) = seen
            .first
            .unwrap_or_else(|| panic!("{s:?} world {world} rank {rank}: no error"));
        assert!(
            at <= bound,
            "{s:?} world {world} rank {rank}: first error at {at}: {e}"
        );
        match seen.after {
            Some(Error::CollectiveDivergence(d)) => {
                assert_eq!(d.field, s.field(CheckMode::Async), "{d}");
            }
            other => panic!("{s:?} world {world} rank {rank}: after {other:?} (first {e:?})"),
        }
    }
}

const ALL: [Scenario; 6] = [
    Scenario::FreeOrder,
    Scenario::Skip,
    Scenario::CrossedPools,
    Scenario::Threads,
    Scenario::SumMax,
    Scenario::CopyEngineSize,
];

#[test]
fn strict_reports_every_scenario_on_every_rank_before_data_moves() {
    for world in [2, 4, 8] {
        for s in ALL {
            check_strict(world, s);
        }
    }
}

#[test]
fn async_reports_every_scenario_on_every_rank_within_the_bound() {
    for world in [2, 4, 8] {
        for s in ALL {
            check_async(world, s);
        }
    }
}

#[test]
fn off_is_silent_as_documented() {
    // Off: the host backend moves the data at the offsets each rank gives, as NCCL
    // would, and nobody reports anything.
    for world in [2, 4, 8] {
        for seen in run(world, CheckMode::Off, Scenario::FreeOrder) {
            assert!(seen.first.is_none(), "{:?}", seen.first);
            assert!(seen.after.is_none());
        }
    }
}

#[test]
fn after_a_divergence_every_later_call_fails_on_every_rank() {
    let bs = backends(2);
    let pools = SymmPool::group(bs, &config(CheckMode::Strict)).unwrap();
    let errs: Vec<Vec<bool>> = thread::scope(|sc| {
        let hs: Vec<_> = pools
            .iter()
            .map(|pool| {
                sc.spawn(move || {
                    let stream = Stream::host();
                    drop(pool.alloc(1 << 20, &stream).unwrap());
                    let n = if pool.rank() == 0 { 1024 } else { 2048 };
                    let buf = pool.alloc(2 * n * 4, &stream).unwrap();
                    let first = coll::all_gather_in_place::<f32>(&buf, &stream);
                    let second = coll::all_gather_in_place::<f32>(&buf, &stream);
                    let alloc = pool.alloc(512, &stream);
                    let reserve = pool.reserve(2 << 20);
                    let trim = pool.trim();
                    vec![
                        matches!(first, Err(Error::CollectiveDivergence(_))),
                        matches!(second, Err(Error::CollectiveDivergence(_))),
                        matches!(alloc, Err(Error::PoolBroken { .. })),
                        matches!(reserve, Err(Error::PoolBroken { .. })),
                        matches!(trim, Err(Error::PoolBroken { .. })),
                    ]
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.iter().all(|&x| x), "{e:?}");
    }
}

#[test]
fn a_loop_of_cache_hits_is_caught_by_the_light_agreement() {
    // No collective at all: rank 1 allocates other sizes from the cache. The light
    // agreement every 8 pool calls catches the differing call hash.
    for mode in [CheckMode::Strict, CheckMode::Async] {
        let pools = SymmPool::group(backends(2), &config(mode).with_check_every_calls(8)).unwrap();
        let results: Vec<Option<Error>> = thread::scope(|sc| {
            let hs: Vec<_> = pools
                .iter()
                .map(|pool| {
                    sc.spawn(move || {
                        let stream = Stream::host();
                        drop(pool.alloc(1 << 20, &stream).unwrap());
                        let bytes = if pool.rank() == 0 { 4096 } else { 8192 };
                        for _ in 0..(8 * (Q + 3)) {
                            if let Err(e) = pool.alloc(bytes, &stream) {
                                return Some(e);
                            }
                        }
                        coll::wait_checks(pool).err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            let e = r.unwrap_or_else(|| panic!("{mode:?}: not caught"));
            assert!(e.to_string().contains("pool call hash"), "{mode:?}: {e}");
        }
    }
}

#[test]
fn ranks_with_different_check_modes_fail_at_pool_creation() {
    let bs = backends(2);
    let errs: Vec<Error> = thread::scope(|sc| {
        let hs: Vec<_> = bs
            .into_iter()
            .enumerate()
            .map(|(r, b)| {
                sc.spawn(move || {
                    let mode = if r == 0 {
                        CheckMode::Async
                    } else {
                        CheckMode::Strict
                    };
                    SymmPool::new(b, config(mode)).unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(matches!(e, Error::ChannelMismatch { .. }), "{e:?}");
    }
}

// ---------------------------------------------------------------------------------
// The property test.

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Alloc { pool: usize, slot: usize, size: u64 },
    Free { slot: usize },
    Gather { slot: usize },
    Reduce { slot: usize, max: bool },
}

const SLOTS: usize = 4;
const SIZES: [u64; 3] = [4096, 8192, 12288];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2usize, 0..SLOTS, 0..SIZES.len()).prop_map(|(pool, slot, s)| Op::Alloc {
            pool,
            slot,
            size: SIZES[s]
        }),
        (0..SLOTS).prop_map(|slot| Op::Free { slot }),
        (0..SLOTS).prop_map(|slot| Op::Gather { slot }),
        (0..SLOTS, any::<bool>()).prop_map(|(slot, max)| Op::Reduce { slot, max }),
    ]
}

#[derive(Debug, Clone)]
enum Perturb {
    None,
    Swap(usize),
    Skip(usize),
    Extra(usize, u64),
    Size(usize),
    Pool(usize),
}

fn perturb() -> impl Strategy<Value = Perturb> {
    prop_oneof![
        Just(Perturb::None),
        (0..64usize).prop_map(Perturb::Swap),
        (0..64usize).prop_map(Perturb::Skip),
        (0..64usize, 0..SIZES.len()).prop_map(|(i, s)| Perturb::Extra(i, SIZES[s])),
        (0..64usize).prop_map(Perturb::Size),
        (0..64usize).prop_map(Perturb::Pool),
    ]
}

fn apply(ops: &[Op], p: &Perturb) -> Vec<Op> {
    let mut v = ops.to_vec();
    let n = v.len();
    match *p {
        Perturb::None => {}
        Perturb::Swap(i) if n >= 2 => v.swap(i % (n - 1), i % (n - 1) + 1),
        Perturb::Skip(i) if n >= 1 => {
            v.remove(i % n);
        }
        Perturb::Extra(i, size) => v.insert(
            i % (n + 1),
            Op::Alloc {
                pool: 0,
                slot: SLOTS,
                size,
            },
        ),
        Perturb::Size(i) if n >= 1 => {
            if let Op::Alloc { size, .. } = &mut v[i % n] {
                *size = if *size == SIZES[0] {
                    SIZES[1]
                } else {
                    SIZES[0]
                };
            }
        }
        Perturb::Pool(i) if n >= 1 => {
            if let Op::Alloc { pool, .. } = &mut v[i % n] {
                *pool = 1 - *pool;
            }
        }
        _ => {}
    }
    v
}

/// What one rank did, as the ranks must agree on it: per pool, its calls in order;
/// per communicator, the collectives on it in order (with their pool). Orders between
/// pools that no communicator sees are free (the pools are independent).
#[derive(Debug, Default, PartialEq)]
struct Trace {
    pools: [Vec<String>; 2],
    comms: std::collections::BTreeMap<usize, Vec<String>>,
}

/// Run `ops` on one rank; returns its trace and whether any error was reported
/// (including at the final collectives and `wait_checks`).
fn play(pools: &[SymmPool], ops: &[Op]) -> (Trace, bool) {
    let stream = Stream::host();
    // A slot holds (pool, the buffer's number among the pool's allocations, buffer):
    // the trace names buffers by that number, as the pool does.
    type Slot = Option<(usize, usize, SymmBuffer)>;
    let mut slots: Vec<Slot> = (0..=SLOTS).map(|_| None).collect();
    let mut trace = Trace::default();
    let mut allocs = [0usize; 2];
    let mut step = |op: &Op, slots: &mut Vec<Slot>| -> symmpool::Result<()> {
        let collective = |trace: &mut Trace,
                          pool: usize,
                          what: String,
                          r: &symmpool::Result<CollectiveReport>| {
            trace.pools[pool].push(what.clone());
            if let Ok(r) = r {
                trace
                    .comms
                    .entry(r.comm)
                    .or_default()
                    .push(format!("p{pool} {what}"));
            }
        };
        match *op {
            Op::Alloc { pool, slot, size } => {
                if let Some((old, id, _)) = slots[slot].take() {
                    trace.pools[old].push(format!("free #{id}"));
                }
                allocs[pool] += 1;
                trace.pools[pool].push(format!("alloc {size}"));
                slots[slot] = Some((pool, allocs[pool], pools[pool].alloc(size, &stream)?));
            }
            Op::Free { slot } => {
                if let Some((pool, id, _)) = slots[slot].take() {
                    trace.pools[pool].push(format!("free #{id}"));
                }
            }
            Op::Gather { slot } => {
                if let Some((pool, id, b)) = &slots[slot] {
                    let r = coll::all_gather_in_place::<f32>(b, &stream);
                    collective(&mut trace, *pool, format!("gather #{id}"), &r);
                    r?;
                }
            }
            Op::Reduce { slot, max } => {
                if let Some((pool, id, b)) = &slots[slot] {
                    let op = if max { ReduceOp::Max } else { ReduceOp::Sum };
                    let r = coll::reduce_scatter_in_place::<f32>(b, op, &stream);
                    collective(&mut trace, *pool, format!("reduce #{id} {max}"), &r);
                    r?;
                }
            }
        }
        Ok(())
    };
    let mut run = || -> symmpool::Result<()> {
        for op in ops {
            step(op, &mut slots)?;
        }
        // A final collective on each pool, then the verdict.
        for p in pools {
            let b = p.alloc(4096, &stream)?;
            coll::all_gather_in_place::<f32>(&b, &stream)?;
        }
        for p in pools {
            coll::wait_checks(p)?;
        }
        Ok(())
    };
    let failed = run().is_err();
    drop(slots);
    (trace, failed)
}

fn property(mode: CheckMode, ops: Vec<Op>, p: Perturb) -> Result<(), TestCaseError> {
    let world = 2;
    let bs = backends(world);
    let cfg = config(mode).with_timeout(Duration::from_millis(200));
    let a = SymmPool::group(bs.clone(), &cfg.clone().with_name("a")).unwrap();
    let b = SymmPool::group(bs, &cfg.with_name("b")).unwrap();
    let plans = [ops.clone(), apply(&ops, &p)];
    let out: Vec<(Trace, bool)> = thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let pools = [a[r].clone(), b[r].clone()];
                let plan = &plans[r];
                sc.spawn(move || play(&pools, plan))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if out[0].0 == out[1].0 {
        prop_assert!(!out[0].1 && !out[1].1, "unperturbed run reported: {out:?}");
    } else {
        prop_assert!(
            out[0].1 && out[1].1,
            "perturbation not reported on every rank: {p:?} {out:?}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn one_perturbation_is_always_reported_and_none_never_strict(
        ops in prop::collection::vec(op(), 1..24),
        p in perturb(),
    ) {
        property(CheckMode::Strict, ops, p)?;
    }

    #[test]
    fn one_perturbation_is_always_reported_and_none_never_async(
        ops in prop::collection::vec(op(), 1..24),
        p in perturb(),
    ) {
        property(CheckMode::Async, ops, p)?;
    }
}
