//! Trials for a world of ranks as processes on one machine, one process per rank,
//! started by `scripts/nccl-world.sh` (torchrun-style variables; on NCCL each rank
//! its own `NCCL_HOSTID`, so several ranks share one GPU and NCCL links them over
//! sockets). Every trial checks what it does and exits non-zero when a check fails.
//!
//! ```text
//! bash scripts/nccl-world.sh -n 2 -- target/release/examples/nccl_world collectives two-pools graph
//! bash scripts/nccl-world.sh -n 2 --fault KILL:1 -- target/release/examples/nccl_world fault-collective
//! bash scripts/nccl-world.sh -n 2 -- target/release/examples/nccl_world hostcost
//! nccl_world compare-losses --tolerance 0.1 host.log nccl.log   # no world: fsdp_step --json lines
//! ```
//!
//! | trial | what it checks |
//! |---|---|
//! | `collectives` | all-gather, reduce-scatter, all-reduce; in place and out of place; f32, bf16, f16; three sizes; on registered pools under every check mode (`off`, `async`, `strict`) and on an unregistered one: every result equal to the value computed on the host (small integers, exact in every type); the path each took |
//! | `two-pools` | two pools on one backend, the second with communicators of its own, each driven from its own thread with its own stream and handle: 20 rounds of growth and collectives, every result checked |
//! | `graph` | a step's all-gather and reduce-scatter captured in a CUDA graph (NCCL only) and replayed ten times with fresh inputs, every replay checked |
//! | `fault-collective`, `fault-registration` | with `--fault SIG:RANK` of the script: after a barrier the victim stops taking part (at its next registration, for the second); the others loop collectives (or growths, so registrations); the script signals the victim's own process (`KILL` or `STOP`) once a survivor is inside the collective (or the victim inside its registration). Each survivor prints the error, its kind, the rank it names and the time from the signal to it, and passes if it is `PeerLost` naming the victim within the documented bound, then drops everything and exits |
//! | `hostcost` | host time of one all-gather call (call to return) on the crate's blocking data communicator, on a non-blocking one (`NcclConfig::data_blocking = false`), and of raw `ncclAllGather` on the same blocking communicator, 64 KiB–4 MiB per rank, median of many calls (NCCL only) |
//! | `compare-losses` | no world: the `--json` lines of `fsdp_step` runs (rank 0's logs): within each run every mode's losses equal (relative 1e-3), and every run's equal, step by step, to the first run's within `--tolerance` (the first being the host backend's at the same sizes) |
//!
//! `--backend shm` runs the trials that need no GPU on the shared-memory backend (the
//! machine's CI runs them so); `graph` and `hostcost` say they were skipped there.
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
use symmpool::coll::Path;
use symmpool::control::{ChannelId, Exchange, StoreConfig, StoreExchange};
use symmpool::{
    Backend, CheckMode, Coll, CollectiveCalls, Deadline, Element, Error, ErrorKind, PoolConfig,
    ReduceOp, Stream, SymmBuffer, SymmPool, bf16, f16,
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
    /// Host time per all-gather call: crate (blocking, non-blocking), raw NCCL
    Hostcost,
    /// Compare `fsdp_step --json` runs (no world)
    CompareLosses,
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

impl World {
    /// Join the world from the launcher's variables: the store, then the backend
    /// (`wrap` replaces its segment provider, for the registration fault).
    fn join(kind: Kind, wrap: Option<Wrap<'_>>) -> Outcome<World> {
        let config = ok("the store's settings", StoreConfig::from_env())?;
        let heartbeat = (config.heartbeat_interval, config.heartbeat_timeout);
        let exchange: Arc<dyn Exchange> =
            Arc::new(ok("joining the store", StoreExchange::connect(config))?);
        let backend = match kind {
            #[cfg(feature = "nccl")]
            Kind::Nccl => ok(
                "NcclBackend::from_env",
                symmpool::backend::NcclBackend::from_env(
                    exchange.clone(),
                    symmpool::backend::NcclConfig::default(),
                ),
            )?,
            #[cfg(not(feature = "nccl"))]
            Kind::Nccl => return Err("built without the `nccl` feature".into()),
            #[cfg(target_os = "linux")]
            Kind::Shm => ok(
                "ShmBackend::join",
                symmpool::backend::ShmBackend::join(
                    exchange.clone(),
                    symmpool::backend::ShmConfig::default(),
                ),
            )?,
            #[cfg(not(target_os = "linux"))]
            Kind::Shm => return Err("the shared-memory backend is Linux only".into()),
        };
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

    /// A pool named `name` on this rank's backend.
    fn pool(&self, config: PoolConfig) -> Outcome<SymmPool> {
        ok("SymmPool::new", SymmPool::new(self.backend.clone(), config))
    }
}

/// Every pool of the trials: checks as given, a timeout of 60 s.
fn config(name: &str, check: CheckMode) -> PoolConfig {
    PoolConfig::default()
        .with_name(name)
        .with_check(check)
        .with_timeout(Duration::from_secs(60))
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
        coll.all_gather::<T>(&input, &output, stream),
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
        coll.all_gather_in_place::<T>(&buf, stream),
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
        coll.reduce_scatter::<T>(&input, &output, ReduceOp::Sum, stream),
    )?;
    same(&what("reduce_scatter"), &read(&output)?, &want)?;
    paths.push(("reduce_scatter", rep.path));
    let buf = alloc(n * count)?;
    ok("write", buf.write(&whole))?;
    let rep = ok(
        &what("reduce_scatter_in_place"),
        coll.reduce_scatter_in_place::<T>(&buf, ReduceOp::Sum, stream),
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
        coll.all_reduce::<T>(&input, &output, ReduceOp::Sum, stream),
    )?;
    same(&what("all_reduce"), &read(&output)?, &want)?;
    paths.push(("all_reduce", rep.path));
    let buf = alloc(count)?;
    ok("write", buf.write(&data))?;
    let rep = ok(
        &what("all_reduce_in_place"),
        coll.all_reduce_in_place::<T>(&buf, ReduceOp::Sum, stream),
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
        let pool = w.pool(config(&name, check).with_register(register))?;
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
    let params = w.pool(config("params", CheckMode::Async))?;
    let own = config("grads", CheckMode::Async).with_own_communicators(true);
    let grads = w.pool(own)?;
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
                        ok("all_gather", coll.all_gather_in_place::<f32>(&buf, &stream))?;
                        let want: Vec<f32> =
                            (0..n).flat_map(|s| vec![(i + s) as f32; count]).collect();
                        same(
                            &format!("round {i}, all-gather"),
                            &ok("read", buf.read())?,
                            &want,
                        )?;
                        ok(
                            "all_reduce",
                            coll.all_reduce_in_place::<f32>(&buf, ReduceOp::Sum, &stream),
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
    let pool = w.pool(config("graph", CheckMode::Off))?;
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
        coll.all_gather::<f32>(&ag_in, &ag_out, &stream)?;
        coll.reduce_scatter::<f32>(&rs_in, &rs_out, ReduceOp::Sum, &stream)?;
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

fn fault_trial(kind: Kind, trial: Trial) -> Outcome {
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
    let pool = w.pool(config("fault", CheckMode::Off))?;
    let coll = ok("Coll::new", Coll::new(&pool))?;
    let stream = ok("new_stream", pool.new_stream())?;
    let count = 256 * 1024;
    let input = ok("alloc", pool.alloc(4 * count as u64, &stream))?;
    let output = ok("alloc", pool.alloc(4 * (w.size * count) as u64, &stream))?;
    // Everything connected and registered once, every rank alive.
    ok("write", input.write(&values::<f32>(w.rank, count, 0)))?;
    ok(
        "warm-up all_gather",
        coll.all_gather::<f32>(&input, &output, &stream),
    )?;
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
            if let Err(e) = coll.all_gather::<f32>(&input, &output, &stream) {
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
    if trial == Trial::FaultShrink {
        verdict?;
        drop(kept);
        drop((input, output, coll));
        return survive(&w, &pool, count, &sig, victim);
    }
    // Everything dropped: a broken backend's teardown is bounded too.
    let dropping = Instant::now();
    drop(kept);
    drop((input, output, coll));
    drop(pool);
    let World {
        backend, exchange, ..
    } = w;
    drop(backend);
    drop(exchange);
    let dropped = dropping.elapsed();
    let op = if registration {
        "registration"
    } else {
        "collective"
    };
    println!(
        "[rank {me}] RESULT fault-{op} SIG{sig} of rank {victim}: {} kind={} names={} took={} bound={:.1}s dropped_in={:.2}s nccl={version} error=\"{error}\"",
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
/// every element, and report the time from the shrink's start to the gathered data.
fn survive(w: &World, pool: &SymmPool, count: usize, sig: &str, victim: usize) -> Outcome {
    let started = Instant::now();
    let (pool, report) = ok("SymmPool::shrink", pool.shrink())?;
    let shrunk_in = started.elapsed();
    let coll = ok("Coll::new", Coll::new(&pool))?;
    let stream = ok("new_stream", pool.new_stream())?;
    let n = report.world_size;
    let input = ok("alloc", pool.alloc(4 * count as u64, &stream))?;
    let output = ok("alloc", pool.alloc(4 * (n * count) as u64, &stream))?;
    ok("write", input.write(&values::<f32>(report.rank, count, 1)))?;
    ok(
        "all_gather after the shrink",
        coll.all_gather::<f32>(&input, &output, &stream),
    )?;
    let gathered: Vec<f32> = (0..n).flat_map(|s| values::<f32>(s, count, 1)).collect();
    same(
        "all-gather after the shrink",
        &ok("read", output.read())?,
        &gathered,
    )?;
    let first = started.elapsed();
    drop((input, output, coll));
    ok("close", pool.close())?;
    println!(
        "[rank {}] RESULT fault-shrink SIG{sig} of rank {victim}: ok rank={}->{} world={}->{} lost={:?} segments={} registrations={} shrink={:.3}s first_all_gather={:.3}s nccl={}",
        w.rank,
        report.old_rank,
        report.rank,
        report.old_world_size,
        n,
        report.lost_ranks,
        report.segments,
        report.registrations,
        shrunk_in.as_secs_f64(),
        first.as_secs_f64(),
        w.backend.nccl_version(),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------
// hostcost

#[cfg(feature = "nccl")]
mod hostcost {
    use super::*;
    use symmpool::backend::{NcclBackend, NcclConfig};

    /// `ncclAllGather`, from the `libnccl.so.2` the crate loaded.
    type AllGather = unsafe extern "C" fn(
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        usize,
        cudarc::nccl::sys::ncclDataType_t,
        cudarc::nccl::sys::ncclComm_t,
        cudarc::nccl::sys::cudaStream_t,
    ) -> i32;

    /// The raw NCCL the crate loaded: its own symbol table (`backend::nccl::ffi`) is
    /// private, so the same library is opened again without loading anything
    /// (`RTLD_NOLOAD`): `$SYMMPOOL_NCCL_LIBRARY` when set, else `libnccl.so.2`.
    fn raw_all_gather() -> Outcome<(libloading::os::unix::Library, AllGather)> {
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
                // SAFETY: the signature is nccl.h's (ncclResult_t as int); the library
                // stays loaded while the caller holds it.
                let f: AllGather = *unsafe { lib.get::<AllGather>(b"ncclAllGather") }
                    .map_err(|e| format!("ncclAllGather: {e}"))?;
                return Ok((lib, f));
            }
        }
        Err("the crate's libnccl.so.2 is not loaded".into())
    }

    /// Median, 10th and 90th percentile, in µs.
    fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        (at(0.5), at(0.1), at(0.9))
    }

    /// Host time of `calls` calls of `call` (each waited for on the device after the
    /// clock stopped), after 3 untimed ones.
    fn time(
        calls: usize,
        stream: &Stream,
        mut call: impl FnMut() -> Outcome,
    ) -> Outcome<(f64, f64, f64)> {
        let cs = stream.cuda_stream().ok_or("not a CUDA stream")?;
        let mut us = Vec::with_capacity(calls);
        for i in 0..calls + 3 {
            let t0 = Instant::now();
            call()?;
            let dt = t0.elapsed();
            cs.synchronize().map_err(|e| format!("{e:?}"))?;
            if i >= 3 {
                us.push(dt.as_secs_f64() * 1e6);
            }
        }
        Ok(spread(us))
    }

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
        let (_lib, raw) = raw_all_gather()?;
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
        let cfg = |name: &str| config(name, CheckMode::Off).with_register(false);
        let pool = w.pool(cfg("hostcost-blocking"))?;
        let nb_pool = ok(
            "SymmPool::new",
            SymmPool::new(nb_backend.clone(), cfg("hostcost-non-blocking")),
        )?;
        let coll = ok("Coll::new", Coll::new(&pool))?;
        let nb_coll = ok("Coll::new", Coll::new(&nb_pool))?;
        let stream = ok("new_stream", pool.new_stream())?;
        let nb_stream = ok("new_stream", nb_pool.new_stream())?;
        let n = w.size;
        let mut lines = vec![format!(
            "HOSTCOST NCCL {}, {n} ranks, one GPU (NCCL_HOSTID), µs per all-gather call from the call to its return, median [p10, p90]",
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
            let crate_b = time(calls, &stream, || {
                ok(
                    "all_gather",
                    coll.all_gather::<f32>(&input, &output, &stream),
                )
                .map(|_| ())
            })?;
            let crate_nb = time(calls, &nb_stream, || {
                ok(
                    "all_gather",
                    nb_coll.all_gather::<f32>(&nb_in, &nb_out, &nb_stream),
                )
                .map(|_| ())
            })?;
            let send = input.device_ptr().ok_or("no device pointer")? as *const std::ffi::c_void;
            let recv = output.device_ptr().ok_or("no device pointer")? as *mut std::ffi::c_void;
            let cu =
                stream.raw_cuda().ok_or("not a CUDA stream")? as cudarc::nccl::sys::cudaStream_t;
            let raw_t = time(calls, &stream, || {
                // SAFETY: `send` and `recv` are live pool buffers of `count` and `n` ×
                // `count` f32s on this device, kept until the stream is synchronised;
                // `raw_comm` is the backend's live blocking plain communicator, which
                // nothing else calls meanwhile (this thread drives the rank).
                let code = unsafe {
                    raw(
                        send,
                        recv,
                        count,
                        cudarc::nccl::sys::ncclDataType_t::ncclFloat32,
                        raw_comm,
                        cu,
                    )
                };
                if code == 0 {
                    Ok(())
                } else {
                    Err(format!("ncclAllGather returned {code}"))
                }
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
                Trial::FaultCollective | Trial::FaultRegistration | Trial::FaultShrink
            )
        })
        .count();
    if faults > 0 {
        if cli.trials.len() != 1 {
            return Err("a fault trial runs alone (it ends the world)".into());
        }
        return fault_trial(cli.backend, cli.trials[0]);
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
            Trial::FaultCollective
            | Trial::FaultRegistration
            | Trial::FaultShrink
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
