//! The divergence scenarios of the checked-collectives tests, on any backend: the
//! host tests (`coll_checked.rs`) run them on 2, 4 and 8 threads, the GPU tests on
//! NCCL. The last rank is the perturbed one.

use std::thread;
use std::time::Duration;
use symmpool::coll::{CollectiveReport, PathPolicy};
use symmpool::{
    Backend, CheckMode, Coll, CollectiveCalls, Error, Group, GroupConfig, PoolConfig, ReduceOp,
    Stream, SymmBuffer, SymmPool,
};

/// Records an async pool may have posted and not yet seen compared.
pub const Q: usize = 4;

/// The group configuration of the scenarios.
pub fn config(mode: CheckMode, timeout: Duration) -> GroupConfig {
    GroupConfig::default()
        .with_timeout(timeout)
        .with_check(mode)
        .with_check_queue(Q)
}

/// What one rank saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// Collectives attempted, and the first failing one (1-based) with its error.
    pub calls: usize,
    pub first: Option<(usize, Error)>,
    /// Whether the failing call's buffers still held what was written before it.
    pub untouched: bool,
    /// `wait_checks` at the end (on the first pool).
    pub after: Option<Error>,
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
pub enum Scenario {
    /// A free and an allocation in a different order on one rank: a later cache hit
    /// lands at another offset.
    FreeOrder,
    /// One rank skips one all-gather of a layer loop.
    Skip,
    /// Two pools in one group (on one backend), used in crossed order on one rank.
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
    pub fn field(self, mode: CheckMode) -> &'static str {
        match (self, mode) {
            (Scenario::FreeOrder, _) => "input offset",
            (Scenario::Skip | Scenario::Threads, _) => "input allocation",
            (Scenario::CrossedPools, _) => "pool (channel ordinal)",
            (Scenario::SumMax, _) => "reduction",
            (Scenario::CopyEngineSize, _) => "count",
        }
    }

    /// The collective (1-based, per rank) at which the strict check fails.
    pub fn strict_at(self) -> usize {
        match self {
            Scenario::Skip => 2,
            _ => 1,
        }
    }
}

/// Enough collectives after the divergence for the async bound to be reached.
pub const MORE: usize = Q + 3;

/// One rank's part of scenario `s` on its pools (`pools[1]` only for crossed pools),
/// every call on `stream`.
pub fn rank_body(s: Scenario, pools: &[SymmPool], perturbed: bool, stream: &Stream) -> Seen {
    let pool = &pools[0];
    let rank = pool.rank();
    let world = pool.world_size() as u64;
    let mut seen = Seen::default();
    // One handle for the rank's pools: crossed pools share its communicator numbers.
    let coll = Coll::with_pools(pools).unwrap();
    let ag = |b: &SymmBuffer| coll.tagged(0).all_gather_in_place::<f32>(b, stream);
    // Grow together first (a small segment serves every size below).
    drop(pool.alloc(1 << 20, stream).unwrap());
    if s == Scenario::CrossedPools {
        drop(pools[1].alloc(1 << 20, stream).unwrap());
    }
    match s {
        Scenario::FreeOrder => {
            let a = pool.alloc(4096, stream).unwrap();
            let b = pool.alloc(8192, stream).unwrap();
            let _x = pool.alloc(4096, stream).unwrap();
            drop(a);
            let c = if perturbed {
                let c = pool.alloc(8192, stream).unwrap();
                drop(b);
                c
            } else {
                drop(b);
                pool.alloc(8192, stream).unwrap()
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
                let buf = match pool.alloc(8192, stream) {
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
            let a = pools[0].alloc(8192, stream).unwrap();
            let b = pools[1].alloc(8192, stream).unwrap();
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
            drop(pool.alloc(16384, stream).unwrap());
            let alloc = |bytes| {
                thread::scope(|s| s.spawn(|| pool.alloc(bytes, stream)).join())
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
            let buf = pool.alloc(world * 1024 * 4, stream).unwrap();
            let op = if perturbed {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            for _ in 0..MORE {
                let f = || {
                    coll.tagged(0)
                        .reduce_scatter_in_place::<f32>(&buf, op, stream)
                };
                if !seen.call(rank, &[&buf], f) {
                    break;
                }
            }
        }
        Scenario::CopyEngineSize => {
            coll.set_path_policy(PathPolicy::default().with_ce_all_gather_min_bytes(64 << 10));
            let per_rank = if perturbed { 128 << 10 } else { 8 << 10 };
            let buf = pool.alloc(world * per_rank, stream).unwrap();
            for _ in 0..MORE {
                if !seen.call(rank, &[&buf], || ag(&buf)) {
                    break;
                }
            }
        }
    }
    seen.after = coll.wait_checks().err();
    seen
}

/// Run scenario `s` under `mode` on the ranks `bs` (one thread each, a new stream
/// each; one group per rank, which the crossed pools share); what every rank saw.
pub fn run(bs: Vec<Backend>, timeout: Duration, mode: CheckMode, s: Scenario) -> Vec<Seen> {
    let world = bs.len();
    let groups = Group::world(bs, &config(mode, timeout)).unwrap();
    let config = PoolConfig::default();
    let mut worlds = vec![SymmPool::world(&groups, &config.clone().with_name("a")).unwrap()];
    if s == Scenario::CrossedPools {
        worlds.push(SymmPool::world(&groups, &config.with_name("b")).unwrap());
    }
    let per_rank: Vec<Vec<SymmPool>> = (0..world)
        .map(|r| worlds.iter().map(|w| w[r].clone()).collect())
        .collect();
    thread::scope(|sc| {
        let hs: Vec<_> = per_rank
            .iter()
            .enumerate()
            .map(|(r, pools)| {
                sc.spawn(move || {
                    let stream = pools[0].new_stream().unwrap();
                    rank_body(s, pools, r == world - 1, &stream)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `Strict`: every rank fails at the divergent collective, naming the first differing
/// field, with its buffers untouched.
pub fn check_strict(bs: Vec<Backend>, timeout: Duration, s: Scenario) {
    let world = bs.len();
    for (rank, seen) in run(bs, timeout, CheckMode::Strict, s)
        .into_iter()
        .enumerate()
    {
        let (at, e) = seen
            .first
            .unwrap_or_else(|| panic!("{s:?} world {world} rank {rank}: no error"));
        assert_eq!(at, s.strict_at(), "{s:?} world {world} rank {rank}: {e}");
        assert!(
            seen.untouched,
            "{s:?} world {world} rank {rank}: data moved"
        );
        match &e {
            Error::CollectiveDivergence(d) => {
                assert_eq!(d.field, s.field(CheckMode::Strict), "{e}");
                assert_eq!(d.values.len(), world, "{e}");
            }
            _ => panic!("{s:?} world {world} rank {rank}: {e:?}"),
        }
    }
}

/// `Async`: every rank fails within the stated bound (in collectives), and
/// `wait_checks` names the differing field.
pub fn check_async(bs: Vec<Backend>, timeout: Duration, s: Scenario) {
    let world = bs.len();
    // The bound: the divergent collective (at most the second of this rank's calls)
    // plus the queue plus one.
    let bound = 2 + Q + 1;
    for (rank, seen) in run(bs, timeout, CheckMode::Async, s)
        .into_iter()
        .enumerate()
    {
        let (at, e) = seen
            .first
            .unwrap_or_else(|| panic!("{s:?} world {world} rank {rank}: no error"));
        assert!(
            at <= bound,
            "{s:?} world {world} rank {rank}: first error at {at}: {e}"
        );
        match (seen.after, s) {
            (Some(Error::CollectiveDivergence(d)), _) => {
                assert_eq!(d.field, s.field(CheckMode::Async), "{d}");
            }
            (other, _) => {
                panic!("{s:?} world {world} rank {rank}: after {other:?} (first {e:?})")
            }
        }
    }
}

/// Every scenario.
pub const ALL: [Scenario; 6] = [
    Scenario::FreeOrder,
    Scenario::Skip,
    Scenario::CrossedPools,
    Scenario::Threads,
    Scenario::SumMax,
    Scenario::CopyEngineSize,
];
