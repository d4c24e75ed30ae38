//! How ranks are started here: one thread per rank in this process ([`run_threads`]:
//! on the host backend, [`run_host`], or on local GPUs, `gpu_math::run`), and a barrier
//! that lines them up before each step. (Ranks as processes, `--nproc`, are in
//! `launch.rs` beside this, calling the same `run::run_one_rank`.)

use super::cli::{Args, BackendChoice, Cli, Mode};
use super::host_math::HostMath;
use super::report::{self, Summary};
use super::run::{Start, run_one_rank};
use super::{make_group, pool_config};
use parking_lot::{Condvar, Mutex};
use symmpool::{Backend, Deadline, Error, HostBackend, HostConfig, Result, SymmPool};

/// What lines the ranks up before each step: a [`StepBarrier`] for threads, a round
/// on the control plane for processes (`launch.rs`).
pub trait StepSync: Sync {
    /// Wait for every rank, before step `step`.
    ///
    /// # Errors
    /// The barrier is broken (a rank failed, or was lost).
    fn wait(&self, step: usize) -> Result<()>;

    /// Go on in the group the pools moved to, over `backend`: the survivors of a lost
    /// rank after the shrink, or the grown group after a heal (collective: every rank
    /// of that group, once its pools are shrunk, grown or joined).
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`] where the ranks cannot lose one (threads); the
    /// exchange's errors.
    fn regrouped(&self, backend: &Backend) -> Result<()> {
        let _ = backend;
        Err(Error::ShrinkFailed {
            reason: "ranks as threads cannot lose one".into(),
            retry: false,
        })
    }
}

impl StepSync for StepBarrier {
    fn wait(&self, _step: usize) -> Result<()> {
        StepBarrier::wait(self)
    }
}

/// A barrier that a failing rank breaks, so the other ranks stop instead of waiting
/// for it forever (`std::sync::Barrier` cannot be broken).
#[derive(Debug)]
pub struct StepBarrier {
    n: usize,
    /// (ranks arrived, generation, the rank that gave up).
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

    /// Wait for every rank; fails once a rank has given up, or after the pools'
    /// default timeout (a rank that neither arrives nor fails).
    pub fn wait(&self) -> Result<()> {
        let broken = |rank| Error::GroupBroken {
            rank,
            op: "fsdp_step",
        };
        let timeout = symmpool::GroupConfig::default().timeout;
        let deadline = Deadline::after(timeout);
        let mut st = self.state.lock();
        if let Some(rank) = st.2 {
            return Err(broken(rank));
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
            if self.cv.wait_until(&mut st, deadline.instant()).timed_out()
                && st.1 == generation
                && st.2.is_none()
            {
                return Err(Error::Timeout {
                    op: "fsdp_step: the step barrier",
                    waited: timeout,
                    missing_ranks: Vec::new(),
                });
            }
        }
        match st.2 {
            Some(rank) if st.1 == generation => Err(broken(rank)),
            _ => Ok(()),
        }
    }

    /// Give up: every waiting and later `wait` fails.
    pub fn abort(&self, rank: usize) {
        let mut st = self.state.lock();
        st.2.get_or_insert(rank);
        self.cv.notify_all();
    }
}

/// Run `f` for rank `r` on thread `r`, with `items[r]`. A rank that fails breaks the
/// barrier so the others stop too. Returns rank 0's result or the first error.
pub fn on_rank_threads<T: Send, R: Send>(
    items: Vec<T>,
    barrier: &StepBarrier,
    f: impl Fn(T) -> Result<R> + Sync,
) -> Result<R> {
    let outs: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
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
        handles
            .into_iter()
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

/// Ranks as threads of this process (a test harness).
pub fn run_threads(cli: &Cli, args: &Args) -> Result<Vec<Summary>> {
    match args.backend {
        #[cfg(feature = "nccl")]
        BackendChoice::Nccl => super::gpu_math::run(args),
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
            .map(|(mode, backend)| {
                let group = make_group(args.check, backend)?;
                Ok((mode, SymmPool::new(&group, pool_config(mode))?))
            })
            .collect::<Result<Vec<_>>>()?;
        run_one_rank(&HostMath::default(), Start::New(pools), args, &barrier)
    })
}
