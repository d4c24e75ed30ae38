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
//! | `main.rs` | the group and a pool per mode, the path policy, the collectives handle, the two collectives on a stream, `main` and its exit statuses |
//! | `run.rs` | one rank: data, a trainer per mode, the steps (in `mode_order`), the warm-up sizing, the summaries; `auto`'s calibration (`calibrate`) |
//! | `trainer.rs` | the FSDP step, written once over a `Math` trait; each collective's tag, `end_step` |
//! | `host_math.rs`, `gpu_math.rs` | `Math` with f32 loops on the host, bf16 cuBLAS on GPUs |
//! | `ranks.rs` | ranks as threads (`run_threads`, `run_host`), and a barrier a failing rank breaks |
//! | `launch.rs` | ranks as processes: `--nproc N`, or started by a launcher |
//! | `survive.rs` | `--survive`: a rank lost on purpose; the shrink after a lost rank (`go_on_without`), the survivors' agreement, the state they go on from |
//! | `heal.rs` | `--heal`: the lost rank replaced; the survivors' grow (`grow_back`), the state handed to the newcomer, its join (`join`), the heal's report |
//! | `report.rs` | the summary (`--json`), the table, the check; the pools' statistics, the memory map (`--memory-map`) |
//! | `trace.rs` | the timeline (`--trace`): device and host spans, Chrome-trace JSON |
//! | `cli.rs` | the command line; the GPU count the defaults follow, `--resume`'s model shape |
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
//! cargo run --release --example fsdp_step -- --nproc 4 --survive --heal  # ... then replace it
//! RUST_LOG=symmpool=debug cargo run --release --example fsdp_step   # the pool's life, traced
//! cargo run --release --example fsdp_step -- --help
//! ```

mod cli;
#[cfg(feature = "nccl")]
#[path = "../support/gpu_math.rs"]
mod cublas;
#[cfg(feature = "nccl")]
mod gpu_math;
pub mod heal;
mod host_math;
pub mod launch;
mod ranks;
#[path = "../support/render.rs"]
mod render;
mod report;
mod run;
pub mod survive;
pub mod trace;
mod trainer;

pub use cli::{Args, Calibrate, Check, Cli, Mode, Survive};
pub use ranks::run_host;
pub use report::{Spread, Summary, check, identity_line, loss_disagreement, print, survival_lines};
pub use run::mode_order;

use clap::Parser;
use symmpool::coll::{Choice, Path, PathPolicy, TaggedColl};
use symmpool::{
    Backend, Coll, CollectiveCalls, Element, ErrorKind, Group, GroupConfig, PoolConfig, ReduceOp,
    Result, Stream, SymmBuffer, SymmPool,
};

// ---------------------------------------------------------------------------------
// 1. A group and a pool per mode. A group is one rank's communicators (the pools on it
//    share them); a pool carves buffers out of a few segments and registers each
//    segment once as an NCCL window; its collectives handle (`Coll`) runs the
//    collectives on its buffers, and its path policy says which NCCL path they prefer
//    on those windows.

/// The group of one rank's `backend` (its communicators, the ledger the ranks compare
/// their calls in), its collectives checked as `check` says (`--check`, async by
/// default). Collective: every rank makes it at the same point.
fn make_group(check: Check, backend: Backend) -> Result<Group> {
    Group::new(backend, GroupConfig::default().with_check(check.mode()))
}

/// A pool of each of `modes` over one rank's `backend` (collective: every rank makes
/// them in the same order). A group has one collectives handle, and each mode has its
/// own, so every mode but the first gets a group of its own, split off the first's.
fn make_pools(modes: &[Mode], check: Check, backend: &Backend) -> Result<Vec<(Mode, SymmPool)>> {
    let group = make_group(check, backend.clone())?;
    (modes.iter().enumerate())
        .map(|(i, &mode)| {
            let own = if i == 0 {
                group.clone()
            } else {
                group.split(mode.name())?
            };
            Ok((mode, SymmPool::new(&own, pool_config(mode))?))
        })
        .collect()
}

/// The pool configuration of `mode`: `ring` registers nothing (plain NCCL).
fn pool_config(mode: Mode) -> PoolConfig {
    PoolConfig::default()
        .with_register(!matches!(mode, Mode::Ring | Mode::None))
        .with_name(mode.name())
}

/// The collectives' path preferences of `mode`; `auto` takes `calibrated` when given
/// (the thresholds measured on this machine, [`run::calibrate`]).
fn path_policy(mode: Mode, calibrated: Option<&PathPolicy>) -> PathPolicy {
    let symm = Choice::Prefer(Path::SymmetricKernel);
    match mode {
        Mode::Symm => PathPolicy::default().with_choices(symm, symm),
        Mode::Ce => PathPolicy::default().with_choices(Choice::Prefer(Path::CopyEngine), symm),
        Mode::Auto => calibrated.cloned().unwrap_or_default(),
        Mode::Ring | Mode::None => PathPolicy::default(),
    }
}

/// The collectives handle of `mode`'s pool, with the mode's path preferences
/// (`calibrated`: auto's measured thresholds, if any). Local: no round with the peers
/// (each rank makes its own; their collectives are what pair).
fn make_coll(mode: Mode, pools: &[SymmPool], calibrated: Option<&PathPolicy>) -> Result<Coll> {
    let coll = Coll::with_pools(pools)?;
    coll.set_path_policy(path_policy(mode, calibrated));
    Ok(coll)
}

// ---------------------------------------------------------------------------------
// 2. The two collectives FSDP needs. `symmpool::alloc` takes from the pool of the
//    enclosing `pool.scope(..)`; `stream` is where the buffer is used and the
//    collective runs (the pool does not reuse the block until that work is done).
//    Each call carries its identity, `coll.tagged(tag)` (the trainer's tags: step,
//    layer, op), so that ranks that skip or reorder a call fail the check there, and
//    every step ends with `coll.end_step()`. `Trainer::step` (`trainer.rs`) makes
//    these calls, with those tags.

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

// ---------------------------------------------------------------------------------
// 3. Starting the ranks. As users' jobs run: one process per rank (`launch.rs`:
//    `--nproc N` starts N processes of this program; torchrun, srun or mpirun start
//    them with the rank in the environment). As a test harness: threads in this
//    process (`ranks.rs`), on the host backend or on local GPUs (`gpu_math::run`).
//    Either way each rank runs `run::run_one_rank`.

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
    let mut args = cli.resolve(cli::gpu_count());
    // `--resume`: the model's shape is the saved state's unless given.
    cli.fit_resumed(&mut args).unwrap_or_else(|err| fail(&err));
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
        let heal = args.survive.as_ref().is_some_and(|s| s.heal_at.is_some());
        launch::spawn_ranks(n, victim, heal).unwrap_or_else(|err| fail(&err))
    } else {
        ranks::run_threads(&cli, &args).unwrap_or_else(|err| fail(&err))
    };
    if launch::is_child() {
        launch::report_to_parent(&results);
        return;
    }
    report::print(&args, &results);
    // With ranks as threads, the memory map and the timeline are written here (with
    // ranks as processes, rank 0 gathered and wrote them).
    if let Err(msg) = report::write_files(&args) {
        eprintln!("fsdp_step: {msg}");
        std::process::exit(1);
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
/// | 69 | `Timeout`, `PeerLost`, `GroupLost` | restart the job (after `PeerLost`, `--survive` shrinks instead, and `--heal` replaces the lost rank later) |
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
