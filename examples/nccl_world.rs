//! Trials for a world of ranks as processes on one machine, one process per rank,
//! started by `scripts/nccl-world.sh` (torchrun-style variables; on NCCL each rank
//! its own `NCCL_HOSTID`, so several ranks share one GPU and NCCL links them over
//! sockets). Every trial checks what it does and exits non-zero when a check fails.
//!
//! ```text
//! bash scripts/nccl-world.sh -n 2 -- target/release/examples/nccl_world collectives two-pools graph
//! bash scripts/nccl-world.sh -n 2 --fault KILL:1 -- target/release/examples/nccl_world fault-collective
//! bash scripts/nccl-world.sh -n 2 -- target/release/examples/nccl_world hostcost
//! bash scripts/nccl-world.sh -n 2 -- target/release/examples/nccl_world paths   # PATHBENCH lines
//! nccl_world compare-losses --tolerance 0.1 host.log nccl.log   # no world: fsdp_step --json lines
//! ```
//!
//! | trial | what it checks |
//! |---|---|
//! | `collectives` | all-gather, reduce-scatter, all-reduce; in place and out of place; f32, bf16, f16; three sizes; on registered pools under every check mode (`off`, `async`, `strict`) and on an unregistered one: every result equal to the value computed on the host (small integers, exact in every type); the path each took |
//! | `two-pools` | two pools on one backend, the second with communicators of its own, each driven from its own thread with its own stream and handle: 20 rounds of growth and collectives, every result checked |
//! | `graph` | a step's all-gather and reduce-scatter captured in a CUDA graph (NCCL only) and replayed ten times with fresh inputs, every replay checked |
//! | `fault-collective`, `fault-registration` | with `--fault SIG:RANK` of the script: after a barrier the victim stops taking part (at its next registration, for the second); the others loop collectives (or growths, so registrations); the script signals the victim's own process (`KILL` or `STOP`) once a survivor is inside the collective (or the victim inside its registration). Each survivor prints the error, its kind, the rank it names and the time from the signal to it, and passes if it is `PeerLost` naming the victim within the documented bound, then drops everything and exits |
//! | `fault-shrink`, `fault-grow` | as `fault-collective` (`--fault KILL:R`); the survivors then shrink and all-gather at the smaller size, every element checked; with `fault-grow`, rank 0 then starts a newcomer as the lost rank (`SYMMPOOL_JOIN=1`, its `RANK`, its own `NCCL_HOSTID` where the ranks have theirs), every survivor grows its pool with it, and all of them all-gather at the full size, checked. Each prints the times from the shrink (grow) to the gathered data; the newcomer from its start |
//! | `hostcost` | host time of one all-gather call (call to return) on the crate's blocking data communicator, on a non-blocking one (`NcclConfig::data_blocking = false`), and of raw `ncclAllGather` on the same blocking communicator, 64 KiB–4 MiB per rank, median of many calls (NCCL only) |
//! | `paths` | the crate against raw NCCL on the same path, communicator, registered buffers and stream, interleaved in one sitting (NCCL only): all-gather (in place), reduce-scatter and all-reduce (sum), bf16 and f32, 64 KiB–256 MiB per rank (`SYMMPOOL_PATHS_MAX_BYTES`, in bytes, caps it), on every path the backend has a communicator for, the crate's call forced onto it (a cell whose call falls back is reported so, without raw); the crate's defaults for safety (`async` checks, every call tagged, `end_step` after each of its batches, untimed). Per cell 2 warm-up calls each, then 5 repetitions of a crate batch and a raw batch (which first alternates) of 256 MiB ÷ size calls within [3, 200] (fewer where a batch would pass 0.1 s at the warm-up's pace), each timed from its first call to the stream's synchronisation: bus bandwidth, the median ratio crate ÷ raw, the median host time per call of each; one checked call of each at the end. Rank 0 prints `PATHBENCH` lines and a summary against the floors (ratio ≥ 0.97, host time ≤ raw + 2 µs), which it reports and does not enforce; cells past `SYMMPOOL_PATHS_BUDGET_S` (240) are not run. It fails on a wrong result or an error |
//! | `compare-losses` | no world: the `--json` lines of `fsdp_step` runs (rank 0's logs): within each run every mode's losses equal (relative 1e-3), and every run's equal, step by step, to the first run's within `--tolerance` (the first being the host backend's at the same sizes) |
//!
//! `--backend shm` runs the trials that need no GPU on the shared-memory backend (the
//! machine's CI runs them so); `graph`, `hostcost` and `paths` say they were skipped there.
//!
//! The bounds of the fault trials are the documented ones (README, *On GPUs*; the
//! `control` module): a killed rank is known within half the store's heartbeat
//! interval on a rank in no exchange call, so a survivor's error comes within that +
//! the watchdog interval (100 ms) + 1 s (1.6 s with the defaults); a frozen one
//! (`SIGSTOP`) within the store's heartbeat timeout + interval + the watchdog interval
//! + 1 s (7.1 s).

use clap::{Parser, ValueEnum};
use std::collections::BTreeSet;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use symmpool::backend::{Refused, Segment, SegmentProvider, Window};
use symmpool::coll::{Choice, Path, PathPolicy};
use symmpool::control::{ChannelId, Exchange, StoreConfig, StoreExchange};
use symmpool::{
    Backend, CheckMode, Coll, CollectiveCalls, Deadline, Element, Error, ErrorKind, Group,
    GroupConfig, PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool, bf16, f16,
};

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Trial {
    /// Every collective, every placement and type, checked
    Collectives,
    /// Two pools on two threads with their own communicators
    TwoPools,
    /// A step's collectives captured in a CUDA graph, replayed 10 times
    Graph,
    /// A rank lost inside a collective (`--fault` of the script)
    FaultCollective,
    /// A rank lost inside a registration (`--fault` of the script)
    FaultRegistration,
    /// A rank lost inside a collective; the survivors shrink and all-gather again
    FaultShrink,
    /// As `fault-shrink`, then a newcomer replaces the lost rank and the survivors grow
    /// back to the full size
    FaultGrow,
    /// Host time per all-gather call: crate (blocking, non-blocking), raw NCCL
    Hostcost,
    /// The crate against raw NCCL on each path, same buffers and communicator
    Paths,
    /// Compare `fsdp_step --json` runs (no world)
    CompareLosses,
}

/// A fault trial's all-gather path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FaultPath {
    /// NCCL's symmetric kernel
    Symm,
    /// The copy engine
    Ce,
    /// NCCL's ring
    Plain,
}

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// NCCL, one GPU per rank (several ranks may share one under `NCCL_HOSTID`)
    Nccl,
    /// The shared-memory host backend (no GPU)
    Shm,
}

/// Trials for a world of ranks as processes (see the file's documentation).
#[derive(Debug, Parser)]
#[command(name = "nccl_world")]
pub struct Cli {
    /// What to run, in this order, in one world
    #[arg(value_enum, required = true)]
    trials: Vec<Trial>,
    /// The backend
    #[arg(long, value_enum, default_value_t = Kind::Nccl)]
    backend: Kind,
    /// `compare-losses`: the largest relative difference allowed between a run's
    /// losses and the first run's, step by step
    #[arg(long, default_value_t = 0.1)]
    tolerance: f64,
    /// The fault trials: the path of the survivors' all-gather (default: the automatic
    /// choice, the symmetric kernel for its 1 MiB per rank where the ranks have one)
    #[arg(long, value_enum)]
    path: Option<FaultPath>,
    /// `compare-losses`: the logs holding `fsdp_step --json` lines, the reference first
    #[arg(long = "losses", value_name = "FILE")]
    losses: Vec<PathBuf>,
}

/// A failed check or call, with what it was about.
pub type Outcome<T = ()> = std::result::Result<T, String>;

/// `Err` with the error's text and kind.
fn fail<T>(what: &str, e: &Error) -> Outcome<T> {
    Err(format!("{what}: {e} [{}]", e.kind()))
}

/// Wrap a crate result with what it was about.
fn ok<T>(what: &str, r: symmpool::Result<T>) -> Outcome<T> {
    r.or_else(|e| fail(what, &e))
}

/// What replaces a backend's segment provider (the registration fault's victim).
type Wrap<'a> = &'a dyn Fn(Arc<dyn SegmentProvider>) -> Arc<dyn SegmentProvider>;

/// One rank of the world.
struct World {
    rank: usize,
    size: usize,
    kind: Kind,
    exchange: Arc<dyn Exchange>,
    backend: Backend,
    /// The store's heartbeat interval and timeout.
    heartbeat: (Duration, Duration),
    /// The script's folder for this world (`SYMMPOOL_WORLD_DIR`).
    dir: Option<PathBuf>,
    /// The channel of [`World::barrier`].
    barrier: ChannelId,
}

/// This rank's backend of `kind` over `exchange` (a rank's at the start, a newcomer's
/// once the survivors grew the group).
fn backend_over(kind: Kind, exchange: &Arc<dyn Exchange>) -> Outcome<Backend> {
    match kind {
        #[cfg(feature = "nccl")]
        Kind::Nccl => ok(
            "NcclBackend::from_env",
            symmpool::backend::NcclBackend::from_env(
                exchange.clone(),
                symmpool::backend::NcclConfig::default(),
            ),
        ),
        #[cfg(not(feature = "nccl"))]
        Kind::Nccl => Err("built without the `nccl` feature".into()),
        #[cfg(target_os = "linux")]
        Kind::Shm => ok(
            "ShmBackend::join",
            symmpool::backend::ShmBackend::join(
                exchange.clone(),
                symmpool::backend::ShmConfig::default(),
            ),
        ),
        #[cfg(not(target_os = "linux"))]
        Kind::Shm => Err("the shared-memory backend is Linux only".into()),
    }
}

impl World {
    /// Join the world from the launcher's variables: the store, then the backend
    /// (`wrap` replaces its segment provider, for the registration fault).
    fn join(kind: Kind, wrap: Option<Wrap<'_>>) -> Outcome<World> {
        let config = ok("the store's settings", StoreConfig::from_env())?;
        let heartbeat = (config.heartbeat_interval, config.heartbeat_timeout);
        let exchange: Arc<dyn Exchange> =
            Arc::new(ok("joining the store", StoreExchange::connect(config))?);
        let backend = backend_over(kind, &exchange)?;
        let backend = match wrap {
            Some(w) => backend.with_segments(w),
            None => backend,
        };
        let barrier = ok(
            "opening the barrier's channel",
            exchange.open_channel(
                "nccl_world:barrier",
                Deadline::after(Duration::from_secs(120)),
            ),
        )?;
        Ok(World {
            rank: exchange.rank(),
            size: exchange.world_size(),
            kind,
            exchange,
            backend,
            heartbeat,
            dir: std::env::var_os("SYMMPOOL_WORLD_DIR").map(PathBuf::from),
            barrier,
        })
    }

    /// Every rank meets here.
    fn barrier(&self, what: &'static str) -> Outcome {
        let r = self.exchange.all_gather(
            self.barrier,
            what,
            &[],
            Deadline::after(Duration::from_secs(120)),
        );
        ok(what, r).map(|_| ())
    }

    /// Print a line, prefixed with the rank.
    fn say(&self, line: &str) {
        println!("[rank {}] {line}", self.rank);
    }

    /// A pool of `config` in a group of its own on this rank's backend, checked as
    /// `check` says, with a timeout of 60 s.
    fn pool(&self, check: CheckMode, config: PoolConfig) -> Outcome<SymmPool> {
        let group = ok(
            "Group::new",
            Group::new(self.backend.clone(), group_config(check)),
        )?;
        ok("SymmPool::new", SymmPool::new(&group, config))
    }
}

/// Every group of the trials: checks as given, a timeout of 60 s.
fn group_config(check: CheckMode) -> GroupConfig {
    (GroupConfig::default().with_check(check)).with_timeout(Duration::from_secs(60))
}

/// A pool of the trials, named `name`.
fn config(name: &str) -> PoolConfig {
    PoolConfig::default().with_name(name)
}

// ---------------------------------------------------------------------------------
// Values whose sums are exact in every type: small integers.

/// Element `i` of rank `r`'s data, in [-8, 8].
fn value(r: usize, i: usize, salt: usize) -> f64 {
    ((r * 7 + i * 3 + salt * 5) % 17) as f64 - 8.0
}

fn values<T: Element>(r: usize, n: usize, salt: usize) -> Vec<T> {
    (0..n).map(|i| T::from_f64(value(r, i, salt))).collect()
}

/// The sum over the `world` ranks of element `i` of their data.
fn summed<T: Element>(world: usize, n: usize, from: usize, salt: usize) -> Vec<T> {
    (0..n)
        .map(|i| T::from_f64((0..world).map(|s| value(s, from + i, salt)).sum()))
        .collect()
}

/// Compare a result with what the host computed.
fn same<T: Element>(what: &str, got: &[T], want: &[T]) -> Outcome {
    if got == want {
        return Ok(());
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b);
    Err(format!(
        "{what}: {} elements, first difference at {at:?}: got {:?}, want {:?}",
        want.len(),
        at.map(|i| got[i]),
        at.map(|i| want[i])
    ))
}

// ---------------------------------------------------------------------------------
// collectives

/// Every collective of one type at `count` elements per rank; the paths taken.
fn collectives_of<T: Element>(
    w: &World,
    pool: &SymmPool,
    coll: &Coll,
    stream: &Stream,
    count: usize,
) -> Outcome<Vec<(&'static str, Path)>> {
    let (r, n, size) = (w.rank, w.size, std::mem::size_of::<T>() as u64);
    let what = |op: &str| format!("{op} of {count} {:?} per rank", T::DTYPE);
    let alloc = |elements: usize| ok("alloc", pool.alloc(elements as u64 * size, stream));
    let read = |b: &SymmBuffer| ok("reading a result", b.read::<T>());
    let mut paths = Vec::new();
    let gathered: Vec<T> = (0..n).flat_map(|s| values::<T>(s, count, 0)).collect();
    // All-gather, out of place, then in place.
    let input = alloc(count)?;
    let output = alloc(n * count)?;
    ok("write", input.write(&values::<T>(r, count, 0)))?;
    ok("write", output.write(&vec![T::from_f64(99.0); n * count]))?;
    let rep = ok(
        &what("all_gather"),
        coll.tagged(0).all_gather::<T>(&input, &output, stream),
    )?;
    same(&what("all_gather"), &read(&output)?, &gathered)?;
    paths.push(("all_gather", rep.path));
    let buf = alloc(n * count)?;
    ok("write", buf.write(&vec![T::from_f64(99.0); n * count]))?;
    let view = ok("view", buf.view::<T>())?;
    let mine = ok("slice", view.slice(r * count, count))?;
    ok("write", mine.copy_from_host(&values::<T>(r, count, 0)))?;
    let rep = ok(
        &what("all_gather_in_place"),
        coll.tagged(0).all_gather_in_place::<T>(&buf, stream),
    )?;
    same(&what("all_gather_in_place"), &read(&buf)?, &gathered)?;
    paths.push(("all_gather_in_place", rep.path));
    // Reduce-scatter: rank r's chunk of the sum.
    let whole = values::<T>(r, n * count, 1);
    let want = summed::<T>(n, count, r * count, 1);
    let input = alloc(n * count)?;
    let output = alloc(count)?;
    ok("write", input.write(&whole))?;
    let rep = ok(
        &what("reduce_scatter"),
        coll.tagged(0)
            .reduce_scatter::<T>(&input, &output, ReduceOp::Sum, stream),
    )?;
    same(&what("reduce_scatter"), &read(&output)?, &want)?;
    paths.push(("reduce_scatter", rep.path));
    let buf = alloc(n * count)?;
    ok("write", buf.write(&whole))?;
    let rep = ok(
        &what("reduce_scatter_in_place"),
        coll.tagged(0)
            .reduce_scatter_in_place::<T>(&buf, ReduceOp::Sum, stream),
    )?;
    let got = read(&buf)?;
    same(
        &what("reduce_scatter_in_place"),
        &got[r * count..(r + 1) * count],
        &want,
    )?;
    paths.push(("reduce_scatter_in_place", rep.path));
    // All-reduce.
    let data = values::<T>(r, count, 2);
    let want = summed::<T>(n, count, 0, 2);
    let input = alloc(count)?;
    let output = alloc(count)?;
    ok("write", input.write(&data))?;
    let rep = ok(
        &what("all_reduce"),
        coll.tagged(0)
            .all_reduce::<T>(&input, &output, ReduceOp::Sum, stream),
    )?;
    same(&what("all_reduce"), &read(&output)?, &want)?;
    paths.push(("all_reduce", rep.path));
    let buf = alloc(count)?;
    ok("write", buf.write(&data))?;
    let rep = ok(
        &what("all_reduce_in_place"),
        coll.tagged(0)
            .all_reduce_in_place::<T>(&buf, ReduceOp::Sum, stream),
    )?;
    same(&what("all_reduce_in_place"), &read(&buf)?, &want)?;
    paths.push(("all_reduce_in_place", rep.path));
    Ok(paths)
}

fn collectives(w: &World) -> Outcome {
    let started = Instant::now();
    let mut calls = 0;
    for (check, register) in [
        (CheckMode::Off, true),
        (CheckMode::Async, true),
        (CheckMode::Strict, true),
        (CheckMode::Off, false),
    ] {
        let name = format!("collectives-{check:?}-{register}").to_lowercase();
        let pool = w.pool(check, config(&name).with_register(register))?;
        let coll = ok("Coll::new", Coll::new(&pool))?;
        let stream = ok("new_stream", pool.new_stream())?;
        let mut paths = BTreeSet::new();
        for count in [1, 1000, 65_537] {
            for p in collectives_of::<f32>(w, &pool, &coll, &stream, count)?
                .into_iter()
                .chain(collectives_of::<bf16>(w, &pool, &coll, &stream, count)?)
                .chain(collectives_of::<f16>(w, &pool, &coll, &stream, count)?)
            {
                paths.insert(format!("{} {:?}", p.0, p.1));
                calls += 1;
            }
        }
        let stats = pool.memory_stats();
        let count = |key: &str| {
            (stats.iter())
                .filter(|(k, _)| k.starts_with(key))
                .filter_map(|(_, v)| v.as_u64())
                .sum::<u64>()
        };
        w.say(&format!(
            "check {check:?}, registered pool {register}: every collective right; registrations {} windows {} (a registration without a window is a NULL window); paths: {}",
            count("registrations."),
            count("windows."),
            paths.into_iter().collect::<Vec<_>>().join(", ")
        ));
        drop(coll);
        ok("close", pool.close())?;
    }
    w.say(&format!(
        "RESULT collectives ok: {calls} collectives checked in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------
// two-pools

fn two_pools(w: &World) -> Outcome {
    let params = w.pool(CheckMode::Async, config("params"))?;
    let own = ok("Group::split", params.group().split("grads"))?;
    let grads = ok("SymmPool::new", SymmPool::new(&own, config("grads")))?;
    let colls = [
        ok("Coll::new", Coll::new(&params))?,
        ok("Coll::new", Coll::new(&grads))?,
    ];
    let (r, n) = (w.rank, w.size);
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let hs: Vec<_> = [&params, &grads]
            .into_iter()
            .zip(&colls)
            .map(|(pool, coll)| {
                s.spawn(move || -> Outcome {
                    let stream = ok("new_stream", pool.new_stream())?;
                    let mut kept = Vec::new();
                    for i in 0..20usize {
                        let count = 1024usize << (i % 8);
                        let buf = ok("alloc", pool.alloc(4 * (n * count) as u64, &stream))?;
                        let view = ok("view", buf.view::<f32>())?;
                        let mine = ok("slice", view.slice(r * count, count))?;
                        ok("write", mine.copy_from_host(&vec![(i + r) as f32; count]))?;
                        ok(
                            "all_gather",
                            coll.tagged(0).all_gather_in_place::<f32>(&buf, &stream),
                        )?;
                        let want: Vec<f32> =
                            (0..n).flat_map(|s| vec![(i + s) as f32; count]).collect();
                        same(
                            &format!("round {i}, all-gather"),
                            &ok("read", buf.read())?,
                            &want,
                        )?;
                        ok(
                            "all_reduce",
                            coll.tagged(0)
                                .all_reduce_in_place::<f32>(&buf, ReduceOp::Sum, &stream),
                        )?;
                        let want: Vec<f32> = want.iter().map(|x| x * n as f32).collect();
                        same(
                            &format!("round {i}, all-reduce"),
                            &ok("read", buf.read())?,
                            &want,
                        )?;
                        kept.push(buf); // grow the pool now and then
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a pool's thread panicked".into()))
            })
            .collect()
    });
    for r in results {
        r?;
    }
    drop(colls);
    ok("close", grads.close())?;
    ok("close", params.close())?;
    w.say("RESULT two-pools ok: 20 rounds on each of two pools (the second on communicators of its own), two threads");
    Ok(())
}

// ---------------------------------------------------------------------------------
// graph

#[cfg(feature = "nccl")]
fn graph(w: &World) -> Outcome {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    if w.kind != Kind::Nccl {
        w.say("RESULT graph skipped: CUDA graphs need the NCCL backend");
        return Ok(());
    }
    let (r, n) = (w.rank, w.size);
    let pool = w.pool(CheckMode::Off, config("graph"))?;
    let coll = ok("Coll::new", Coll::new(&pool))?;
    let stream = ok("new_stream", pool.new_stream())?;
    ok("reserve", pool.reserve(16 << 20))?;
    let count = 64 * 1024;
    let alloc = |elements: usize| ok("alloc", pool.alloc(4 * elements as u64, &stream));
    let (ag_in, ag_out) = (alloc(count)?, alloc(n * count)?);
    let (rs_in, rs_out) = (alloc(n * count)?, alloc(count)?);
    let segments = pool.memory_stats()["segment.all.current"].as_u64();
    let cs = stream.cuda_stream().ok_or("not a CUDA stream")?.clone();
    cs.synchronize().map_err(|e| format!("{e:?}"))?;
    cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| format!("begin_capture: {e:?}"))?;
    let captured = (|| -> symmpool::Result<()> {
        coll.tagged(0).all_gather::<f32>(&ag_in, &ag_out, &stream)?;
        coll.tagged(0)
            .reduce_scatter::<f32>(&rs_in, &rs_out, ReduceOp::Sum, &stream)?;
        Ok(())
    })();
    let graph = cs.end_capture(CUgraphInstantiate_flags(0));
    ok("the collectives under capture", captured)?;
    let graph = graph
        .map_err(|e| format!("end_capture: {e:?}"))?
        .ok_or("an empty graph")?;
    if pool.memory_stats()["segment.all.current"].as_u64() != segments {
        return Err("the pool grew under capture".into());
    }
    for replay in 0..10 {
        ok("write", ag_in.write(&values::<f32>(r, count, replay)))?;
        ok(
            "write",
            rs_in.write(&values::<f32>(r, n * count, replay + 100)),
        )?;
        graph
            .launch()
            .map_err(|e| format!("replay {replay}: {e:?}"))?;
        let gathered: Vec<f32> = (0..n)
            .flat_map(|s| values::<f32>(s, count, replay))
            .collect();
        same(
            &format!("replay {replay}, all-gather"),
            &ok("read", ag_out.read())?,
            &gathered,
        )?;
        same(
            &format!("replay {replay}, reduce-scatter"),
            &ok("read", rs_out.read())?,
            &summed::<f32>(n, count, r * count, replay + 100),
        )?;
    }
    drop(graph);
    drop((ag_in, ag_out, rs_in, rs_out));
    drop(coll);
    ok("close", pool.close())?;
    w.say("RESULT graph ok: an all-gather and a reduce-scatter captured in a CUDA graph, replayed 10 times, every replay right");
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn graph(w: &World) -> Outcome {
    w.say("RESULT graph skipped: built without the `nccl` feature");
    Ok(())
}

// ---------------------------------------------------------------------------------
// faults

/// The script's fault: the signal and the victim (`SYMMPOOL_WORLD_FAULT=KILL:1`).
fn fault() -> Outcome<(String, usize)> {
    let spec = std::env::var("SYMMPOOL_WORLD_FAULT")
        .map_err(|_| "no fault given: run under scripts/nccl-world.sh --fault SIG:RANK")?;
    let (sig, rank) = spec
        .split_once(':')
        .ok_or_else(|| format!("SYMMPOOL_WORLD_FAULT={spec}: expected SIG:RANK"))?;
    let rank = rank
        .parse()
        .map_err(|_| format!("SYMMPOOL_WORLD_FAULT={spec}: expected SIG:RANK"))?;
    Ok((sig.to_ascii_uppercase(), rank))
}

/// Tell the script the world is at the fault's point (a file in its folder).
fn at_point(dir: Option<&FsPath>) {
    if let Some(dir) = dir {
        let _ = std::fs::write(dir.join("fault-point"), b"");
    }
}

/// The victim's wait at the point: the script signals it within its own bound; if it
/// never does, the victim gives up after 5 minutes.
fn wait_for_the_signal() -> ! {
    let until = Instant::now() + Duration::from_secs(300);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("nccl_world: the victim was never signalled");
    std::process::exit(3)
}

/// When the script signalled the victim (seconds since the epoch, `fault-at`).
fn signalled_at(dir: Option<&FsPath>) -> Option<f64> {
    let path = dir?.join("fault-at");
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(t) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Some(t);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn now_epoch() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A segment provider that stops its rank at its first registration once armed: the
/// point of `fault-registration` (its peers are then inside NCCL's registration).
#[derive(Debug)]
struct StopAtRegister {
    inner: Arc<dyn SegmentProvider>,
    armed: Arc<AtomicBool>,
    dir: Option<PathBuf>,
}

impl SegmentProvider for StopAtRegister {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        self.inner.allocate(size_bytes)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: symmpool::Deadline,
    ) -> symmpool::Result<Option<Window>> {
        if self.armed.load(Ordering::SeqCst) {
            println!("victim: at the registration, waiting for the signal");
            at_point(self.dir.as_deref());
            wait_for_the_signal();
        }
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.register(segment, comm, deadline) }
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.free(segment) }
    }
}

/// Wait for the device work on `stream` so far, polling; `false` if the backend broke
/// meanwhile (the next call reports it). Nothing to wait for on the host backends.
fn wait_device(w: &World, stream: &Stream) -> Outcome<bool> {
    #[cfg(feature = "nccl")]
    if let Some(cs) = stream.cuda_stream() {
        let nccl = w
            .backend
            .downcast_ref::<symmpool::backend::NcclBackend>()
            .ok_or("not an NCCL backend")?;
        let event = cs
            .record_event(None)
            .map_err(|e| format!("cuEventRecord: {e:?}"))?;
        let until = Instant::now() + Duration::from_secs(900);
        while !event.is_complete() {
            if nccl.health().is_err() {
                return Ok(false);
            }
            if Instant::now() >= until {
                return Err("the device never finished, and the backend did not break".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let _ = (w, stream);
    Ok(true)
}

/// The documented bound on a survivor's error after `sig` (inside a window
/// registration, `registration`: 2 s more, for the abort that ends it), plus
/// `SYMMPOOL_WORLD_SLACK_MS` (0 by default; a busy CI machine's allowance).
fn bound(w: &World, sig: &str, registration: bool) -> Duration {
    let interval = Duration::from_millis(100); // NcclConfig::default().watchdog_interval
    let (heartbeat, timeout) = w.heartbeat;
    let slack = std::env::var("SYMMPOOL_WORLD_SLACK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    let abort = Duration::from_secs(2 * u64::from(registration));
    slack
        + abort
        + match sig {
            "STOP" => timeout + heartbeat + interval + Duration::from_secs(1),
            _ => heartbeat / 2 + interval + Duration::from_secs(1),
        }
}

fn fault_trial(kind: Kind, trial: Trial, path: Option<FaultPath>) -> Outcome {
    if std::env::var_os("SYMMPOOL_JOIN").is_some() {
        return newcomer(kind);
    }
    let registration = trial == Trial::FaultRegistration;
    let (sig, victim) = fault()?;
    let armed = Arc::new(AtomicBool::new(false));
    let dir = std::env::var_os("SYMMPOOL_WORLD_DIR").map(PathBuf::from);
    let me: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .ok_or("RANK is not set")?;
    let wrap = |inner: Arc<dyn SegmentProvider>| -> Arc<dyn SegmentProvider> {
        Arc::new(StopAtRegister {
            inner,
            armed: armed.clone(),
            dir: dir.clone(),
        })
    };
    let wrap: Wrap<'_> = &wrap;
    let stopping = registration && me == victim;
    let w = World::join(kind, stopping.then_some(wrap))?;
    if victim >= w.size {
        return Err(format!("the victim {victim} is not a rank of {}", w.size));
    }
    // Checks off: a survivor then waits inside NCCL, not in a check's round.
    let pool = w.pool(CheckMode::Off, config("fault"))?;
    let coll = ok("Coll::new", Coll::new(&pool))?;
    let wanted = path.map(|p| match p {
        FaultPath::Symm => Path::SymmetricKernel,
        FaultPath::Ce => Path::CopyEngine,
        FaultPath::Plain => Path::PlainKernel,
    });
    if let Some(p) = wanted {
        coll.set_path_policy(
            PathPolicy::default().with_choices(Choice::Prefer(p), Choice::Prefer(p)),
        );
    }
    let stream = ok("new_stream", pool.new_stream())?;
    let count = 256 * 1024;
    let input = ok("alloc", pool.alloc(4 * count as u64, &stream))?;
    let output = ok("alloc", pool.alloc(4 * (w.size * count) as u64, &stream))?;
    // Everything connected and registered once, every rank alive.
    ok("write", input.write(&values::<f32>(w.rank, count, 0)))?;
    let taken = ok(
        "warm-up all_gather",
        coll.tagged(0).all_gather::<f32>(&input, &output, &stream),
    )?
    .path;
    if wanted.is_some_and(|p| p != taken) {
        return Err(format!("--path {path:?}: the all-gather took {taken:?}"));
    }
    let gathered: Vec<f32> = (0..w.size)
        .flat_map(|s| values::<f32>(s, count, 0))
        .collect();
    same("warm-up all-gather", &ok("read", output.read())?, &gathered)?;
    w.barrier("before the fault")?;
    // More than the pool holds: every such request grows it (an agreement, then a
    // registration on every registering communicator). The same on every rank.
    let reserved = pool.memory_stats()["reserved_bytes.all.current"]
        .as_u64()
        .unwrap_or(0);
    let growth = |k: u64| reserved + (8 << 20) * (k + 1);
    let mut kept = Vec::new();
    if w.rank == victim {
        if registration {
            armed.store(true, Ordering::SeqCst);
            // The growth's agreement pairs with the survivors'; the victim stops at
            // its registration.
            let r = pool.alloc(growth(0), &stream);
            return Err(format!("the victim's growth returned: {r:?}"));
        }
        w.say(&format!("victim: stops taking part; waiting for SIG{sig}"));
        wait_for_the_signal();
    }
    let started = Instant::now();
    let mut calls = 0u64;
    let error = loop {
        if registration {
            match pool.alloc(growth(calls), &stream) {
                Ok(b) => kept.push(b),
                Err(e) => break e,
            }
        } else {
            if calls == 0 {
                // The all-gather is enqueued (or, on the host backends, waiting in
                // its round) long before the script's signal lands.
                w.say("survivor: entering the all-gather the victim never joins");
                at_point(w.dir.as_deref());
            }
            if let Err(e) = coll.tagged(0).all_gather::<f32>(&input, &output, &stream) {
                break e;
            }
            wait_device(&w, &stream)?;
        }
        calls += 1;
        if started.elapsed() > Duration::from_secs(900) {
            return Err("no error after 15 minutes".into());
        }
    };
    let now = now_epoch();
    let took = signalled_at(w.dir.as_deref()).map(|t| Duration::from_secs_f64((now - t).max(0.0)));
    let bound = bound(&w, &sig, registration);
    let named = match &error {
        Error::PeerLost { rank, .. } => Some(*rank),
        _ => None,
    };
    w.say(&format!(
        "survivor: after {calls} calls: {error} [{}]",
        error.kind()
    ));
    let verdict = match (error.kind(), named, took) {
        (ErrorKind::PeerLost, Some(v), Some(t)) if v == victim && t <= bound => Ok(()),
        (_, _, None) => Err("the script's fault-at file is missing".to_string()),
        _ => Err(format!(
            "expected PeerLost naming rank {victim} within {bound:?}"
        )),
    };
    let version = w.backend.nccl_version();
    if matches!(trial, Trial::FaultShrink | Trial::FaultGrow) {
        verdict?;
        drop(kept);
        drop((input, output, coll));
        let shrunk = survive(&w, &pool, count, &sig, victim)?;
        return match trial {
            Trial::FaultGrow => heal(&w, shrunk, count, victim),
            _ => ok("close", shrunk.close()),
        };
    }
    // Everything dropped: a broken backend's teardown is bounded too.
    // Each step's end on stderr as it happens: a teardown that hangs shows where.
    let dropping = Instant::now();
    let step = |what: &str| {
        eprintln!(
            "[rank {me}] TEARDOWN {what} dropped at {:.2}s",
            dropping.elapsed().as_secs_f64()
        )
    };
    drop(kept);
    drop((input, output, coll));
    step("buffers");
    drop(pool);
    step("pool");
    let World {
        backend, exchange, ..
    } = w;
    drop(backend);
    step("backend");
    drop(exchange);
    let dropped = dropping.elapsed();
    let op = if registration {
        "registration"
    } else {
        "collective"
    };
    println!(
        "[rank {me}] RESULT fault-{op} SIG{sig} of rank {victim}: {} kind={} names={} took={} bound={:.1}s dropped_in={:.2}s nccl={version} all_gather_path={taken:?} error=\"{error}\"",
        if verdict.is_ok() { "ok" } else { "FAILED" },
        error.kind(),
        named.map_or("-".into(), |r| r.to_string()),
        took.map_or("?".into(), |t| format!("{:.2}s", t.as_secs_f64())),
        bound.as_secs_f64(),
        dropped.as_secs_f64(),
    );
    verdict
}

/// The survivors of `fault-shrink`: shrink the pool, all-gather at the new size, check
/// every element, and report the time from the shrink's start to the gathered data;
/// the shrunk pool.
fn survive(
    w: &World,
    pool: &SymmPool,
    count: usize,
    sig: &str,
    victim: usize,
) -> Outcome<SymmPool> {
    let started = Instant::now();
    let (pool, report) = ok("SymmPool::shrink", pool.shrink())?;
    let shrunk_in = started.elapsed();
    gather_checked(&pool, count, "all-gather after the shrink")?;
    let first = started.elapsed();
    println!(
        "[rank {}] RESULT fault-shrink SIG{sig} of rank {victim}: ok rank={}->{} world={}->{} lost={:?} segments={} registrations={} shrink={:.3}s first_all_gather={:.3}s nccl={}",
        w.rank,
        report.old_rank,
        report.rank,
        report.old_world_size,
        report.world_size,
        report.lost_ranks,
        report.segments,
        report.registrations,
        shrunk_in.as_secs_f64(),
        first.as_secs_f64(),
        w.backend.nccl_version(),
    );
    Ok(pool)
}

/// All-gather `count` elements per rank on `pool`, checked: the first collective at
/// a grown size.
fn gather_checked(pool: &SymmPool, count: usize, what: &str) -> Outcome {
    let coll = ok("Coll::new", Coll::new(pool))?;
    let stream = ok("new_stream", pool.new_stream())?;
    let n = pool.world_size();
    let input = ok("alloc", pool.alloc(4 * count as u64, &stream))?;
    let output = ok("alloc", pool.alloc(4 * (n * count) as u64, &stream))?;
    ok("write", input.write(&values::<f32>(pool.rank(), count, 2)))?;
    ok(
        what,
        coll.tagged(0).all_gather::<f32>(&input, &output, &stream),
    )?;
    let gathered: Vec<f32> = (0..n).flat_map(|s| values::<f32>(s, count, 2)).collect();
    same(what, &ok("read", output.read())?, &gathered)
}

/// `fault-grow` after the shrink: rank 0 starts a newcomer as the lost rank (this
/// program again, with `SYMMPOOL_JOIN=1`, the victim's `RANK` and its own
/// `NCCL_HOSTID` where the ranks have theirs), every survivor grows the pool with it,
/// all-gathers at the full size and checks every element; the time from the grow's
/// start to the gathered data.
fn heal(w: &World, pool: SymmPool, count: usize, victim: usize) -> Outcome {
    let mut child = match pool.rank() {
        0 => {
            let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
            let exe = std::env::current_exe().map_err(|e| io("current_exe", e))?;
            let mut cmd = std::process::Command::new(exe);
            cmd.args(std::env::args().skip(1))
                .env("SYMMPOOL_JOIN", "1")
                .env("RANK", victim.to_string())
                .env("LOCAL_RANK", victim.to_string());
            if std::env::var_os("NCCL_HOSTID").is_some() {
                cmd.env("NCCL_HOSTID", format!("simnode{victim}"));
            }
            Some(cmd.spawn().map_err(|e| io("starting the newcomer", e))?)
        }
        _ => None,
    };
    let started = Instant::now();
    let (grown, report) = ok("SymmPool::grow", pool.grow(true))?.ok_or("no newcomer came")?;
    let grew_in = started.elapsed();
    gather_checked(&grown, count, "all-gather after the grow")?;
    let first = started.elapsed();
    ok("close", grown.close())?;
    println!(
        "[rank {}] RESULT fault-grow of rank {victim}: ok rank={}->{} world={}->{} newcomers={:?} segments={} registrations={} pinned={} grow={:.3}s first_all_gather={:.3}s nccl={}",
        w.rank,
        pool.rank(),
        report.rank,
        report.old_world_size,
        report.world_size,
        report.newcomers,
        report.segments,
        report.registrations,
        report.pinned_blocks,
        grew_in.as_secs_f64(),
        first.as_secs_f64(),
        w.backend.nccl_version(),
    );
    if let Some(c) = child.as_mut() {
        let until = Instant::now() + Duration::from_secs(120);
        let io = |e: std::io::Error| format!("waiting for the newcomer: {e}");
        while c.try_wait().map_err(io)?.is_none() {
            if Instant::now() >= until {
                let _ = c.kill();
                return Err("the newcomer did not exit within 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = c.wait().map_err(io)?;
        if !status.success() {
            return Err(format!("the newcomer failed: {status}"));
        }
    }
    Ok(())
}

/// The newcomer of `fault-grow`: join the store as the lost rank, make the backend,
/// group and pool with the survivors' grow, all-gather at the full size, checked; the
/// time from its start to the gathered data.
fn newcomer(kind: Kind) -> Outcome {
    let started = Instant::now();
    let store = ok("the store's settings", StoreConfig::from_env())?;
    let exchange: Arc<dyn Exchange> =
        Arc::new(ok("joining the store", StoreExchange::connect(store))?);
    let joined = started.elapsed();
    let backend = backend_over(kind, &exchange)?;
    let group = ok(
        "Group::new",
        Group::new(backend, group_config(CheckMode::Off)),
    )?;
    let (pool, report) = ok("SymmPool::join", SymmPool::join(&group, config("fault")))?;
    gather_checked(&pool, 256 * 1024, "the newcomer's all-gather")?;
    let first = started.elapsed();
    ok("close", pool.close())?;
    println!(
        "[rank {}] RESULT fault-grow newcomer: ok rank={} world={} segments={} registrations={} admitted={:.3}s first_all_gather={:.3}s (from its start)",
        report.rank,
        report.rank,
        report.world_size,
        report.segments,
        report.registrations,
        joined.as_secs_f64(),
        first.as_secs_f64(),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------
// raw NCCL beside the crate, and host timing (hostcost, paths)

#[cfg(feature = "nccl")]
mod raw {
    use super::*;
    use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};
    use std::ffi::c_void;

    /// `ncclAllGather` (nccl.h, `ncclResult_t` as int).
    type AllGather = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> i32;

    /// `ncclReduceScatter` and `ncclAllReduce`.
    type Reduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> i32;

    /// The collectives of the `libnccl.so.2` the crate loaded, valid while this lives.
    pub(super) struct Nccl {
        pub(super) all_gather: AllGather,
        pub(super) reduce_scatter: Reduce,
        pub(super) all_reduce: Reduce,
        _lib: libloading::os::unix::Library,
    }

    /// The raw NCCL the crate loaded: its own symbol table (`backend::nccl::ffi`) is
    /// private, so the same library is opened again without loading anything
    /// (`RTLD_NOLOAD`): `$SYMMPOOL_NCCL_LIBRARY` when set, else `libnccl.so.2`.
    pub(super) fn nccl() -> Outcome<Nccl> {
        let names: Vec<String> = std::env::var("SYMMPOOL_NCCL_LIBRARY")
            .ok()
            .into_iter()
            .chain(["libnccl.so.2".to_string()])
            .collect();
        for name in names {
            // SAFETY: RTLD_NOLOAD only returns a library already loaded (the crate's
            // NCCL), running no initialiser.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(&name),
                    libc::RTLD_NOLOAD | libloading::os::unix::RTLD_NOW,
                )
            };
            if let Ok(lib) = lib {
                let reduce = |name: &str| {
                    // SAFETY: the signature is nccl.h's; the pointer is used only while
                    // `_lib` keeps the library loaded.
                    unsafe { lib.get::<Reduce>(name.as_bytes()) }
                        .map(|f| *f)
                        .map_err(|e| format!("{name}: {e}"))
                };
                // SAFETY: as above.
                let all_gather = *unsafe { lib.get::<AllGather>(b"ncclAllGather") }
                    .map_err(|e| format!("ncclAllGather: {e}"))?;
                let (reduce_scatter, all_reduce) =
                    (reduce("ncclReduceScatter")?, reduce("ncclAllReduce")?);
                return Ok(Nccl {
                    all_gather,
                    reduce_scatter,
                    all_reduce,
                    _lib: lib,
                });
            }
        }
        Err("the crate's libnccl.so.2 is not loaded".into())
    }

    /// An NCCL call's result code as an outcome.
    pub(super) fn check(what: &str, code: i32) -> Outcome {
        match code {
            0 => Ok(()),
            _ => Err(format!("{what} returned {code}")),
        }
    }

    /// Median, 10th and 90th percentile (of 5 values: median, least, greatest).
    pub(super) fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        (at(0.5), at(0.1), at(0.9))
    }

    /// `calls` calls of `call` after `warm` untimed ones: the host time of each (call
    /// to return, µs), and the seconds from before the first timed call to the end of
    /// the stream's work after the last. With `each`, the stream is synchronised after
    /// every call too (outside the call's time).
    pub(super) fn time(
        calls: usize,
        warm: usize,
        each: bool,
        stream: &Stream,
        mut call: impl FnMut() -> Outcome,
    ) -> Outcome<(Vec<f64>, f64)> {
        let cs = stream.cuda_stream().ok_or("not a CUDA stream")?;
        let sync = || cs.synchronize().map_err(|e| format!("{e:?}"));
        let mut us = Vec::with_capacity(calls);
        let mut t0 = Instant::now();
        for i in 0..warm + calls {
            if i == warm {
                sync()?;
                t0 = Instant::now();
            }
            let t = Instant::now();
            call()?;
            let dt = t.elapsed();
            if each {
                sync()?;
            }
            if i >= warm {
                us.push(dt.as_secs_f64() * 1e6);
            }
        }
        sync()?;
        Ok((us, t0.elapsed().as_secs_f64()))
    }
}

// ---------------------------------------------------------------------------------
// hostcost

#[cfg(feature = "nccl")]
mod hostcost {
    use super::raw::{self, spread, time};
    use super::*;
    use symmpool::backend::{NcclBackend, NcclConfig};

    pub(super) fn run(w: &World) -> Outcome {
        if w.kind != Kind::Nccl {
            w.say("RESULT hostcost skipped: it measures NCCL");
            return Ok(());
        }
        let blocking = w
            .backend
            .downcast_ref::<NcclBackend>()
            .ok_or("not an NCCL backend")?;
        let plain = (w.backend.communicators().iter())
            .position(|c| !c.registers)
            .ok_or("no plain communicator")?;
        if blocking.is_blocking(plain) != Some(true) {
            return Err("the plain data communicator is not blocking".into());
        }
        let raw_comm = blocking.raw_comm(plain).ok_or("no raw communicator")?;
        let nccl = raw::nccl()?;
        // A second backend over the same exchange, with non-blocking data
        // communicators (collective: every rank makes it here).
        let nb_backend = ok(
            "NcclBackend::from_env (non-blocking)",
            NcclBackend::from_env(
                w.exchange.clone(),
                NcclConfig::default().with_data_blocking(false),
            ),
        )?;
        // Unregistered pools, checks off: the plain path, the crate's call alone.
        let cfg = |name: &str| config(name).with_register(false);
        let pool = w.pool(CheckMode::Off, cfg("hostcost-blocking"))?;
        let nb_group = ok(
            "Group::new",
            Group::new(nb_backend.clone(), group_config(CheckMode::Off)),
        )?;
        let nb_pool = ok(
            "SymmPool::new",
            SymmPool::new(&nb_group, cfg("hostcost-non-blocking")),
        )?;
        let coll = ok("Coll::new", Coll::new(&pool))?;
        let nb_coll = ok("Coll::new", Coll::new(&nb_pool))?;
        let stream = ok("new_stream", pool.new_stream())?;
        let nb_stream = ok("new_stream", nb_pool.new_stream())?;
        let n = w.size;
        let nodes = match std::env::var("NCCL_HOSTID") {
            Ok(_) => "a simulated node each (NCCL_HOSTID)",
            Err(_) => "one node",
        };
        let mut lines = vec![format!(
            "HOSTCOST NCCL {}, {n} ranks, one GPU, {nodes}, µs per all-gather call from the call to its return, median [p10, p90]",
            w.backend.nccl_version()
        )];
        lines.push(format!(
            "{:>9} {:>6}  {:>24}  {:>24}  {:>24}",
            "size/rank", "calls", "crate, blocking", "crate, non-blocking", "raw ncclAllGather"
        ));
        let mut floor = None;
        for (bytes, calls) in [
            (64usize << 10, 300),
            (256 << 10, 200),
            (1 << 20, 100),
            (4 << 20, 40),
        ] {
            let count = bytes / 4;
            let alloc = |p: &SymmPool, s: &Stream, b: usize| ok("alloc", p.alloc(b as u64, s));
            let (input, output) = (
                alloc(&pool, &stream, bytes)?,
                alloc(&pool, &stream, n * bytes)?,
            );
            let (nb_in, nb_out) = (
                alloc(&nb_pool, &nb_stream, bytes)?,
                alloc(&nb_pool, &nb_stream, n * bytes)?,
            );
            ok("write", input.write(&values::<f32>(w.rank, count, 0)))?;
            ok("write", nb_in.write(&values::<f32>(w.rank, count, 0)))?;
            // µs per call, median [p10, p90], after 3 untimed calls.
            let per_call = |s: &Stream, call: &mut dyn FnMut() -> Outcome| {
                time(calls, 3, true, s, call).map(|(us, _)| spread(us))
            };
            let crate_b = per_call(&stream, &mut || {
                ok(
                    "all_gather",
                    coll.tagged(0).all_gather::<f32>(&input, &output, &stream),
                )
                .map(|_| ())
            })?;
            let crate_nb = per_call(&nb_stream, &mut || {
                ok(
                    "all_gather",
                    nb_coll
                        .tagged(0)
                        .all_gather::<f32>(&nb_in, &nb_out, &nb_stream),
                )
                .map(|_| ())
            })?;
            let send = input.device_ptr().ok_or("no device pointer")? as *const std::ffi::c_void;
            let recv = output.device_ptr().ok_or("no device pointer")? as *mut std::ffi::c_void;
            let cu =
                stream.raw_cuda().ok_or("not a CUDA stream")? as cudarc::nccl::sys::cudaStream_t;
            let raw_t = per_call(&stream, &mut || {
                // SAFETY: `send` and `recv` are live pool buffers of `count` and `n` ×
                // `count` f32s on this device, kept until the stream is synchronised;
                // `raw_comm` is the backend's live blocking plain communicator, which
                // nothing else calls meanwhile (this thread drives the rank).
                let code = unsafe {
                    (nccl.all_gather)(
                        send,
                        recv,
                        count,
                        cudarc::nccl::sys::ncclDataType_t::ncclFloat32,
                        raw_comm,
                        cu,
                    )
                };
                raw::check("ncclAllGather", code)
            })?;
            let gathered: Vec<f32> = (0..n).flat_map(|s| values::<f32>(s, count, 0)).collect();
            same(
                "hostcost all-gather",
                &ok("read", output.read())?,
                &gathered,
            )?;
            same(
                "hostcost all-gather (non-blocking)",
                &ok("read", nb_out.read())?,
                &gathered,
            )?;
            let cell = |(m, lo, hi): (f64, f64, f64)| format!("{m:.1} [{lo:.1}, {hi:.1}]");
            lines.push(format!(
                "{:>9} {calls:>6}  {:>24}  {:>24}  {:>24}",
                format!("{} KiB", bytes >> 10),
                cell(crate_b),
                cell(crate_nb),
                cell(raw_t)
            ));
            if bytes == 64 << 10 {
                floor = Some((crate_b.0, raw_t.0));
            }
        }
        if let Some((c, r)) = floor {
            let met = if c <= r + 2.0 { "met" } else { "NOT met" };
            lines.push(format!(
                "floor at 64 KiB, crate blocking <= raw + 2 µs: {c:.1} vs {r:.1} + 2: {met}"
            ));
        }
        drop((coll, nb_coll));
        ok("close", pool.close())?;
        ok("close", nb_pool.close())?;
        drop(nb_backend);
        if w.rank == 0 {
            for l in &lines {
                println!("{l}");
            }
        }
        w.say("RESULT hostcost ok: measured, results checked");
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// paths

#[cfg(feature = "nccl")]
mod paths {
    use super::raw::{self, spread, time};
    use super::*;
    use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};
    use std::cell::Cell;
    use symmpool::DType;
    use symmpool::backend::{CommRole, NcclBackend};
    use symmpool::coll::{Choice, CollectiveReport, PathPolicy, path_name};

    /// Bytes per rank measured (those up to `SYMMPOOL_PATHS_MAX_BYTES`).
    const SIZES: [usize; 7] = [
        64 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
        64 << 20,
        256 << 20,
    ];
    /// Repetitions of (crate batch, raw batch) per cell.
    const REPS: usize = 5;
    /// A batch's calls: 256 MiB ÷ bytes, and no more than fill this many seconds at
    /// the warm-up's pace (two ranks time-slicing one GPU pay 2–3 ms a small call),
    /// within [3, 200].
    const BATCH_S: f64 = 0.1;
    /// The floors the summary reports (and does not enforce).
    const RATIO_FLOOR: f64 = 0.97;
    const HOST_FLOOR_US: f64 = 2.0;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Op {
        AllGather,
        ReduceScatter,
        AllReduce,
    }

    impl Op {
        fn name(self) -> &'static str {
            match self {
                Op::AllGather => "all_gather",
                Op::ReduceScatter => "reduce_scatter",
                Op::AllReduce => "all_reduce",
            }
        }

        /// Bus bytes per byte per rank among `g` ranks (nccl-tests' busbw).
        fn bus(self, g: usize) -> f64 {
            let g = g as f64;
            match self {
                Op::AllReduce => 2.0 * (g - 1.0) / g,
                _ => g - 1.0,
            }
        }
    }

    /// One (collective, type, size)'s buffers, shared by its paths: the all-gather's
    /// gathered buffer (this rank's slice written), or the reductions' input (written)
    /// and output; the raw call's arguments; what the checked calls must give.
    struct Bufs<T> {
        input: SymmBuffer,
        output: Option<SymmBuffer>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: ncclDataType_t,
        /// Device ranges filled with 0xFF (NaN in f32 and bf16) before a checked call:
        /// whatever the call does not write fails the check.
        poison: Vec<(u64, usize)>,
        want: Vec<T>,
    }

    impl<T> Bufs<T> {
        /// The buffer holding the result (the all-gather's is its input).
        fn output(&self) -> &SymmBuffer {
            self.output.as_ref().unwrap_or(&self.input)
        }
    }

    /// The sitting: the handle, the raw NCCL, the tally.
    struct Bench<'a> {
        w: &'a World,
        coll: Coll,
        stream: Stream,
        cu: cudaStream_t,
        nccl: raw::Nccl,
        /// The next call's tag.
        tag: Cell<u64>,
        started: Instant,
        budget_s: f64,
        /// (cell, ratio crate ÷ raw, host µs crate − raw) of every measured cell.
        measured: Vec<(String, f64, f64)>,
        fell_back: usize,
        not_run: usize,
    }

    /// `name` from the environment, or `default`.
    fn env<T: std::str::FromStr>(name: &str, default: T) -> Outcome<T> {
        match std::env::var(name) {
            Err(_) => Ok(default),
            Ok(v) => (v.trim().parse()).map_err(|_| format!("{name}={v}: not a number")),
        }
    }

    fn size(bytes: usize) -> String {
        match bytes {
            b if b < 1 << 20 => format!("{}KiB", b >> 10),
            b => format!("{}MiB", b >> 20),
        }
    }

    /// A cell's line: `cols` after the cell's name (collective, type, size, path).
    fn row(cell: [&str; 4], cols: &str) -> String {
        let [op, dtype, size, path] = cell;
        format!("{op:<14} {dtype:<4} {size:>6} {path:<16} {cols}")
    }

    impl Bench<'_> {
        /// A `PATHBENCH` line, on rank 0.
        fn say(&self, line: &str) {
            if self.w.rank == 0 {
                println!("PATHBENCH {line}");
            }
        }

        /// The largest `x` of the ranks (the ranks decide alike: they make the same
        /// calls).
        fn max_over_ranks(&self, what: &'static str, x: f64) -> Outcome<f64> {
            let deadline = Deadline::after(Duration::from_secs(120));
            let all =
                (self.w.exchange).all_gather(self.w.barrier, what, &x.to_le_bytes(), deadline);
            ok(what, all)?.iter().try_fold(x, |m, b| {
                let b = <[u8; 8]>::try_from(b.as_slice()).map_err(|_| format!("{what}: {b:?}"))?;
                Ok(m.max(f64::from_le_bytes(b)))
            })
        }

        /// Whether any rank is past the budget.
        fn over_budget(&self) -> Outcome<bool> {
            let elapsed = self.started.elapsed().as_secs_f64();
            Ok(self.max_over_ranks("paths: budget", elapsed)? > self.budget_s)
        }

        /// The crate's call, tagged with a tag of its own.
        fn crate_call<T: Element>(&self, op: Op, b: &Bufs<T>) -> Outcome<CollectiveReport> {
            let tag = self.tag.replace(self.tag.get() + 1);
            let (c, s) = (self.coll.tagged(tag), &self.stream);
            let r = match op {
                Op::AllGather => c.all_gather_in_place::<T>(&b.input, s),
                Op::ReduceScatter => c.reduce_scatter::<T>(&b.input, b.output(), ReduceOp::Sum, s),
                Op::AllReduce => c.all_reduce::<T>(&b.input, b.output(), ReduceOp::Sum, s),
            };
            ok(op.name(), r)
        }

        /// The raw NCCL call on `comm`, with the crate's pointers and stream.
        fn raw_call<T>(&self, op: Op, b: &Bufs<T>, comm: ncclComm_t) -> Outcome {
            let (send, recv) = (b.send as *const _, b.recv as *mut _);
            let (n, dt, sum, cu) = (b.count, b.dtype, ncclRedOp_t::ncclSum, self.cu);
            // SAFETY: `send` and `recv` lie in live pool buffers of this device, sized
            // for `n` elements of `dt` per rank (as the crate's call on them), kept
            // until the stream is synchronised; `comm` is the backend's live blocking
            // data communicator, which nothing else calls meanwhile (this thread drives
            // the rank); `cu` is the pool's live stream.
            let code = unsafe {
                match op {
                    Op::AllGather => (self.nccl.all_gather)(send, recv, n, dt, comm, cu),
                    Op::ReduceScatter => {
                        (self.nccl.reduce_scatter)(send, recv, n, dt, sum, comm, cu)
                    }
                    Op::AllReduce => (self.nccl.all_reduce)(send, recv, n, dt, sum, comm, cu),
                }
            };
            raw::check(op.name(), code)
        }

        /// Fill `b`'s poison ranges with 0xFF, on the stream.
        fn poison<T>(&self, b: &Bufs<T>) -> Outcome {
            let cs = self.stream.cuda_stream().ok_or("not a CUDA stream")?;
            let cuda = |e| format!("cuMemsetD8Async: {e:?}");
            cs.context().bind_to_thread().map_err(cuda)?;
            for &(ptr, len) in b.poison.iter().filter(|p| p.1 > 0) {
                // SAFETY: the range lies in a live pool buffer of this device, which the
                // stream orders before and after the collectives on it.
                unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, len, cs.cu_stream()) }
                    .map_err(cuda)?;
            }
            Ok(())
        }

        /// The buffers of `op` at `bytes` per rank, inputs written.
        fn buffers<T: Element>(&self, op: Op, bytes: usize) -> Outcome<Bufs<T>> {
            let (r, n, count) = (self.w.rank, self.w.size, bytes / size_of::<T>());
            let pool = self.coll.pool();
            let alloc = |b: usize| ok("alloc", pool.alloc(b as u64, &self.stream));
            let ptr = |b: &SymmBuffer| b.device_ptr().ok_or("no device pointer");
            let dtype = match T::DTYPE {
                DType::BF16 => ncclDataType_t::ncclBfloat16,
                DType::F32 => ncclDataType_t::ncclFloat32,
                d => return Err(format!("{d:?} is not measured")),
            };
            if op == Op::AllGather {
                let input = alloc(n * bytes)?;
                let view = ok("view", input.view::<T>())?;
                let mine = ok("slice", view.slice(r * count, count))?;
                ok("write", mine.copy_from_host(&values::<T>(r, count, 0)))?;
                let p = ptr(&input)?;
                let (at, after) = ((r * bytes) as u64, ((r + 1) * bytes) as u64);
                return Ok(Bufs {
                    send: p + at,
                    recv: p,
                    count,
                    dtype,
                    poison: vec![(p, r * bytes), (p + after, (n - r - 1) * bytes)],
                    want: (0..n).flat_map(|s| values::<T>(s, count, 0)).collect(),
                    input,
                    output: None,
                });
            }
            // Reduce-scatter: world × count in, this rank's chunk of the sum out;
            // all-reduce: count in, the sum out. Out of place: repeated calls give the
            // same result.
            let (whole, from, salt) = match op {
                Op::ReduceScatter => (n * count, r * count, 1),
                _ => (count, 0, 2),
            };
            let (input, output) = (alloc(whole * size_of::<T>())?, alloc(bytes)?);
            ok("write", input.write(&values::<T>(r, whole, salt)))?;
            let (send, recv) = (ptr(&input)?, ptr(&output)?);
            Ok(Bufs {
                send,
                recv,
                count,
                dtype,
                poison: vec![(recv, bytes)],
                want: summed::<T>(n, count, from, salt),
                input,
                output: Some(output),
            })
        }

        /// Every path's cell of `op` on `T` at `bytes` per rank: (path, communicator
        /// index, its raw handle). The buffers are made at the first cell run and
        /// freed after the last.
        fn group<T: Element>(
            &mut self,
            op: Op,
            bytes: usize,
            paths: &[(Path, usize, ncclComm_t)],
        ) -> Outcome {
            let (dtype, size) = (format!("{:?}", T::DTYPE).to_lowercase(), size(bytes));
            let mut bufs = None;
            for &target in paths {
                let cell = [op.name(), &dtype, &size, path_name(target.0)];
                if self.over_budget()? {
                    self.not_run += 1;
                    self.say(&row(cell, "not run (budget)"));
                    continue;
                }
                let b = match &mut bufs {
                    Some(b) => b,
                    None => bufs.insert(self.buffers::<T>(op, bytes)?),
                };
                match self.cell(op, b, target, cell)? {
                    Some((ratio, host)) => (self.measured).push((cell.join(" "), ratio, host)),
                    None => self.fell_back += 1,
                }
            }
            Ok(())
        }

        /// One cell: the crate's call forced onto `path` against raw NCCL on that
        /// path's communicator, same buffers and stream. `None` if the crate's call
        /// falls back to another path (raw is not run then).
        fn cell<T: Element>(
            &self,
            op: Op,
            b: &Bufs<T>,
            (path, index, comm): (Path, usize, ncclComm_t),
            cell: [&str; 4],
        ) -> Outcome<Option<(f64, f64)>> {
            let name = cell.join(" ");
            let prefer = Choice::Prefer(path);
            let policy = PathPolicy::default().with_choices(prefer, prefer);
            self.coll.set_path_policy(policy.with_all_reduce(prefer));
            let end_step = || ok("end_step", self.coll.end_step());
            let stream = &self.stream;
            // A timed crate call on another path or communicator fails the cell.
            let checked = || {
                let r = self.crate_call(op, b)?;
                match (r.path, r.comm) {
                    (p, c) if p == path && c == index => Ok(()),
                    (p, c) => Err(format!("{name}: a call took {p:?} on communicator {c}")),
                }
            };
            // Warm-up, 2 calls each; the first says whether the crate takes the path.
            let first = self.crate_call(op, b)?;
            if first.path != path {
                end_step()?;
                let fell = format!("n/a (fell back to {})", path_name(first.path));
                self.say(&row(cell, &fell));
                return Ok(None);
            }
            if first.comm != index {
                let used = first.comm;
                return Err(format!(
                    "{name}: the crate used communicator {used}, not {index}"
                ));
            }
            let (_, c) = time(1, 0, false, stream, &checked)?;
            let (_, r) = time(2, 0, false, stream, || self.raw_call(op, b, comm))?;
            end_step()?;
            let per_call = self.max_over_ranks("paths: warm-up", c.max(r / 2.0))?;
            let bytes = b.count * size_of::<T>();
            let fill = (BATCH_S / per_call) as usize;
            let iters = ((256 << 20) / bytes).min(fill).clamp(3, 200);
            // Side 0 is the crate, side 1 raw; which goes first alternates.
            let bus = bytes as f64 * op.bus(self.w.size) * iters as f64 / 1e9;
            let (mut ratios, mut bw, mut host) = (vec![], [vec![], vec![]], [vec![], vec![]]);
            for rep in 0..REPS {
                let mut secs = [0.0; 2];
                for side in [rep % 2, 1 - rep % 2] {
                    let (us, s) = match side {
                        0 => time(iters, 0, false, stream, &checked)?,
                        _ => time(iters, 0, false, stream, || self.raw_call(op, b, comm))?,
                    };
                    if side == 0 {
                        end_step()?;
                    }
                    host[side].extend(us);
                    bw[side].push(bus / s);
                    secs[side] = s;
                }
                ratios.push(secs[1] / secs[0]);
            }
            // One checked call of each, onto poisoned results.
            for side in ["crate", "raw"] {
                self.poison(b)?;
                if side == "crate" {
                    self.crate_call(op, b)?;
                    end_step()?;
                } else {
                    self.raw_call(op, b, comm)?;
                }
                let got = ok("read", b.output().read::<T>())?;
                same(&format!("{name}, {side}"), &got, &b.want)?;
            }
            let med = |v: &[f64]| spread(v.to_vec()).0;
            let (ratio, lo, hi) = spread(ratios);
            let (hc, hr) = (med(&host[0]), med(&host[1]));
            let (bc, br) = (med(&bw[0]), med(&bw[1]));
            let range = format!("[{lo:.3}, {hi:.3}]");
            let cols = format!(
                "{iters:>5} {bc:>10.2} {br:>10.2} {ratio:>6.3} {range:<14} {hc:>8.1} {hr:>8.1} {:>+8.1}",
                hc - hr
            );
            self.say(&row(cell, &cols));
            Ok(Some((ratio, hc - hr)))
        }
    }

    pub(super) fn run(w: &World) -> Outcome {
        if w.kind != Kind::Nccl {
            w.say("RESULT paths skipped: it measures NCCL");
            return Ok(());
        }
        let backend = (w.backend.downcast_ref::<NcclBackend>()).ok_or("not an NCCL backend")?;
        let max_bytes = env("SYMMPOOL_PATHS_MAX_BYTES", 256usize << 20)?;
        let budget_s = env("SYMMPOOL_PATHS_BUDGET_S", 240.0)?;
        let sizes: Vec<usize> = SIZES.into_iter().filter(|&s| s <= max_bytes).collect();
        // Each path the backend has a communicator for: the first of its role (the
        // one the crate's choice takes), which must be blocking, and its raw handle.
        let comms = w.backend.communicators();
        let mut paths: Vec<(Path, usize, ncclComm_t)> = Vec::new();
        for (i, c) in comms.iter().enumerate() {
            let path = match c.role {
                CommRole::Symmetric => Path::SymmetricKernel,
                CommRole::CopyEngine => Path::CopyEngine,
                CommRole::Plain => Path::PlainKernel,
            };
            if paths.iter().any(|p| p.0 == path) {
                continue;
            }
            if backend.is_blocking(i) != Some(true) {
                return Err(format!(
                    "data communicator {i} ({:?}) is not blocking",
                    c.role
                ));
            }
            paths.push((path, i, backend.raw_comm(i).ok_or("no raw communicator")?));
        }
        // A registered pool under the crate's default checks, with room for the
        // largest cell (the reduce-scatter's world + 1 chunks) registered before any
        // timing; smaller buffers come from it or from small segments made outside
        // the timed batches.
        let pool = w.pool(CheckMode::default(), config("paths"))?;
        if let Some(top) = sizes.last() {
            ok("reserve", pool.reserve(((w.size + 1) * top) as u64))?;
        }
        let coll = ok("Coll::new", Coll::new(&pool))?;
        let stream = ok("new_stream", pool.new_stream())?;
        let cu = stream.raw_cuda().ok_or("not a CUDA stream")? as cudaStream_t;
        let mut bench = Bench {
            w,
            coll,
            stream,
            cu,
            nccl: raw::nccl()?,
            tag: Cell::new(0),
            started: Instant::now(),
            budget_s,
            measured: Vec::new(),
            fell_back: 0,
            not_run: 0,
        };
        let hostid = std::env::var("NCCL_HOSTID").map_or_else(
            |_| "NCCL_HOSTID unset".into(),
            |v| format!("NCCL_HOSTID={v}"),
        );
        bench.say(&format!(
            "NCCL {}, {} ranks on {} node(s) ({hostid}), communicators {:?}; the crate: check {:?}, every call tagged, end_step after each of its batches (untimed); per cell {REPS} repetitions of a crate batch and a raw batch (which first alternates), each timed from its first call to the stream's synchronisation; GB/s: bus bandwidth; ratio: median over the repetitions of crate/raw [least, greatest]; us: host time per call (call to return), median; budget {budget_s} s",
            w.backend.nccl_version(),
            w.size,
            w.backend.info().nodes,
            comms.iter().map(|c| c.role).collect::<Vec<_>>(),
            bench.coll.check_mode(),
        ));
        let names = ["iters", "crate_GB/s", "raw_GB/s", "ratio", "[min, max]"];
        let [iters, c, r, ratio, range] = names;
        let (hc, hr, hd) = ("crate_us", "raw_us", "diff_us");
        let cols =
            format!("{iters:>5} {c:>10} {r:>10} {ratio:>6} {range:<14} {hc:>8} {hr:>8} {hd:>8}");
        bench.say(&row(["collective", "type", "size", "path"], &cols));
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            // The copy engine runs all-gathers only.
            let paths: Vec<_> = (paths.iter().copied())
                .filter(|p| op == Op::AllGather || p.0 != Path::CopyEngine)
                .collect();
            for &bytes in &sizes {
                bench.group::<bf16>(op, bytes, &paths)?;
            }
            for &bytes in &sizes {
                bench.group::<f32>(op, bytes, &paths)?;
            }
        }
        let m = &bench.measured;
        let below = m.iter().filter(|c| c.1 < RATIO_FLOOR).count();
        let over = m.iter().filter(|c| c.2 > HOST_FLOOR_US).count();
        let met = |bad: usize| if bad == 0 { "met" } else { "NOT met" };
        match (
            m.iter().min_by(|a, b| a.1.total_cmp(&b.1)),
            m.iter().max_by(|a, b| a.2.total_cmp(&b.2)),
        ) {
            (Some(low), Some(high)) => {
                bench.say(&format!(
                    "summary ratio: min {:.3} at {}; every ratio >= {RATIO_FLOOR}: {} ({below} of {} below)",
                    low.1,
                    low.0,
                    met(below),
                    m.len()
                ));
                bench.say(&format!(
                    "summary host: max crate - raw {:+.1} us at {}; every difference <= {HOST_FLOOR_US} us: {} ({over} of {} over)",
                    high.2,
                    high.0,
                    met(over),
                    m.len()
                ));
            }
            _ => bench.say("summary ratio: no cell measured; summary host: no cell measured"),
        }
        let tally = format!(
            "{} cells measured, {} fell back (n/a), {} not run (budget), {:.1} s",
            m.len(),
            bench.fell_back,
            bench.not_run,
            bench.started.elapsed().as_secs_f64()
        );
        bench.say(&format!("summary cells: {tally}"));
        drop(bench);
        ok("close", pool.close())?;
        w.say(&format!("RESULT paths ok: {tally}, every result checked"));
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// compare-losses

/// The `fsdp_step --json` objects of a log: (label, mode, losses).
fn runs_of(path: &FsPath) -> Outcome<Vec<(String, String, Vec<f64>)>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut runs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| l.starts_with("{\"")) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}: {e}", path.display()))?;
        let mode = v["mode"].as_str().unwrap_or("?").to_string();
        if mode == "none" {
            continue; // its losses mean nothing
        }
        let losses = (v["losses"].as_array())
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        let label = format!(
            "{} {} check {}",
            path.display(),
            v["backend"].as_str().unwrap_or("?"),
            v["check"].as_str().unwrap_or("?")
        );
        runs.push((label, mode, losses));
    }
    if runs.is_empty() {
        return Err(format!("{}: no fsdp_step --json lines", path.display()));
    }
    Ok(runs)
}

/// The largest relative difference between two loss trajectories (of equal length).
fn worst(a: &[f64], b: &[f64]) -> Outcome<f64> {
    if a.len() != b.len() || a.is_empty() {
        return Err(format!("{} steps against {}", a.len(), b.len()));
    }
    Ok(a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y.abs().max(1e-30)).abs())
        .fold(0.0, f64::max))
}

fn compare_losses(files: &[PathBuf], tolerance: f64) -> Outcome {
    let [reference, others @ ..] = files else {
        return Err("compare-losses needs --losses FILE (the reference first)".into());
    };
    let base = runs_of(reference)?;
    let (base_label, _, base_losses) = &base[0];
    let mut failed = Vec::new();
    for file in std::iter::once(reference).chain(others) {
        let runs = runs_of(file)?;
        for (label, mode, losses) in &runs {
            // Every mode of a run follows its first mode's trajectory (the paths
            // differ, the sums do not).
            let within = worst(losses, &runs[0].2)?;
            let across = worst(losses, base_losses)?;
            let ok_run = within <= 1e-3 && across <= tolerance;
            println!(
                "{} {label} {mode}: first {:.6e} last {:.6e}; vs its first mode {within:.2e} (<= 1e-3); vs {base_label} {across:.2e} (<= {tolerance})",
                if ok_run { "ok" } else { "FAILED" },
                losses[0],
                losses[losses.len() - 1]
            );
            if !ok_run {
                failed.push(format!("{label} {mode}"));
            }
        }
    }
    if failed.is_empty() {
        println!("RESULT compare-losses ok: {} files", files.len());
        Ok(())
    } else {
        Err(format!("losses differ: {}", failed.join(", ")))
    }
}

/// Run what `cli` says; `Err` says which check failed.
pub fn run(cli: &Cli) -> Outcome {
    if cli.trials.contains(&Trial::CompareLosses) {
        if cli.trials.len() != 1 {
            return Err("compare-losses runs alone".into());
        }
        return compare_losses(&cli.losses, cli.tolerance);
    }
    let faults = (cli.trials.iter())
        .filter(|t| {
            matches!(
                t,
                Trial::FaultCollective
                    | Trial::FaultRegistration
                    | Trial::FaultShrink
                    | Trial::FaultGrow
            )
        })
        .count();
    if faults > 0 {
        if cli.trials.len() != 1 {
            return Err("a fault trial runs alone (it ends the world)".into());
        }
        return fault_trial(cli.backend, cli.trials[0], cli.path);
    }
    let w = World::join(cli.backend, None)?;
    w.say(&format!(
        "{} ranks on {:?} (NCCL {} rules), communicators {:?}, pid {}",
        w.size,
        w.kind,
        w.backend.nccl_version(),
        (w.backend.communicators().iter())
            .map(|c| format!("{:?}", c.role))
            .collect::<Vec<_>>(),
        std::process::id()
    ));
    for trial in &cli.trials {
        match trial {
            Trial::Collectives => collectives(&w)?,
            Trial::TwoPools => two_pools(&w)?,
            Trial::Graph => graph(&w)?,
            #[cfg(feature = "nccl")]
            Trial::Hostcost => hostcost::run(&w)?,
            #[cfg(not(feature = "nccl"))]
            Trial::Hostcost => w.say("RESULT hostcost skipped: built without the `nccl` feature"),
            #[cfg(feature = "nccl")]
            Trial::Paths => paths::run(&w)?,
            #[cfg(not(feature = "nccl"))]
            Trial::Paths => w.say("RESULT paths skipped: built without the `nccl` feature"),
            Trial::FaultCollective
            | Trial::FaultRegistration
            | Trial::FaultShrink
            | Trial::FaultGrow
            | Trial::CompareLosses => {
                unreachable!("handled above")
            }
        }
        w.barrier("between trials")?;
    }
    Ok(())
}

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "-".into());
        println!("[rank {rank}] FAILED: {e}");
        std::process::exit(1);
    }
}
