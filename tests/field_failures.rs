//! The field's known failures, as tests: what users report against other
//! symmetric-memory pools, reproduced against this crate, each shown refused or
//! impossible.
//!
//! - Reuse in another order than registration silently corrupts a collective
//!   (pytorch/pytorch#190977): `reuse_in_another_order_than_registration_never_pairs_the_wrong_buffers`,
//!   on shared-memory processes, whose collectives read peers at the local offset.
//! - A pool that grows at run time on one rank hangs the others in registration
//!   (pytorch/pytorch#191955, sgl-project/sglang#36943):
//!   `growth_at_run_time_on_one_rank_fails_every_rank_within_the_timeout` on threads,
//!   `growth_at_run_time_on_one_process_fails_every_process_within_the_timeout` on
//!   processes, and `a_registration_that_never_completes_on_one_rank_holds_no_other_rank`.
//! - The same allocation registered twice until NCCL's symmetric address space runs
//!   out (NVIDIA/nccl#2331): `the_same_allocation_is_never_registered_twice`.
//!
//! Nothing sleeps to synchronise: ranks meet in the pool's own rounds, a stuck
//! registration is released by the test through a channel, and every wait is bounded
//! by a group timeout of a few seconds. Process jobs kill and reap their children on
//! every path and leave nothing in `/dev/shm`.

mod common;

use common::figures::{count, per_comm, segments};
use common::rng::Rng;
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use symmpool::backend::{Refused, Segment, SegmentProvider, Window};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Deadline, Error, Group, GroupConfig, HostBackend, HostConfig,
    PoolConfig, Stream, SymmBuffer, SymmPool,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// f32 elements per rank of a gathered buffer.
const CHUNK: usize = 1024;
/// "Within one exchange round": well under every timeout here.
const PROMPT: Duration = Duration::from_millis(1500);

/// Run `f(pool)` on one thread per rank; the results in rank order.
fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn mode_name(mode: CheckMode) -> &'static str {
    match mode {
        CheckMode::Strict => "strict",
        CheckMode::Async => "async",
        _ => "off",
    }
}

fn mode_of(name: Option<&str>) -> CheckMode {
    match name {
        Some("strict") => CheckMode::Strict,
        Some("off") => CheckMode::Off,
        _ => CheckMode::Async,
    }
}

/// The value of `key=` in a line of `key=value` words.
fn field_of<'a>(line: &'a str, key: &str) -> &'a str {
    let word = (line.split(' '))
        .find(|w| w.starts_with(key) && w[key.len()..].starts_with('='))
        .unwrap_or_else(|| panic!("no {key} in {line}"));
    &word[key.len() + 1..]
}

/// The first field a divergence names (`": <field> differs:"`), if `e` is one.
fn differing_field(e: &Error) -> Option<String> {
    let text = match e {
        Error::CollectiveDivergence(d) => d.to_string(),
        Error::Divergence(d) => d.to_string(),
        _ => return None,
    };
    let end = text.find(" differs:")?;
    let start = text[..end].rfind(": ")? + 2;
    Some(text[start..end].to_string())
}

// ---------------------------------------------------------------------------------
// 1. Reuse in another order than registration (pytorch/pytorch#190977)
// ---------------------------------------------------------------------------------

/// Generation-1 buffers of the reuse test; the odd ones are freed.
const GENERATION: usize = 8;
/// The reuse test's group timeout (what a process blocked in a collective its peer
/// stopped joining waits, under `Async`).
const REUSE_TIMEOUT: Duration = Duration::from_secs(3);

/// **Reported** (pytorch/pytorch#190977,
/// <https://github.com/pytorch/pytorch/issues/190977>): with PyTorch's
/// symmetric-memory `MemPool`, each rank reuses freed blocks locally, lowest address
/// first, while the ranks are tied together only by the order of their `rendezvous`
/// calls. When the ranks' address order differs (a rank used other memory before its
/// heap, or freed in another order), the n-th tensor lands in another window slot on
/// one rank than on the others; `rendezvous` succeeds (the sizes match) and the
/// collective silently returns wrong numbers.
///
/// **The crate's answer**: placement is a function of the pool's call sequence, never
/// of addresses or of the order in which blocks came back: a free block is chosen by
/// (size, segment number, offset), and freed neighbours merge, so ranks that freed the
/// same blocks in any order place the next tensors identically. The order of frees is
/// part of the call sequence all the same, and every collective's record carries that
/// sequence's count and hash and the allocation number, segment and offset of its
/// buffers: the ranks' differing frees are reported (`strict`: before data moves;
/// `async`: within its documented bound; `off`: at the next agreement, here `close`)
/// rather than assumed harmless, and a rank whose n-th collective names another
/// allocation than its peers' (the split generation itself, which the open
/// pytorch/pytorch#198024 proposes to detect in PyTorch) is refused the same way.
///
/// **The reproduction**, two processes on the shared-memory backend (each maps the
/// segments wherever its own address space puts them; a collective on windows writes
/// into every peer at the *local* offset, as NCCL's symmetric kernels do, so a
/// misplaced buffer shows as wrong data): generation 1 is eight buffers of one size,
/// allocated alike (one growth, one registration); the odd four are freed, rank 0 in
/// ascending and rank 1 in descending order (a free list that hands back the last
/// freed block would now place differently on each rank); generation 2 is four
/// buffers of the same size, and every rank all-gathers layer *i* in buffer *i*,
/// tagged *i*, and checks every rank's chunk. Asserted, in every check mode:
/// generation 2 fills exactly the freed slots, in the same order on every rank, and no
/// collective returns `Ok` with wrong data; under `strict` the first collective is
/// refused on the pool call hash before any data moved, under `async` the same
/// divergence is reported by the third collective at the latest, and under `off` every
/// collective succeeds (on the symmetric path) and `close` reports the divergence.
///
/// In the second scenario ("swapped") every rank frees alike but the last rank runs
/// layer *i* in generation 2's buffer 3 − *i*: under `strict` the first collective is
/// refused on its input allocation before data moves; under `async` at most the
/// documented two calls return `Ok`; under `off` (no per-collective check) every
/// collective returns `Ok` with wrong data on every rank: the silent corruption of the
/// report, which also shows that this harness sees a misplaced buffer when there is
/// one.
#[cfg(target_os = "linux")]
#[test]
fn reuse_in_another_order_than_registration_never_pairs_the_wrong_buffers() {
    use procs::*;
    let before = common::shm::shm_entries();
    for mode in ["strict", "async", "off"] {
        for scenario in ["free_order", "swapped"] {
            let what = format!("{scenario} {mode}");
            let extra = vec![
                ("CHECK_MODE", mode.to_string()),
                ("SCENARIO", scenario.to_string()),
                // Two processes on a loaded 2-core machine must not look frozen.
                ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
            ];
            let [placements, outcomes] = job_lines(2, "reuse", extra, ["@@placement ", "@@reuse "]);
            // Generation 2 takes the freed (odd) slots of generation 1, in one order on
            // every rank.
            for (rank, line) in placements.iter().enumerate() {
                let (gen1, gen2) = line.split_once(' ').unwrap();
                let gen1: Vec<&str> = gen1.trim_start_matches("gen1=").split(',').collect();
                let gen2: Vec<&str> = gen2.trim_start_matches("gen2=").split(',').collect();
                let mut freed: Vec<&str> = gen1.iter().copied().skip(1).step_by(2).collect();
                let mut taken = gen2.clone();
                freed.sort();
                taken.sort();
                assert_eq!(
                    taken, freed,
                    "{what}: rank {rank} did not reuse the freed slots"
                );
                assert_eq!(
                    line, &placements[0],
                    "{what}: rank {rank} placed differently"
                );
            }
            let seen: Vec<Outcome> = outcomes.iter().map(|l| Outcome::parse(l)).collect();
            for (rank, o) in seen.iter().enumerate() {
                let at = |o: &Outcome| o.first.unwrap_or(usize::MAX);
                match (scenario, mode) {
                    (_, "strict") => {
                        assert_eq!(o.first, Some(1), "{what}: rank {rank}: {o:?}");
                        assert!(o.untouched, "{what}: rank {rank}: data moved: {o:?}");
                        assert_eq!(o.wrong_ok, 0, "{what}: rank {rank}: {o:?}");
                    }
                    (_, "async") => {
                        // Collective k + 2 fails at the latest after a mismatch at k = 1.
                        assert!(at(o) <= 3, "{what}: rank {rank}: {o:?}");
                        let bound = if scenario == "swapped" { 2 } else { 0 };
                        assert!(o.wrong_ok <= bound, "{what}: rank {rank}: {o:?}");
                    }
                    ("free_order", _) => {
                        // Off: every collective ran, with the right data; the close's
                        // agreement compares the call sequences.
                        assert_eq!(o.first, None, "{what}: rank {rank}: {o:?}");
                        assert_eq!(o.wrong_ok, 0, "{what}: rank {rank}: {o:?}");
                        assert_eq!(o.closed, "Err(Divergence)", "{what}: rank {rank}: {o:?}");
                    }
                    _ => {
                        // Off, swapped: the report's silent corruption, on every layer.
                        assert_eq!(o.first, None, "{what}: rank {rank}: {o:?}");
                        assert_eq!(o.wrong_ok, GENERATION / 2, "{what}: rank {rank}: {o:?}");
                    }
                }
                if mode != "off" {
                    let field = if scenario == "swapped" {
                        "input allocation"
                    } else {
                        "pool call hash"
                    };
                    assert_eq!(
                        o.field.as_deref(),
                        Some(field),
                        "{what}: rank {rank}: {o:?}"
                    );
                    assert_eq!(o.closed, "Err(Broken)", "{what}: rank {rank}: {o:?}");
                } else {
                    // The collectives wrote into the peers at the local offset.
                    assert!(
                        o.path == "Some(SymmetricKernel)" || o.path == "Some(CopyEngine)",
                        "{what}: rank {rank}: {o:?}"
                    );
                }
            }
        }
    }
    assert_eq!(
        common::shm::shm_entries(),
        before,
        "nothing left in /dev/shm"
    );
}

/// One rank's `@@reuse` line.
#[derive(Debug)]
struct Outcome {
    first: Option<usize>,
    field: Option<String>,
    untouched: bool,
    wrong_ok: usize,
    path: String,
    closed: String,
}

impl Outcome {
    fn parse(line: &str) -> Outcome {
        let (first, field) = (field_of(line, "first"), field_of(line, "field"));
        Outcome {
            first: (first != "none").then(|| first.parse().unwrap()),
            field: (field != "none").then(|| field.replace('_', " ")),
            untouched: field_of(line, "untouched") == "true",
            wrong_ok: field_of(line, "wrong_ok").parse().unwrap(),
            path: field_of(line, "path").to_string(),
            closed: field_of(line, "closed").to_string(),
        }
    }
}

// ---------------------------------------------------------------------------------
// 2. Growth at run time on one rank (pytorch/pytorch#191955, sgl-project/sglang#36943)
// ---------------------------------------------------------------------------------

/// The growth tests' group timeout: with ranks as threads, and as processes (above the
/// store's heartbeat timeout there, so that it is what ends a wait on a live peer).
const GROWTH_TIMEOUT: Duration = Duration::from_secs(2);
const PROCESS_GROWTH_TIMEOUT: Duration = Duration::from_secs(4);
/// An allocation no segment of the warmed pool can serve.
const GROWTH_BYTES: u64 = 64 * MIB;
/// Steps of the serving loop; the last rank's request grows the pool in step 2.
const STEPS: u64 = 5;
const GROWS_AT: u64 = 2;

/// What one rank of the run-time growth loop saw.
#[derive(Debug)]
struct Grew {
    /// The first failure: (what, step, error).
    first: Option<(&'static str, u64, Error)>,
    /// Collectives that returned `Ok` with a chunk that is not that rank's of this step.
    wrong_ok: usize,
    /// From the loop's start to its first failure (or its end).
    took: Duration,
    /// (segments, registrations per communicator) before the loop and after it.
    before: (u64, Vec<u64>),
    after: (u64, Vec<u64>),
    /// How long `close` took, and its result.
    closed: (Duration, symmpool::Result<()>),
}

/// The variant's name of an error (`Timeout`, `CollectiveDivergence`, ...).
fn variant(e: &Error) -> String {
    let debug = format!("{e:?}");
    let end = debug.find([' ', '(', '{']).unwrap_or(debug.len());
    debug[..end].to_string()
}

impl Grew {
    /// One line, the same from a thread and from a process: `what=W step=N
    /// error=Variant growth_named=B took_ms=N wrong_ok=N figures=BEFORE/AFTER
    /// close_ms=N closed=Ok|Variant`.
    fn line(&self, grower: usize) -> String {
        let (what, step, error, named) = match &self.first {
            Some((what, step, e)) => {
                let named =
                    (e.to_string()).contains(&format!("rank {grower} has a growth of the pool by"));
                (*what, step.to_string(), variant(e), named)
            }
            None => ("none", "none".into(), "none".into(), false),
        };
        let figures = |(segments, registrations): &(u64, Vec<u64>)| {
            format!("{segments}:{registrations:?}").replace(' ', "")
        };
        format!(
            "what={what} step={step} error={error} growth_named={named} took_ms={} wrong_ok={} figures={}/{} close_ms={} closed={}",
            self.took.as_millis(),
            self.wrong_ok,
            figures(&self.before),
            figures(&self.after),
            self.closed.0.as_millis(),
            self.closed.1.as_ref().err().map_or("Ok".into(), variant),
        )
    }
}

/// The assertions of both run-time growth tests on every rank's line
/// ([`Grew::line`]): every rank fails at the lone growth's step, the growing rank in
/// its allocation and the others in their collective; under `strict` and `async` with
/// the same divergence, naming the growing rank's growth; under `off` with timeouts
/// (a rank that learns of another's timeout first reports `GroupBroken`); every rank
/// within `bound`, none with another step's data, all with the segments and
/// registrations they had before (the same on every rank), and every `close` within a
/// round.
fn check_growth(what: &str, mode: CheckMode, lines: &[String], bound: Duration) {
    let grower = lines.len() - 1;
    for (rank, line) in lines.iter().enumerate() {
        let at = format!("{what}, rank {rank}: {line}");
        assert_eq!(field_of(line, "step"), GROWS_AT.to_string(), "{at}");
        let call = if rank == grower {
            "alloc"
        } else {
            "all_gather"
        };
        assert_eq!(field_of(line, "what"), call, "{at}");
        let error = field_of(line, "error");
        if mode == CheckMode::Off {
            assert!(error == "Timeout" || error == "GroupBroken", "{at}");
        } else {
            assert_eq!(error, "CollectiveDivergence", "{at}");
            assert_eq!(field_of(line, "growth_named"), "true", "{at}");
        }
        let took: u64 = field_of(line, "took_ms").parse().unwrap();
        assert!(
            took < bound.as_millis() as u64,
            "{at}: not within {bound:?}"
        );
        assert_eq!(field_of(line, "wrong_ok"), "0", "{at}");
        let (before, after) = field_of(line, "figures").split_once('/').unwrap();
        assert_eq!(
            before, after,
            "{at}: the failed growth left a segment or a window"
        );
        assert_eq!(
            field_of(line, "figures"),
            field_of(&lines[0], "figures"),
            "{at}: the ranks' figures differ"
        );
        let close: u64 = field_of(line, "close_ms").parse().unwrap();
        assert!(
            close < PROMPT.as_millis() as u64,
            "{at}: close took {close} ms"
        );
        let closed = field_of(line, "closed");
        assert!(closed == "PoolBroken" || closed == "GroupBroken", "{at}");
    }
    if mode == CheckMode::Off {
        let timed_out = lines.iter().any(|l| field_of(l, "error") == "Timeout");
        assert!(timed_out, "{what}: no rank's wait timed out: {lines:?}");
    }
}

/// The serving loop of one rank: a persistent gather buffer and a cached 1 MiB block
/// (allocated alike, growing the pool together), then per step a batch buffer from
/// the cache, a tagged all-gather, `end_step`; in step [`GROWS_AT`] the last rank's
/// batch is larger than anything cached (its requests were longer), so its pool needs
/// a new segment there and nowhere else. Stops at the first failure.
fn serving_loop(pool: &SymmPool) -> Grew {
    let (rank, world) = (pool.rank(), pool.world_size());
    let coll = Coll::new(pool).unwrap();
    let stream = Stream::host();
    let gathered = pool.alloc((world * CHUNK * 4) as u64, &stream).unwrap();
    drop(pool.alloc(MIB, &stream).unwrap());
    let figures = || {
        let s = pool.memory_stats();
        (
            count(&s, "segment.all.current"),
            per_comm(pool, &s, "registrations"),
        )
    };
    let before = figures();
    let mut first = None;
    let mut wrong_ok = 0;
    let started = Instant::now();
    for step in 0..STEPS {
        let grows = step == GROWS_AT && rank == world - 1;
        let batch = match pool.alloc(if grows { GROWTH_BYTES } else { MIB / 2 }, &stream) {
            Ok(b) => b,
            Err(e) => {
                first = Some(("alloc", step, e));
                break;
            }
        };
        gathered
            .write(&vec![(rank * 1000) as f32 + step as f32; world * CHUNK])
            .unwrap();
        match coll
            .tagged(step)
            .all_gather_in_place::<f32>(&gathered, &stream)
        {
            Ok(_) => {
                let got = gathered.read::<f32>().unwrap();
                let right = (0..world).all(|r| {
                    got[r * CHUNK..(r + 1) * CHUNK]
                        .iter()
                        .all(|&v| v == (r * 1000) as f32 + step as f32)
                });
                wrong_ok += usize::from(!right);
            }
            Err(e) => {
                first = Some(("all_gather", step, e));
                break;
            }
        }
        drop(batch);
        if let Err(e) = coll.end_step() {
            first = Some(("end_step", step, e));
            break;
        }
    }
    let took = started.elapsed();
    let after = figures();
    drop((gathered, coll));
    let closing = Instant::now();
    let closed = pool.close();
    Grew {
        first,
        wrong_ok,
        took,
        before,
        after,
        closed: (closing.elapsed(), closed),
    }
}

/// **Reported** (pytorch/pytorch#191955,
/// <https://github.com/pytorch/pytorch/pull/191955>, and sgl-project/sglang#36943,
/// <https://github.com/sgl-project/sglang/issues/36943>): symmetric pools that register
/// a segment as an NCCL window when the caching allocator grows the pool at run time.
/// In PyTorch the allocator's trace hook turned a segment added after
/// `register_mem_pool(symm=True)` into a window, a collective call made on one rank's
/// local decision that the peers need not make, and the job hung; the pull request
/// stops the hook from making collective calls (and sorts the communicators it
/// registers on, which ranks had visited in opposite orders). In SGLang every rank
/// enters `ncclCommWindowRegister` when its pool grows, and a registration that does
/// not complete holds every scheduler process for good, with nothing logged (see also
/// `a_registration_that_never_completes_on_one_rank_holds_no_other_rank`).
///
/// **The crate's answer**: a segment is never registered on one rank's decision. Every
/// growth is first agreed by all ranks in a round of the control plane, bounded by the
/// group's timeout, and the agreement is a record of the same ledger as the collectives'
/// checks: a rank that grows where its peers make a collective is named there, within
/// the round (`strict`, `async`), and with the checks off the agreement and the peers'
/// collective each end at the group's timeout. Only after the agreement does any rank
/// allocate or register, so a refused growth leaves no window anywhere. (Two pools
/// that share communicators agree on the order of their registrations too:
/// `tests/pool_host.rs`, `pools_growing_in_different_orders_fail_before_any_window_pairs_wrongly`.)
///
/// **The reproduction**, three ranks as threads in every check mode: a serving loop
/// whose last rank needs a larger batch buffer in step 2 than anything its pool holds
/// (the others' batches come from the cache). Asserted: every rank gets an error at
/// that step, the growing rank in its allocation and the others in their collective:
/// under `strict` and `async` the same divergence naming the growth, within a round;
/// under `off` a timeout (or `GroupBroken`, where a rank learns of a peer's timeout
/// first) within the group's timeout plus a round; none returns another step's data;
/// every rank still has the segments and registrations it had before the loop (the
/// lone growth registered nothing, on any rank); and every rank's `close` returns
/// within a round, reporting the failure.
#[test]
fn growth_at_run_time_on_one_rank_fails_every_rank_within_the_timeout() {
    for mode in [CheckMode::Strict, CheckMode::Async, CheckMode::Off] {
        let config = GroupConfig::default()
            .with_timeout(GROWTH_TIMEOUT)
            .with_check(mode);
        let groups = Group::host(3, &config).unwrap();
        let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
        let lines: Vec<String> = on_ranks(&pools, |p| serving_loop(p).line(2));
        // Under the checks the divergence is found within a round; without them, the
        // waits end at the group's timeout.
        let bound = match mode {
            CheckMode::Off => GROWTH_TIMEOUT + PROMPT,
            _ => PROMPT,
        };
        check_growth(&format!("threads, {mode:?}"), mode, &lines, bound);
    }
}

/// A segment provider that forwards everything, except that the `stuck_at`-th
/// registration (1-based) does not complete until the test sends on `release`: the
/// lost message of sgl-project/sglang#36943. Released, it forwards the registration,
/// whose round its peers have long left.
#[derive(Debug)]
struct StuckRegistration {
    inner: Arc<dyn SegmentProvider>,
    stuck_at: u64,
    seen: Mutex<u64>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl SegmentProvider for StuckRegistration {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        self.inner.allocate(size_bytes)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> symmpool::Result<Option<Window>> {
        let n = {
            let mut seen = self.seen.lock().unwrap();
            *seen += 1;
            *seen
        };
        if n == self.stuck_at {
            // Bounded only so that a broken test cannot hang the suite.
            let _ = (self.release.lock().unwrap()).recv_timeout(Duration::from_secs(60));
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.register(segment, comm, deadline) }
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.free(segment) }
    }
}

/// **Reported** (sgl-project/sglang#36943,
/// <https://github.com/sgl-project/sglang/issues/36943>): every rank grows its pool at
/// run time and enters `ncclCommWindowRegister` together; the registration's
/// file-descriptor exchange loses a message, and every rank then waits in a `recvmsg`
/// without a timeout, forever, with nothing logged.
///
/// **The crate's answer**: a registration's wait is bounded by the growth's deadline
/// (half of what is left of the group's timeout; on NCCL through the watchdog, which
/// revokes and aborts a call stuck inside NCCL: README, *On GPUs*), and the outcome of
/// every registration is agreed in a round of its own, so a registration that did not
/// complete somewhere fails the growth on every rank, and every later collective pool
/// call fails at once ([`Error::GroupBroken`]) instead of registering a window out of
/// step.
///
/// **The reproduction**, two ranks as threads: both grow at the same call; rank 1's
/// registration does not complete (its provider blocks until the test releases it, as
/// a thread of the host backend has no watchdog to end it). Asserted: rank 0, which
/// is inside the real registration round, returns a timeout naming rank 1 within the
/// group's timeout plus a round, while rank 1 is still stuck (the test releases it
/// only then); released, rank 1 fails too, learning that rank 0 timed out; each
/// rank's next growth fails within a round with [`Error::GroupBroken`]; and neither
/// rank holds a segment or a window of the failed growths.
#[test]
fn a_registration_that_never_completes_on_one_rank_holds_no_other_rank() {
    let (release, stuck) = mpsc::channel();
    let mut world = HostBackend::world(HostConfig::new(2)).unwrap();
    let last = world.pop().unwrap().with_segments(|inner| {
        Arc::new(StuckRegistration {
            inner,
            // The first growth registers on the two registering communicators; the
            // second growth's first registration is stuck.
            stuck_at: 3,
            seen: Mutex::new(0),
            release: Mutex::new(stuck),
        })
    });
    world.push(last);
    let config = GroupConfig::default().with_timeout(GROWTH_TIMEOUT);
    let groups = Group::world(world, &config).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let stream = Stream::host();
    let run = |p: &SymmPool| {
        let warm = p.alloc(MIB, &stream).unwrap();
        let started = Instant::now();
        let grown = p.alloc(GROWTH_BYTES, &stream).map(drop);
        let took = started.elapsed();
        let started = Instant::now();
        let next = p.alloc(GROWTH_BYTES, &stream).map(drop);
        let next_took = started.elapsed();
        let figures = (segments(p), per_comm(p, &p.memory_stats(), "windows"));
        drop(warm);
        (grown, took, (next, next_took), figures)
    };
    let (healthy, stuck) = thread::scope(|s| {
        let h0 = s.spawn(|| run(&pools[0]));
        let h1 = s.spawn(|| run(&pools[1]));
        // Rank 0 returns while rank 1 is still inside its registration.
        let healthy = h0.join().unwrap();
        let still_stuck = !h1.is_finished();
        release.send(()).unwrap();
        (healthy, (still_stuck, h1.join().unwrap()))
    });
    let (grown, took, next, figures) = &healthy;
    match grown {
        Err(Error::Timeout {
            op: "window registration",
            missing_ranks,
            ..
        }) => assert_eq!(missing_ranks, &[1]),
        other => panic!("rank 0: {other:?}"),
    }
    assert!(*took < GROWTH_TIMEOUT + PROMPT, "rank 0 waited {took:?}");
    assert!(stuck.0, "rank 1 returned before the test released it");
    let (grown1, _, next1, figures1) = &stuck.1;
    assert!(
        matches!(grown1, Err(Error::GroupBroken { rank: 0, .. })),
        "rank 1: {grown1:?}"
    );
    for (rank, (next, next_took)) in [next, next1].into_iter().enumerate() {
        assert!(
            matches!(next, Err(Error::GroupBroken { .. })),
            "rank {rank}: {next:?}"
        );
        assert!(*next_took < PROMPT, "rank {rank}: {next_took:?}");
    }
    // The warm-up's segment and its two windows, nothing of the failed growths.
    for (rank, f) in [figures, figures1].into_iter().enumerate() {
        assert_eq!(f, &(1, vec![1, 1, 0]), "rank {rank}");
    }
}

// ---------------------------------------------------------------------------------
// 3. The same allocation registered twice (NVIDIA/nccl#2331)
// ---------------------------------------------------------------------------------

/// A segment provider that forwards everything and keeps NCCL's account: the
/// segments it allocated, and per communicator the windows alive and the bytes they
/// map (NCCL 2.30.7 maps each window's whole allocation into the communicator's
/// symmetric address space, without deduplication).
#[derive(Debug, Default)]
struct Ledger {
    allocated: u64,
    /// Per communicator: registrations made, and window ordinal → bytes mapped.
    registrations: BTreeMap<usize, u64>,
    windows: BTreeMap<usize, BTreeMap<u64, u64>>,
}

#[derive(Debug)]
struct Counting {
    inner: Arc<dyn SegmentProvider>,
    ledger: Arc<Mutex<Ledger>>,
}

impl SegmentProvider for Counting {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        let segment = self.inner.allocate(size_bytes)?;
        self.ledger.lock().unwrap().allocated += 1;
        Ok(segment)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> symmpool::Result<Option<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        let window = unsafe { self.inner.register(segment, comm, deadline) }?;
        let mut ledger = self.ledger.lock().unwrap();
        *ledger.registrations.entry(comm).or_default() += 1;
        if let Some(w) = &window {
            let mapped = ledger.windows.entry(comm).or_default();
            mapped.insert(w.ordinal(), segment.size_bytes());
        }
        Ok(window)
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        let (comm, ordinal) = (window.comm(), window.ordinal());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.deregister(window, deadline) }?;
        let mut ledger = self.ledger.lock().unwrap();
        (ledger.windows.entry(comm).or_default()).remove(&ordinal);
        Ok(())
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.free(segment) }
    }
}

/// **Reported** (NVIDIA/nccl#2331, <https://github.com/NVIDIA/nccl/issues/2331>):
/// calling `ncclCommWindowRegister` several times on the same allocation (several
/// tensors of one slab, or one buffer registered again) maps the whole allocation into
/// the communicator's symmetric address space each time (NCCL 2.30.7 keeps no count
/// of what is mapped), until `ncclSpaceAlloc` fails with "No suitable space" and the
/// registrations after it with an unhandled CUDA error.
///
/// **The crate's answer**: there is no call that registers a buffer. The pool's safe
/// API has none; windows belong to segments, and a segment is registered exactly once
/// per registering communicator, by the growth that adds it (an allocation that grows
/// the pool, `reserve`, `reserve_small`, `fit_to_peak`), and deregistered once, by the
/// release that removes it (`trim`, `close`). Buffers are carved out of registered
/// segments and use their windows. (The backend's `SegmentProvider::register` is an
/// `unsafe` trait method for those who write a backend, whose contract forbids a
/// second window on a segment.)
///
/// **The reproduction**, two ranks as threads, every rank's provider wrapped in one
/// that keeps NCCL's account (registrations made, windows alive and the bytes they
/// map, per communicator): 560 tensors carved out of a reserved large segment and a
/// reserved small one (the several tensors of one slab), the same `reserve` made
/// again, then 40 cycles of seeded allocations and frees (some growing the pool), a
/// `trim` every second cycle and `fit_to_peak` once, a last `trim` and `close`.
/// Asserted after every step, on every rank, for each registering communicator: the
/// windows alive, by the pool's count and by the provider's, and the pool's
/// registrations less its deregistrations, equal the segments; the bytes the windows
/// map equal the pool's reserved bytes (so the address space runs out no sooner than
/// the memory); the registrations the provider saw equal the segments it allocated
/// (each segment registered once, whatever happened to it since); the plain
/// communicator registers nothing. Also: the tensors registered nothing and sit in
/// their slab's windows; the repeated `reserve` made a second segment with one window
/// per communicator, not a second window on the first; the cycles allocated at least
/// ten segments, alike on every rank; `close` left no window.
#[test]
fn the_same_allocation_is_never_registered_twice() {
    let world = HostBackend::world(HostConfig::new(2)).unwrap();
    let ledgers: Vec<Arc<Mutex<Ledger>>> = (0..2).map(|_| Arc::default()).collect();
    let world: Vec<_> = (world.into_iter().zip(&ledgers))
        .map(|(b, ledger)| {
            let ledger = ledger.clone();
            b.with_segments(move |inner| Arc::new(Counting { inner, ledger }))
        })
        .collect();
    let config = GroupConfig::default().with_timeout(Duration::from_secs(10));
    let groups = Group::world(world, &config).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let allocated = on_ranks(&pools, |pool| {
        let ledger = &ledgers[pool.rank()];
        let stream = Stream::host();
        let registering: Vec<bool> = (pool.backend().communicators().iter())
            .map(|c| c.role != symmpool::backend::CommRole::Plain)
            .collect();
        // The account, after every step of the test.
        let check = |when: &str| {
            let s = pool.memory_stats();
            let l = ledger.lock().unwrap();
            let at = format!("rank {} after {when}: {s:?} {l:?}", pool.rank());
            let segments = count(&s, "segment.all.current");
            let (regs, deregs) = (
                per_comm(pool, &s, "registrations"),
                per_comm(pool, &s, "deregistrations"),
            );
            let windows = per_comm(pool, &s, "windows");
            for (c, &registers) in registering.iter().enumerate() {
                let mapped = l.windows.get(&c).map(|w| w.values().sum()).unwrap_or(0u64);
                let alive = l.windows.get(&c).map_or(0, |w| w.len() as u64);
                let made = l.registrations.get(&c).copied().unwrap_or(0);
                if registers {
                    assert_eq!(windows[c], segments, "{at}: communicator {c}");
                    assert_eq!(regs[c] - deregs[c], segments, "{at}: communicator {c}");
                    assert_eq!(alive, segments, "{at}: communicator {c}");
                    assert_eq!(made, l.allocated, "{at}: communicator {c}");
                    let reserved = count(&s, "reserved_bytes.all.current");
                    assert_eq!(mapped, reserved, "{at}: communicator {c}");
                } else {
                    assert_eq!((regs[c], made), (0, 0), "{at}: communicator {c}");
                }
            }
            regs
        };
        // Many tensors of one slab: a reserved large segment and a reserved small one.
        let slab = pool.reserve(64 * MIB).unwrap();
        let small = pool.reserve_small(2 * MIB).unwrap();
        let registered = check("reserve and reserve_small");
        let tensors: Vec<SymmBuffer> = (0..60)
            .map(|_| pool.alloc(MIB + 64 * KIB, &stream).unwrap())
            .chain((0..500).map(|_| pool.alloc(4 * KIB, &stream).unwrap()))
            .collect();
        assert_eq!(
            check("560 tensors"),
            registered,
            "the tensors registered nothing"
        );
        for (i, t) in tensors.iter().enumerate() {
            let home = if i < 60 { slab } else { small };
            assert_eq!(t.segment(), home, "tensor {i}");
            for (c, &registers) in registering.iter().enumerate() {
                assert_eq!(t.in_window(c), registers, "tensor {i}, communicator {c}");
            }
        }
        drop(tensors);
        // The same reservation again: a second segment, not a second window on the first.
        let again = pool.reserve(64 * MIB).unwrap();
        assert_ne!(again, slab);
        let more = check("the second reserve");
        for (c, &registers) in registering.iter().enumerate() {
            assert_eq!(more[c], registered[c] + u64::from(registers));
        }
        // Cycles of seeded allocations and frees, growth, trim and fit_to_peak.
        let mut rng = Rng(2331);
        let mut live: Vec<SymmBuffer> = Vec::new();
        for cycle in 0..40 {
            for _ in 0..4 {
                let size = match rng.next() % 3 {
                    0 => 1 + rng.next() % (512 * KIB),
                    1 => MIB + rng.next() % (8 * MIB),
                    _ => 16 * MIB + rng.next() % (48 * MIB),
                };
                live.push(pool.alloc(size, &stream).unwrap());
                if rng.next().is_multiple_of(3) {
                    let i = (rng.next() % live.len() as u64) as usize;
                    live.swap_remove(i);
                }
            }
            if cycle % 2 == 1 {
                live.truncate(1);
                pool.trim().unwrap();
            }
            if cycle == 20 {
                pool.fit_to_peak().unwrap();
            }
            check(&format!("cycle {cycle}"));
        }
        drop(live);
        pool.trim().unwrap();
        check("the last trim");
        let allocated = ledger.lock().unwrap().allocated;
        pool.close().unwrap();
        let l = ledger.lock().unwrap();
        assert!(l.windows.values().all(|w| w.is_empty()), "close left {l:?}");
        allocated
    });
    // The cycles grew and released the pool many times, alike on every rank.
    assert!(allocated[0] >= 10, "{allocated:?}");
    assert_eq!(allocated[0], allocated[1]);
}

// ---------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------

/// The shared-memory children of the process tests.
#[cfg(target_os = "linux")]
mod procs {
    use super::*;
    use common::procs::Job;
    use common::shm::join;

    pub const ENTRY: &str = "child_process_entry";

    fn var(name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    pub fn child() -> symmpool::Result<i32> {
        let (rank, world, backend) = join()?;
        match var("CHILD_ROLE").as_deref() {
            Some("reuse") => reuse_child(rank, world, backend),
            Some("grow") => grow_child(rank, world, backend),
            other => {
                println!("@@unknown role {other:?}");
                Ok(4)
            }
        }
    }

    /// One rank of the reuse test (see its documentation): prints where generations 1
    /// and 2 were placed (`@@placement gen1=S+O,... gen2=S+O,...`) and what the layers'
    /// collectives did (`@@reuse first=N|none field=F|none untouched=B wrong_ok=N
    /// path=P closed=Ok|Err(Kind)`, spaces in the field's name as `_`).
    fn reuse_child(rank: usize, world: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
        let mode = mode_of(var("CHECK_MODE").as_deref());
        let swapped = var("SCENARIO").as_deref() == Some("swapped");
        let last = rank == world - 1;
        let config = GroupConfig::default()
            .with_timeout(REUSE_TIMEOUT)
            .with_check(mode);
        let group = Group::new(backend, config)?;
        let pool = SymmPool::new(&group, PoolConfig::default())?;
        let coll = Coll::new(&pool)?;
        let stream = Stream::host();
        let bytes = (world * CHUNK * 4) as u64;
        let place = |bs: &mut dyn Iterator<Item = &SymmBuffer>| {
            let v: Vec<String> = bs
                .map(|b| format!("{}+{}", b.segment().0, b.offset_bytes()))
                .collect();
            v.join(",")
        };
        let mut generation1: Vec<Option<SymmBuffer>> = (0..GENERATION)
            .map(|_| pool.alloc(bytes, &stream).map(Some))
            .collect::<symmpool::Result<_>>()?;
        let gen1 = place(&mut generation1.iter().flatten());
        // The odd half goes: ascending on even ranks, descending on odd ones (alike
        // in the swapped scenario).
        let mut odd: Vec<usize> = (1..GENERATION).step_by(2).collect();
        if !swapped && rank % 2 == 1 {
            odd.reverse();
        }
        for i in odd {
            generation1[i] = None;
        }
        let generation2: Vec<SymmBuffer> = (0..GENERATION / 2)
            .map(|_| pool.alloc(bytes, &stream))
            .collect::<symmpool::Result<_>>()?;
        println!(
            "@@placement gen1={gen1} gen2={}",
            place(&mut generation2.iter())
        );
        let (mut first, mut wrong_ok, mut untouched, mut path) = (None, 0, true, None);
        let layers = GENERATION / 2;
        for layer in 0..layers {
            let i = if swapped && last {
                layers - 1 - layer
            } else {
                layer
            };
            let buffer = &generation2[i];
            let pattern = vec![(rank * 1000 + layer) as f32; world * CHUNK];
            buffer.write(&pattern)?;
            match (coll.tagged(layer as u64)).all_gather_in_place::<f32>(buffer, &stream) {
                Ok(report) => {
                    path = Some(report.path);
                    let got = buffer.read::<f32>()?;
                    let right = (0..world).all(|r| {
                        (got[r * CHUNK..(r + 1) * CHUNK].iter())
                            .all(|&v| v == (r * 1000 + layer) as f32)
                    });
                    wrong_ok += usize::from(!right);
                }
                Err(e) => {
                    untouched = buffer.read::<f32>()? == pattern;
                    first = Some((layer + 1, e));
                    break;
                }
            }
        }
        let end = coll.end_step().err();
        drop((generation1, generation2, coll));
        let closed = pool.close();
        let field = (first.iter().map(|f| &f.1).chain(end.iter())).find_map(differing_field);
        println!(
            "@@reuse first={} field={} untouched={untouched} wrong_ok={wrong_ok} path={path:?} closed={:?}",
            first.as_ref().map_or("none".into(), |f| f.0.to_string()),
            field.map_or("none".into(), |f| f.replace(' ', "_")),
            closed.as_ref().map_err(|e| e.kind()),
        );
        Ok(0)
    }

    /// One rank of the process version of the run-time growth loop: prints its
    /// [`Grew::line`] after `@@grow `.
    fn grow_child(rank: usize, world: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
        let mode = mode_of(var("CHECK_MODE").as_deref());
        let config = GroupConfig::default()
            .with_timeout(PROCESS_GROWTH_TIMEOUT)
            .with_check(mode);
        let group = Group::new(backend, config)?;
        let pool = SymmPool::new(&group, PoolConfig::default())?;
        let grew = serving_loop(&pool);
        println!("@@grow {}", grew.line(world - 1));
        if let Some((_, _, e)) = &grew.first {
            eprintln!("rank {rank}: {e}");
        }
        Ok(0)
    }

    /// Run `role` on `world` processes; for each prefix, every rank's line after it.
    pub fn job_lines<const N: usize>(
        world: usize,
        role: &'static str,
        extra: Vec<(&'static str, String)>,
        prefixes: [&str; N],
    ) -> [Vec<String>; N] {
        let env = move |_| {
            let mut v = vec![("CHILD_ROLE", role.to_string())];
            v.extend(extra.iter().cloned());
            v
        };
        let mut job = Job::start(ENTRY, world, env);
        let all: Vec<usize> = (0..world).collect();
        let codes = job.wait(&all, Duration::from_secs(120));
        assert_eq!(codes, vec![0; world], "{role}: {:?}", job.seen);
        prefixes.map(|prefix| {
            (all.iter())
                .map(|&r| job.expect(r, prefix, Duration::from_secs(5)))
                .collect()
        })
    }
}

#[cfg(target_os = "linux")]
#[test]
fn child_process_entry() {
    if std::env::var_os(common::procs::CHILD).is_none() {
        return;
    }
    let code = match procs::child() {
        Ok(code) => code,
        Err(e) => {
            println!("@@error {e}");
            2
        }
    };
    std::process::exit(code);
}

/// The process version of [`growth_at_run_time_on_one_rank_fails_every_rank_within_the_timeout`]
/// (pytorch/pytorch#191955, sgl-project/sglang#36943: what hung there were whole
/// processes): two ranks as processes on the shared-memory backend, whose
/// registration publishes each segment and maps every peer's (the symmetric heap's
/// file-descriptor exchange). Asserted, in every check mode, as on threads: every
/// process reports an error at the lone growth's step (the divergence naming the
/// growth within a round, or with the checks off a timeout within the group's timeout
/// plus a round), keeps the segments and registrations it had, closes within a round
/// and exits on its own (the job's bound); nothing is left in `/dev/shm`.
#[cfg(target_os = "linux")]
#[test]
fn growth_at_run_time_on_one_process_fails_every_process_within_the_timeout() {
    use procs::*;
    let before = common::shm::shm_entries();
    for mode in [CheckMode::Strict, CheckMode::Async, CheckMode::Off] {
        let extra = vec![
            ("CHECK_MODE", mode_name(mode).to_string()),
            // Past this the store declares a silent process lost; below the pool's
            // timeout, so that a wait on a live peer ends at the group's timeout.
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "3000".to_string()),
        ];
        let [lines] = job_lines(2, "grow", extra, ["@@grow "]);
        let bound = match mode {
            CheckMode::Off => PROCESS_GROWTH_TIMEOUT + PROMPT,
            _ => PROMPT,
        };
        check_growth(&format!("processes, {mode:?}"), mode, &lines, bound);
    }
    assert_eq!(
        common::shm::shm_entries(),
        before,
        "nothing left in /dev/shm"
    );
}
