//! `--survive`: a rank is lost on purpose, and the others go on without it.
//!
//! The victim's backend raises SIGKILL on entering its reduce-scatter of layer
//! `layers / 2` in the step `--kill-at-step` ([`victim`]): it dies inside the step's
//! backward pass as a crashed process does, with no word to anyone; the store learns
//! of it from the closed connection. The survivors' next call that needs it fails
//! with `PeerLost` ([`is_loss`]); they shrink their pools ([`go_on_without`]:
//! `SymmPool::shrink`), agree on the last step whose whole parameters they
//! all kept ([`agree`]; the lost rank's shards are gone with it, so each rank keeps the
//! parameters its all-gathers brought, [`Kept`]), and cut that [`State`]
//! into shards for the new world size.
//!
//! The code is the same on every backend: on the shared-memory backend the shrink
//! opens new channels among the survivors; on NCCL it aborts the old communicators and
//! makes a new set from the store (`Backend::shrink`). With `--heal` a replacement takes
//! the lost rank's place later, and the world grows back (`heal.rs`).

use super::cli::Args;
use super::ranks::StepSync;
use super::report;
use super::run::{Run, ms_since, start_run};
use super::trainer::{self, Math};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use symmpool::backend::{CollArgs, Collectives};
use symmpool::coll::PathPolicy;
use symmpool::{
    Backend, Deadline, Error, ErrorKind, Exchange, Result, Stream, SymmBuffer, SymmPool,
};

/// Whether `e` says that a rank was lost, so that the survivors may shrink: an error of
/// kind `PeerLost`, whichever call met the loss and whatever its variant (as the
/// crate's README matches it).
pub fn is_loss(e: &Error) -> bool {
    e.kind() == ErrorKind::PeerLost
}

/// The loss `e` reports, in words for a run that went on past it: what happened, not
/// the advice for a job that stops there (the error's own message ends with it).
pub fn loss_words(e: &Error) -> String {
    match e {
        Error::PeerLost { rank, op, detail } => {
            format!("rank {rank} was lost while this rank was in {op}: {detail}")
        }
        Error::GroupBroken { rank, op } => {
            format!("rank {rank} timed out in {op}, which broke the group")
        }
        e => e.to_string(),
    }
}

/// The whole parameters at the start of a step: every layer's h × h values,
/// column-major, as f32 (bf16 on GPUs converts both ways exactly).
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The step they are the parameters of (before its update).
    pub step: usize,
    /// Each layer's h × h values.
    pub layers: Vec<Vec<f32>>,
}

/// The first bytes of a state file.
const MAGIC: &[u8; 8] = b"fsdpst01";

impl State {
    /// Write to `path`: [`MAGIC`], then the step, the number of layers and the values
    /// per layer as u64, then the values as f32, all little-endian.
    ///
    /// # Errors
    /// [`Error::Internal`] naming the file if it cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        let per_layer = self.layers.first().map_or(0, Vec::len);
        let mut bytes = MAGIC.to_vec();
        for n in [self.step, self.layers.len(), per_layer] {
            bytes.extend((n as u64).to_le_bytes());
        }
        for x in self.layers.iter().flatten() {
            bytes.extend(x.to_le_bytes());
        }
        std::fs::File::create(path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(|e| Error::Internal {
                what: format!("writing the state to {}: {e}", path.display()),
            })
    }

    /// Read what [`save`](Self::save) wrote.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the file if it cannot be read or is not a state.
    pub fn load(path: &Path) -> Result<State> {
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| not_a_state(path, e.to_string()))?;
        let (step, layers, per_layer) = header(path, &bytes, bytes.len() as u64)?;
        let all: Vec<f32> = (bytes[HEADER_BYTES..].chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let layers = (all.chunks(per_layer.max(1)).take(layers))
            .map(<[f32]>::to_vec)
            .collect();
        Ok(State { step, layers })
    }

    /// Fits `args` to the state in `path`, reading its header only, before any rank
    /// starts: the layers and hidden size not given (`given`: `--layers`, `--hidden`)
    /// are the state's; then whether it fits (its layers and sizes, hidden² split over
    /// the ranks and, with `--survive`, over one fewer, a step before the last and
    /// before `--kill-at-step`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] saying what does not fit.
    pub fn fit_file(
        path: &Path,
        args: &mut super::Args,
        given: (Option<usize>, Option<usize>),
    ) -> Result<()> {
        let mut bytes = [0u8; HEADER_BYTES];
        let len = std::fs::File::open(path)
            .and_then(|mut f| {
                f.read_exact(&mut bytes)?;
                f.metadata()
            })
            .map_err(|e| not_a_state(path, e.to_string()))?
            .len();
        let (step, layers, per_layer) = header(path, &bytes, len)?;
        args.layers = given.0.unwrap_or(layers);
        let side = per_layer.isqrt();
        if side * side == per_layer {
            args.hidden = given.1.unwrap_or(side);
        }
        let (h, ranks) = (args.hidden, args.ranks);
        let kill = args.survive.as_ref().map(|s| s.kill_at_step);
        let survive = args.survive.as_ref().map(|s| s.check(args, true));
        let why = if (layers, per_layer) != (args.layers, h * h) {
            format!(
                "{layers} layers of {per_layer} values, not {} of {h}²",
                args.layers
            )
        } else if !(h * h).is_multiple_of(ranks) {
            format!("{h}² values per layer, which do not split over {ranks} ranks")
        } else if let Some(Err(msg)) = survive {
            return Err(Error::InvalidConfig(msg));
        } else if step >= args.steps {
            format!("step {step}, not before the end of --steps {}", args.steps)
        } else if kill.is_some_and(|k| k <= step) {
            format!(
                "step {step}, not before --kill-at-step {}",
                kill.unwrap_or(0)
            )
        } else {
            return Ok(());
        };
        Err(not_a_state(path, format!("the state is of {why}")))
    }
}

/// Magic, step, layers, values per layer.
const HEADER_BYTES: usize = MAGIC.len() + 24;

fn not_a_state(path: &Path, why: String) -> Error {
    Error::InvalidConfig(format!("--resume {}: {why}", path.display()))
}

/// The step, layers and values per layer of the state file `path` whose first bytes
/// are `bytes` and whose length is `len` bytes.
fn header(path: &Path, bytes: &[u8], len: u64) -> Result<(usize, usize, usize)> {
    if bytes.len() < HEADER_BYTES || &bytes[..MAGIC.len()] != MAGIC {
        return Err(not_a_state(
            path,
            "not a state written by --save-state".into(),
        ));
    }
    let word = |i: usize| {
        let at = MAGIC.len() + 8 * i;
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
    };
    let (step, layers, per_layer) = (word(0), word(1), word(2));
    let values = layers.checked_mul(per_layer).and_then(|n| n.checked_mul(4));
    if values.and_then(|n| n.checked_add(HEADER_BYTES as u64)) != Some(len) {
        return Err(not_a_state(
            path,
            format!("{len} bytes, not a header and {layers} layers of {per_layer} f32"),
        ));
    }
    Ok((step as usize, layers as usize, per_layer as usize))
}

/// A step whose whole parameters a rank keeps ([`Kept`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The step.
    pub step: usize,
    /// Every rank is known to have ended the step (this one passed the step barrier
    /// after it), so on every rank its all-gathers were done: what a rank holds of it
    /// is whole.
    pub everywhere: bool,
}

/// The whole parameters of a rank's last two steps, as gathered in their forward
/// pass and copied on the all-gather stream (`Trainer::step`): what the survivors of a
/// lost rank re-shard, since the lost rank's shards are gone with it. Slot `k % 2`
/// holds step k's: [`Held`] once the step's end has synchronised on this rank, held
/// *everywhere* once this rank starts step k + 1, which it does only after the step
/// barrier, when every rank has synchronised step k (so on GPUs, too, every rank's
/// all-gathers of step k were done, none cut short by a loss); not held once step
/// k + 2 starts writing it. A survivor starts writing step k's slot only after every
/// rank passed the barrier before step k, so whatever call a rank is lost in, step
/// k − 1 is held on every survivor and everywhere on one at least ([`agree`]).
#[derive(Debug)]
pub struct Kept {
    /// `[slot][layer]`, each one layer's whole parameters.
    slots: [Vec<SymmBuffer>; 2],
    /// The step each slot holds.
    held: [Option<Held>; 2],
}

impl Kept {
    /// Two slots of `layers` buffers of `layer_bytes` each from `pool`, on `stream`
    /// (where the copies into them run).
    ///
    /// # Errors
    /// The pool's allocation errors.
    pub fn new(pool: &SymmPool, layers: usize, layer_bytes: u64, stream: &Stream) -> Result<Kept> {
        let slot = || {
            (0..layers)
                .map(|_| pool.alloc(layer_bytes, stream))
                .collect::<Result<Vec<_>>>()
        };
        Ok(Kept {
            slots: [slot()?, slot()?],
            held: [None, None],
        })
    }

    /// Step `step` begins, after the step barrier: every rank has ended the step
    /// before, whose parameters are now held everywhere.
    pub fn begin(&mut self, step: usize) {
        for held in self.held.iter_mut().flatten() {
            held.everywhere |= held.step + 1 == step;
        }
    }

    /// Where layer `layer` of step `step` is to be copied: that step's slot, which
    /// holds no step until [`end`](Self::end).
    pub fn slot(&mut self, step: usize, layer: usize) -> &mut SymmBuffer {
        self.held[step % 2] = None;
        &mut self.slots[step % 2][layer]
    }

    /// Step `step` has ended on this rank (its streams synchronised).
    pub fn end(&mut self, step: usize) {
        self.held[step % 2] = Some(Held {
            step,
            everywhere: false,
        });
    }

    /// The steps held.
    pub fn held(&self) -> Vec<Held> {
        self.held.iter().flatten().copied().collect()
    }

    /// The buffers of step `step`, one per layer, if held.
    pub fn layers(&self, step: usize) -> Option<&[SymmBuffer]> {
        (self.held[step % 2].is_some_and(|h| h.step == step)).then(|| &self.slots[step % 2][..])
    }
}

/// The last step whose whole parameters every survivor kept: each offers what it
/// holds (`kept`) in one round on the survivors' `exchange`; the newest step that every
/// survivor holds, and one at least holds everywhere, wins.
///
/// # Collective
/// Every survivor calls it once, after its pools are shrunk.
///
/// # Errors
/// [`Error::ShrinkFailed`] if the survivors share no such step; the exchange's errors
/// (by `timeout`).
pub fn agree(exchange: &dyn Exchange, kept: &[Held], timeout: Duration) -> Result<usize> {
    let deadline = Deadline::after(timeout);
    let channel = exchange.open_channel("fsdp_step:resume", deadline)?;
    let mine: Vec<u8> = (kept.iter())
        .flat_map(|h| {
            (h.step as u64)
                .to_le_bytes()
                .into_iter()
                .chain([h.everywhere as u8])
        })
        .collect();
    let all = exchange.all_gather(
        channel,
        "fsdp_step: the step to go on from",
        &mine,
        deadline,
    )?;
    let held = |bytes: &[u8]| -> Vec<Held> {
        (bytes.chunks_exact(9))
            .map(|b| Held {
                step: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize,
                everywhere: b[8] != 0,
            })
            .collect()
    };
    let each: Vec<Vec<Held>> = all.iter().map(|b| held(b)).collect();
    (kept.iter().map(|h| h.step))
        .filter(|&s| each.iter().all(|k| k.iter().any(|h| h.step == s)))
        .filter(|&s| each.iter().flatten().any(|h| h.step == s && h.everywhere))
        .max()
        .ok_or_else(|| Error::ShrinkFailed {
            reason: format!(
                "the survivors kept the whole parameters of no step in common (each \
                 rank's: {each:?})"
            ),
            retry: false,
        })
}

/// The victim's collectives: once armed, the reduce-scatter `fatal` calls later
/// (counting from 0) kills the process on entry, the others pass through.
#[derive(Debug)]
struct Victim {
    inner: Arc<dyn Collectives>,
    armed: Arc<AtomicBool>,
    /// Reduce-scatters entered since armed.
    entered: AtomicUsize,
    fatal: usize,
    /// Who dies where, for the last words.
    what: String,
}

impl Collectives for Victim {
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        self.inner.all_gather(args)
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        if self.armed.load(Ordering::SeqCst)
            && self.entered.fetch_add(1, Ordering::SeqCst) == self.fatal
        {
            eprintln!("fsdp_step: {} (--survive)", self.what);
            // SAFETY: raise(3) with a valid signal number only sends it to this
            // process; SIGKILL ends it there, touching no memory of the program.
            unsafe {
                libc::raise(libc::SIGKILL);
            }
        }
        self.inner.reduce_scatter(args)
    }

    fn all_reduce(&self, args: &CollArgs<'_>) -> Result<()> {
        self.inner.all_reduce(args)
    }

    fn abandon(&self, why: &'static str) {
        self.inner.abandon(why)
    }
}

/// The victim's `backend` for a model of `layers` layers: its collectives, once the
/// returned switch is on (the step barrier before `step` turns it on), raise SIGKILL
/// on entering the reduce-scatter of layer `layers / 2` (the backward pass reaches
/// the layers from the last down, one reduce-scatter each).
pub fn victim(backend: Backend, layers: usize, step: usize) -> (Backend, Arc<AtomicBool>) {
    let armed = Arc::new(AtomicBool::new(false));
    let layer = super::Survive::layer(layers);
    let what = format!(
        "rank {} kills itself (SIGKILL) on entering its reduce-scatter of layer {layer} in \
         step {step}",
        backend.rank()
    );
    let switch = armed.clone();
    let backend = backend.with_collectives(move |inner| {
        Arc::new(Victim {
            inner,
            armed: switch,
            entered: AtomicUsize::new(0),
            fatal: layers - 1 - layer,
            what,
        })
    });
    (backend, armed)
}

/// A run, its data pool and data after the step-`lost` error told this rank that a rank
/// was lost: the run rebuilt among the survivors, the new data pool and data, and the
/// step to go on from.
type WentOn<'m, M> = (Vec<Run<'m, M>>, SymmPool, trainer::Data, usize);

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
pub(super) fn go_on_without<'m, M: Math>(
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
    barrier.regrouped(params.backend())?;
    let shrink_ms = ms_since(t0, Instant::now());
    let timeout = params.group().config().timeout;
    let at = agree(params.backend().exchange(), &trainer.kept_steps(), timeout)?;
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
    // With `--heal`, the state saved is the one at the heal (`heal::grow_back`).
    let save = (args.survive.as_ref())
        .filter(|s| s.heal_at.is_none())
        .and_then(|s| s.save_state.as_ref());
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
    log.registrations_replaced = log.registrations;
    log.regrouped_at = Some(t0);
    let (_, pools, trainer, _) = run;
    Ok((vec![(mode, pools, trainer, log)], new_data_pool, data, at))
}
