//! FSDP-style training on a `symmpool` pool: the crate's API in one page.
//!
//! A stack of linear layers learns a known teacher. Each layer's parameters are
//! sharded over the ranks; before a layer runs, its shard is all-gathered into a
//! buffer from the pool on a communication stream (prefetching the next layers,
//! `--prefetch N`, while this one computes), and after the backward pass its gradient is reduce-scattered
//! back to shards. This file shows the API; the rest are the parts around it:
//!
//! | file | what |
//! |---|---|
//! | `main.rs` | pools, `scope`, `alloc`, the two collectives on a stream, statistics, the shrink after a lost rank, `main` |
//! | `trainer.rs` | the FSDP step, written once over a `Math` trait; each collective's tag, `end_step` |
//! | `host_math.rs`, `gpu_math.rs` | `Math` with f32 loops on the host, bf16 cuBLAS on GPUs |
//! | `ranks.rs` | ranks as threads, and a barrier a failing rank breaks |
//! | `survive.rs` | `--survive`: a rank lost on purpose; the survivors' agreement, the state they go on from |
//! | `report.rs` | the summary (`--json`), the table, the check |
//! | `trace.rs` | the timeline (`--trace`): device and host spans, Chrome-trace JSON |
//! | `cli.rs` | the command line |
//!
//! Without GPUs it runs on the host backend (ranks as threads, memory on the host);
//! with two or more GPUs, on NCCL.
//!
//! ```text
//! cargo run --release --example fsdp_step                      # defaults for the machine
//! cargo run --release --example fsdp_step -- --compare         # every mode, one table
//! cargo run --release --example fsdp_step -- --comm auto --json
//! cargo run --release --example fsdp_step -- --balanced --compare   # comm ≈ compute (GPUs)
//! cargo run --release --example fsdp_step -- --memory-map map.svg  # every rank's pool, drawn
//! cargo run --release --example fsdp_step -- --trace step.json     # the timeline (Perfetto)
//! cargo run --release --example fsdp_step -- --nproc 4 --survive   # lose a rank, shrink, go on
//! RUST_LOG=symmpool=debug cargo run --release --example fsdp_step   # the pool's life, traced
//! cargo run --release --example fsdp_step -- --help
//! ```

mod cli;
#[cfg(feature = "nccl")]
#[path = "../support/gpu_math.rs"]
mod cublas;
#[cfg(feature = "nccl")]
mod gpu_math;
mod host_math;
pub mod launch;
mod ranks;
#[path = "../support/render.rs"]
mod render;
mod report;
pub mod survive;
pub mod trace;
mod trainer;

pub use cli::{Args, BackendChoice, Calibrate, Check, Cli, Mode, Survive};
pub use report::{
    Calibrated, Log, Spread, Summary, check, identity_line, loss_disagreement, print,
    survival_lines,
};

use clap::Parser;
use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use ranks::{StepBarrier, StepSync, on_rank_threads};
use std::time::Instant;
use symmpool::coll::{CalibrateConfig, Choice, Path, PathPolicy, TaggedColl};
use symmpool::observe::{MemoryStats, PoolSnapshot, StatValue};
use symmpool::{
    Backend, Coll, CollectiveCalls, Element, ErrorKind, HostBackend, HostConfig, PoolConfig,
    ReduceOp, Result, Stream, SymmBuffer, SymmPool,
};
use trainer::{Math, On, Trainer};

// ---------------------------------------------------------------------------------
// 1. A pool per mode. A pool carves buffers out of a few segments and registers each
//    segment once as an NCCL window; its collectives handle (`Coll`) runs the
//    collectives on its buffers, and its path policy says which NCCL path they prefer
//    on those windows.

/// The pool configuration of `mode`: `ring` registers nothing (plain NCCL); the
/// collectives are checked as `check` says (`--check`, async by default).
fn pool_config(mode: Mode, check: Check) -> PoolConfig {
    PoolConfig::default()
        .with_register(!matches!(mode, Mode::Ring | Mode::None))
        .with_name(mode.name())
        .with_check(check.mode())
}

/// The collectives' path preferences of `mode`; `auto` takes `calibrated` when given
/// (the thresholds measured on this machine, [`calibrate`]).
fn path_policy(mode: Mode, calibrated: Option<&PathPolicy>) -> PathPolicy {
    let symm = Choice::Prefer(Path::SymmetricKernel);
    match mode {
        Mode::Symm => PathPolicy::default().with_choices(symm, symm),
        Mode::Ce => PathPolicy::default().with_choices(Choice::Prefer(Path::CopyEngine), symm),
        Mode::Auto => calibrated.cloned().unwrap_or_default(),
        Mode::Ring | Mode::None => PathPolicy::default(),
    }
}

/// A pool of `mode` over one rank's `backend`, checked as `check` says.
fn make_pool(mode: Mode, check: Check, backend: Backend) -> Result<SymmPool> {
    SymmPool::new(backend, pool_config(mode, check))
}

/// A pool of each of `modes` over one rank's `backend` (collective: every rank makes
/// them in the same order). A communicator set has one collectives handle, and each
/// mode has its own, so every mode but the first gets communicators of its own.
fn make_pools(modes: &[Mode], check: Check, backend: &Backend) -> Result<Vec<(Mode, SymmPool)>> {
    (modes.iter().enumerate())
        .map(|(i, &mode)| {
            let config = pool_config(mode, check).with_own_communicators(i > 0);
            Ok((mode, SymmPool::new(backend.clone(), config)?))
        })
        .collect()
}

/// The collectives handle of `mode`'s pool, with the mode's path preferences
/// (`calibrated`: auto's measured thresholds, if any). Local: no round with the peers
/// (each rank makes its own; their collectives are what pair).
fn make_coll(mode: Mode, pools: &[SymmPool], calibrated: Option<&PathPolicy>) -> Result<Coll> {
    let coll = Coll::with_pools(pools)?;
    coll.set_path_policy(path_policy(mode, calibrated));
    Ok(coll)
}

/// The bytes per rank of this run's collectives: (all-gather input, the shard;
/// reduce-scatter output, the gradient's shard), both hidden² / ranks elements.
fn collective_bytes<M: Math>(args: &Args, world: usize) -> (u64, u64) {
    let shard = (args.hidden * args.hidden / world * std::mem::size_of::<M::E>()) as u64;
    (shard, shard)
}

/// `auto`'s path thresholds measured on this machine, over exactly the sizes this
/// run's collectives use, when `--calibrate` asks (`auto`: where symmpool says the
/// defaults are not known to hold, [`Coll::needs_calibration`]); `None` otherwise, or
/// without an `auto` mode. The measurement runs on `auto`'s communicators, in a
/// temporary pool, with cheap settings (3 repetitions of 3 calls per path).
///
/// Collective: every rank calls it at the same point (every rank reaches the same
/// decision: it depends on the arguments and on what the ranks agreed at set-up).
fn calibrate<M: Math>(
    math: &M,
    pools: &[(Mode, SymmPool)],
    args: &Args,
) -> Result<Option<(PathPolicy, Calibrated)>> {
    let Some((_, pool)) = pools.iter().find(|(m, _)| *m == Mode::Auto) else {
        return Ok(None);
    };
    // A handle of its own, dropped before the trainer makes the mode's handle.
    let coll = Coll::new(pool)?;
    let reason = match args.calibrate {
        Calibrate::Never => None,
        Calibrate::Auto => coll.calibration_reason(),
        Calibrate::Always => Some(coll.calibration_reason().unwrap_or("asked")),
    };
    let Some(reason) = reason else {
        return Ok(None);
    };
    let (ag, rs) = collective_bytes::<M>(args, pool.world_size());
    // At least 4 bytes: the smallest size calibration measures.
    let (lo, hi) = (ag.min(rs).max(4), ag.max(rs).max(4));
    let t0 = Instant::now();
    let calibration =
        coll.calibrate(math.stream(On::AllGather), &CalibrateConfig::quick(lo, hi))?;
    let ms = ms_since(t0, Instant::now());
    let note = Calibrated::new(reason, &calibration.policy, (lo, hi), ms);
    Ok(Some((calibration.policy, note)))
}

// ---------------------------------------------------------------------------------
// 2. The two collectives FSDP needs. `symmpool::alloc` takes from the pool of the
//    enclosing `pool.scope(..)`; `stream` is where the buffer is used and the
//    collective runs (the pool does not reuse the block until that work is done).
//    Each call carries its identity, `coll.tagged(tag)` (the trainer's tags: step,
//    layer, op), so that ranks that skip or reorder a call fail the check there, and
//    every step ends with `coll.end_step()`.

/// All-gather every rank's `shard` into a new buffer (the layer's whole parameters).
pub fn all_gather<E: Element>(
    coll: TaggedColl<'_>,
    shard: &SymmBuffer,
    stream: &Stream,
) -> Result<(SymmBuffer, Path)> {
    let world = shard.pool().world_size() as u64;
    let full = symmpool::alloc(shard.len_bytes() * world, stream)?;
    let report = coll.all_gather::<E>(shard, &full, stream)?;
    Ok((full, report.path))
}

/// Sum `full` over the ranks in place: this rank's chunk (`full.len_bytes() / world`
/// bytes at `rank` times that) holds its shard of the sum afterwards.
pub fn reduce_scatter_in_place<E: Element>(
    coll: TaggedColl<'_>,
    full: &SymmBuffer,
    stream: &Stream,
) -> Result<Path> {
    let report = coll.reduce_scatter_in_place::<E>(full, ReduceOp::Sum, stream)?;
    Ok(report.path)
}

/// A mode's statistics: its parameter pool's and its gradient pool's, summed key by
/// key (peaks: the sum of the two pools' peaks).
fn stats(pools: &[SymmPool; 2]) -> MemoryStats {
    let mut all = pools[0].memory_stats();
    for (key, value) in pools[1].memory_stats() {
        let sum = match (all.get(&key), value) {
            (Some(StatValue::Count(a)), StatValue::Count(b)) => StatValue::Count(a + b),
            (Some(StatValue::Real(a)), StatValue::Real(b)) => StatValue::Real(a + b),
            (_, v) => v,
        };
        all.insert(key, sum);
    }
    all
}

/// Window registrations on every communicator.
fn registrations(stats: &MemoryStats) -> u64 {
    (stats.iter())
        .filter(|(k, _)| k.starts_with("registrations."))
        .filter_map(|(_, v)| v.as_u64())
        .sum()
}

/// Every rank's snapshot at the end of training (with `--memory-map`), per mode.
static MEMORY_MAPS: Mutex<Vec<(Mode, PoolSnapshot)>> = Mutex::new(Vec::new());

/// Draw rank by rank the pools of the first mode (`render_ranks` outlines any block
/// placed differently on some rank) and save every snapshot beside it as JSON.
fn write_memory_map(path: &std::path::Path, first: Mode) -> std::io::Result<()> {
    let mut all = std::mem::take(&mut *MEMORY_MAPS.lock());
    all.sort_by_key(|(m, s)| (*m != first, s.rank));
    let ranks: Vec<PoolSnapshot> = (all.iter())
        .filter(|(m, _)| *m == first)
        .map(|(_, s)| s.clone())
        .collect();
    std::fs::write(path, render::render_ranks(&ranks))?;
    let snapshots: Vec<&PoolSnapshot> = all.iter().map(|(_, s)| s).collect();
    let json = serde_json::to_string_pretty(&snapshots).map_err(std::io::Error::other)?;
    let mut json_path = path.as_os_str().to_owned();
    json_path.push(".json");
    std::fs::write(json_path, json)
}

// ---------------------------------------------------------------------------------
// 3. One rank: data, a trainer per mode, the steps, the statistics. How the rank
//    was started (a thread here) does not matter to it.

/// One mode's run on this rank: its pools (parameters, gradients), trainer and log.
type Run<'m, M> = (Mode, [SymmPool; 2], Trainer<'m, M>, Log);

/// A trainer of `mode` over `pools` (parameters, gradients) at their rank and world
/// size, on `data` in `data_pool`; from `state` when given (`--resume`, or the
/// survivors' state after a loss); `auto` with the `calibrated` thresholds, if any.
fn start_run<'m, M: Math>(
    math: &'m M,
    (mode, pools): (Mode, [SymmPool; 2]),
    (data_pool, data): (&SymmPool, &trainer::Data),
    args: &Args,
    state: Option<&survive::State>,
    calibrated: Option<&PathPolicy>,
) -> Result<Run<'m, M>> {
    let [pool, grads] = &pools;
    let place = (pool.rank(), pool.world_size());
    // The weight gradients in a pool of their own, as FSDP2's gradients and parameters
    // never share blocks (see `Trainer::grad_pool`); one collectives handle for both.
    let coll = make_coll(mode, &[pool.clone(), grads.clone()], calibrated)?;
    let communicate = mode.communicates().then_some(coll);
    let mut trainer = pool.scope(|| {
        Trainer::new(
            math,
            data.clone(),
            data_pool,
            grads,
            args,
            place,
            communicate,
        )
    })?;
    if let Some(state) = state {
        trainer.load(state)?;
    }
    let log = Log {
        first_step: state.map_or(0, |s| s.step),
        ..Log::default()
    };
    Ok((mode, pools, trainer, log))
}

/// Train every mode of `pools` (this rank's, one per mode) for `args.steps` steps,
/// interleaved step by step so that they see the same machine; returns a summary per
/// mode. Every rank calls this with the same arguments. With `--survive`, a lost rank
/// is survived once ([`go_on_without`]).
pub fn run_one_rank<M: Math>(
    math: &M,
    pools: Vec<(Mode, SymmPool)>,
    args: &Args,
    barrier: &dyn StepSync,
) -> Result<Vec<Summary>> {
    // `--resume`: the state a run saved, cut for this run's world size.
    let resumed = args
        .resume
        .as_deref()
        .map(survive::State::load)
        .transpose()?;
    let first = &pools[0].1;
    // The data, and what no collective touches (activations, their gradients), live
    // in a pool of their own, unregistered: each mode's pool holds only the buffers
    // its collectives use, so its statistics count those alone.
    let data_config = PoolConfig::default()
        .with_register(false)
        .with_timeout(first.config().timeout);
    let mut data_pool = SymmPool::new(first.backend().clone(), data_config)?;
    let mut data = data_pool.scope(|| trainer::make_data(math, args, first.rank()))?;
    // Before training: `auto`'s thresholds measured here, when `--calibrate` says so.
    let calibrated = calibrate(math, &pools, args)?;
    let auto_policy = calibrated.as_ref().map(|(p, _)| p);
    let start = resumed.as_ref().map_or(0, |s| s.step);
    let mut runs = Vec::new();
    for (mode, pool) in pools {
        let grads = make_pool(mode, args.check, pool.backend().clone())?;
        let run = start_run(
            math,
            (mode, [pool, grads]),
            (&data_pool, &data),
            args,
            resumed.as_ref(),
            auto_policy,
        )?;
        // The warm-up step's peak is what `fit_to_peak` sizes the pools from.
        run.1.iter().for_each(SymmPool::reset_peak);
        runs.push(run);
    }
    let mut step = start;
    while step < args.steps {
        match run_step(&mut runs, step, start, args, barrier) {
            Ok(()) => step += 1,
            // One lost rank is survived (`--survive`; one mode, so one run).
            Err(lost) if args.survive.is_some() && survive::is_loss(&lost) => {
                let Some(run) = runs.pop().filter(|r| r.3.survival.is_none()) else {
                    return Err(lost);
                };
                let went_on = go_on_without(
                    math,
                    run,
                    (data_pool, data),
                    args,
                    barrier,
                    lost,
                    auto_policy,
                )?;
                (runs, data_pool, data, step) = went_on;
                let survival = runs.iter().find_map(|r| r.3.survival.as_ref());
                let show = |s: &&report::Survival| s.rank_after == 0 && !args.quiet && !args.json;
                if let Some(s) = survival.filter(show) {
                    // What happened, in the run's own words (the crate logs the errors it
                    // returns at debug: the caller decides what they deserve).
                    report::survival_notice(s)
                        .iter()
                        .for_each(|l| report::line(l));
                }
            }
            Err(e) => return Err(e),
        }
    }
    let mut summaries = Vec::new();
    for (mode, pools, mut trainer, log) in runs {
        if args.memory_map.is_some() {
            // While the trainer's buffers are alive: parameters, shards, optimizer state.
            let snapshot = pools[0].memory_snapshot();
            let mut maps = MEMORY_MAPS.lock();
            maps.push((mode, snapshot));
        }
        if let Some(recorder) = trainer.trace.take() {
            trace::keep(recorder.spans);
        }
        let (ag, rs) = (&trainer.ag_paths, &trainer.rs_paths);
        let stats = stats(&pools);
        let rank = pools[0].rank();
        let mut summary = Summary::new(args, mode, rank, log, &stats, ag, rs);
        if mode == Mode::Auto {
            summary.calibration = calibrated.as_ref().map(|(_, note)| note.clone());
        }
        summaries.push(summary);
        // Release the pools on every rank (collective); dropping one unclosed warns.
        drop(trainer);
        for pool in pools {
            pool.close()?;
        }
    }
    drop(data);
    data_pool.close()?;
    report::add_ratios(&mut summaries);
    Ok(summaries)
}

/// Step `step` of every run, the modes in [`mode_order`], each after the step barrier;
/// `start`: the run's first step (the warm-up).
fn run_step<M: Math>(
    runs: &mut [Run<'_, M>],
    step: usize,
    start: usize,
    args: &Args,
    barrier: &dyn StepSync,
) -> Result<()> {
    for i in mode_order(step, runs.len()) {
        let (mode, pools, trainer, log) = &mut runs[i];
        let rank = pools[0].rank();
        if step == start + 1 && args.trace.is_some() {
            // The timeline leaves out the warm-up step.
            trainer.trace = Some(trace::Recorder::new(rank, *mode));
        }
        barrier.wait(step)?;
        let out = pools[0].scope(|| trainer.step(step))?;
        log.losses.push(out.loss);
        log.step_ms.push(out.ms);
        if step == start {
            log.segments_first_step = stats(pools)["segment.all.current"].as_u64().unwrap_or(0);
            // Warm-up sizing (collective): the step's temporaries are free now, but
            // for layer 0's parameters gathered for the next step (the trainer holds
            // them, and their segment stays); segments sized to the step's peak
            // replace the others growth made on the way.
            for pool in pools.iter() {
                pool.fit_to_peak()?;
            }
        }
        let now = registrations(&stats(pools));
        log.registrations = log.registrations_before_loss + now;
        if step == start {
            log.registrations_first_step = log.registrations;
        }
        if let (Some(s), Some(t0)) = (&mut log.survival, log.lost_at.take()) {
            // The first step at the new world size.
            s.first_step_ms = ms_since(t0, Instant::now());
            s.first_collective_ms = trainer.first_collective.map_or(0.0, |t| ms_since(t0, t));
            s.registrations_first_step_after = now.saturating_sub(s.registrations_shrink());
        }
        if rank == 0 && !args.quiet && !args.json {
            // A step run again after a lost rank is marked, with the new world size.
            let again = (log.survival.as_ref())
                .filter(|s| step < s.lost_in_step)
                .map(|s| s.world_size_after);
            report::step_line(*mode, step, out.loss, out.ms, again);
        }
    }
    Ok(())
}

fn ms_since(t0: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(t0).as_secs_f64() * 1e3
}

/// A run, its data pool and data after the step-`lost` error told this rank that a rank
/// was lost: the run rebuilt among the survivors, the new data pool and data, and the
/// step to go on from.
type WentOn<'m, M> = (Vec<Run<'m, M>>, SymmPool, trainer::Data, usize);

/// Go on without the lost rank (`--survive`), on every survivor: shrink the pools, in
/// the same order everywhere (`SymmPool::shrink`: the same memory, its segments
/// registered once on the survivors' new communicators); move the step barrier to the
/// survivors; agree on the last step whose whole parameters every survivor kept (the
/// lost rank's shards are gone with it); rebuild what depends on the world size and on
/// this rank's place in it (the shards, cut anew from that state; the data; the
/// collectives handle) and go on from that step.
///
/// # Errors
/// The shrink's errors ([`symmpool::Error::ShrinkFailed`] among them: a loss of rank
/// 0, which hosts the store, cannot be survived), and those of the rebuild.
/// `pool.shrink()`, asked again after a second loss while the survivors agreed
/// (`retry`: each retry follows a new loss, so there are fewer than the ranks).
fn shrink(pool: &SymmPool) -> Result<(SymmPool, symmpool::ShrinkReport)> {
    loop {
        match pool.shrink() {
            Err(symmpool::Error::ShrinkFailed { retry: true, .. }) => continue,
            other => return other,
        }
    }
}

fn go_on_without<'m, M: Math>(
    math: &'m M,
    (mode, pools, trainer, mut log): Run<'m, M>,
    (data_pool, data): (SymmPool, trainer::Data),
    args: &Args,
    barrier: &dyn StepSync,
    lost: symmpool::Error,
    calibrated: Option<&PathPolicy>,
) -> Result<WentOn<'m, M>> {
    let t0 = Instant::now();
    let (params, params_report) = shrink(&pools[0])?;
    let (grads, grads_report) = shrink(&pools[1])?;
    let (new_data_pool, data_report) = shrink(&data_pool)?;
    barrier.shrunk(params.backend())?;
    let shrink_ms = ms_since(t0, Instant::now());
    let timeout = params.config().timeout;
    let at = survive::agree(params.backend().exchange(), &trainer.kept_steps(), timeout)?;
    let state = trainer.kept(at)?;
    // The old buffers' blocks go back to the new pools, for the new ones to reuse.
    drop((trainer, pools, data, data_pool));
    let rank = params.rank();
    let data = new_data_pool.scope(|| trainer::make_data(math, args, rank))?;
    let run = start_run(
        math,
        (mode, [params, grads]),
        (&new_data_pool, &data),
        args,
        Some(&state),
        calibrated,
    )?;
    let save = args.survive.as_ref().and_then(|s| s.save_state.as_ref());
    if let Some(path) = save.filter(|_| rank == 0) {
        state.save(path)?;
    }
    // The step the loss came in; the losses and times of the steps the survivors run
    // again are dropped.
    let lost_in = log.first_step + log.losses.len();
    log.losses.truncate(at - log.first_step);
    log.step_ms.truncate(at - log.first_step);
    let pools = [
        ("parameters", &params_report),
        ("gradients", &grads_report),
        ("data", &data_report),
    ];
    log.survival = Some(report::Survival::new(&lost, lost_in, at, shrink_ms, pools));
    log.registrations_before_loss = log.registrations;
    log.lost_at = Some(t0);
    let (_, pools, trainer, _) = run;
    Ok((vec![(mode, pools, trainer, log)], new_data_pool, data, at))
}

// ---------------------------------------------------------------------------------
// 4. Starting the ranks. As users' jobs run: one process per rank (`launch.rs`:
//    `--nproc N` starts N processes of this program; torchrun, srun or mpirun start
//    them with the rank in the environment). As a test harness: threads in this
//    process, on the host backend or on local GPUs (`gpu_math::run`).

/// The order in which step `step` runs `modes` modes (indices), the same on every
/// rank: drawn from the step's number. In a fixed order each mode always follows the
/// same one, and on one H200 that alone made `auto` 3 % slower than `ring` on the same
/// path (the mode after the heaviest one paid for it).
pub fn mode_order(step: usize, modes: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..modes).collect();
    order.shuffle(&mut StdRng::seed_from_u64(0x5eed ^ step as u64));
    order
}

/// Train on the host backend, a thread per rank; returns rank 0's summaries.
pub fn run_host(args: &Args) -> Result<Vec<Summary>> {
    // Each mode gets a host "world" of its own: one backend per rank, sharing memory.
    let mut per_rank: Vec<Vec<(Mode, Backend)>> = (0..args.ranks).map(|_| Vec::new()).collect();
    for &mode in &args.modes {
        let host = HostConfig::new(args.ranks);
        for (rank, backend) in HostBackend::world(host)?.into_iter().enumerate() {
            per_rank[rank].push((mode, backend));
        }
    }
    let barrier = StepBarrier::new(args.ranks);
    on_rank_threads(per_rank, &barrier, |backends| {
        // Making a pool is collective: every rank makes its own, in the same order.
        let pools = backends
            .into_iter()
            .map(|(mode, backend)| Ok((mode, make_pool(mode, args.check, backend)?)))
            .collect::<Result<Vec<_>>>()?;
        run_one_rank(&host_math::HostMath::default(), pools, args, &barrier)
    })
}

fn gpu_count() -> usize {
    #[cfg(feature = "nccl")]
    return symmpool::backend::nccl::device_count().unwrap_or(0);
    #[cfg(not(feature = "nccl"))]
    return 0;
}

fn main() {
    // `RUST_LOG=symmpool=info` (or `debug`, `trace`) shows the pool's spans and events.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // No colour codes in a redirected log.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut args = cli.resolve(gpu_count());
    if let Some(path) = args.resume.clone() {
        // Before any rank starts: the model's shape is the state's unless given, and a
        // state that does not fit is a configuration error.
        let given = (cli.layers, cli.hidden);
        survive::State::fit_file(&path, &mut args, given).unwrap_or_else(|err| fail(&err));
    }
    let rank_process = launch::is_rank_process(cli.nproc);
    args.processes = rank_process || cli.nproc.is_some();
    let results = if rank_process {
        // Started by a launcher (or by `--nproc`): this process is one rank.
        match launch::run_as_rank(&args) {
            Ok(Some(results)) => results,
            Ok(None) => return, // not rank 0: rank 0 reports
            Err(err) => fail(&err),
        }
    } else if let Some(n) = cli.nproc {
        let victim = args.survive.as_ref().map(|s| s.victim);
        launch::spawn_ranks(n, victim).unwrap_or_else(|err| fail(&err))
    } else {
        run_threads(&cli, &args).unwrap_or_else(|err| fail(&err))
    };
    if launch::is_child() {
        launch::report_to_parent(&results);
        return;
    }
    report::print(&args, &results);
    // With ranks as processes, rank 0 gathered every rank's snapshot and wrote it.
    let threads = !args.processes;
    if let Some(path) = args.memory_map.as_ref().filter(|_| threads) {
        match write_memory_map(path, args.modes[0]) {
            Ok(()) if !args.json => report::line(&format!("memory map: {}", path.display())),
            Ok(()) => {}
            Err(e) => {
                eprintln!(
                    "fsdp_step: writing the memory map to {}: {e}",
                    path.display()
                );
                std::process::exit(1);
            }
        }
    }
    // With ranks as processes, rank 0 gathered every rank's spans and wrote them.
    if let Some(path) = args.trace.as_ref().filter(|_| threads) {
        let spans = trace::take();
        if let Err(e) = trace::write(path, &spans) {
            eprintln!("fsdp_step: writing the trace to {}: {e}", path.display());
            std::process::exit(1);
        }
        eprintln!("trace: {}\n{}", path.display(), trace::summary(&spans, 0));
    }
    if let Err(msg) = check(&results) {
        eprintln!("fsdp_step: check failed: {msg}");
        std::process::exit(1);
    }
}

/// Report `err` (its `Display`, which carries the advice, and its kind) and exit with
/// the kind's status, so that a launcher or a runtime can sort failures without parsing
/// messages:
///
/// | status | [`ErrorKind`] | what to do |
/// |---|---|---|
/// | 64 | `Usage` | fix the program |
/// | 65 | `Divergence` | fix the program (the ranks made different calls) |
/// | 78 | `Configuration` | fix the settings or the environment |
/// | 75 | `OutOfMemory` | retry with less (a smaller model or batch) |
/// | 69 | `Timeout`, `PeerLost`, `GroupLost` | restart the job (after `PeerLost`, `--survive` shrinks instead) |
/// | 71 | `System` | restart; look at the device or the host |
/// | 70 | `Broken`, `Internal`, others | restart; report an internal error |
///
/// A failed check of the results exits with 1.
fn fail(err: &symmpool::Error) -> ! {
    eprintln!("fsdp_step: {err} [{}]", err.kind());
    std::process::exit(exit_code(err.kind()))
}

/// The exit status for an error of `kind` (the table of [`fail`]).
pub fn exit_code(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::Usage => 64,
        ErrorKind::Divergence => 65,
        ErrorKind::Configuration => 78,
        ErrorKind::OutOfMemory => 75,
        ErrorKind::Timeout | ErrorKind::PeerLost | ErrorKind::GroupLost => 69,
        ErrorKind::System => 71,
        _ => 70,
    }
}

/// With ranks as processes: gather every rank's snapshots on rank 0, which writes the
/// memory map.
pub fn gather_memory_map(exchange: &dyn symmpool::Exchange, args: &Args) -> Result<()> {
    let Some(path) = &args.memory_map else {
        return Ok(());
    };
    let mine = std::mem::take(&mut *MEMORY_MAPS.lock());
    let json = serde_json::to_vec(&mine).map_err(|e| symmpool::Error::Internal {
        what: format!("encoding a snapshot: {e}"),
    })?;
    let deadline = symmpool::Deadline::after(PoolConfig::default().timeout);
    let channel = exchange.open_channel("fsdp_step:memory-map", deadline)?;
    let all = exchange.all_gather(channel, "memory map", &json, deadline)?;
    if exchange.rank() == 0 {
        let mut maps = MEMORY_MAPS.lock();
        for bytes in all {
            if let Ok(v) = serde_json::from_slice::<Vec<(Mode, PoolSnapshot)>>(&bytes) {
                maps.extend(v);
            }
        }
        drop(maps);
        write_memory_map(path, args.modes[0]).map_err(|e| symmpool::Error::Internal {
            what: format!("writing the memory map to {}: {e}", path.display()),
        })?;
    }
    Ok(())
}

/// Ranks as threads of this process (a test harness).
fn run_threads(cli: &Cli, args: &Args) -> Result<Vec<Summary>> {
    match args.backend {
        #[cfg(feature = "nccl")]
        BackendChoice::Nccl => gpu_math::run(args),
        #[cfg(not(feature = "nccl"))]
        BackendChoice::Nccl => {
            eprintln!("fsdp_step: built without the `nccl` feature");
            std::process::exit(2)
        }
        _ => {
            if cli.backend == BackendChoice::Auto && !args.json && !args.quiet {
                let n = args.ranks.max(2);
                report::line(&format!(
                    "no GPUs found (or fewer than {n}): running on the host backend"
                ));
            }
            run_host(args)
        }
    }
}
