//! The command line (`clap`), and the options it resolves to ([`Args`]).

use clap::{CommandFactory, Parser, ValueEnum};
use serde::{Deserialize, Serialize};

/// How the collectives are checked across ranks (`--check`): symmpool's
/// [`CheckMode`](symmpool::CheckMode) (at one rank every mode runs as off: there is no
/// peer to compare with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Check {
    /// No checks.
    Off,
    /// Records posted and compared off the critical path (symmpool's default).
    #[default]
    Async,
    /// Records compared before every collective is launched.
    Strict,
}

impl Check {
    /// symmpool's mode.
    pub fn mode(self) -> symmpool::CheckMode {
        match self {
            Check::Off => symmpool::CheckMode::Off,
            Check::Async => symmpool::CheckMode::Async,
            Check::Strict => symmpool::CheckMode::Strict,
        }
    }

    /// The `--check` name.
    pub fn name(self) -> &'static str {
        match self {
            Check::Off => "off",
            Check::Async => "async",
            Check::Strict => "strict",
        }
    }
}

/// Whether `auto` calibrates its path choice before training (`--calibrate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Calibrate {
    /// When symmpool says the default thresholds are not known to hold here
    /// (`Coll::needs_calibration`: NCCL with ranks sharing a GPU or spanning nodes)
    #[default]
    Auto,
    /// Always, on any backend (on the host it measures host copies: a test of the
    /// mechanics, not of a machine)
    Always,
    /// Never: auto keeps symmpool's default thresholds
    Never,
}

/// How the collectives run (`--comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A pool that registers nothing: plain NCCL, the baseline
    Ring,
    /// NCCL's symmetric kernels for both collectives
    Symm,
    /// Copy-engine all-gather, symmetric-kernel reduce-scatter (PyTorch FSDP2's recipe)
    Ce,
    /// The crate's choice per size
    Auto,
    /// No communication: the same step with the collectives left out (their output
    /// buffers are allocated and used as they are), the bound on the step time that
    /// hiding all communication would reach; its losses mean nothing
    None,
}

impl Mode {
    /// Every mode that communicates, ring first.
    pub const ALL: [Mode; 4] = [Mode::Ring, Mode::Symm, Mode::Ce, Mode::Auto];

    /// What `--compare` runs: every mode, `none` last.
    pub const COMPARED: [Mode; 5] = [Mode::Ring, Mode::Symm, Mode::Ce, Mode::Auto, Mode::None];

    /// Whether the mode runs the collectives (all but `none`).
    pub fn communicates(self) -> bool {
        self != Mode::None
    }

    /// The `--comm` name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ring => "ring",
            Mode::Symm => "symm",
            Mode::Ce => "ce",
            Mode::Auto => "auto",
            Mode::None => "none",
        }
    }
}

/// Where to run (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// NCCL when enough GPUs are present, else the host backend
    Auto,
    /// The host backend: ranks are threads, memory is host memory, math is f32 loops
    Host,
    /// NCCL: one GPU per rank, bf16, cuBLAS
    Nccl,
}

impl BackendChoice {
    /// The `--backend` name.
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Host => "host",
            BackendChoice::Nccl => "nccl",
        }
    }
}

const AFTER_HELP: &str = "\
Defaults: host backend: 2 ranks, 4 layers, hidden 64, batch 32, 30 steps
          GPUs:         2 ranks, 8 layers, hidden 4096, batch 1024, 20 steps
--balanced (GPUs): hidden 16384, batch 1024, 8 layers: communication about equal to
          computation on 2xH200 (per layer, each rank gathers 256 MiB, ~0.97 ms on ring,
          and reduce-scatters 512 MiB, ~1.07 ms; each GEMM is 2*16384^2*1024 flop, ~0.85 ms:
          forward 1 GEMM vs 1 all-gather, backward 2 GEMMs vs all-gather + reduce-scatter)
Streams: compute, all-gather, reduce-scatter (the SGD update of the shards runs on the
          last); the host waits for the device once per step, at its end, to read the loss.
--sm-margin N (GPUs): the GEMMs of a mode that communicates plan for N SMs fewer
          (cublasSetSmCountTarget), so that the all-gathers and reduce-scatters beside them
          find SMs free instead of waiting for a GEMM's wave to end; `none` keeps every
          SM. 12 was the best single value for both sizes on one H200 (BENCHMARKS.md,
          runs 30-33; 16 was better for --balanced alone); not measured on two GPUs.
--trace FILE: FILE (Chrome-trace JSON, every step after the first) and FILE.svg (the
          last step of rank 0 per mode); the summary on stderr gives per mode each
          stream's busy time, the communication left exposed (compute stream idle) and
          hidden, the host's µs per call and its wait at the end of the step. Tracing
          adds two event records per operation.
--calibrate auto|always|never: before training, auto's path thresholds are measured
          over this run's collective sizes (the all-gather shard and reduce-scatter output,
          hidden²/ranks elements: every path, 3 repetitions of 3 calls) and the fastest path
          per size is used (`Coll::calibrate`); auto does so where symmpool says the
          default thresholds (measured on 2 GPUs of one node) may not hold: NCCL with
          ranks that share a GPU or span several nodes. One line says what was chosen.
--survive: ranks as processes (--nproc N, or a launcher), N >= 2. The victim's backend
          raises SIGKILL on entering its reduce-scatter of layer <layers>/2 in step
          --kill-at-step; the launcher of --nproc expects that death, and no other. The
          survivors shrink their three pools (parameters, gradients, data), agree on the
          last step whose parameters they all hold in full (each rank keeps the whole
          parameters gathered in its last two steps: 2 x layers x hidden² elements more
          memory), re-shard them for the new world size and train on from there; the summary says what was lost, when, what the
          shrink did and the losses before and after. hidden² must split over N and N-1
          ranks (without --hidden, the default grows to the next size that does).
          `--save-state F`, then `--nproc N-1 --resume F`: a fresh job at the smaller
          size from the same state, whose losses equal the survivors'.
--heal (with --survive): the launcher of --nproc starts a replacement for the lost rank
          (its RANK, SYMMPOOL_JOIN=1) once it died; at the start of step --heal-at-step
          the survivors gather the whole parameters, rank 0 writes them to a file the
          launcher names for the newcomer (SYMMPOOL_FSDP_HEAL_STATE), they drop their
          buffers and grow the three pools (`SymmPool::grow`) while the newcomer joins
          them (`SymmPool::join`); the four re-shard and train on at the full size. The
          summary adds the heal: the pools' grow reports, the newcomer's time from its
          admission to its first collective, the losses at N, N-1 and N again. With
          --heal, `--save-state F` writes the state at the heal: `--nproc N --resume F`
          gives the healed job's losses from there. auto keeps its default thresholds (a
          newcomer has no calibration to share).";

/// FSDP-style training of a stack of linear layers: parameters sharded over the ranks,
/// all-gathered into symmpool buffers before use, gradients reduce-scattered.
#[derive(Debug, Parser)]
#[command(name = "fsdp_step", after_help = AFTER_HELP)]
pub struct Cli {
    /// Ranks as threads of this process (threads on the host backend, GPUs on NCCL)
    /// [default: 2]; with ranks as processes, `--nproc` sets their number instead
    #[arg(long, value_parser = at_least::<1>, conflicts_with = "nproc")]
    pub ranks: Option<usize>,
    /// Layers, each hidden × hidden [default: see below]
    #[arg(long, value_parser = at_least::<1>)]
    pub layers: Option<usize>,
    /// Hidden size; hidden² must split evenly over the ranks [default: see below]
    #[arg(long, value_parser = at_least::<1>)]
    pub hidden: Option<usize>,
    /// Batch (columns per rank) [default: see below]
    #[arg(long, value_parser = at_least::<1>)]
    pub batch: Option<usize>,
    /// Training steps, at least 2 (the check compares the first and last loss) [default:
    /// see below]
    #[arg(long, value_parser = at_least::<2>)]
    pub steps: Option<usize>,
    /// Learning rate, as a fraction of the inverse curvature (stable below ~1)
    #[arg(long, default_value_t = 1.0, value_parser = positive_finite, allow_negative_numbers = true)]
    pub lr: f32,
    /// How many layers ahead the all-gathers are issued (1, FSDP2's default; each more
    /// keeps one more gathered layer alive; more than the layers means all of them)
    #[arg(long, default_value_t = 1, value_parser = at_least::<1>)]
    pub prefetch: usize,
    /// SMs the compute stream's cuBLAS calls (the GEMMs) leave free for the
    /// communication beside them, in the modes that communicate (cuBLAS's SM count
    /// target; GPUs only, nothing on the host); 0 = every SM
    #[arg(long, default_value_t = 12)]
    pub sm_margin: usize,
    /// How the collectives run
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub comm: Mode,
    /// Run every mode (ring, symm, ce, auto, none), interleaved step by step, in one
    /// table
    #[arg(long)]
    pub compare: bool,
    /// How the collectives are checked across ranks (off, async, strict; by default
    /// `SYMMPOOL_CHECK`, else async)
    #[arg(long, value_enum, default_value_t = Check::Async, env = "SYMMPOOL_CHECK", ignore_case = true)]
    pub check: Check,
    /// Whether `auto` measures every path over this run's collective sizes before
    /// training and uses the fastest per size (auto: where symmpool says the default
    /// thresholds may not hold; see below)
    #[arg(long, value_enum, default_value_t = Calibrate::Auto)]
    pub calibrate: Calibrate,
    /// GPU sizes where communication takes about as long as computation (see below)
    #[arg(long)]
    pub balanced: bool,
    /// Where to run
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Start this many processes of this program, one rank each (torchrun-style
    /// variables on 127.0.0.1), and print rank 0's results; launched by torchrun,
    /// srun or mpirun instead, each process runs one rank from the environment
    #[arg(long, value_parser = at_least::<1>)]
    pub nproc: Option<usize>,
    /// Print one JSON object per mode instead of the table
    #[arg(long)]
    pub json: bool,
    /// No per-step lines
    #[arg(long)]
    pub quiet: bool,
    /// Write the memory map of every rank's pool at the end (first mode) to this SVG,
    /// and the snapshots beside it as JSON (PATH.json; `examples/memory_map.rs` renders
    /// them again)
    #[arg(long, value_name = "PATH")]
    pub memory_map: Option<std::path::PathBuf>,
    /// Write the timeline of every step after the first (every rank, every mode) to
    /// this file as Chrome-trace JSON (Perfetto, chrome://tracing): per stream and
    /// layer, when each GEMM, all-gather, reduce-scatter, copy and wait ran on the
    /// device, and the host calls; a summary of it goes to stderr
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    /// Lose a rank on purpose and go on without it: in step --kill-at-step, rank
    /// --victim kills itself (SIGKILL) inside a reduce-scatter; the others get
    /// `PeerLost`, shrink their pools (`SymmPool::shrink`) and train on to the end at
    /// one rank fewer, from the parameters of the last step they all hold in full.
    /// Ranks as processes only (--nproc or a launcher), one mode; see below
    #[arg(long, conflicts_with_all = ["compare", "trace"])]
    pub survive: bool,
    /// With --survive: the step in which the victim kills itself (from 1 to --steps
    /// minus 1)
    #[arg(long, default_value_t = 3, requires = "survive", value_parser = at_least::<1>)]
    pub kill_at_step: usize,
    /// With --survive: the rank that kills itself [default: the last]; not rank 0,
    /// which hosts the store
    #[arg(long, requires = "survive")]
    pub victim: Option<usize>,
    /// With --survive: the survivors' rank 0 writes the state they went on from (its
    /// step and every layer's parameters) to this file, for --resume; with --heal, the
    /// state at the heal (the one the world goes on from at its full size)
    #[arg(long, value_name = "FILE", requires = "survive")]
    pub save_state: Option<std::path::PathBuf>,
    /// With --survive: a replacement takes the lost rank's place (the launcher starts
    /// it, `SYMMPOOL_JOIN=1`), the survivors grow their pools to take it in
    /// (`SymmPool::grow`) at the start of step --heal-at-step, and the world trains on
    /// at its full size; see below
    #[arg(long, requires = "survive", conflicts_with = "calibrate")]
    pub heal: bool,
    /// With --heal: the step at whose start the world grows back, after
    /// --kill-at-step and before the end of --steps [default: --kill-at-step + 2]
    #[arg(long, requires = "heal", value_parser = at_least::<1>)]
    pub heal_at_step: Option<usize>,
    /// Start from a state written by --save-state (its step, its parameters) at this
    /// run's world size, instead of from the first step
    #[arg(long, value_name = "FILE")]
    pub resume: Option<std::path::PathBuf>,
    // `cargo test` and `cargo bench` pass these to targets without a harness.
    #[arg(long, hide = true)]
    bench: bool,
    #[arg(long, hide = true)]
    test: bool,
    #[arg(long, hide = true)]
    nocapture: bool,
}

fn at_least<const N: usize>(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= N => Ok(n),
        _ => Err(format!("expected an integer, at least {N}")),
    }
}

fn positive_finite(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("expected a positive, finite number".into()),
    }
}

/// The example's options, resolved: every size known, the backend chosen.
#[derive(Debug, Clone)]
pub struct Args {
    /// Ranks.
    pub ranks: usize,
    /// Layers.
    pub layers: usize,
    /// Hidden size (each layer is hidden × hidden).
    pub hidden: usize,
    /// Batch (columns per rank).
    pub batch: usize,
    /// Training steps.
    pub steps: usize,
    /// Learning rate, as a fraction of the inverse curvature.
    pub lr: f32,
    /// Layers whose all-gathers are issued ahead of the one computing (at least 1).
    pub prefetch: usize,
    /// SMs the compute stream's GEMMs leave to the communication, in the modes that
    /// communicate (0: every SM; always 0 on the host backend, which has none).
    pub sm_margin: usize,
    /// Ranks are processes (`--nproc` or a launcher), not threads: on the host, the
    /// shared-memory backend.
    pub processes: bool,
    /// Modes to run, interleaved step by step.
    pub modes: Vec<Mode>,
    /// How every pool checks its collectives across the ranks.
    pub check: Check,
    /// Whether `auto` calibrates its path choice before training.
    pub calibrate: Calibrate,
    /// Print one JSON object per mode instead of the table.
    pub json: bool,
    /// Where to run: `Host` or `Nccl` (never `Auto` once resolved).
    pub backend: BackendChoice,
    /// No per-step lines.
    pub quiet: bool,
    /// Where to write the memory map (SVG) and its snapshots (`PATH.json`).
    pub memory_map: Option<std::path::PathBuf>,
    /// Where to write the timeline (Chrome-trace JSON).
    pub trace: Option<std::path::PathBuf>,
    /// Lose a rank and go on without it (`--survive`).
    pub survive: Option<Survive>,
    /// Start from this state file (`--resume`).
    pub resume: Option<std::path::PathBuf>,
}

/// What `--survive` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survive {
    /// The step in which the victim kills itself.
    pub kill_at_step: usize,
    /// The rank that kills itself (never 0, which hosts the store).
    pub victim: usize,
    /// Where the survivors' rank 0 writes the state they go on from (with `heal_at`,
    /// the state at the heal).
    pub save_state: Option<std::path::PathBuf>,
    /// `--heal`: the step at whose start a replacement joins and the world grows back.
    pub heal_at: Option<usize>,
}

impl Survive {
    /// The layer in whose reduce-scatter the victim dies: `layers / 2`, which the
    /// backward pass reaches half-way.
    pub fn layer(layers: usize) -> usize {
        layers / 2
    }
}

impl Args {
    /// The backend that runs, as the summary names it: `host`, `shm` (ranks as
    /// processes on the host share memory through the shm backend) or `nccl`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            BackendChoice::Host if self.processes => "shm",
            b => b.name(),
        }
    }

    /// The host defaults, for `modes`.
    pub fn host(modes: Vec<Mode>) -> Args {
        Args {
            ranks: 2,
            layers: 4,
            hidden: 64,
            batch: 32,
            steps: 30,
            lr: 1.0,
            prefetch: 1,
            sm_margin: 0,
            processes: false,
            modes,
            check: Check::Async,
            calibrate: Calibrate::Auto,
            json: false,
            backend: BackendChoice::Host,
            quiet: true,
            memory_map: None,
            trace: None,
            survive: None,
            resume: None,
        }
    }
}

/// How many GPUs this machine has (none without the `nccl` feature): the defaults
/// follow it ([`Cli::resolve`]).
pub fn gpu_count() -> usize {
    #[cfg(feature = "nccl")]
    return symmpool::backend::nccl::device_count().unwrap_or(0);
    #[cfg(not(feature = "nccl"))]
    return 0;
}

/// Whether hidden² splits evenly over `ranks`.
fn splits(hidden: usize, ranks: usize) -> bool {
    (hidden * hidden).is_multiple_of(ranks)
}

impl Cli {
    /// Resolve the defaults (they depend on whether the run is on GPUs; `gpus` is how
    /// many this machine has). An invalid combination exits with a usage error (code 2).
    pub fn resolve(&self, gpus: usize) -> Args {
        let launched = symmpool::Launch::from_env().ok().map(|l| l.world_size);
        let ranks = launched.or(self.nproc).or(self.ranks).unwrap_or(2);
        let backend = match self.backend {
            BackendChoice::Auto if gpus >= ranks.max(2) => BackendChoice::Nccl,
            BackendChoice::Auto => BackendChoice::Host,
            chosen => chosen,
        };
        let (layers, hidden, batch, steps) = match (backend, self.balanced) {
            (BackendChoice::Nccl, false) => (8, 4096, 1024, 20),
            (BackendChoice::Nccl, true) => (8, 16384, 1024, 20),
            _ => (4, 64, 32, 30),
        };
        // After a loss the parameters are re-sharded over one rank fewer: the default
        // size grows to the next one whose square splits both ways.
        let after = if self.survive { ranks - 1 } else { ranks };
        let hidden = (hidden..)
            .find(|&h| splits(h, ranks) && splits(h, after.max(1)))
            .unwrap_or(hidden);
        let args = Args {
            ranks,
            layers: self.layers.unwrap_or(layers),
            hidden: self.hidden.unwrap_or(hidden),
            batch: self.batch.unwrap_or(batch),
            steps: self.steps.unwrap_or(steps),
            lr: self.lr,
            prefetch: self.prefetch,
            sm_margin: if backend == BackendChoice::Nccl {
                self.sm_margin
            } else {
                0
            },
            processes: false,
            modes: if self.compare {
                Mode::COMPARED.to_vec()
            } else {
                vec![self.comm]
            },
            check: self.check,
            // A newcomer has no calibration to share: with --heal, auto keeps its
            // default thresholds on every rank.
            calibrate: if self.heal {
                Calibrate::Never
            } else {
                self.calibrate
            },
            json: self.json,
            backend,
            quiet: self.quiet,
            memory_map: self.memory_map.clone(),
            trace: self.trace.clone(),
            survive: self.survive.then(|| Survive {
                kill_at_step: self.kill_at_step,
                victim: self.victim.unwrap_or(ranks.saturating_sub(1)),
                save_state: self.save_state.clone(),
                heal_at: (self.heal).then(|| self.heal_at_step.unwrap_or(self.kill_at_step + 2)),
            }),
            resume: self.resume.clone(),
        };
        let usage = |msg: String| -> ! {
            Cli::command()
                .error(clap::error::ErrorKind::ValueValidation, msg)
                .exit()
        };
        if !splits(args.hidden, ranks) {
            // A hidden size that is a multiple of the ranks always splits.
            let fit = args.hidden.div_ceil(ranks) * ranks;
            usage(format!(
                "hidden² = {} must split evenly over {ranks} ranks: pass --hidden {fit} \
                 (or another multiple of {ranks})",
                args.hidden * args.hidden
            ));
        }
        if let Some(s) = &args.survive {
            let processes = launched.is_some() || self.nproc.is_some();
            if let Err(msg) = s.check(&args, processes) {
                usage(msg);
            }
        }
        args
    }

    /// `--resume`, before any rank starts: the model's shape is the saved state's
    /// unless given, and a state that does not fit is a configuration error.
    pub fn fit_resumed(&self, args: &mut Args) -> symmpool::Result<()> {
        let Some(path) = args.resume.clone() else {
            return Ok(());
        };
        let given = (self.layers, self.hidden);
        super::survive::State::fit_file(&path, args, given)
    }
}

impl Survive {
    /// Whether `args` (this `--survive` among them) can lose a rank and go on;
    /// `processes`: the ranks are processes. The reason when not.
    pub fn check(&self, args: &Args, processes: bool) -> Result<(), String> {
        let (ranks, hidden) = (args.ranks, args.hidden);
        if !processes {
            return Err(
                "--survive needs ranks as processes (--nproc N or a launcher): \
                        ranks as threads cannot lose one"
                    .into(),
            );
        }
        if ranks < 2 {
            return Err("--survive needs at least 2 ranks: one is lost".into());
        }
        if self.victim == 0 || self.victim >= ranks {
            return Err(format!(
                "--victim {} must be a rank from 1 to {} (rank 0 hosts the store)",
                self.victim,
                ranks - 1
            ));
        }
        if self.kill_at_step >= args.steps {
            return Err(format!(
                "--kill-at-step {} must come before the end of --steps {}",
                self.kill_at_step, args.steps
            ));
        }
        if let Some(at) = self.heal_at
            && !(self.kill_at_step < at && at < args.steps)
        {
            return Err(format!(
                "--heal-at-step {at} must come after --kill-at-step {} and before the end \
                 of --steps {}",
                self.kill_at_step, args.steps
            ));
        }
        if args.modes.len() != 1 || !args.modes[0].communicates() {
            return Err("--survive needs one mode that communicates (not --comm none)".into());
        }
        if !splits(hidden, ranks - 1) {
            let fit = (hidden..)
                .find(|&h| splits(h, ranks) && splits(h, ranks - 1))
                .unwrap_or(hidden);
            return Err(format!(
                "hidden² = {} must split evenly over {ranks} ranks and, after the loss, \
                 over {}: pass --hidden {fit}",
                hidden * hidden,
                ranks - 1
            ));
        }
        Ok(())
    }
}
