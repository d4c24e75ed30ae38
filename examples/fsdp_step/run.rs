//! One rank: data, a trainer per mode, the steps, the statistics. How the rank was
//! started (a thread, `ranks.rs`, or a process, `launch.rs`) does not matter to it.
//!
//! Before training, `auto`'s thresholds are measured on this machine when
//! `--calibrate` asks ([`calibrate`]); after the warm-up step the pools are sized to its
//! peak; a lost rank is survived in `survive.rs` (`go_on_without`), and replaced in
//! `heal.rs` (`grow_back` on the survivors; a newcomer starts from [`Start::Joined`]).

use super::cli::{Args, Calibrate, Mode};
use super::ranks::StepSync;
use super::report::{self, Calibrated, Log, Summary};
use super::trainer::{self, Math, On, Trainer};
use super::{heal, make_coll, pool_config, survive, trace};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use std::time::Instant;
use symmpool::coll::{CalibrateConfig, PathPolicy};
use symmpool::{Coll, PoolConfig, Result, SymmPool};

/// One mode's run on this rank: its pools (parameters, gradients), trainer and log.
pub type Run<'m, M> = (Mode, [SymmPool; 2], Trainer<'m, M>, Log);

/// A trainer of `mode` over `pools` (parameters, gradients) at their rank and world
/// size, on `data` in `data_pool`; from `state` when given (`--resume`, or the
/// survivors' state after a loss); `auto` with the `calibrated` thresholds, if any.
pub fn start_run<'m, M: Math>(
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

/// The configuration of the pool of the data and of what no collective touches
/// (activations, their gradients): unregistered, so that each mode's pool holds only
/// the buffers its collectives use, and its statistics count those alone.
pub fn data_config() -> PoolConfig {
    PoolConfig::default().with_register(false)
}

/// How a rank starts: with pools made anew, one per mode (every rank of a job), or
/// joined to the group the survivors grew (a newcomer, `--heal`: [`heal::join`]).
#[derive(Debug)]
pub enum Start {
    /// This rank's pool per mode, made collectively with the other ranks'.
    New(Vec<(Mode, SymmPool)>),
    /// A newcomer's pools.
    Joined(Box<heal::Joined>),
}

/// A rank's runs (one per mode), data pool and data, and `auto`'s calibration.
type Begun<'m, M> = (
    Vec<Run<'m, M>>,
    SymmPool,
    trainer::Data,
    Option<(PathPolicy, Calibrated)>,
);

/// The runs of `pools` (this rank's, one per mode), each with its gradients' pool, and
/// the data pool and data: a rank at the job's start, from `--resume`'s state if given;
/// `auto`'s thresholds measured first when `--calibrate` says so.
fn begin<'m, M: Math>(
    math: &'m M,
    pools: Vec<(Mode, SymmPool)>,
    args: &Args,
) -> Result<Begun<'m, M>> {
    // `--resume`: the state a run saved, cut for this run's world size.
    let resumed = args
        .resume
        .as_deref()
        .map(survive::State::load)
        .transpose()?;
    let first = &pools[0].1;
    let data_pool = SymmPool::new(first.group(), data_config())?;
    let data = data_pool.scope(|| trainer::make_data(math, args, first.rank()))?;
    // Before training: `auto`'s thresholds measured here, when `--calibrate` says so.
    let calibrated = calibrate(math, &pools, args)?;
    let auto_policy = calibrated.as_ref().map(|(p, _)| p);
    let mut runs = Vec::new();
    for (mode, pool) in pools {
        let grads = SymmPool::new(pool.group(), pool_config(mode))?;
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
    Ok((runs, data_pool, data, calibrated))
}

/// Train every mode (this rank's pools, made or joined as `start` says) for
/// `args.steps` steps, interleaved step by step so that they see the same machine;
/// returns a summary per mode. Every rank calls this with the same arguments. With
/// `--survive`, a lost rank is survived once ([`survive::go_on_without`]); with
/// `--heal`, replaced once ([`heal::grow_back`]).
pub fn run_one_rank<M: Math>(
    math: &M,
    start: Start,
    args: &Args,
    barrier: &dyn StepSync,
) -> Result<Vec<Summary>> {
    // The warm-up step, the job's first: none on a newcomer, which joins sized pools.
    let (mut runs, mut data_pool, mut data, calibrated, warm_up) = match start {
        Start::New(pools) => {
            let (runs, data_pool, data, calibrated) = begin(math, pools, args)?;
            let first = runs[0].3.first_step;
            (runs, data_pool, data, calibrated, Some(first))
        }
        Start::Joined(joined) => {
            let (runs, data_pool, data) = heal::begin(math, *joined, args)?;
            (runs, data_pool, data, None, None)
        }
    };
    let auto_policy = calibrated.as_ref().map(|(p, _)| p);
    let mut step = runs[0].3.first_step;
    while step < args.steps {
        if heal::due(args, step, &runs) {
            let run = runs.pop().expect("one mode");
            let grown = (data_pool, data);
            let grown = heal::grow_back(math, run, grown, args, barrier, step, auto_policy)?;
            (runs, data_pool, data) = grown;
            let heal = runs.iter().find_map(|r| r.3.heal.as_ref());
            if let Some(h) = heal.filter(|h| h.rank_after == 0 && !args.quiet && !args.json) {
                report::line(&heal::notice(h));
            }
        }
        match run_step(&mut runs, step, warm_up, args, barrier) {
            Ok(()) => step += 1,
            // One lost rank is survived (`--survive`; one mode, so one run).
            Err(lost) if args.survive.is_some() && survive::is_loss(&lost) => {
                let Some(run) = runs.pop().filter(|r| r.3.survival.is_none()) else {
                    return Err(lost);
                };
                let went_on = survive::go_on_without(
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
            report::keep_memory_map(mode, pools[0].memory_snapshot());
        }
        if let Some(recorder) = trainer.trace.take() {
            trace::keep(recorder.spans);
        }
        let (ag, rs) = (&trainer.ag_paths, &trainer.rs_paths);
        let stats = report::stats(&pools);
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

/// The order in which step `step` runs `modes` modes (indices), the same on every
/// rank: drawn from the step's number. In a fixed order each mode always follows the
/// same one, and on one H200 that alone made `auto` 3 % slower than `ring` on the same
/// path (the mode after the heaviest one paid for it).
pub fn mode_order(step: usize, modes: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..modes).collect();
    order.shuffle(&mut StdRng::seed_from_u64(0x5eed ^ step as u64));
    order
}

/// Step `step` of every run, the modes in [`mode_order`], each after the step barrier;
/// `warm_up`: the run's first step, which sizes the pools (none on a newcomer).
fn run_step<M: Math>(
    runs: &mut [Run<'_, M>],
    step: usize,
    warm_up: Option<usize>,
    args: &Args,
    barrier: &dyn StepSync,
) -> Result<()> {
    for i in mode_order(step, runs.len()) {
        let (mode, pools, trainer, log) = &mut runs[i];
        let rank = pools[0].rank();
        if warm_up.is_some_and(|w| step == w + 1) && args.trace.is_some() {
            // The timeline leaves out the warm-up step.
            trainer.trace = Some(trace::Recorder::new(rank, *mode));
        }
        barrier.wait(step)?;
        let out = pools[0].scope(|| trainer.step(step))?;
        log.losses.push(out.loss);
        log.step_ms.push(out.ms);
        if Some(step) == warm_up {
            log.segments_first_step = report::stats(pools)["segment.all.current"]
                .as_u64()
                .unwrap_or(0);
            // Warm-up sizing (collective): the step's temporaries are free now, but
            // for layer 0's parameters gathered for the next step (the trainer holds
            // them, and their segment stays); segments sized to the step's peak
            // replace the others growth made on the way.
            for pool in pools.iter() {
                pool.fit_to_peak()?;
            }
        }
        let now = report::registrations(&report::stats(pools));
        log.registrations = log.registrations_replaced + now;
        if Some(step) == warm_up {
            log.registrations_first_step = log.registrations;
        }
        if let Some(t0) = log.regrouped_at.take() {
            // The first step at the new world size.
            log.first_step_regrouped(t0, trainer.first_collective, now);
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

/// Milliseconds from `t0` to `t` (0 when `t` came first).
pub fn ms_since(t0: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(t0).as_secs_f64() * 1e3
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
