//! FSDP-style training of a stack of linear layers, with the parameter all-gathers and
//! gradient reduce-scatters going through a `SymmPool` and its collectives.
//!
//! A student of L square layers learns a known teacher (each teacher layer is the
//! identity plus a low-rank perturbation) on a synthetic regression task, so the loss
//! must fall. Parameters are sharded over the ranks. Each step:
//! - forward: all-gather each layer's parameters into a pool buffer on the
//!   communication stream, prefetching layer l+1 while layer l computes;
//! - backward: re-gather with prefetch, compute the weight gradient and the input
//!   gradient, reduce-scatter the weight gradient on the communication stream while
//!   the previous layer's backward computes, and apply SGD to the shard.
//!
//! On a machine without GPUs it runs on the host backend (ranks as threads, f32, plain
//! loops); with two or more GPUs, on NCCL (bf16, cuBLAS GEMMs through cudarc).
//!
//! ```text
//! cargo run --release --example fsdp_step                      # defaults for the machine
//! cargo run --release --example fsdp_step -- --compare         # all modes, one table
//! cargo run --release --example fsdp_step -- --comm auto --json
//! cargo run --release --example fsdp_step -- --balanced --compare   # comm ≈ compute (GPUs)
//! ```
//!
//! `--comm ring|symm|ce|auto`: `ring` uses a pool that registers nothing (plain NCCL,
//! the baseline); `symm` prefers NCCL's symmetric kernels for both collectives; `ce`
//! prefers the copy engine for all-gathers (symmetric kernel for reduce-scatters, as
//! PyTorch FSDP2 does); `auto` lets the crate choose per size.

#[cfg(feature = "nccl")]
#[path = "support/gpu_math.rs"]
mod gpu_math;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;
use symmpool::coll::{self, Choice, CollectiveReport, Path, PathPolicy};
use symmpool::{Element, PoolConfig, ReduceOp, Result, Stream, SymmBuffer, SymmPool};

/// Print a line to stdout; a closed pipe (`| head`) is not an error worth a panic.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// A barrier that a failing rank breaks, so the other ranks stop instead of waiting
/// for it forever.
#[derive(Debug)]
pub struct StepBarrier {
    n: usize,
    state: Mutex<(usize, u64, Option<usize>)>,
    cv: Condvar,
}

impl StepBarrier {
    /// A barrier for `n` ranks.
    pub fn new(n: usize) -> Self {
        StepBarrier {
            n,
            state: Mutex::new((0, 0, None)),
            cv: Condvar::new(),
        }
    }

    /// Wait for every rank; fails once a rank has given up.
    pub fn wait(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rank) = st.2 {
            return Err(symmpool::Error::GroupBroken {
                rank,
                op: "fsdp_step",
            });
        }
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.n {
            st.0 = 0;
            st.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while st.1 == generation && st.2.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match st.2 {
            Some(rank) if st.1 == generation => Err(symmpool::Error::GroupBroken {
                rank,
                op: "fsdp_step",
            }),
            _ => Ok(()),
        }
    }

    /// Give up: every waiting and later `wait` fails.
    pub fn abort(&self, rank: usize) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.2.get_or_insert(rank);
        self.cv.notify_all();
    }
}

// ---------------------------------------------------------------------------------
// Options

/// How the collectives run (`--comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A pool that registers nothing: plain NCCL, the baseline.
    Ring,
    /// NCCL's symmetric kernels for both collectives.
    Symm,
    /// Copy-engine all-gather, symmetric-kernel reduce-scatter (PyTorch FSDP2's recipe).
    Ce,
    /// The crate's choice per size.
    Auto,
}

impl Mode {
    /// Every mode, ring first.
    pub const ALL: [Mode; 4] = [Mode::Ring, Mode::Symm, Mode::Ce, Mode::Auto];

    /// The `--comm` name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ring => "ring",
            Mode::Symm => "symm",
            Mode::Ce => "ce",
            Mode::Auto => "auto",
        }
    }

    fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }

    fn pool_config(self) -> PoolConfig {
        PoolConfig::default().with_register(self != Mode::Ring)
    }

    fn path_policy(self) -> PathPolicy {
        let symm = Choice::Prefer(Path::SymmetricKernel);
        match self {
            Mode::Symm => PathPolicy::default().with_choices(symm, symm),
            Mode::Ce => PathPolicy::default().with_choices(Choice::Prefer(Path::CopyEngine), symm),
            Mode::Ring | Mode::Auto => PathPolicy::default(),
        }
    }

    /// A pool of this mode over `backend`.
    fn pool(self, backend: symmpool::Backend) -> Result<SymmPool> {
        let pool = SymmPool::new(backend, self.pool_config())?;
        symmpool::coll::set_path_policy(&pool, self.path_policy())?;
        Ok(pool)
    }
}

/// Where to run (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// NCCL when enough GPUs are present, else the host backend.
    Auto,
    /// The host backend.
    Host,
    /// NCCL.
    Nccl,
}

/// The example's options.
#[derive(Debug, Clone)]
pub struct Args {
    /// Ranks (threads; GPUs on NCCL).
    pub ranks: usize,
    /// Layers.
    pub layers: usize,
    /// Hidden size (each layer is hidden × hidden).
    pub hidden: usize,
    /// Batch (columns per rank).
    pub batch: usize,
    /// Training steps.
    pub steps: usize,
    /// Learning rate, as a fraction of the inverse curvature (stable below ~1).
    pub lr: f32,
    /// Modes to run, interleaved step by step.
    pub modes: Vec<Mode>,
    /// Print one JSON object per mode instead of the table.
    pub json: bool,
    /// Where to run.
    pub backend: BackendChoice,
    /// No per-step lines.
    pub quiet: bool,
}

impl Args {
    /// The host defaults, for `modes`.
    pub fn host(modes: Vec<Mode>) -> Args {
        Args {
            ranks: 2,
            layers: 4,
            hidden: 64,
            batch: 32,
            steps: 30,
            lr: 1.0,
            modes,
            json: false,
            backend: BackendChoice::Host,
            quiet: true,
        }
    }
}

const USAGE: &str = "usage: fsdp_step [--ranks N] [--layers L] [--hidden H] [--batch B] [--steps S]
                 [--lr X] [--comm ring|symm|ce|auto] [--compare] [--balanced]
                 [--backend auto|host|nccl] [--json] [--quiet]
defaults: host backend: 2 ranks, 4 layers, hidden 64, batch 32, 30 steps
          GPUs: 2 ranks, 8 layers, hidden 4096, batch 1024, 20 steps
--balanced (GPUs): hidden 16384, batch 1024, 8 layers: communication about equal to
          computation on 2xH200 (per layer, each rank gathers 256 MiB, ~0.97 ms on ring,
          and reduce-scatters 512 MiB, ~1.07 ms; each GEMM is 2*16384^2*1024 flop, ~0.85 ms:
          forward 1 GEMM vs 1 all-gather, backward 2 GEMMs vs all-gather + reduce-scatter)";

fn parse_args() -> std::result::Result<(Args, bool), String> {
    let mut it = std::env::args().skip(1);
    let (mut ranks, mut layers, mut hidden, mut batch, mut steps, mut lr) =
        (None, None, None, None, None, None);
    let (mut modes, mut compare, mut json, mut balanced, mut quiet) =
        (Vec::new(), false, false, false, false);
    let mut backend = BackendChoice::Auto;
    let num = |v: Option<String>, name: &str| -> std::result::Result<usize, String> {
        v.and_then(|s| s.parse().ok())
            .filter(|&n| n > 0)
            .ok_or(format!("{name} needs a positive integer"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--ranks" => ranks = Some(num(it.next(), "--ranks")?),
            "--layers" => layers = Some(num(it.next(), "--layers")?),
            "--hidden" => hidden = Some(num(it.next(), "--hidden")?),
            "--batch" => batch = Some(num(it.next(), "--batch")?),
            "--steps" => {
                let n = num(it.next(), "--steps")?;
                if n < 2 {
                    return Err(
                        "--steps must be at least 2 (the check compares the first and last loss)"
                            .into(),
                    );
                }
                steps = Some(n);
            }
            "--lr" => {
                lr = Some(
                    it.next()
                        .and_then(|s| s.parse::<f32>().ok())
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or("--lr needs a positive, finite number")?,
                )
            }
            "--comm" => {
                let v = it.next().unwrap_or_default();
                modes = vec![
                    Mode::parse(&v)
                        .ok_or(format!("--comm must be ring, symm, ce or auto, not {v:?}"))?,
                ];
            }
            "--compare" => compare = true,
            "--balanced" => balanced = true,
            "--json" => json = true,
            "--quiet" => quiet = true,
            "--backend" => {
                backend = match it.next().as_deref() {
                    Some("auto") => BackendChoice::Auto,
                    Some("host") => BackendChoice::Host,
                    Some("nccl") => BackendChoice::Nccl,
                    other => {
                        return Err(format!(
                            "--backend must be auto, host or nccl, not {:?}",
                            other.unwrap_or_default()
                        ));
                    }
                }
            }
            "-h" | "--help" => return Err(String::new()),
            // cargo test / bench pass these to harnessless targets.
            "--bench" | "--test" | "--nocapture" => {}
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if compare {
        modes = Mode::ALL.to_vec();
    } else if modes.is_empty() {
        modes = vec![Mode::Auto];
    }
    let gpu = match backend {
        BackendChoice::Host => false,
        BackendChoice::Nccl => true,
        BackendChoice::Auto => gpu_count() >= ranks.unwrap_or(2).max(2),
    };
    let (dl, dh, db, ds) = match (gpu, balanced) {
        (false, _) => (4, 64, 32, 30),
        (true, false) => (8, 4096, 1024, 20),
        (true, true) => (8, 16384, 1024, 20),
    };
    let args = Args {
        ranks: ranks.unwrap_or(2),
        layers: layers.unwrap_or(dl),
        hidden: hidden.unwrap_or(dh),
        batch: batch.unwrap_or(db),
        steps: steps.unwrap_or(ds),
        lr: lr.unwrap_or(1.0),
        modes,
        json,
        backend,
        quiet,
    };
    if !(args.hidden * args.hidden).is_multiple_of(args.ranks) {
        return Err(format!(
            "hidden² = {} must split evenly over {} ranks",
            args.hidden * args.hidden,
            args.ranks
        ));
    }
    Ok((args, gpu))
}

fn gpu_count() -> usize {
    #[cfg(feature = "nccl")]
    {
        symmpool::backend::nccl::device_count().unwrap_or(0)
    }
    #[cfg(not(feature = "nccl"))]
    {
        0
    }
}

// ---------------------------------------------------------------------------------
// The math a rank needs, on the host (f32) or a GPU (bf16 + cuBLAS)

/// Which of a rank's two streams.
#[derive(Clone, Copy, PartialEq, Eq)]
enum On {
    Compute,
    Comm,
}

/// Column-major matrix operations on pool buffers (offsets in elements).
trait Math {
    type E: Element;
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
        c: &SymmBuffer,
    ) -> Result<()>;
    /// `y += alpha · x`.
    fn axpy(&self, on: On, alpha: f32, x: &SymmBuffer, y: &SymmBuffer) -> Result<()>;
    /// `x *= alpha`.
    fn scal(&self, on: On, alpha: f32, x: &SymmBuffer) -> Result<()>;
    /// `dst = src`.
    fn copy(&self, on: On, src: &SymmBuffer, dst: &SymmBuffer) -> Result<()>;
    /// Start computing ‖x‖² into slot `slot` of `out` (read by `read_sums`).
    fn sumsq_into(&self, on: On, x: &SymmBuffer, out: &SymmBuffer, slot: usize) -> Result<()>;
    /// A marker of the work enqueued so far on one stream.
    type Ev;
    /// Mark the work enqueued so far on `on`.
    fn record(&self, on: On) -> Result<Self::Ev>;
    /// `to` waits (device-side) for the work before `ev`.
    fn wait_for(&self, to: On, ev: &Self::Ev) -> Result<()>;
    /// Wait for everything on both streams.
    fn sync(&self) -> Result<()>;
    /// Read back the sums written by `sumsq_into`.
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>>;
}

/// Host math: f32 buffers, synchronous, naive loops (small sizes only).
struct HostMath {
    compute: Stream,
    comm: Stream,
}

impl HostMath {
    fn get(x: &SymmBuffer) -> Result<Vec<f32>> {
        x.read::<f32>()
    }
}

impl Math for HostMath {
    type E = f32;
    fn stream(&self, on: On) -> &Stream {
        if on == On::Compute {
            &self.compute
        } else {
            &self.comm
        }
    }
    fn gemm(
        &self,
        _: On,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &SymmBuffer,
        b: &SymmBuffer,
        beta: f32,
        c: &SymmBuffer,
    ) -> Result<()> {
        let (av, bv, mut cv) = (Self::get(a)?, Self::get(b)?, Self::get(c)?);
        // op(A)[i][p]: A is m×k (lda m) or, transposed, k×m (lda k).
        let at = |i: usize, p: usize| if ta { av[p + i * k] } else { av[i + p * m] };
        let bt = |p: usize, j: usize| if tb { bv[j + p * n] } else { bv[p + j * k] };
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for p in 0..k {
                    acc += at(i, p) * bt(p, j);
                }
                cv[i + j * m] = alpha * acc
                    + if beta == 0.0 {
                        0.0
                    } else {
                        beta * cv[i + j * m]
                    };
            }
        }
        c.write(&cv)
    }
    fn axpy(&self, _: On, alpha: f32, x: &SymmBuffer, y: &SymmBuffer) -> Result<()> {
        let (xv, mut yv) = (Self::get(x)?, Self::get(y)?);
        yv.iter_mut().zip(&xv).for_each(|(y, x)| *y += alpha * x);
        y.write(&yv)
    }
    fn scal(&self, _: On, alpha: f32, x: &SymmBuffer) -> Result<()> {
        let xv: Vec<f32> = Self::get(x)?.into_iter().map(|v| v * alpha).collect();
        x.write(&xv)
    }
    fn copy(&self, _: On, src: &SymmBuffer, dst: &SymmBuffer) -> Result<()> {
        dst.write(&Self::get(src)?)
    }
    fn sumsq_into(&self, _: On, x: &SymmBuffer, out: &SymmBuffer, slot: usize) -> Result<()> {
        let n = Self::get(x)?
            .iter()
            .map(|v| (*v as f64) * (*v as f64))
            .sum::<f64>() as f32;
        let mut o = Self::get(out)?;
        o[slot] = n;
        out.write(&o)
    }
    type Ev = ();
    fn record(&self, _: On) -> Result<()> {
        Ok(())
    }
    fn wait_for(&self, _: On, _: &()) -> Result<()> {
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>> {
        Self::get(out)
    }
}

// ---------------------------------------------------------------------------------
// One rank's training state for one mode

struct Trainer<'m, M: Math> {
    mode: Mode,
    pool: SymmPool,
    math: &'m M,
    h: usize,
    batch: usize,
    layers: usize,
    lr: f32,
    shards: Vec<SymmBuffer>,
    acts: Vec<SymmBuffer>,
    grads: [SymmBuffer; 2],
    sums: SymmBuffer,
    data: Arc<Vec<(SymmBuffer, SymmBuffer)>>,
    ag_paths: Vec<Path>,
    rs_paths: Vec<Path>,
}

struct StepOut {
    loss: f32,
    ms: f64,
}

impl<'m, M: Math> Trainer<'m, M> {
    /// Gather layer `l`'s parameters on the comm stream; the event marks completion.
    fn ag(&mut self, l: usize) -> Result<(SymmBuffer, M::Ev)> {
        let e = std::mem::size_of::<M::E>() as u64;
        let comm = self.math.stream(On::Comm);
        let full = self.pool.alloc((self.h * self.h) as u64 * e, comm)?;
        let r: CollectiveReport = coll::all_gather::<M::E>(&self.shards[l], &full, comm)?;
        self.ag_paths.push(r.path);
        Ok((full, self.math.record(On::Comm)?))
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

    /// One training step on batch `k`.
    fn step(&mut self, k: usize) -> Result<StepOut> {
        let start = Instant::now();
        let (h, b, layers) = (self.h, self.batch, self.layers);
        let e = std::mem::size_of::<M::E>() as u64;
        let m = self.math;
        let data = self.data.clone();
        let (x, t) = &data[k % data.len()];
        self.ag_paths.clear();
        self.rs_paths.clear();
        // Forward: gather layer l+1 on the comm stream while layer l computes.
        let (mut cur, mut arrived) = self.ag(0)?;
        for l in 0..layers {
            m.wait_for(On::Compute, &arrived)?;
            let next = if l + 1 < layers {
                Some(self.ag(l + 1)?)
            } else {
                None
            };
            let input = if l == 0 { x } else { &self.acts[l - 1] };
            m.gemm(
                On::Compute,
                false,
                false,
                h,
                b,
                h,
                1.0,
                &cur,
                input,
                0.0,
                &self.acts[l],
            )?;
            cur.record_stream(m.stream(On::Compute))?;
            drop(cur);
            (cur, arrived) = match next {
                Some(n) => n,
                None => break,
            };
        }
        // Loss = mean squared error; G = dLoss/dOutput = 2/(h·b) · (out − target).
        let g_top = &self.grads[layers % 2];
        m.copy(On::Compute, &self.acts[layers - 1], g_top)?;
        m.axpy(On::Compute, -1.0, t, g_top)?;
        m.sumsq_into(On::Compute, g_top, &self.sums, 0)?;
        m.scal(On::Compute, 2.0 / (h * b) as f32, g_top)?;
        // Backward: re-gather with prefetch; reduce-scatter weight gradients on the
        // comm stream while the layer below computes.
        let world = self.pool.world_size();
        let shard_bytes = (h * h / world) as u64 * e;
        let (mut cur, mut arrived) = self.ag(layers - 1)?;
        let mut prev_grad: Option<(SymmBuffer, SymmBuffer)> = None;
        for l in (0..layers).rev() {
            m.wait_for(On::Compute, &arrived)?;
            let next = if l > 0 { Some(self.ag(l - 1)?) } else { None };
            let input = if l == 0 { x } else { &self.acts[l - 1] };
            let g_out = &self.grads[(l + 1) % 2];
            let dw = self.pool.alloc((h * h) as u64 * e, m.stream(On::Compute))?;
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
                &dw,
            )?;
            let dw_ready = m.record(On::Compute)?;
            if l > 0 {
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
                    &self.grads[l % 2],
                )?;
            }
            m.wait_for(On::Comm, &dw_ready)?;
            let dw_shard = self.pool.alloc(shard_bytes, m.stream(On::Comm))?;
            let r =
                coll::reduce_scatter::<M::E>(&dw, &dw_shard, ReduceOp::Sum, m.stream(On::Comm))?;
            self.rs_paths.push(r.path);
            // SGD on the shard (mean of the ranks' gradients), on the comm stream.
            m.axpy(
                On::Comm,
                -self.step_size() / world as f32,
                &dw_shard,
                &self.shards[l],
            )?;
            cur.record_stream(m.stream(On::Compute))?;
            drop(cur);
            // Keep one gradient pair alive so the next layer's lands in other blocks
            // and its GEMM does not wait for this reduce-scatter.
            prev_grad = Some((dw, dw_shard));
            (cur, arrived) = match next {
                Some(n) => n,
                None => break,
            };
        }
        drop(prev_grad);
        m.sync()?;
        let sumsq = m.read_sums(&self.sums)?[0] as f64;
        Ok(StepOut {
            loss: (sumsq / (h * b) as f64) as f32,
            ms: start.elapsed().as_secs_f64() * 1e3,
        })
    }
}

/// Deterministic pseudo-random numbers (SplitMix64), uniform in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const RANK_OF_TEACHER: usize = 8;
const BATCHES: usize = 2;

/// Build data (per rank) and a trainer per mode on one rank, then train.
fn run_rank<M: Math>(
    math: &M,
    pools: Vec<(Mode, SymmPool)>,
    args: &Args,
    barrier: &StepBarrier,
) -> Result<Vec<RankResult>> {
    let (h, b, layers) = (args.hidden, args.batch, args.layers);
    let e = std::mem::size_of::<M::E>() as u64;
    let rank = pools[0].1.rank();
    let world = pools[0].1.world_size();
    // Data lives in a pool of its own (unregistered) on the first mode's backend, so
    // every mode's pool statistics count only the training's own buffers.
    let data_pool = &SymmPool::new(
        pools[0].1.backend().clone(),
        PoolConfig::default()
            .with_register(false)
            .with_timeout(pools[0].1.config().timeout),
    )?;
    let cs = math.stream(On::Compute);
    let to_e = |v: &[f32]| {
        v.iter()
            .map(|&x| M::E::from_f64(x as f64))
            .collect::<Vec<_>>()
    };
    // Teacher: layer l is I + c·P_l·Q_lᵀ with P, Q of rank 8; T = teacher(X).
    let c = 0.05f32;
    let mut teach = Vec::new();
    for l in 0..layers {
        let mut rng = Rng(0x7ea0 + l as u64);
        let p: Vec<f32> = (0..h * RANK_OF_TEACHER)
            .map(|_| rng.next() * (3.0 / h as f32).sqrt())
            .collect();
        let q: Vec<f32> = (0..h * RANK_OF_TEACHER).map(|_| rng.next()).collect();
        let (pb, qb) = (
            data_pool.alloc(p.len() as u64 * e, cs)?,
            data_pool.alloc(q.len() as u64 * e, cs)?,
        );
        pb.write(&to_e(&p))?;
        qb.write(&to_e(&q))?;
        teach.push((pb, qb));
    }
    let u = data_pool.alloc((RANK_OF_TEACHER * b) as u64 * e, cs)?;
    let mut data = Vec::new();
    for k in 0..BATCHES {
        let mut rng = Rng(0xda7a ^ ((rank as u64) << 20) ^ k as u64);
        let xv: Vec<f32> = (0..h * b).map(|_| rng.next()).collect();
        let x = data_pool.alloc((h * b) as u64 * e, cs)?;
        let t = data_pool.alloc((h * b) as u64 * e, cs)?;
        x.write(&to_e(&xv))?;
        math.copy(On::Compute, &x, &t)?;
        for (p, q) in &teach {
            // U = Qᵀ·T (r×b); T += c·P·U.
            math.gemm(
                On::Compute,
                true,
                false,
                RANK_OF_TEACHER,
                b,
                h,
                1.0,
                q,
                &t,
                0.0,
                &u,
            )?;
            math.gemm(
                On::Compute,
                false,
                false,
                h,
                b,
                RANK_OF_TEACHER,
                c,
                p,
                &u,
                1.0,
                &t,
            )?;
        }
        data.push((x, t));
    }
    math.sync()?;
    drop((teach, u));
    let data = Arc::new(data);
    // Student: every layer starts at the identity; rank r holds columns
    // [r·h/world, (r+1)·h/world) of each (column-major, so a contiguous shard).
    let shard_len = h * h / world;
    let mut ident = vec![0f32; shard_len];
    for (i, v) in ident.iter_mut().enumerate() {
        let flat = rank * shard_len + i;
        if flat % h == flat / h {
            *v = 1.0;
        }
    }
    let ident = to_e(&ident);
    let mut trainers = Vec::new();
    for (mode, pool) in pools {
        let shards = (0..layers)
            .map(|_| {
                let s = pool.alloc(shard_len as u64 * e, cs)?;
                s.write(&ident)?;
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        let acts = (0..layers)
            .map(|_| pool.alloc((h * b) as u64 * e, cs))
            .collect::<Result<Vec<_>>>()?;
        let grads = [
            pool.alloc((h * b) as u64 * e, cs)?,
            pool.alloc((h * b) as u64 * e, cs)?,
        ];
        let sums = pool.alloc(4 * 4, cs)?;
        sums.write(
            &to_e(&[0.0; 4])
                .iter()
                .map(|v| v.to_f64() as f32)
                .collect::<Vec<f32>>(),
        )?;
        trainers.push(Trainer {
            mode,
            pool,
            math,
            h,
            batch: b,
            layers,
            lr: args.lr,
            shards,
            acts,
            grads,
            sums,
            data: data.clone(),
            ag_paths: Vec::new(),
            rs_paths: Vec::new(),
        });
    }
    let mut results: Vec<RankResult> = trainers
        .iter()
        .map(|t| RankResult {
            mode: t.mode,
            losses: Vec::new(),
            ms: Vec::new(),
            regs_after_first: 0,
            stats: t.pool.stats(),
            ag_paths: Vec::new(),
            rs_paths: Vec::new(),
        })
        .collect();
    let mut regs_first = vec![0u64; trainers.len()];
    for step in 0..args.steps {
        // Interleave the modes step by step so they see the same machine conditions.
        for (i, tr) in trainers.iter_mut().enumerate() {
            barrier.wait()?;
            let out = tr.step(step)?;
            let regs: u64 = tr.pool.stats().registrations.iter().sum();
            if step == 0 {
                regs_first[i] = regs;
            } else {
                results[i].regs_after_first = regs - regs_first[i];
            }
            if rank == 0 && !args.quiet && !args.json {
                out!(
                    "[{:>4}] step {:>3}  loss {:.6e}  {:>9.2} ms",
                    tr.mode.name(),
                    step,
                    out.loss,
                    out.ms
                );
            }
            results[i].losses.push(out.loss);
            results[i].ms.push(out.ms);
            results[i].ag_paths = tr.ag_paths.clone();
            results[i].rs_paths = tr.rs_paths.clone();
        }
    }
    for (i, tr) in trainers.iter().enumerate() {
        results[i].stats = tr.pool.stats();
    }
    Ok(results)
}

/// What one mode did on rank 0.
#[derive(Debug)]
pub struct RankResult {
    /// The mode.
    pub mode: Mode,
    /// Loss per step.
    pub losses: Vec<f32>,
    /// Step time per step, in ms.
    pub ms: Vec<f64>,
    /// Window registrations after the first step.
    pub regs_after_first: u64,
    /// The pool's statistics at the end.
    pub stats: symmpool::PoolStats,
    /// Paths of the last step's all-gathers.
    pub ag_paths: Vec<Path>,
    /// Paths of the last step's reduce-scatters.
    pub rs_paths: Vec<Path>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn paths_summary(p: &[Path]) -> String {
    let mut kinds: Vec<Path> = Vec::new();
    for x in p {
        if !kinds.contains(x) {
            kinds.push(*x);
        }
    }
    kinds
        .iter()
        .map(|k| format!("{k:?}"))
        .collect::<Vec<_>>()
        .join("+")
}

/// The `--json` summary object of one mode.
pub fn json_summary(args: &Args, backend: &str, r: &RankResult) -> serde_json::Value {
    let s = &r.stats;
    serde_json::json!({
        "backend": backend,
        "ranks": args.ranks,
        "mode": r.mode.name(),
        "layers": args.layers,
        "hidden": args.hidden,
        "batch": args.batch,
        "steps": args.steps,
        "median_step_ms": median(&r.ms[1.min(r.ms.len() - 1)..]),
        "first_loss": r.losses.first(),
        "last_loss": r.losses.last(),
        "registrations": s.registrations.iter().sum::<u64>(),
        "registrations_per_communicator": s
            .roles
            .iter()
            .zip(&s.registrations)
            .map(|(role, n)| (format!("{role:?}"), *n))
            .collect::<std::collections::BTreeMap<_, _>>(),
        "registrations_after_first_step": r.regs_after_first,
        "segments": s.core.segments.current,
        "peak_reserved_bytes": s.core.reserved_bytes.peak,
        "peak_allocated_bytes": s.core.allocated_bytes.peak,
        "all_gather_paths": paths_summary(&r.ag_paths),
        "reduce_scatter_paths": paths_summary(&r.rs_paths),
    })
}

fn report(args: &Args, backend: &str, results: &[RankResult]) {
    let ring = results
        .iter()
        .find(|r| r.mode == Mode::Ring)
        .map(|r| median(&r.ms[1..]));
    if args.json {
        for r in results {
            out!("{}", json_summary(args, backend, r));
        }
        return;
    }
    out!(
        "\nsummary: backend {backend}, {} ranks, {} layers, hidden {}, batch {}, {} steps (median over steps 1..)",
        args.ranks,
        args.layers,
        args.hidden,
        args.batch,
        args.steps
    );
    out!(
        "{:<5} {:>10} {:>8} {:>12} {:>12} {:>6} {:>8} {:>11} {:>11}  {:<28} {:<28}",
        "mode",
        "step ms",
        "vs ring",
        "first loss",
        "last loss",
        "regs",
        "regs>1st",
        "reserved",
        "allocated",
        "all-gather path",
        "reduce-scatter path"
    );
    for r in results {
        let s = &r.stats;
        let med = median(&r.ms[1.min(r.ms.len() - 1)..]);
        out!(
            "{:<5} {:>10.2} {:>8} {:>12.5e} {:>12.5e} {:>6} {:>8} {:>8} MiB {:>7} MiB  {:<28} {:<28}",
            r.mode.name(),
            med,
            ring.map_or("-".into(), |x| format!("{:.3}", med / x)),
            r.losses[0],
            r.losses[r.losses.len() - 1],
            s.registrations.iter().sum::<u64>(),
            r.regs_after_first,
            s.core.reserved_bytes.peak >> 20,
            s.core.allocated_bytes.peak >> 20,
            paths_summary(&r.ag_paths),
            paths_summary(&r.rs_paths),
        );
    }
    // The trajectories must agree across modes (up to bf16 rounding on GPUs).
    if results.len() > 1
        && let Some(first) = results.first()
    {
        let worst = results
            .iter()
            .flat_map(|r| {
                r.losses
                    .iter()
                    .zip(&first.losses)
                    .map(|(a, b)| ((a - b) / b.abs().max(1e-30)).abs())
            })
            .fold(0f32, f32::max);
        out!("largest relative loss difference between modes: {worst:.2e}");
    }
}

/// The loss fell and nothing registered after the first step, in every mode.
pub fn check(results: &[RankResult]) -> std::result::Result<(), String> {
    for r in results {
        let (first, last) = (r.losses[0], r.losses[r.losses.len() - 1]);
        if !last.is_finite() || last >= first {
            return Err(format!(
                "{}: loss did not fall ({first} -> {last})",
                r.mode.name()
            ));
        }
        if r.regs_after_first != 0 {
            return Err(format!(
                "{}: {} registrations after the first step",
                r.mode.name(),
                r.regs_after_first
            ));
        }
    }
    Ok(())
}

/// Train on the host backend; returns rank 0's results per mode.
pub fn run_host(args: &Args) -> Result<Vec<RankResult>> {
    let barrier = StepBarrier::new(args.ranks);
    let per_mode: Vec<Vec<SymmPool>> = args
        .modes
        .iter()
        .map(|m| {
            let pools = SymmPool::host_group(args.ranks, m.pool_config())?;
            for p in &pools {
                symmpool::coll::set_path_policy(p, m.path_policy())?;
            }
            Ok(pools)
        })
        .collect::<Result<_>>()?;
    // Regroup: rank r gets the r-th pool of every mode.
    let mut per_rank: Vec<Vec<(Mode, SymmPool)>> = (0..args.ranks).map(|_| Vec::new()).collect();
    for (m, pools) in args.modes.iter().zip(per_mode) {
        for (r, p) in pools.into_iter().enumerate() {
            per_rank[r].push((*m, p));
        }
    }
    on_rank_threads(per_rank, &barrier, |pools| {
        let math = HostMath {
            compute: Stream::host(),
            comm: Stream::host(),
        };
        run_rank(&math, pools, args, &barrier)
    })
}

/// Run `f` for rank `r` on thread `r`, with `items[r]`. A rank that fails breaks the
/// barrier so the others stop too. Returns rank 0's results or the first error.
fn on_rank_threads<T: Send>(
    items: Vec<T>,
    barrier: &StepBarrier,
    f: impl Fn(T) -> Result<Vec<RankResult>> + Sync,
) -> Result<Vec<RankResult>> {
    let outs: Vec<Result<Vec<RankResult>>> = std::thread::scope(|s| {
        let hs: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(rank, item)| {
                let f = &f;
                s.spawn(move || {
                    let out = f(item);
                    if out.is_err() {
                        barrier.abort(rank);
                    }
                    out
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let mut outs = outs.into_iter();
    let first = outs.next().expect("rank 0")?;
    for o in outs {
        o?;
    }
    Ok(first)
}

#[cfg(feature = "nccl")]
mod gpu {
    //! The NCCL/cuBLAS side: bf16, two streams per rank, events between them.

    use super::*;
    use cudarc::driver::CudaStream;
    use symmpool::backend::{NcclBackend, NcclWorldConfig};
    use symmpool::bf16;

    pub struct GpuMath {
        compute: Stream,
        comm: Stream,
        blas_compute: gpu_math::Blas,
        blas_comm: gpu_math::Blas,
    }

    fn e(s: String) -> symmpool::Error {
        symmpool::Error::InvalidConfig(s)
    }

    fn ptr(b: &SymmBuffer) -> Result<u64> {
        b.device_ptr()
            .ok_or_else(|| e("not a device buffer".into()))
    }

    impl GpuMath {
        fn cuda(&self, on: On) -> &Arc<CudaStream> {
            self.stream(on).cuda_stream().expect("cuda stream")
        }
        fn blas(&self, on: On) -> &gpu_math::Blas {
            if on == On::Compute {
                &self.blas_compute
            } else {
                &self.blas_comm
            }
        }
    }

    impl Math for GpuMath {
        type E = bf16;
        fn stream(&self, on: On) -> &Stream {
            if on == On::Compute {
                &self.compute
            } else {
                &self.comm
            }
        }
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
            c: &SymmBuffer,
        ) -> Result<()> {
            let (lda, ldb) = (if ta { k } else { m }, if tb { n } else { k });
            // SAFETY: the buffers are live pool buffers of this rank's device with the
            // sizes the shapes imply (allocated by the trainer for exactly these).
            unsafe {
                self.blas(on).gemm_bf16(
                    ta,
                    tb,
                    m,
                    n,
                    k,
                    alpha,
                    ptr(a)?,
                    lda,
                    ptr(b)?,
                    ldb,
                    beta,
                    ptr(c)?,
                    m,
                )
            }
            .map_err(e)
        }
        fn axpy(&self, on: On, alpha: f32, x: &SymmBuffer, y: &SymmBuffer) -> Result<()> {
            let n = (x.len_bytes() / 2) as usize;
            // SAFETY: x and y are live buffers of n bf16 elements.
            unsafe { self.blas(on).axpy_bf16(n, alpha, ptr(x)?, ptr(y)?) }.map_err(e)
        }
        fn scal(&self, on: On, alpha: f32, x: &SymmBuffer) -> Result<()> {
            // SAFETY: x is a live buffer of len/2 bf16 elements.
            unsafe {
                self.blas(on)
                    .scal_bf16((x.len_bytes() / 2) as usize, alpha, ptr(x)?)
            }
            .map_err(e)
        }
        fn copy(&self, on: On, src: &SymmBuffer, dst: &SymmBuffer) -> Result<()> {
            // SAFETY: both are live device buffers of at least src.len_bytes() bytes.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    ptr(dst)?,
                    ptr(src)?,
                    src.len_bytes() as usize,
                    self.cuda(on).cu_stream(),
                )
            }
            .map_err(|x| e(format!("cuMemcpyDtoDAsync: {x:?}")))
        }
        fn sumsq_into(&self, on: On, x: &SymmBuffer, out: &SymmBuffer, slot: usize) -> Result<()> {
            // SAFETY: x holds len/2 bf16 elements; out holds at least slot+1 f32.
            unsafe {
                self.blas(on).sumsq_bf16(
                    (x.len_bytes() / 2) as usize,
                    ptr(x)?,
                    ptr(out)? + 4 * slot as u64,
                )
            }
            .map_err(e)
        }
        type Ev = cudarc::driver::CudaEvent;
        fn record(&self, on: On) -> Result<Self::Ev> {
            self.cuda(on)
                .record_event(None)
                .map_err(|x| e(format!("cuEventRecord: {x:?}")))
        }
        fn wait_for(&self, to: On, ev: &Self::Ev) -> Result<()> {
            self.cuda(to)
                .wait(ev)
                .map_err(|x| e(format!("cuStreamWaitEvent: {x:?}")))
        }
        fn sync(&self) -> Result<()> {
            self.cuda(On::Compute)
                .synchronize()
                .map_err(|x| e(format!("{x:?}")))?;
            self.cuda(On::Comm)
                .synchronize()
                .map_err(|x| e(format!("{x:?}")))
        }
        fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>> {
            out.read::<f32>()
        }
    }

    pub fn run(args: &Args) -> Result<Vec<RankResult>> {
        let devices: Vec<usize> = (0..args.ranks).collect();
        let backends = NcclBackend::local_world(&devices, NcclWorldConfig::default())?;
        let barrier = StepBarrier::new(args.ranks);
        on_rank_threads(backends, &barrier, |b| {
            let nccl = b
                .downcast_ref::<NcclBackend>()
                .ok_or_else(|| e("not an NCCL backend".into()))?;
            let pools = args
                .modes
                .iter()
                .map(|m| Ok((*m, m.pool(b.clone())?)))
                .collect::<Result<Vec<_>>>()?;
            let (compute, comm) = (nccl.cuda_stream()?, nccl.cuda_stream()?);
            let math = GpuMath {
                blas_compute: gpu_math::Blas::new(compute.clone()).map_err(e)?,
                blas_comm: gpu_math::Blas::new(comm.clone()).map_err(e)?,
                compute: Stream::cuda(compute),
                comm: Stream::cuda(comm),
            };
            let out = run_rank(&math, pools, args, &barrier);
            math.sync()?;
            out
        })
    }
}

fn main() {
    let (args, gpu) = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("fsdp_step: {msg}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if msg.is_empty() { 0 } else { 2 });
        }
    };
    let (backend, results) = if gpu {
        #[cfg(feature = "nccl")]
        {
            ("nccl", gpu::run(&args))
        }
        #[cfg(not(feature = "nccl"))]
        {
            eprintln!("fsdp_step: built without the `nccl` feature");
            std::process::exit(2)
        }
    } else {
        if args.backend == BackendChoice::Auto && !args.json && !args.quiet {
            out!(
                "no GPUs found (or fewer than {}): running on the host backend",
                args.ranks.max(2)
            );
        }
        ("host", run_host(&args))
    };
    let results = match results {
        Ok(r) => r,
        Err(err) => {
            eprintln!("fsdp_step: {err}");
            std::process::exit(1);
        }
    };
    report(&args, backend, &results);
    if let Err(msg) = check(&results) {
        eprintln!("fsdp_step: check failed: {msg}");
        std::process::exit(1);
    }
}
