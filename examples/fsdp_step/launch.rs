//! Ranks as processes, the shape of a real job.
//!
//! Launched by torchrun, `srun` or `mpirun`, each process reads its rank from the
//! environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or
//! slurm's and Open MPI's), joins the crate's rendezvous store (rank 0 hosts it) and
//! runs one rank: NCCL on its GPU where there are GPUs, the shared-memory host
//! backend otherwise. `--nproc N` does the launcher's job on this machine: it starts
//! N processes of this program with those variables on 127.0.0.1 and prints rank 0's
//! results; it gives them a random job identity (`SYMMPOOL_JOB_ID`), so two runs that
//! happen to share a port never merge. With `--survive` one rank is lost on purpose
//! (`survive.rs`): the launcher expects that rank's death by SIGKILL, and no other; with
//! `--heal` it then starts a replacement, as a scheduler would (`heal.rs`): this
//! program again as the lost rank, with `SYMMPOOL_JOIN=1`.

#[cfg(feature = "nccl")]
use super::cli::BackendChoice;
use super::run::{Start, run_one_rank};
use super::{Args, Summary, heal, make_pools, ranks::StepSync, survive};
use parking_lot::Mutex;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use symmpool::control::{ChannelId, Exchange, StoreExchange};
use symmpool::{Backend, Deadline, Error, Launch, Result};

/// Set in the processes `--nproc` starts: they report to their parent.
const CHILD_VAR: &str = "SYMMPOOL_FSDP_CHILD";
/// The line prefix of a child's results.
const SUMMARY: &str = "@@summary ";

/// Whether a launcher started this process as one rank: its variables are valid, or,
/// without `--nproc`, `RANK` or `MASTER_PORT` is set (a launch was meant;
/// `run_as_rank` then reports what is wrong with it instead of falling back to
/// threads).
pub fn is_rank_process(nproc: Option<usize>) -> bool {
    Launch::from_env().is_ok()
        || (nproc.is_none()
            && (std::env::var_os("RANK").is_some() || std::env::var_os("MASTER_PORT").is_some()))
}

/// Whether `--nproc` started this process (it reports to its parent).
pub fn is_child() -> bool {
    std::env::var_os(CHILD_VAR).is_some()
}

/// A step barrier over the control plane: a round on a channel of its own, on the
/// survivors' exchange once a rank is lost, on the grown group's after a heal. On the
/// victim of `--survive`, the barrier before the fatal step arms its backend.
struct ExchangeBarrier {
    /// The exchange and the barrier's channel on it.
    on: Mutex<(Arc<dyn Exchange>, ChannelId)>,
    timeout: Duration,
    /// The victim's: the step to arm its backend before, and the switch.
    arm: Option<(usize, Arc<AtomicBool>)>,
}

impl ExchangeBarrier {
    /// The exchange the ranks use now.
    fn exchange(&self) -> Arc<dyn Exchange> {
        self.on.lock().0.clone()
    }
}

impl StepSync for ExchangeBarrier {
    fn wait(&self, step: usize) -> Result<()> {
        let (exchange, channel) = self.on.lock().clone();
        let deadline = Deadline::after(self.timeout);
        exchange.all_gather(channel, "fsdp_step step", &[], deadline)?;
        if let Some((at, armed)) = &self.arm
            && *at == step
        {
            armed.store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    fn regrouped(&self, backend: &Backend) -> Result<()> {
        let exchange = backend.exchange_handle();
        let channel = exchange.open_channel("fsdp_step:steps", Deadline::after(self.timeout))?;
        *self.on.lock() = (exchange, channel);
        Ok(())
    }
}

/// Run this process's rank; rank 0 returns the results, the others `None`. A newcomer
/// (`--heal`) is admitted once the survivors grow, and joins their pools.
pub fn run_as_rank(args: &Args) -> Result<Option<Vec<Summary>>> {
    let started = Instant::now();
    let newcomer = heal::is_newcomer();
    let exchange: Arc<dyn Exchange> = Arc::new(StoreExchange::from_env()?);
    let admitted = Instant::now();
    let rank = exchange.rank();
    let timeout = symmpool::GroupConfig::default().timeout;
    let backend = match args.backend {
        #[cfg(feature = "nccl")]
        BackendChoice::Nccl => super::gpu_math::process_backend(exchange.clone(), args.sm_margin)?,
        _ => symmpool::backend::ShmBackend::join(
            exchange.clone(),
            symmpool::backend::ShmConfig::default(),
        )?,
    };
    // `--survive`: the victim's backend kills the process inside a reduce-scatter of
    // the fatal step, once the barrier before that step has armed it.
    let (backend, arm) = match &args.survive {
        Some(s) if s.victim == rank && !newcomer => {
            let (backend, armed) = survive::victim(backend, args.layers, s.kill_at_step);
            (backend, Some((s.kill_at_step, armed)))
        }
        _ => (backend, None),
    };
    // Making pools is collective: every rank makes them in the same order (a newcomer
    // joins them in the order the survivors grow theirs).
    let start = if newcomer {
        let mode = (args.modes[0], args.check);
        Start::Joined(Box::new(heal::join(mode, &backend, (started, admitted))?))
    } else {
        if args.survive.as_ref().is_some_and(|s| s.heal_at.is_some()) {
            heal::state_file()?; // named by the launcher, or no newcomer can come
        }
        Start::New(make_pools(&args.modes, args.check, &backend)?)
    };
    let channel = exchange.open_channel("fsdp_step:steps", Deadline::after(timeout))?;
    let barrier = ExchangeBarrier {
        on: Mutex::new((exchange.clone(), channel)),
        timeout,
        arm,
    };
    let mut summaries = match args.backend {
        #[cfg(feature = "nccl")]
        BackendChoice::Nccl => super::gpu_math::run_process_rank(&backend, start, args, &barrier)?,
        _ => run_one_rank(
            &super::host_math::HostMath::default(),
            start,
            args,
            &barrier,
        )?,
    };
    // After a loss, the survivors' exchange (after a heal, the grown group's).
    let exchange = barrier.exchange();
    if args.survive.as_ref().is_some_and(|s| s.heal_at.is_some()) {
        heal::gather(exchange.as_ref(), &mut summaries)?;
    }
    super::report::gather_memory_map(exchange.as_ref(), args)?;
    super::trace::gather(exchange.as_ref(), args)?;
    Ok((rank == 0).then_some(summaries))
}

/// Print rank 0's results for the parent (`--nproc`).
pub fn report_to_parent(results: &[Summary]) {
    match serde_json::to_string(results) {
        Ok(json) => println!("{SUMMARY}{json}"),
        Err(e) => eprintln!("fsdp_step: cannot encode the summary: {e}"),
    }
}

/// The children of `--nproc`, killed and reaped however this process leaves.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// This program's arguments without `--nproc N`.
fn passthrough_args() -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--nproc" {
            args.next();
        } else if !a.starts_with("--nproc=") {
            out.push(a);
        }
    }
    out
}

/// How long the ranks of a job may take in all (a bound, not an estimate).
const JOB_LIMIT: Duration = Duration::from_secs(30 * 60);
/// After one rank fails, how long the others get to notice and leave on their own
/// (the control plane reports a lost rank within seconds).
const GRACE: Duration = Duration::from_secs(20);

/// A random job identity: 128 bits from the kernel's random source, in hex (or, where
/// it cannot be read, this process's id and the time).
fn random_job_id() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)) {
        Ok(()) => format!("fsdp_step-{}", hex(&bytes)),
        Err(_) => format!(
            "fsdp_step-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ),
    }
}

/// Whether `status` is the planned end of the victim of `--survive`: killed by SIGKILL.
fn lost_as_planned(status: ExitStatus) -> bool {
    status.signal() == Some(libc::SIGKILL)
}

/// The file the survivors hand a newcomer its state in (`--heal`), removed with the job.
struct HealState(std::path::PathBuf);

impl Drop for HealState {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Start `n` processes of this program, one rank each, on 127.0.0.1; return rank 0's
/// results once every rank has finished. `victim`: the rank `--survive` loses on
/// purpose, whose death by SIGKILL is expected (and any other end of it a failure);
/// with `heal`, a replacement is started for it then (`SYMMPOOL_JOIN=1`), and must
/// succeed as every rank.
pub fn spawn_ranks(n: usize, victim: Option<usize>, heal: bool) -> Result<Vec<Summary>> {
    let io = |op: &'static str| {
        move |source: std::io::Error| Error::Transport {
            op,
            detail: "fsdp_step --nproc".into(),
            source: source.into(),
        }
    };
    // A free port for rank 0's store (released just before rank 0 binds it).
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(io("finding a free port"))?
        .port();
    let exe = std::env::current_exe().map_err(io("finding this program"))?;
    // A job identity of its own, so that the ranks of two runs on one port never
    // merge (the store refuses a rank of another job).
    let job_id = random_job_id();
    let heal_state = heal.then(|| HealState(std::env::temp_dir().join(format!("{job_id}.heal"))));
    let mut children = Children(Vec::new());
    // Rank `rank`, or (`join`) the replacement of a lost rank `rank`.
    let start = |rank: usize, join: bool| {
        let mut cmd = Command::new(&exe);
        cmd.args(passthrough_args())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("SYMMPOOL_JOB_ID", &job_id)
            .env(CHILD_VAR, "1")
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .stdout(if rank == 0 && !join {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        if let Some(HealState(path)) = &heal_state {
            cmd.env(heal::STATE_VAR, path);
        }
        if join {
            cmd.env("SYMMPOOL_JOIN", "1");
        }
        let parent = std::process::id();
        // SAFETY: runs in the child between fork and exec, and calls only prctl(2),
        // getppid(2) and _exit(2), which are async-signal-safe.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(move || {
                // A rank dies with the launcher (killed or not), never orphaned...
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // ...including when the launcher died before the line above ran.
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        cmd.spawn().map_err(io("starting a rank"))
    };
    for rank in 0..n {
        children.0.push(start(rank, false)?);
    }
    // Child i is rank i; child n, the replacement of the victim.
    let name = |i: usize| match victim {
        Some(v) if i == n => format!("rank {v} (the replacement)"),
        _ => format!("rank {i}"),
    };
    // Rank 0's output: its step lines go through, its results are kept.
    let out = children.0[0].stdout.take();
    let reader = std::thread::spawn(move || {
        let mut results = None;
        for line in out
            .into_iter()
            .flat_map(|o| BufReader::new(o).lines().map_while(|l| l.ok()))
        {
            match line.strip_prefix(SUMMARY) {
                Some(json) => results = serde_json::from_str::<Vec<Summary>>(json).ok(),
                None => println!("{line}"),
            }
        }
        results
    });
    let started = Instant::now();
    let mut codes: Vec<Option<i32>> = vec![None; n];
    let mut first_failure: Option<Instant> = None;
    let mut planned_loss = false;
    let mut replacement = None;
    while codes.iter().any(Option::is_none) {
        for (rank, c) in children.0.iter_mut().enumerate() {
            if codes[rank].is_none()
                && let Ok(Some(status)) = c.try_wait()
            {
                let planned = victim == Some(rank) && lost_as_planned(status);
                planned_loss |= planned;
                if planned && heal {
                    // As a scheduler: a replacement as soon as the lost rank is gone.
                    replacement = Some(start(rank, true));
                }
                let code = if planned {
                    0
                } else {
                    status.code().unwrap_or(-1)
                };
                codes[rank] = Some(code);
                if code != 0 && first_failure.is_none() {
                    first_failure = Some(Instant::now());
                }
            }
        }
        if let Some(child) = replacement.take() {
            children.0.push(child?);
            codes.push(None);
        }
        let late =
            first_failure.is_some_and(|t| t.elapsed() > GRACE) || started.elapsed() > JOB_LIMIT;
        if late {
            break; // the guard kills what is left
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(children);
    let results = reader.join().ok().flatten();
    let failed: Vec<String> = codes
        .iter()
        .enumerate()
        .filter(|(_, c)| **c != Some(0))
        .map(|(r, c)| match c {
            Some(-1) => format!("{} was killed by a signal", name(r)),
            Some(code) => format!("{} exited with {code}", name(r)),
            None => format!("{} was stopped", name(r)),
        })
        .collect();
    if let [Some(first), rest @ ..] = codes.as_slice()
        && *first > 0
        && rest.iter().all(|c| *c == Some(*first))
    {
        // Every rank failed the same way (a missing library, a bad setting): its exit
        // status says what, no rank was lost.
        eprintln!("fsdp_step --nproc: every rank exited with {first} (see their messages above)");
        std::process::exit(*first);
    }
    if !failed.is_empty() {
        // The rank to name: one killed by a signal (the others fail because of it),
        // else the first that failed, else one still running when the job was ended.
        let lost = codes
            .iter()
            .position(|c| *c == Some(-1))
            .or_else(|| {
                codes
                    .iter()
                    .position(|c| matches!(c, Some(code) if *code != 0))
            })
            .or_else(|| codes.iter().position(Option::is_none))
            .unwrap_or(0);
        let lost = victim.filter(|_| lost == n).unwrap_or(lost);
        return Err(Error::PeerLost {
            rank: lost,
            op: "fsdp_step --nproc",
            detail: format!("{} (see the ranks' messages above)", failed.join(", ")),
        });
    }
    if let Some(v) = victim.filter(|_| !planned_loss) {
        return Err(Error::Internal {
            what: format!("rank {v} was to kill itself (--survive) but exited with 0"),
        });
    }
    results.ok_or_else(|| Error::InvalidConfig("rank 0 reported no results".into()))
}
