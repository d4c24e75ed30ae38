//! Collectives on pool buffers: all-gather (copy engine, symmetric kernel, or the plain
//! ring where the policy says), reduce-scatter and all-reduce (symmetric kernel or
//! NCCL's ordinary kernels), each on the fastest of the backend's paths for its size,
//! as calibrated (BENCHMARKS.md has the figures).
//!
//! They are the methods of [`CollectiveCalls`] on a [`Coll`] handle made from a pool
//! (local: no round; the pool knows nothing of the handle). Each call checks its
//! buffers (same pool, open, sizes consistent), picks a communicator and path from the
//! NCCL version, the communicators' CTA policies, the buffers' registrations and the
//! size ([`PathPolicy`]), runs it, and returns a [`CollectiveReport`] naming the path.
//! An inconsistent call is an error, never a silent fallback that could corrupt data.
//!
//! # Collective
//! Every function here is collective: every rank calls it in the same order, with
//! buffers of the same sizes from the same pool call sequence (hence the same offsets).
//!
//! # Cost of a call
//! Under [`CheckMode::Off`] a collective takes no lock and allocates nothing on the
//! calling thread: the pool's state is read from atomics, the path policy from the
//! thread's copy of it, and a buffer used on the stream it was last used on records
//! nothing. [`CheckMode::Async`] adds the record's post into the ledger's queue (one
//! short lock, no allocation), and waits while the queue is full (the bound below):
//! back-to-back calls run at about two per control-plane round, calls further apart
//! never wait. [`CheckMode::Strict`] makes one control-plane round per call. Then the
//! backend's call: on NCCL the enqueue and the completion event, on the caller's
//! thread. BENCHMARKS.md counts the instructions.
//!
//! # Checked collectives
//! NCCL's symmetric kernels and copy engines read and write peers at the caller's
//! window offset and check nothing: if the ranks disagree about a buffer (a free and an
//! allocation in different orders, a skipped collective, two pools crossed, two threads
//! racing on one rank) the result is silent corruption or a hang. So every collective
//! makes a **record**, the same mechanism on every backend:
//!
//! | field | what |
//! |---|---|
//! | record kind | collective, step boundary ([`Coll::end_step`]), or one of the pool's agreements (a growth, `trim`, `close`...: the same ledger carries them, so a rank whose extra allocation grows the pool while its peers make a collective fails on every rank within the growth's own round) |
//! | pool | the ordinal of the pool's exchange channel (its identity among the ranks) |
//! | tag | the caller's identity of the call ([`Coll::tagged`]: any `u64`, 0 included; "no tag" on a pool made for untagged calls) |
//! | pool collective number | collectives issued on this pool so far |
//! | collective, element type, reduction, count | the call |
//! | communicator, communicator sequence number | the communicator the path chose, and the collectives the handle issued on it over *every* pool of the handle (one handle per communicator set: see [`Coll::with_pools`]) |
//! | path | copy engine, symmetric kernel, plain kernel |
//! | input and output: allocation, segment, offset, bytes | the buffers (allocation sequence numbers are the same on every rank for the same call sequence) |
//! | pool call count and hash | the pool's running hash of every allocation and free before the call |
//!
//! The ranks compare their records in the **ledger** of the communicators: one
//! ordered stream of records on one exchange channel, shared by every pool over them
//! (the mode is part of the name of the group's ledger channel, so ranks with
//! different modes fail when they make the group, [`Error::ChannelMismatch`]). The
//! records of all those pools, collectives and agreements, form one sequence, so a
//! rank that reaches the communicators through two pools in crossed order differs
//! from its peers at the first crossed call ("pool").
//! What happens depends on the group's [`GroupConfig::check`](crate::GroupConfig::check):
//!
//! * [`CheckMode::Strict`]: before the collective is launched, the ranks exchange and
//!   compare the record. A difference is [`Error::CollectiveDivergence`] on every rank,
//!   naming the first differing field and each rank's value, and **no data moves**.
//!   Costs one control-plane round per collective on the calling thread; the round
//!   (under `Async`, the post) and the launch are one step per handle, so the records'
//!   order is the launches' order (a second thread waits).
//! * [`CheckMode::Async`] (the default): the calling thread posts the record and
//!   returns; the ledger's thread exchanges the posted records in batches and compares
//!   them. A difference breaks the pool on every rank: the next collective and the
//!   next local pool call fail with [`Error::CollectiveDivergence`]. **Bound on the
//!   damage**: a rank launches a collective only while at most
//!   [`GroupConfig::check_queue`](crate::GroupConfig::check_queue) (default **1**) of
//!   its earlier records are uncompared, so after a mismatch at this rank's collective
//!   *k*, at most `check_queue` further collectives of the rank run and return `Ok`,
//!   and collective *k* + `check_queue` + 1 fails with the divergence: with one
//!   persistent gather buffer, at most `check_queue` + 1 calls of a rank return `Ok`
//!   with another call's data (a caller further ahead waits for the check, at most
//!   twice the group's timeout). In time, a divergence is reported within one
//!   control-plane round after the last rank posted record *k*; a rank that skipped
//!   the last collective of a step, when it reaches [`Coll::end_step`], within one
//!   round; without a step boundary, after the group's timeout ([`Error::Timeout`]
//!   breaks the exchange). [`Coll::wait_checks`] waits until everything posted is
//!   compared. The diverging collectives themselves may have run (and moved wrong
//!   data, or timed out).
//! * [`CheckMode::Off`]: no record: a divergence is what it is without the crate
//!   (silent corruption on the symmetric paths, a hang or an NCCL error otherwise; the
//!   host backends move the data at the offsets given, bounds checked, and time out on
//!   mismatched rounds). At world size 1 every handle runs so: one rank has no peer
//!   to diverge from.
//!
//! **Calls that know who they are**: calls of the same shape make the same record, so
//! every collective carries its identity, [`Coll::tagged`], and a skipped call differs
//! in the field `tag` ([`TaggedColl`]). A collective without a tag is refused
//! ([`Error::Untagged`], nothing runs), in every mode and at every world size, unless
//! its pool was made for untagged collectives
//! ([`PoolConfig::with_untagged_collectives`](crate::PoolConfig::with_untagged_collectives),
//! alike on every rank: compared when the pool is made); those are compared by shape
//! only, and a skipped one is caught at the step boundary at the latest. The crate's
//! example (`fsdp_step`) and Python package (`symmpool.fsdp.install`) tag every
//! collective and mark every step.
//!
//! **Step boundary**: [`Coll::end_step`] catches a skipped or extra collective (tagged
//! or not), an extra allocation, or a loop of cache hits without collectives, on every
//! rank, at the end of its step at the latest: an extra collective shows in "record
//! kind" (against a peer's step boundary), an extra allocation in "pool call count".
//! (Under `Async` a collective that a peer never joins waits for it on a backend whose
//! collectives block: on the host threads backend this rank's failed check ends the
//! wait within a round; on the shared-memory backend the rank ahead gets that
//! collective's [`Error::Timeout`], then the divergence from `end_step`.)
//!
//! **Breakage is consistent**: after a mismatch, or a collective that timed out or
//! lost a peer, the pool fails every later call on this rank and every collective
//! pool operation on every rank (as [`Error::CollectiveDivergence`] says); `close`
//! still releases the memory.
//!
//! **NCCL's own check**: NCCL ≥ 2.29.7 has `NCCL_CHECK_MODE=DEBUG_GLOBAL`, which checks
//! each collective's registration and offsets across ranks (not skipped calls: a
//! skipped collective pairs with the next one); `scripts/gpu-check.sh run` sets it
//! when run with `NCCL_CHECK=1` (only for an NCCL that has it).
//!
//! ```
//! use symmpool::{coll, Coll, CollectiveCalls, PoolConfig, Stream, SymmPool};
//!
//! let pools = SymmPool::host_group(2, PoolConfig::default())?;
//! std::thread::scope(|s| {
//!     for pool in &pools {
//!         s.spawn(move || {
//!             let coll = Coll::new(pool).unwrap(); // local: no round with the peers
//!             let stream = Stream::host();
//!             let rank = pool.rank();
//!             // FSDP style: each rank holds its shard inside the gathered buffer.
//!             let params = pool.alloc(2 * 4 * 1024, &stream).unwrap();
//!             let shard = params.view::<f32>().unwrap().slice(rank * 1024, 1024).unwrap();
//!             shard.copy_from_host(&vec![rank as f32; 1024]).unwrap();
//!             // Every collective carries its identity: here layer 0's gather.
//!             let report = coll.tagged(0).all_gather_in_place::<f32>(&params, &stream).unwrap();
//!             assert_eq!(report.path, coll::Path::SymmetricKernel);
//!             let all = params.read::<f32>().unwrap();
//!             assert_eq!((all[0], all[1024]), (0.0, 1.0));
//!         });
//!     }
//! });
//! # Ok::<(), symmpool::Error>(())
//! ```

mod calibrate;
mod call;
mod path;

pub use calibrate::{CalibrateConfig, Calibration, MAX_CALIBRATE_BYTES, Measurement};
pub use call::{CollectiveCalls, TaggedColl};
pub(crate) use path::PATHS;
pub use path::{Choice, CollectiveReport, Path, PathPolicy, path_name};

use crate::backend::Claim;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{CheckMode, CollectiveRecord};
use crate::pool::{MemoryStats, StatValue, SymmPool};
use arc_swap::ArcSwap;
use call::invalid;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The collectives of one rank on the buffers of one pool (or of several pools of one
/// [`Group`](crate::Group); one handle per group), with the path chosen per
/// call, checked across ranks (see the [module documentation](self)): the methods of
/// [`CollectiveCalls`] (`use symmpool::CollectiveCalls;`), on the handle or its
/// [`tagged`](Self::tagged) form.
///
/// Cheap to clone (a handle); it keeps its pools alive. It owns the path policy, the
/// per-path counters and the per-communicator sequence numbers; its collectives'
/// records go to the pools' ledger. Examples: the [module's](self) and [`TaggedColl`]'s.
#[derive(Clone)]
pub struct Coll {
    inner: Arc<CollInner>,
}

struct CollInner {
    /// The pools, each with its counters (usually one).
    pools: Vec<PoolColl>,
    /// The path policy: read on every collective without a lock or a reference count
    /// ([`PolicyCell::with`]), replaced whole by [`Coll::set_path_policy`].
    policy: PolicyCell,
    /// Per communicator: collectives issued on it through this handle, over every
    /// pool of the handle (the records' communicator sequence number).
    comm_seqs: Box<[AtomicU64]>,
    /// This handle's hold on its group's communicators (one handle per group, so one
    /// sequence per communicator); `None` for calibration's handle, which
    /// runs inside a call of the handle holding them.
    _claim: Option<Claim>,
}

/// What the handle keeps per pool.
struct PoolColl {
    pool: SymmPool,
    /// Collectives issued on this pool (the records' pool collective number).
    collectives: AtomicU64,
    counters: PathCounters,
}

impl fmt::Debug for Coll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pools = self.inner.pools.iter().map(|p| &p.pool.config().name);
        f.debug_struct("Coll")
            .field("pools", &pools.collect::<Vec<_>>())
            .field("check", &self.check_mode())
            .finish_non_exhaustive()
    }
}

impl Coll {
    /// The collectives handle of `pool`, checked as its group's settings say
    /// ([`GroupConfig::check`](crate::GroupConfig::check),
    /// [`GroupConfig::check_queue`](crate::GroupConfig::check_queue)), with the default
    /// [`PathPolicy`].
    ///
    /// One handle per group: while a handle (or a clone of it) lives, a second on a
    /// pool of the same group is refused, since it would number
    /// their collectives apart from the first. Clone the handle to use it from several
    /// places, make one handle for several pools with [`with_pools`](Self::with_pools),
    /// or give a pool used from another thread a group of its own
    /// ([`Group::split`](crate::Group::split)).
    ///
    /// Local: no round with the peers (the checks are the group's ledger, made with the
    /// group), so ranks may make their handles at different times.
    ///
    /// # Errors
    /// [`Error::PoolClosed`] ([`Error::Shrunk`] on a pool a shrink replaced, whatever
    /// handle it has); [`Error::InvalidCollective`] if the pool's group already has a
    /// handle on this rank (with what to do instead).
    pub fn new(pool: &SymmPool) -> Result<Coll> {
        Self::build(std::slice::from_ref(pool), Some("Coll::new"))
    }

    /// One handle for several pools of one group: their collectives
    /// share the per-communicator sequence numbers and form one sequence of checked
    /// records, so a rank that uses two pools in crossed order fails at the first
    /// crossed call, on the field "pool" (under `Strict` before data moves). Each pool
    /// keeps its counters and its check mode; the path policy is the handle's. Local,
    /// as [`new`](Self::new).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::InvalidCollective`] if `pools` is empty, or if
    /// the pools are not all of one group (a pool in a group of its own has a handle of
    /// its own).
    pub fn with_pools(pools: &[SymmPool]) -> Result<Coll> {
        Self::build(pools, Some("Coll::with_pools"))
    }

    /// The handle of `pools`, holding their communicators (`op` names the call in
    /// errors); without `op`, calibration's handle of its temporary pool, which claims
    /// nothing (it is made inside a call of the handle that holds the communicators).
    fn build(pools: &[SymmPool], op: Option<&'static str>) -> Result<Coll> {
        let Some(first) = pools.first() else {
            return Err(Error::InvalidCollective {
                op: op.unwrap_or("Coll::with_pools"),
                detail: "no pool".into(),
            });
        };
        // Before the claim: a pool a shrink replaced says so, whatever handle it has.
        for pool in pools {
            pool.check_open()?;
            if !pool.group().same_group(first.group()) {
                return Err(invalid(
                    "Coll::with_pools",
                    "the pools are in different groups: make a handle per group".into(),
                ));
            }
        }
        let claim = op.map(|op| {
            let name = &first.config().name;
            first.group().claim_collectives().ok_or_else(|| {
                invalid(
                    op,
                    format!(
                        "the communicators of pool {name:?} already have a collectives handle on \
                         this rank; a second would number their collectives apart, and a rank \
                         using the two in crossed order would pair the wrong calls: clone the \
                         handle (it is cheap), make one for several pools with Coll::with_pools, \
                         or give a pool used from another thread its own group (Group::split)"
                    ),
                )
            })
        });
        let comms = first.backend().communicators();
        let inner = CollInner {
            _claim: claim.transpose()?,
            pools: pools
                .iter()
                .map(|pool| PoolColl {
                    pool: pool.clone(),
                    collectives: AtomicU64::new(0),
                    counters: PathCounters::default(),
                })
                .collect(),
            policy: PolicyCell::new(PathPolicy::default()),
            comm_seqs: comms.iter().map(|_| AtomicU64::new(0)).collect(),
        };
        Ok(Coll {
            inner: Arc::new(inner),
        })
    }

    /// One handle per pool, in the pools' order (for ranks that are threads of this
    /// process).
    ///
    /// # Errors
    /// The first rank's error, as [`new`](Self::new).
    pub fn world(pools: &[SymmPool]) -> Result<Vec<Coll>> {
        pools.iter().map(Coll::new).collect()
    }

    /// The (first) pool of the handle.
    pub fn pool(&self) -> &SymmPool {
        &self.inner.pools[0].pool
    }

    /// The check mode of the handle: its group's
    /// [`GroupConfig::check`](crate::GroupConfig::check), or [`CheckMode::Off`] at world
    /// size 1 (one rank has no peer to compare with).
    pub fn check_mode(&self) -> CheckMode {
        self.pool().check_mode()
    }

    /// Wait until every collective record this rank posted has been compared with the
    /// peers' (under [`CheckMode::Async`]; at once otherwise), and return the
    /// verdict: for example before reading results that must be trusted.
    ///
    /// # Collective
    /// The comparison needs the peers' records: every rank should call it at the same
    /// point (or at least have made the same collectives).
    ///
    /// # Errors
    /// [`Error::CollectiveDivergence`] or [`Error::PoolBroken`] if a check failed;
    /// [`Error::Timeout`] if the records are not compared within twice the group's timeout.
    pub fn wait_checks(&self) -> Result<()> {
        let deadline = Deadline::after(self.pool().group().config().timeout.saturating_mul(2));
        self.pool().ledger().wait_compared(deadline)
    }

    /// A step boundary: under [`CheckMode::Async`] and [`CheckMode::Strict`] (never at
    /// world size 1), check for each pool and communicator a record of the collectives
    /// issued on the pool and on the communicator and of the pool's call count and
    /// hash, then [`wait_checks`](Self::wait_checks): a skipped or extra collective, an
    /// extra allocation, or pool calls without collectives (a loop of cache hits)
    /// cannot drift past the step. A rank whose peer made one collective more fails
    /// here within one exchange round ("record kind" differs), not after a timeout.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence (its record pairs
    /// with the peers' records there).
    ///
    /// # Errors
    /// As [`wait_checks`](Self::wait_checks).
    pub fn end_step(&self) -> Result<()> {
        let deadline = Deadline::after(self.pool().group().config().timeout.saturating_mul(2));
        let (ledger, mode) = (self.pool().ledger(), self.check_mode());
        if mode == CheckMode::Off {
            return Ok(());
        }
        ledger.check()?;
        let launch = ledger.launch_lock();
        let comms = &self.inner.comm_seqs;
        for entry in &self.inner.pools {
            // One record per communicator: its sequence count, with the pool's
            // collective count and call hash (so a rank behind or ahead on any of
            // them fails here, on every rank, in this round).
            let (pool, head) = (entry.pool.channel().ordinal(), entry.pool.call_head());
            let collectives = entry.collectives.load(Ordering::Relaxed);
            for comm in 0..comms.len().max(1) {
                let seq = comms.get(comm).map_or(0, |c| c.load(Ordering::Relaxed));
                let record = CollectiveRecord::step(pool, collectives, (comm as u64, seq), head);
                ledger.submit(mode, record, || deadline)?;
            }
        }
        drop(launch);
        ledger.wait_compared(deadline)
    }

    /// The path thresholds the collectives use now ([`PathPolicy::default`] until
    /// [`set_path_policy`](Self::set_path_policy) replaces them).
    pub fn path_policy(&self) -> PathPolicy {
        PathPolicy::clone(&self.inner.policy.current.load())
    }

    /// Replace the path thresholds (for example with the result of
    /// [`calibrate`](Self::calibrate)). Collectives running on other threads finish
    /// with the policy they started with; the next ones read the new one (the policy
    /// is read without a lock).
    ///
    /// # Collective
    /// Every rank must use the same policy (a different choice of communicator on two
    /// ranks hangs the collective); `calibrate` returns the same policy on every rank.
    pub fn set_path_policy(&self, policy: PathPolicy) {
        self.inner.policy.set(policy);
    }

    /// The pool's flat statistics ([`SymmPool::memory_stats`]) with this handle's
    /// collectives on that pool: `collectives.PATH.count` and `collectives.PATH.bytes`
    /// per path (`copy_engine`, `symmetric_kernel`, `plain_kernel`; bytes per rank:
    /// all-gather input, reduce-scatter output, all-reduce buffer).
    pub fn memory_stats(&self) -> MemoryStats {
        let entry = &self.inner.pools[0];
        let mut m = entry.pool.memory_stats();
        for path in PATHS {
            let (n, bytes) = entry.counters.get(path as usize);
            let p = path_name(path);
            m.insert(format!("collectives.{p}.count"), StatValue::Count(n));
            m.insert(format!("collectives.{p}.bytes"), StatValue::Count(bytes));
        }
        m
    }

    /// The entry of `pool`, if the handle has it.
    #[inline]
    fn entry(&self, pool: &SymmPool) -> Option<&PoolColl> {
        self.inner.pools.iter().find(|e| e.pool.same_pool(pool))
    }
}

/// A handle's path policy, read on every collective for the price of a thread-local
/// lookup: each thread keeps the policy it last read with its *generation* (a number
/// no other policy of any handle ever has), and reads the shared one again only when
/// the generation changed ([`Coll::set_path_policy`]) or it last read another
/// handle's. An `ArcSwap` load on every call cost about a sixth of the crate's
/// instructions per call. Beside its copy, each thread keeps the paths of its last
/// few calls' shapes ([`PolicyCell::choice`]): a repeated call (every layer, every
/// step) skips the choice, about 100 instructions.
struct PolicyCell {
    current: ArcSwap<PathPolicy>,
    generation: AtomicU64,
}

/// Generations of path policies, over every handle of the process.
static GENERATIONS: AtomicU64 = AtomicU64::new(0);

/// What a path choice depends on that varies from call to call on one handle: the
/// pool (its entry's address), the operation, the element type, the bytes per rank;
/// the two buffers' segments (whose windows are fixed for their lives); a forced path.
/// The rest (the backend's NCCL version, world, nodes and communicators) is the
/// handle's.
type ChoiceKey = (
    (usize, path::CollOp, crate::dtype::DType, u64),
    (u32, u32),
    Option<Path>,
);

/// How many recent path choices a thread keeps under its current policy.
const CHOICES: usize = 4;

/// The policy this thread last read, and its choices under it.
struct LastPolicy {
    generation: u64,
    policy: Arc<PathPolicy>,
    choices: [Option<(ChoiceKey, (usize, Path))>; CHOICES],
    next: usize,
}

thread_local! {
    /// The policy this thread last read.
    static LAST_POLICY: std::cell::RefCell<Option<LastPolicy>> =
        const { std::cell::RefCell::new(None) };
}

impl PolicyCell {
    fn new(policy: PathPolicy) -> Self {
        PolicyCell {
            current: ArcSwap::from_pointee(policy),
            generation: AtomicU64::new(GENERATIONS.fetch_add(1, Ordering::Relaxed) + 1),
        }
    }

    /// Replace the policy: calls that read it before go on with the old one.
    fn set(&self, policy: PathPolicy) {
        self.current.store(Arc::new(policy));
        // Published after the store: a thread that sees the new generation reads the
        // new policy.
        let generation = GENERATIONS.fetch_add(1, Ordering::Relaxed) + 1;
        self.generation.store(generation, Ordering::Release);
    }

    /// The path for a call of `key`: this thread's earlier choice under the current
    /// policy, else `choose` of the policy (kept, the oldest of [`CHOICES`] dropped;
    /// the policy itself on a thread whose copy is gone: it is exiting). A choice is a
    /// function of the key and the policy, so the same key chooses the same path as
    /// long as the policy stands. `choose` must not read a policy: this thread's copy
    /// is borrowed while it runs. `try_with`: `LocalKey::with` was not always inlined
    /// into the call path.
    #[inline]
    fn choice(
        &self,
        key: ChoiceKey,
        choose: impl Fn(&PathPolicy) -> (usize, Path),
    ) -> (usize, Path) {
        let generation = self.generation.load(Ordering::Acquire);
        LAST_POLICY
            .try_with(|last| {
                let mut last = last.borrow_mut();
                if last.as_ref().is_some_and(|l| l.generation != generation) {
                    *last = None;
                }
                let last = last.get_or_insert_with(|| self.reload(generation));
                if let Some((_, c)) = last.choices.iter().flatten().find(|(k, _)| *k == key) {
                    return *c;
                }
                let c = choose(&last.policy);
                last.choices[last.next] = Some((key, c));
                last.next = (last.next + 1) % CHOICES;
                c
            })
            .unwrap_or_else(|_| choose(&self.current.load_full()))
    }

    /// A copy of the policy, read anew, with no choices yet.
    #[cold]
    #[inline(never)]
    fn reload(&self, generation: u64) -> LastPolicy {
        LastPolicy {
            generation,
            policy: self.current.load_full(),
            choices: [None; CHOICES],
            next: 0,
        }
    }
}

/// Collectives run on each path: calls and bytes per rank.
#[derive(Debug, Default)]
struct PathCounters {
    paths: [(AtomicU64, AtomicU64); 3],
}

impl PathCounters {
    /// Count one collective that ran on path number `path` with `bytes_per_rank`.
    ///
    /// A load and a store, not a locked read-modify-write (this is on every
    /// collective's path): exact because one rank's collectives on a pool are ordered
    /// (every rank must issue them in the same order, so calls from several threads
    /// are synchronised by the caller, and that synchronisation orders these accesses too).
    #[inline]
    fn add(&self, path: usize, bytes_per_rank: u64) {
        let Some((count, bytes)) = self.paths.get(path) else {
            return;
        };
        let n = count.load(Ordering::Relaxed);
        count.store(n.wrapping_add(1), Ordering::Relaxed);
        let b = bytes.load(Ordering::Relaxed);
        bytes.store(b.wrapping_add(bytes_per_rank), Ordering::Relaxed);
    }

    /// (calls, bytes per rank) of collectives on path number `path`.
    fn get(&self, path: usize) -> (u64, u64) {
        self.paths.get(path).map_or((0, 0), |(c, b)| {
            (c.load(Ordering::Relaxed), b.load(Ordering::Relaxed))
        })
    }
}
