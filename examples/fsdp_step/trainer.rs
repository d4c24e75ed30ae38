//! The FSDP step, written once over a [`Math`] trait (host loops or cuBLAS).
//!
//! A student of L square layers learns a known teacher (each teacher layer is the
//! identity plus a low-rank perturbation) on a synthetic regression task, so the loss
//! must fall. Parameters are sharded over the ranks. Each step:
//! - forward: all-gather each layer's parameters into a pool buffer on the all-gather
//!   stream, layers l+1 … l+N (`--prefetch N`, default 1) issued before layer l's GEMM,
//!   so that they run beside it;
//! - backward: the last layer's parameters are kept from the forward (as FSDP2 keeps
//!   the root's); re-gather the others with the same prefetch, compute the weight
//!   gradient and the input gradient, reduce-scatter the weight gradient on the
//!   reduce-scatter stream while the layer below computes, and apply SGD to the shard
//!   there.
//!
//! A GEMM fills every SM, so a collective issued beside it (a copy or a kernel on
//! SMs) waits for the GEMM's CTAs to end; with `--sm-margin N` the compute stream's
//! cuBLAS calls (the GEMMs) in a step that communicates plan for N SMs fewer, which the
//! collectives find free.
//!
//! Three streams, as FSDP2 has them: compute, all-gather, reduce-scatter. A backward
//! prefetch never queues behind a reduce-scatter. Streams wait on events only where
//! data flows (compute on a gathered layer; the reduce-scatter on its gradient; the
//! next step's first all-gather on this step's last update), buffers go back to the pool
//! stream-ordered (`record_stream`), and the host waits for the device once, at the end
//! of the step, to read the loss. Layer 0's all-gather for the next step is issued
//! before that wait, behind the step's last SGD update, so that the next step starts on
//! gathered parameters (not after the last step).
//!
//! Every buffer comes from `symmpool::alloc`, that is from the pool of the caller's
//! `SymmPool::scope`.
//!
//! With `--survive` each rank also keeps the whole parameters its forward all-gathers
//! brought, for its last two steps (a device copy on the all-gather stream;
//! `survive::Kept`): after a lost rank, the survivors cut the newest step they all hold into
//! shards for their new world size ([`Trainer::kept`], [`Trainer::load`]).
//!
//! Every collective carries its identity ([`tag`]: the step it belongs to, its layer,
//! all-gather or reduce-scatter), and every step ends with `Coll::end_step` on every
//! rank, once the step's device work is queued: under `--check strict` or `async` a
//! rank that skips, adds or reorders a collective fails at that call (or at the end of
//! its step at the latest), on every rank, naming what differs.

use super::cli::Args;
use super::survive::{Held, Kept, State};
use super::trace::{self, Recorder};
use super::{all_gather, reduce_scatter_in_place};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;
use symmpool::coll::Path;
use symmpool::{Coll, Element, Result, Stream, SymmBuffer, SymmPool, alloc};

/// What a collective of the step is, in its [`tag`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A layer's parameters gathered.
    AllGather = 1,
    /// A layer's weight gradient reduce-scattered.
    ReduceScatter = 2,
    /// A layer's parameters gathered for the state a newcomer is handed (`--heal`).
    Whole = 3,
}

/// How the collectives know who they are, as the summary reports it.
pub const IDENTITY: &str = "tags (step, layer, op) + end_step";

/// The identity of a collective, the tag it carries: `op << 56 | step << 24 | layer`
/// (the step modulo 2³², the layer modulo 2²⁴; so `0x01_00000007_000003` is step 7's
/// all-gather of layer 3). Every rank computes
/// the same tag for the same call, so that ranks making different calls fail the
/// check at that call, naming the field `tag`.
pub fn tag(step: usize, layer: usize, op: Op) -> u64 {
    ((op as u64) << 56) | ((step as u64 & 0xffff_ffff) << 24) | (layer as u64 & 0xff_ffff)
}

/// Which of a rank's three streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum On {
    /// The stream the GEMMs run on.
    Compute,
    /// The stream the all-gathers run on.
    AllGather,
    /// The stream the reduce-scatters (and the SGD update of the shards) run on.
    ReduceScatter,
}

impl On {
    /// Every stream.
    pub const ALL: [On; 3] = [On::Compute, On::AllGather, On::ReduceScatter];

    /// The stream's name (a row of the timeline).
    pub fn name(self) -> &'static str {
        match self {
            On::Compute => "compute",
            On::AllGather => "all-gather",
            On::ReduceScatter => "reduce-scatter",
        }
    }
}

/// Column-major matrix operations on pool buffers.
pub trait Math {
    /// The element type of the buffers.
    type E: Element;
    /// One of the two streams.
    fn stream(&self, on: On) -> &Stream;
    /// `C (m×n) = alpha · op(A) · op(B) + beta · C`, leading dimension = rows.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        on: On,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &SymmBuffer,
        b: &SymmBuffer,
        beta: f32,
        c: &mut SymmBuffer,
    ) -> Result<()>;
    /// `y += alpha · x[chunk]`, where `x[chunk]` is the `chunk`-th run of `y`'s
    /// length in `x`.
    fn axpy(
        &self,
        on: On,
        alpha: f32,
        x: &SymmBuffer,
        chunk: usize,
        y: &mut SymmBuffer,
    ) -> Result<()>;
    /// `x *= alpha`.
    fn scal(&self, on: On, alpha: f32, x: &mut SymmBuffer) -> Result<()>;
    /// `dst = src`.
    fn copy(&self, on: On, src: &SymmBuffer, dst: &mut SymmBuffer) -> Result<()>;
    /// Start computing ‖x‖² into f32 slot `slot` of `out` (read by `read_sums`).
    fn sumsq_into(&self, on: On, x: &SymmBuffer, out: &mut SymmBuffer, slot: usize) -> Result<()>;
    /// A marker of the work enqueued so far on one stream.
    type Ev;
    /// Mark the work enqueued so far on `on`.
    fn record(&self, on: On) -> Result<Self::Ev>;
    /// `to` waits (device-side) for the work before `ev`.
    fn wait_for(&self, to: On, ev: &Self::Ev) -> Result<()>;
    /// Wait for everything on every stream.
    fn sync(&self) -> Result<()>;
    /// A timing marker (the timeline, `--trace`).
    type Mark;
    /// A timing marker after the work enqueued so far on `on`.
    fn mark(&self, on: On) -> Result<Self::Mark>;
    /// µs from marker `from` to marker `to`, both reached (after a `sync`).
    fn elapsed_us(&self, from: &Self::Mark, to: &Self::Mark) -> Result<f64>;
    /// Read back the sums written by `sumsq_into`.
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>>;
    /// Let the GEMMs enqueued from now on leave the SMs of `--sm-margin` to the work
    /// on the other streams when `communicating`, or use every SM. Nothing to leave on
    /// the host.
    fn share_sms(&self, _communicating: bool) -> Result<()> {
        Ok(())
    }
}

fn bytes<M: Math>(elements: usize) -> u64 {
    (elements * std::mem::size_of::<M::E>()) as u64
}

fn to_e<M: Math>(v: &[f32]) -> Vec<M::E> {
    v.iter().map(|&x| M::E::from_f64(x as f64)).collect()
}

const RANK_OF_TEACHER: usize = 8;
const BATCHES: usize = 2;

/// One rank's training data: `BATCHES` pairs (input X, target T = teacher(X)).
pub type Data = Arc<Vec<(SymmBuffer, SymmBuffer)>>;

/// Make this rank's data in the current pool. The teacher's layer l is
/// `I + c·P_l·Q_lᵀ` with P, Q of rank 8, the same on every rank; X differs per rank.
pub fn make_data<M: Math>(math: &M, args: &Args, rank: usize) -> Result<Data> {
    let (h, b, r) = (args.hidden, args.batch, RANK_OF_TEACHER);
    let cs = math.stream(On::Compute);
    let c = 0.05f32;
    let mut teacher = Vec::new();
    for l in 0..args.layers {
        let mut rng = StdRng::seed_from_u64(0x7ea0 + l as u64);
        let scale = (3.0 / h as f32).sqrt();
        let p: Vec<f32> = (0..h * r)
            .map(|_| rng.random_range(-1.0..1.0) * scale)
            .collect();
        let q: Vec<f32> = (0..h * r).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (pb, qb) = (alloc(bytes::<M>(h * r), cs)?, alloc(bytes::<M>(h * r), cs)?);
        pb.write(&to_e::<M>(&p))?;
        qb.write(&to_e::<M>(&q))?;
        teacher.push((pb, qb));
    }
    let mut u = alloc(bytes::<M>(r * b), cs)?;
    let mut data = Vec::new();
    for k in 0..BATCHES {
        let mut rng = StdRng::seed_from_u64(0xda7a ^ ((rank as u64) << 20) ^ k as u64);
        let xv: Vec<f32> = (0..h * b).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x = alloc(bytes::<M>(h * b), cs)?;
        let mut t = alloc(bytes::<M>(h * b), cs)?;
        x.write(&to_e::<M>(&xv))?;
        math.copy(On::Compute, &x, &mut t)?;
        for (p, q) in &teacher {
            // U = Qᵀ·T (r×b); T += c·P·U.
            math.gemm(On::Compute, true, false, r, b, h, 1.0, q, &t, 0.0, &mut u)?;
            math.gemm(On::Compute, false, false, h, b, r, c, p, &u, 1.0, &mut t)?;
        }
        data.push((x, t));
    }
    math.sync()?;
    Ok(Arc::new(data))
}

/// One rank's training state for one mode.
pub struct Trainer<'m, M: Math> {
    math: &'m M,
    h: usize,
    batch: usize,
    layers: usize,
    rank: usize,
    world: usize,
    lr: f32,
    /// The collectives, if they run (`None`: their outputs are only allocated).
    communicate: Option<Coll>,
    /// The weight gradients' pool (registered like the current one): FSDP2's
    /// gradients never take a block an all-gather freed, or the reverse, since PyTorch's
    /// caching allocator keeps a free list per stream. One pool would hand an
    /// all-gather the block of a gradient whose SGD is still queued on the
    /// reduce-scatter stream, and the all-gather would wait for that SGD.
    grad_pool: SymmPool,
    shards: Vec<SymmBuffer>,
    acts: Vec<SymmBuffer>,
    grads: [SymmBuffer; 2],
    sums: SymmBuffer,
    data: Data,
    /// Paths of the last step's all-gathers.
    pub ag_paths: Vec<Path>,
    /// Paths of the last step's reduce-scatters.
    pub rs_paths: Vec<Path>,
    /// Layer 0's parameters for the next step, gathered at the end of this one (after
    /// its last SGD update), with the all-gather's path.
    first: Option<(SymmBuffer, M::Ev, Option<Path>)>,
    /// The timeline's recorder (`--trace`), when this step is traced.
    pub trace: Option<Recorder<M::Mark>>,
    /// How many layers ahead the all-gathers are issued (`--prefetch`; 1 is FSDP2's
    /// default).
    prefetch: usize,
    /// Steps of the run: the last one gathers nothing for a next step.
    steps: usize,
    /// With `--survive`: the whole parameters of this rank's last two steps.
    kept: Option<Kept>,
    /// When this trainer's first collective call returned (after a shrink: the first
    /// at the new world size).
    pub first_collective: Option<Instant>,
}

/// What one step did.
#[derive(Debug, Clone, Copy)]
pub struct StepOut {
    /// Mean squared error before the update.
    pub loss: f32,
    /// Wall time of the step, in ms.
    pub ms: f64,
}

impl<'m, M: Math> Trainer<'m, M> {
    /// Allocate the state in the current pool. Every layer starts at the identity; rank
    /// r holds columns [r·h/world, (r+1)·h/world) of each (column-major, so a
    /// contiguous shard). Without `communicate` (the collectives handle of the current
    /// pool) the step leaves the collectives out.
    ///
    /// The shards (the all-gathers' inputs) and the gathered parameters come from the
    /// current pool, the weight gradients from `grad_pool`; what no
    /// collective touches (activations, their gradients, the loss sum) from `state`,
    /// an unregistered pool, as in FSDP2: only the collectives' buffers belong in
    /// symmetric memory, where they would otherwise pin registered segments.
    pub fn new(
        math: &'m M,
        data: Data,
        state: &SymmPool,
        grad_pool: &SymmPool,
        args: &Args,
        (rank, world): (usize, usize),
        communicate: Option<Coll>,
    ) -> Result<Self> {
        let (h, b) = (args.hidden, args.batch);
        let cs = math.stream(On::Compute);
        let shard_len = h * h / world;
        let mut ident = vec![0f32; shard_len];
        for (i, v) in ident.iter_mut().enumerate() {
            let flat = rank * shard_len + i;
            if flat % h == flat / h {
                *v = 1.0;
            }
        }
        let ident = to_e::<M>(&ident);
        let shards = (0..args.layers)
            .map(|_| {
                let s = alloc(bytes::<M>(shard_len), cs)?;
                s.write(&ident)?;
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        let acts = (0..args.layers)
            .map(|_| state.alloc(bytes::<M>(h * b), cs))
            .collect::<Result<Vec<_>>>()?;
        let grads = [
            state.alloc(bytes::<M>(h * b), cs)?,
            state.alloc(bytes::<M>(h * b), cs)?,
        ];
        let sums = state.alloc(4 * 4, cs)?;
        sums.write(&[0f32; 4])?;
        let kept = (args.survive.as_ref())
            .map(|_| {
                Kept::new(
                    state,
                    args.layers,
                    bytes::<M>(h * h),
                    math.stream(On::AllGather),
                )
            })
            .transpose()?;
        Ok(Trainer {
            math,
            h,
            batch: b,
            layers: args.layers,
            rank,
            world,
            lr: args.lr,
            communicate,
            grad_pool: grad_pool.clone(),
            shards,
            acts,
            grads,
            sums,
            data,
            ag_paths: Vec::new(),
            rs_paths: Vec::new(),
            first: None,
            trace: None,
            prefetch: args.prefetch.max(1),
            steps: args.steps,
            kept,
            first_collective: None,
        })
    }

    /// Start from `state`: this rank's shard of each of its layers, for this trainer's
    /// world size (the shards of a state saved at another size, or gathered before a
    /// loss, are cut anew).
    ///
    /// # Errors
    /// [`symmpool::Error::InvalidConfig`] if the state has other layers or sizes; the
    /// buffers' write errors.
    pub fn load(&mut self, state: &State) -> Result<()> {
        let square = self.h * self.h;
        if state.layers.len() != self.layers || state.layers.iter().any(|w| w.len() != square) {
            return Err(symmpool::Error::InvalidConfig(format!(
                "the state of step {} is not {} layers of {}²",
                state.step, self.layers, self.h
            )));
        }
        let len = square / self.world;
        for (shard, whole) in self.shards.iter().zip(&state.layers) {
            shard.write(&to_e::<M>(&whole[self.rank * len..(self.rank + 1) * len]))?;
        }
        self.first = None;
        Ok(())
    }

    /// The steps whose whole parameters this rank holds (`--survive`).
    pub fn kept_steps(&self) -> Vec<Held> {
        self.kept.as_ref().map_or_else(Vec::new, Kept::held)
    }

    /// The whole parameters of `step` (one of [`kept_steps`](Self::kept_steps)), read
    /// back to the host once every stream is done.
    ///
    /// # Errors
    /// [`symmpool::Error::InvalidConfig`] if this rank does not hold that step; the
    /// streams' and buffers' errors.
    pub fn kept(&self, step: usize) -> Result<State> {
        let Some(layers) = self.kept.as_ref().and_then(|k| k.layers(step)) else {
            return Err(symmpool::Error::InvalidConfig(format!(
                "the parameters of step {step} are not kept whole on this rank"
            )));
        };
        self.math.sync()?;
        let layers = (layers.iter())
            .map(|b| {
                Ok(b.read::<M::E>()?
                    .iter()
                    .map(|x| x.to_f64() as f32)
                    .collect())
            })
            .collect::<Result<Vec<Vec<f32>>>>()?;
        Ok(State { step, layers })
    }

    /// The whole parameters at the start of step `step`, between steps (the shards as
    /// the last update left them): every layer's shards all-gathered in the current
    /// pool (tagged [`Op::Whole`]), read back to the host, then a step boundary
    /// (`end_step`) that checks the ranks made these calls alike.
    ///
    /// # Collective
    /// Every rank calls it at the same point, between the same steps.
    ///
    /// # Errors
    /// [`symmpool::Error::InvalidConfig`] without collectives (`--comm none`); the
    /// collectives', streams' and buffers' errors.
    pub fn whole(&self, step: usize) -> Result<State> {
        let Some(coll) = &self.communicate else {
            return Err(symmpool::Error::InvalidConfig(
                "the whole parameters are gathered by the collectives (not --comm none)".into(),
            ));
        };
        let (m, ag) = (self.math, self.math.stream(On::AllGather));
        let layers = (self.shards.iter().enumerate())
            .map(|(l, shard)| {
                let coll = coll.tagged(tag(step, l, Op::Whole));
                let (full, _) = all_gather::<M::E>(coll, shard, ag)?;
                m.sync()?;
                let values = full.read::<M::E>()?;
                Ok(values.iter().map(|x| x.to_f64() as f32).collect())
            })
            .collect::<Result<Vec<Vec<f32>>>>()?;
        coll.end_step()?;
        Ok(State { step, layers })
    }

    /// Gather layer `l`'s parameters for step `k` on the all-gather stream, counting
    /// its path in this step's; the event marks completion.
    fn fetch(
        &mut self,
        tr: &mut Option<Recorder<M::Mark>>,
        k: usize,
        l: usize,
    ) -> Result<(SymmBuffer, M::Ev)> {
        let (full, arrived, path) = self.gather(tr, k, l)?;
        if path.is_some() {
            self.first_collective.get_or_insert_with(Instant::now);
        }
        self.ag_paths.extend(path);
        Ok((full, arrived))
    }

    /// [`fetch`](Self::fetch), with the path (if a collective ran) returned instead.
    fn gather(
        &self,
        tr: &mut Option<Recorder<M::Mark>>,
        k: usize,
        l: usize,
    ) -> Result<(SymmBuffer, M::Ev, Option<Path>)> {
        let m = self.math;
        let ag = m.stream(On::AllGather);
        let (full, path) = if let Some(coll) = &self.communicate {
            let shard = &self.shards[l];
            let coll = coll.tagged(tag(k, l, Op::AllGather));
            let (full, path) = trace::op(tr, m, On::AllGather, "all-gather", Some(l), || {
                all_gather::<M::E>(coll, shard, ag)
            })?;
            (full, Some(path))
        } else {
            let len = bytes::<M>(self.h * self.h);
            (trace::host(tr, "alloc", Some(l), || alloc(len, ag))?, None)
        };
        Ok((full, m.record(On::AllGather)?, path))
    }

    /// The SGD step: `lr` over an estimate of the loss curvature, per layer
    /// `2·(1 + √(h/b))²·σ²/h` with σ² = 1/3 (inputs uniform in [-1, 1]; the
    /// Marchenko-Pastur edge of X·Xᵀ), times the number of layers (all of them move
    /// the output at once), so one `lr` works at every size and depth.
    fn step_size(&self) -> f32 {
        let (h, b) = (self.h as f32, self.batch as f32);
        let curvature = 2.0 * (1.0 + (h / b).sqrt()).powi(2) / (3.0 * h);
        self.lr / (curvature * self.layers as f32)
    }

    /// One training step on batch `k`, called once every rank has ended the step
    /// before (after the step barrier).
    pub fn step(&mut self, k: usize) -> Result<StepOut> {
        let start = Instant::now();
        if let Some(kept) = &mut self.kept {
            kept.begin(k);
        }
        let (h, b, layers) = (self.h, self.batch, self.layers);
        let m = self.math;
        let data = self.data.clone();
        let (x, t) = &data[k % data.len()];
        self.ag_paths.clear();
        self.rs_paths.clear();
        let mut tr = self.trace.take();
        // The GEMMs leave SMs to the collectives running beside them; a step without
        // collectives keeps them all.
        m.share_sms(self.communicate.is_some())?;
        trace::begin_step(&mut tr, m, k)?;
        // Forward: layer l+prefetch's all-gather is issued before layer l's GEMM; layer
        // 0's was issued at the end of the last step.
        let depth = self.prefetch;
        let mut ahead = std::collections::VecDeque::new();
        match self.first.take() {
            Some((params, arrived, path)) => {
                self.ag_paths.extend(path);
                ahead.push_back((params, arrived));
            }
            None => ahead.push_back(self.fetch(&mut tr, k, 0)?),
        }
        let mut fetched = 1;
        let mut cur = None;
        for l in 0..layers {
            let (params, arrived) = ahead.pop_front().expect("fetched");
            if let Some(kept) = &mut self.kept {
                m.copy(On::AllGather, &params, kept.slot(k, l))?;
            }
            trace::op(&mut tr, m, On::Compute, "wait", Some(l), || {
                m.wait_for(On::Compute, &arrived)
            })?;
            // Layers up to l + prefetch are gathered beside this GEMM: issued before it.
            while fetched < layers && fetched <= l + depth {
                ahead.push_back(self.fetch(&mut tr, k, fetched)?);
                fetched += 1;
            }
            let (before, from_l) = self.acts.split_at_mut(l);
            let input = if l == 0 { x } else { &before[l - 1] };
            let out = &mut from_l[0];
            trace::op(&mut tr, m, On::Compute, "gemm", Some(l), || {
                m.gemm(
                    On::Compute,
                    false,
                    false,
                    h,
                    b,
                    h,
                    1.0,
                    &params,
                    input,
                    0.0,
                    out,
                )
            })?;
            if l + 1 < layers {
                params.record_stream(m.stream(On::Compute))?;
            } else {
                // The last layer's parameters stay for the backward (FSDP2 does not
                // reshard the root after the forward): one all-gather fewer, and the
                // backward starts without waiting for one.
                cur = Some(params);
            }
        }
        let mut cur = cur.expect("at least one layer");
        // Loss = mean squared error; G = dLoss/dOutput = 2/(h·b) · (out − target).
        let g_top = &mut self.grads[layers % 2];
        let top = &self.acts[layers - 1];
        trace::op(&mut tr, m, On::Compute, "copy", None, || {
            m.copy(On::Compute, top, g_top)
        })?;
        let sums = &mut self.sums;
        trace::op(&mut tr, m, On::Compute, "loss", None, || {
            m.axpy(On::Compute, -1.0, t, 0, g_top)?;
            m.sumsq_into(On::Compute, g_top, sums, 0)?;
            m.scal(On::Compute, 2.0 / (h * b) as f32, g_top)
        })?;
        // Backward: prefetch layers l−1 … l−N on the all-gather stream; reduce-scatter
        // layer l's weight gradient on the reduce-scatter stream while l−1 computes.
        let mut arrived: Option<M::Ev> = None;
        let mut ahead: std::collections::VecDeque<(SymmBuffer, M::Ev)> = Default::default();
        // The layers below the last, counting down, whose all-gathers are not issued yet.
        let mut to_fetch = (0..layers - 1).rev().peekable();
        let alpha = -self.step_size() / self.world as f32;
        // Two weight gradients are in flight: layer l−1's is allocated while layer l's
        // is still alive, so it never lands in the block layer l's reduce-scatter
        // reads. Layer l's is freed right after its reduce-scatter is queued, so the
        // fence a later allocation waits for is that reduce-scatter's end, not the
        // SGD queued behind it.
        let mut next_dw = Some(
            self.grad_pool
                .alloc(bytes::<M>(h * h), m.stream(On::Compute))?,
        );
        for l in (0..layers).rev() {
            if let Some(ev) = arrived.take() {
                trace::op(&mut tr, m, On::Compute, "wait", Some(l), || {
                    m.wait_for(On::Compute, &ev)
                })?;
            }
            while let Some(j) = to_fetch.next_if(|&j| j + depth >= l) {
                ahead.push_back(self.fetch(&mut tr, k, j)?);
            }
            let next = ahead.pop_front();
            let input = if l == 0 { x } else { &self.acts[l - 1] };
            let [g0, g1] = &mut self.grads;
            let (g_in, g_out) = if l % 2 == 0 { (g0, &*g1) } else { (g1, &*g0) };
            let mut dw = match next_dw.take() {
                Some(dw) => dw,
                None => self
                    .grad_pool
                    .alloc(bytes::<M>(h * h), m.stream(On::Compute))?,
            };
            trace::op(&mut tr, m, On::Compute, "gemm dW", Some(l), || {
                m.gemm(
                    On::Compute,
                    false,
                    true,
                    h,
                    h,
                    b,
                    1.0,
                    g_out,
                    input,
                    0.0,
                    &mut dw,
                )
            })?;
            let dw_ready = m.record(On::Compute)?;
            if l > 0 {
                trace::op(&mut tr, m, On::Compute, "gemm dX", Some(l), || {
                    m.gemm(
                        On::Compute,
                        true,
                        false,
                        h,
                        b,
                        h,
                        1.0,
                        &cur,
                        g_out,
                        0.0,
                        g_in,
                    )
                })?;
            }
            trace::op(&mut tr, m, On::ReduceScatter, "wait", Some(l), || {
                m.wait_for(On::ReduceScatter, &dw_ready)
            })?;
            // Reduce-scatter in place: this rank's chunk of `dw` becomes its shard of
            // the summed gradient (no second buffer; at world size 1 no copy at all).
            let rs = m.stream(On::ReduceScatter);
            if let Some(coll) = &self.communicate {
                let coll = coll.tagged(tag(k, l, Op::ReduceScatter));
                let path = trace::op(
                    &mut tr,
                    m,
                    On::ReduceScatter,
                    "reduce-scatter",
                    Some(l),
                    || reduce_scatter_in_place::<M::E>(coll, &dw, rs),
                )?;
                self.rs_paths.push(path);
            } else {
                dw.record_stream(rs)?;
            }
            if l > 0 {
                next_dw = Some(
                    self.grad_pool
                        .alloc(bytes::<M>(h * h), m.stream(On::Compute))?,
                );
            }
            // SGD on the shard (mean of the ranks' gradients), on the reduce-scatter
            // stream. It writes the shard layer l's all-gather read: the compute stream
            // waited for that all-gather before the weight-gradient GEMM this stream
            // waited for.
            let shard = &mut self.shards[l];
            trace::op(&mut tr, m, On::ReduceScatter, "sgd", Some(l), || {
                m.axpy(On::ReduceScatter, alpha, &dw, self.rank, shard)
            })?;
            // Freed once the SGD is queued: the fence a later allocation waits for is
            // this layer's SGD, two layers before it needs the block.
            drop(dw);
            cur.record_stream(m.stream(On::Compute))?;
            match next {
                Some((n, ev)) => {
                    cur = n;
                    arrived = Some(ev);
                }
                None => break,
            }
        }
        drop(cur);
        // The next step's first all-gather moves from the head of the next step to the
        // tail of this one: it reads the shard this step's last SGD update writes, so it
        // waits for that update on the device, and it is issued before the host's wait
        // for the loss instead of after the next step's first host calls. Not after the
        // last step. After the warm-up step too, so that it is a step like the others:
        // its peak, which sizes the pools (`fit_to_peak`), holds that buffer.
        if k + 1 < self.steps {
            let updated = m.record(On::ReduceScatter)?;
            trace::op(&mut tr, m, On::AllGather, "wait", None, || {
                m.wait_for(On::AllGather, &updated)
            })?;
            self.first = Some(self.gather(&mut tr, k + 1, 0)?);
        }
        // The step boundary, on every rank: one control-plane round that checks that
        // the ranks made the same collectives and pool calls this step. After the
        // step's device work is queued, so that the device runs while the host waits.
        if let Some(coll) = &self.communicate {
            trace::host(&mut tr, "end_step", None, || coll.end_step())?;
        }
        trace::host(&mut tr, "sync", None, || m.sync())?;
        if let Some(kept) = &mut self.kept {
            kept.end(k);
        }
        let sumsq = m.read_sums(&self.sums)?[0] as f64;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        trace::end_step(&mut tr, m, start)?;
        self.trace = tr;
        Ok(StepOut {
            loss: (sumsq / (h * b) as f64) as f32,
            ms,
        })
    }
}
