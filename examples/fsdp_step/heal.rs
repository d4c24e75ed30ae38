//! `--heal`: a replacement takes the lost rank's place, and the world grows back.
//!
//! The launcher of `--nproc` (`launch.rs`, in a scheduler's part) starts the
//! replacement once the victim of `--survive` died: this program again, with the job's
//! environment, the lost rank's `RANK` and `SYMMPOOL_JOIN=1` ([`is_newcomer`]). Its
//! store connection (`StoreExchange::from_env`) waits until the survivors grow the
//! group, and returns its place there: the lost rank's. At the start of step
//! `--heal-at-step` the survivors ([`grow_back`]):
//! 1. agree on the state: they all-gather their shards at their size
//!    (`Trainer::whole`). No rank was lost in the step, so there is nothing to vote on
//!    as after a loss (`survive::agree`): every survivor gets the same whole parameters
//!    of the step, and the collectives' tags check that they are at the same step;
//! 2. hand it to the newcomer: their rank 0 writes it to the file the launcher names
//!    ([`STATE_VAR`]; `--save-state`'s format), before the grow, so the file is whole
//!    when the newcomer is admitted (its connection returns only once the survivors
//!    grow). A checkpoint, as a restarted rank reads one (on several machines, from a
//!    shared file system); the survivors could as well send it over the pool, a
//!    broadcast at the full size, but one format for every state keeps it short;
//! 3. drop every buffer of the old pools (blocks live at a grow stay allocated on every
//!    rank, pinned) and grow the pools, in the order they were made: parameters,
//!    gradients, data (`SymmPool::grow`);
//! 4. cut the state into shards for the full size and go on from that step.
//!
//! The newcomer ([`join`], then [`begin`]) makes its backend and group as every rank
//! does, joins the three pools in the survivors' order (`SymmPool::join`: their
//! layout, so every rank's next placement is identical), loads the state and trains on
//! from the same step. What the heal did is the summary's [`Healing`].

use super::cli::{Args, Check, Mode};
use super::ranks::StepSync;
use super::report::Summary;
use super::run::{Run, data_config, ms_since, start_run};
use super::survive::State;
use super::trainer::{self, Math};
use super::{make_group, pool_config};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;
use symmpool::coll::PathPolicy;
use symmpool::{Backend, Deadline, Error, Exchange, GrowReport, Result, SymmPool};

/// The variable that names the file the survivors hand the newcomer its state in (set
/// by the launcher on every rank).
pub const STATE_VAR: &str = "SYMMPOOL_FSDP_HEAL_STATE";

/// Whether this process is a replacement, started to join the group
/// (`SYMMPOOL_JOIN=1`).
pub fn is_newcomer() -> bool {
    std::env::var("SYMMPOOL_JOIN").is_ok_and(|v| v == "1")
}

/// The file the survivors hand the newcomer its state in.
///
/// # Errors
/// [`Error::InvalidConfig`] if the launcher named none.
pub fn state_file() -> Result<PathBuf> {
    std::env::var_os(STATE_VAR)
        .map(PathBuf::from)
        .ok_or_else(|| {
            Error::InvalidConfig(format!(
                "--heal: the launcher starts the replacement (the lost RANK, SYMMPOOL_JOIN=1) \
             and names the file that hands it the state ({STATE_VAR}); --nproc does both"
            ))
        })
}

/// What one pool's grow (or join, on the newcomer) did ([`GrowReport`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrownPool {
    /// Which pool: `parameters`, `gradients` or `data`.
    pub pool: String,
    /// Segments of the pool (no reallocation on the survivors).
    pub segments: usize,
    /// Window registrations made on the grown group's communicators.
    pub registrations: u64,
    /// Blocks allocated at the grow, which stay allocated on every rank.
    pub pinned_blocks: u64,
    /// Bytes of those blocks.
    pub pinned_bytes: u64,
    /// How long the grow took, in ms.
    pub ms: f64,
}

/// How the world grew back (`--heal`), on one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Healing {
    /// The step at whose start the world grew: its loss and the later ones are at the
    /// full size.
    pub at_step: usize,
    /// The world size before the grow.
    pub world_size_before: usize,
    /// The world size after it.
    pub world_size_after: usize,
    /// The newcomers' ranks in the grown group (the lost ranks' places).
    pub newcomers: Vec<usize>,
    /// This rank before the grow (`null` on the newcomer).
    pub rank_before: Option<usize>,
    /// This rank after it.
    pub rank_after: usize,
    /// From the start of the heal (the state gathered) to every pool grown and the
    /// step barrier moved, in ms (on the newcomer: from its admission, joined).
    pub grow_ms: f64,
    /// From the start of the heal to this rank's first collective at the full size
    /// returning, in ms (on the newcomer: from its admission).
    pub first_collective_ms: f64,
    /// From the start of the heal to the end of the first step at the full size, in ms.
    pub first_step_ms: f64,
    /// The newcomer's: from its admission (the survivors grew the group and the store
    /// took it in) to its first collective at the full size returning, in ms: its
    /// backend, group and pools joined, the state loaded, data and trainer made.
    pub newcomer_first_collective_ms: f64,
    /// The newcomer's: from its start (its call to the store) to its admission, in ms:
    /// it waited for the survivors to reach the heal.
    pub newcomer_waited_ms: f64,
    /// What each pool's grow did (on the newcomer, its join).
    pub pools: Vec<GrownPool>,
    /// Window registrations the first step at the full size made beyond the grow's.
    pub registrations_first_step_after: u64,
}

impl Healing {
    /// The heal at step `at_step` that `pools`' grows (or joins, parameters first)
    /// reported, taking `grow_ms`; the times of the first collective and step are
    /// filled in once it ends, the newcomer's by [`gather`].
    fn new(at_step: usize, grow_ms: f64, pools: [(&str, &GrowReport); 3]) -> Healing {
        let first = pools[0].1;
        Healing {
            at_step,
            world_size_before: first.old_world_size,
            world_size_after: first.world_size,
            newcomers: first.newcomers.clone(),
            rank_before: (first.old_world_size > 0).then_some(first.rank),
            rank_after: first.rank,
            grow_ms,
            first_collective_ms: 0.0,
            first_step_ms: 0.0,
            newcomer_first_collective_ms: 0.0,
            newcomer_waited_ms: 0.0,
            pools: (pools.iter())
                .map(|(name, r)| GrownPool {
                    pool: name.to_string(),
                    segments: r.segments,
                    registrations: r.registrations,
                    pinned_blocks: r.pinned_blocks,
                    pinned_bytes: r.pinned_bytes,
                    ms: r.took.as_secs_f64() * 1e3,
                })
                .collect(),
            registrations_first_step_after: 0,
        }
    }

    /// The window registrations the grows made.
    pub fn registrations_grow(&self) -> u64 {
        self.pools.iter().map(|p| p.registrations).sum()
    }
}

/// Whether the survivors grow back before step `step`: `--heal` asks it there, and
/// these `runs` went on past a loss and have not grown back yet.
pub(super) fn due<M: Math>(args: &Args, step: usize, runs: &[Run<'_, M>]) -> bool {
    let at = args.survive.as_ref().and_then(|s| s.heal_at);
    at == Some(step) && (runs.iter()).any(|r| r.3.survival.is_some() && r.3.heal.is_none())
}

/// A grow that found no newcomer.
fn no_newcomer() -> Error {
    Error::Internal {
        what: "the survivors grew with no newcomer".into(),
    }
}

/// Grow back at the start of step `step` (`--heal`), on every survivor: the whole
/// parameters all-gathered, handed to the newcomer; every buffer dropped, every pool
/// grown in order, the step barrier moved to the grown group; the shards cut for the
/// full size, the data made for this rank's place (`calibrated`: auto's thresholds).
///
/// # Errors
/// The collectives', the grows' ([`Error::Timeout`] if no newcomer comes within the
/// group's timeout) and the rebuild's; writing the state.
pub(super) fn grow_back<'m, M: Math>(
    math: &'m M,
    (mode, pools, trainer, mut log): Run<'m, M>,
    (data_pool, data): (SymmPool, trainer::Data),
    args: &Args,
    barrier: &dyn StepSync,
    step: usize,
    calibrated: Option<&PathPolicy>,
) -> Result<(Vec<Run<'m, M>>, SymmPool, trainer::Data)> {
    let t0 = Instant::now();
    let state = pools[0].scope(|| trainer.whole(step))?;
    if pools[0].rank() == 0 {
        let save = args.survive.as_ref().and_then(|s| s.save_state.clone());
        for path in [Some(state_file()?), save].into_iter().flatten() {
            state.save(&path)?;
        }
    }
    // Blocks live at the grow would stay allocated on every rank: none is.
    drop((trainer, data));
    let grow = |pool: &SymmPool| pool.grow(true)?.ok_or_else(no_newcomer);
    let (params, params_report) = grow(&pools[0])?;
    let (grads, grads_report) = grow(&pools[1])?;
    let (new_data_pool, data_report) = grow(&data_pool)?;
    barrier.regrouped(params.backend())?;
    let grow_ms = ms_since(t0, Instant::now());
    drop((pools, data_pool));
    let data = new_data_pool.scope(|| trainer::make_data(math, args, params.rank()))?;
    let (_, pools, trainer, _) = start_run(
        math,
        (mode, [params, grads]),
        (&new_data_pool, &data),
        args,
        Some(&state),
        calibrated,
    )?;
    let reports = [
        ("parameters", &params_report),
        ("gradients", &grads_report),
        ("data", &data_report),
    ];
    log.heal = Some(Healing::new(step, grow_ms, reports));
    log.registrations_replaced = log.registrations;
    log.regrouped_at = Some(t0);
    Ok((vec![(mode, pools, trainer, log)], new_data_pool, data))
}

/// A newcomer's pools, joined to the grown group, and when it started and was admitted.
#[derive(Debug)]
pub struct Joined {
    mode: Mode,
    /// Parameters, gradients, data.
    pools: [(SymmPool, GrowReport); 3],
    started: Instant,
    admitted: Instant,
    /// From its admission to its pools joined, in ms.
    joined_ms: f64,
}

/// The newcomer's pools for `mode` over its `backend` (made from the exchange the
/// store admitted it with, at `admitted`; it started at `started`): its group, and the
/// three pools joined in the order the survivors grow theirs, with the same names and
/// settings (`check`: the collectives' checks).
///
/// # Errors
/// As `Group::new` and `SymmPool::join`.
pub fn join(
    (mode, check): (Mode, Check),
    backend: &Backend,
    (started, admitted): (Instant, Instant),
) -> Result<Joined> {
    let group = make_group(check, backend.clone())?;
    let params = SymmPool::join(&group, pool_config(mode))?;
    let grads = SymmPool::join(&group, pool_config(mode))?;
    let data = SymmPool::join(&group, data_config())?;
    Ok(Joined {
        mode,
        pools: [params, grads, data],
        started,
        admitted,
        joined_ms: ms_since(admitted, Instant::now()),
    })
}

/// The newcomer's run, data pool and data, from the state the survivors handed it
/// (the file the launcher named), ready for the state's step.
///
/// # Errors
/// Reading the state; as `start_run`.
pub(super) fn begin<'m, M: Math>(
    math: &'m M,
    joined: Joined,
    args: &Args,
) -> Result<(Vec<Run<'m, M>>, SymmPool, trainer::Data)> {
    let Joined {
        mode,
        pools:
            [
                (params, params_report),
                (grads, grads_report),
                (data_pool, data_report),
            ],
        started,
        admitted,
        joined_ms,
    } = joined;
    let state = State::load(&state_file()?)?;
    let data = data_pool.scope(|| trainer::make_data(math, args, params.rank()))?;
    let run = start_run(
        math,
        (mode, [params, grads]),
        (&data_pool, &data),
        args,
        Some(&state),
        None,
    )?;
    let (mode, pools, trainer, mut log) = run;
    let reports = [
        ("parameters", &params_report),
        ("gradients", &grads_report),
        ("data", &data_report),
    ];
    let mut healing = Healing::new(state.step, joined_ms, reports);
    healing.newcomer_waited_ms = ms_since(started, admitted);
    log.heal = Some(healing);
    log.regrouped_at = Some(admitted);
    Ok((vec![(mode, pools, trainer, log)], data_pool, data))
}

/// At the end of a healed run, on every rank of the grown group's `exchange`: the
/// newcomer's times go to rank 0's summaries (`results`).
///
/// # Collective
/// Every rank of the grown group, once.
///
/// # Errors
/// The exchange's.
pub fn gather(exchange: &dyn Exchange, results: &mut [Summary]) -> Result<()> {
    let timeout = symmpool::GroupConfig::default().timeout;
    let deadline = Deadline::after(timeout);
    let channel = exchange.open_channel("fsdp_step:heal", deadline)?;
    let mine: Vec<u8> = (results.iter().filter_map(|r| r.heal.as_ref()))
        .filter(|h| h.rank_before.is_none())
        .flat_map(|h| [h.first_collective_ms, h.newcomer_waited_ms])
        .flat_map(f64::to_le_bytes)
        .collect();
    let all = exchange.all_gather(channel, "fsdp_step: the newcomer's times", &mine, deadline)?;
    let Some(times) = all.iter().find(|b| b.len() == 16) else {
        return Ok(());
    };
    let ms = |i: usize| f64::from_le_bytes(times[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    for h in results.iter_mut().filter_map(|r| r.heal.as_mut()) {
        (h.newcomer_first_collective_ms, h.newcomer_waited_ms) = (ms(0), ms(1));
    }
    Ok(())
}

/// What rank 0 prints when the world has grown back: one line.
pub fn notice(h: &Healing) -> String {
    format!(
        "healed: rank {} joined at the start of step {}, world size {} → {}; every pool \
         grown {:.1} ms after the survivors began",
        words(&h.newcomers),
        h.at_step,
        h.world_size_before,
        h.world_size_after,
        h.grow_ms
    )
}

/// `ranks` as `1, 3`.
fn words(ranks: &[usize]) -> String {
    let words: Vec<String> = ranks.iter().map(usize::to_string).collect();
    words.join(", ")
}

/// What the summary says of the heal (`--heal`), line by line; `losses`: the steps at
/// the full size again, in words.
pub fn lines(h: &Healing, losses: String) -> Vec<String> {
    let mut lines = vec![
        format!(
            "heal: rank {} joined in step {}, world size {} → {}; every pool grown {:.1} ms \
             after the survivors began, their first collective at world size {} returned \
             after {:.1} ms, its first step ended after {:.1} ms",
            words(&h.newcomers),
            h.at_step,
            h.world_size_before,
            h.world_size_after,
            h.grow_ms,
            h.world_size_after,
            h.first_collective_ms,
            h.first_step_ms
        ),
        format!(
            "  the newcomer: admitted {:.1} ms after its start; its first collective at \
             world size {} returned {:.1} ms after its admission",
            h.newcomer_waited_ms, h.world_size_after, h.newcomer_first_collective_ms
        ),
    ];
    for p in &h.pools {
        lines.push(format!(
            "  {:<10} segments: {}, window registrations on the new communicators: {}, \
             pinned blocks: {} ({:.1} KiB), grow: {:.1} ms",
            p.pool,
            p.segments,
            p.registrations,
            p.pinned_blocks,
            p.pinned_bytes as f64 / 1024.0,
            p.ms
        ));
    }
    lines.push(format!(
        "  registrations of the first step at world size {} beyond the grow's: {}",
        h.world_size_after, h.registrations_first_step_after
    ));
    lines.push(format!(
        "losses at world size {} again: {losses}",
        h.world_size_after
    ));
    lines
}

/// The losses at the full size again, from the heal on (none without one; before it,
/// [`Summary::losses_around_the_loss`]).
pub fn losses_after(r: &Summary) -> &[f32] {
    let at = (r.heal.as_ref()).map_or(r.losses.len(), |h| h.at_step - r.first_step);
    &r.losses[at.min(r.losses.len())..]
}
