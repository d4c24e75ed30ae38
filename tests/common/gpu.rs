//! Helpers for the GPU tests: trials that declare how many GPUs they need and are
//! reported as *ignored*, with the reason, where the machine has fewer; and local NCCL
//! worlds. `SYMMPOOL_REQUIRE_GPU=1` (set by the GPU check) turns every such skip into
//! a failure.

#![cfg(feature = "nccl")]

use libtest_mimic::{Completion, Failed, Trial};
use std::sync::OnceLock;
use symmpool::backend::{NcclBackend, NcclConfig};
use symmpool::{Group, GroupConfig, PoolConfig, Stream, SymmPool};

/// GPUs visible with a working driver and NCCL, or why none are usable.
pub fn gpus() -> Result<usize, String> {
    static FOUND: OnceLock<Result<usize, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let n = symmpool::backend::nccl::device_count().map_err(|e| e.to_string())?;
            symmpool::backend::nccl::nccl_version().map_err(|e| e.to_string())?;
            Ok(n)
        })
        .clone()
}

/// Whether skips are failures here (`SYMMPOOL_REQUIRE_GPU=1`).
pub fn required() -> bool {
    std::env::var("SYMMPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// A trial that needs `need` GPUs: ignored with the reason where there are fewer
/// (a failure under `SYMMPOOL_REQUIRE_GPU=1`); a panic in `f` is a failure.
pub fn trial(name: &str, need: usize, f: fn()) -> Trial {
    let name = format!("{name} ({need} GPU{})", if need == 1 { "" } else { "s" });
    Trial::ignorable_test(name, move || {
        let reason = match gpus() {
            Ok(n) if n >= need => None,
            Ok(n) => Some(format!("needs {need} GPUs, found {n}")),
            Err(e) => Some(format!("no usable GPU: {e}")),
        };
        match reason {
            Some(r) if required() => Err(Failed::from(format!("SYMMPOOL_REQUIRE_GPU=1 but {r}"))),
            Some(r) => Ok(Completion::ignored_with(r)),
            None => {
                f();
                Ok(Completion::Completed)
            }
        }
    })
}

/// One pool per GPU `0..n` (one rank per GPU, threads of this process), each in a
/// group of its own rank made with `group` (`pool.group()`).
///
/// # Panics
/// If NCCL cannot build the world (the trial checked the GPUs first).
pub fn world(n: usize, group: &GroupConfig, config: PoolConfig) -> Vec<SymmPool> {
    let devices: Vec<usize> = (0..n).collect();
    let backends = NcclBackend::local_world(&devices, NcclConfig::default()).expect("NCCL world");
    let groups = Group::world(backends, group).expect("groups");
    SymmPool::world(&groups, &config).expect("pools")
}

/// Run `f(pool, stream)` on one thread per rank with a fresh stream each.
pub fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool, &Stream) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let f = &f;
                s.spawn(move || {
                    let stream = p.new_stream().expect("stream");
                    f(p, &stream)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// The variable that makes the GPU test binary run one rank of a multi-process
/// scenario instead of its trials (see [`spawn_ranks`]).
pub const CHILD_VAR: &str = "SYMMPOOL_GPU_CHILD";

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Rank processes of one scenario; every one still running is killed (SIGKILL) and
/// reaped on drop, so no path of a test leaves a child behind.
pub struct Ranks {
    children: Vec<(usize, std::process::Child)>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<_> = self.children.iter().map(|(r, c)| (r, c.id())).collect();
        write!(f, "Ranks({ids:?})")
    }
}

/// Start `world` copies of this test binary as ranks `0..world` of `scenario`, with
/// torchrun's variables (`RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR
/// MASTER_PORT`, a fresh port on 127.0.0.1) and `CUDA_VISIBLE_DEVICES` unset, so that
/// `LOCAL_RANK` picks the GPU. Their output goes to the test's.
pub fn spawn_ranks(scenario: &str, world: usize) -> Ranks {
    let exe = std::env::current_exe().expect("the test binary");
    let port = free_port().to_string();
    let mut ranks = Ranks {
        children: Vec::new(),
    };
    for rank in 0..world {
        let child = std::process::Command::new(&exe)
            .env(CHILD_VAR, scenario)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("SLURM_PROCID")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("spawn a rank");
        ranks.children.push((rank, child));
    }
    ranks
}

impl Ranks {
    /// Wait for every rank to exit, at most `bound`; past it, kill them all and panic.
    /// Returns each rank's exit status, in rank order.
    pub fn wait(mut self, bound: std::time::Duration) -> Vec<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + bound;
        let mut done: Vec<Option<std::process::ExitStatus>> = vec![None; self.children.len()];
        loop {
            for (i, (_, child)) in self.children.iter_mut().enumerate() {
                if done[i].is_none() {
                    done[i] = child.try_wait().expect("try_wait");
                }
            }
            if done.iter().all(Option::is_some) {
                self.children.clear();
                return done.into_iter().map(Option::unwrap).collect();
            }
            if std::time::Instant::now() >= deadline {
                let running: Vec<usize> = done
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| d.is_none())
                    .map(|(r, _)| r)
                    .collect();
                for &r in &running {
                    print_stacks(r, self.children[r].1.id());
                }
                drop(self); // kills and reaps
                panic!("ranks {running:?} still running after {bound:?}: killed");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// Where a rank that overran its bound is stuck: every thread's stack, from
/// `cuda-gdb` (the GPU machine has it; no gdb there), bounded by `timeout(1)`. Nothing
/// where it is missing.
fn print_stacks(rank: usize, pid: u32) {
    let out = std::process::Command::new("timeout")
        .args(["60", "cuda-gdb", "-p", &pid.to_string(), "-batch"])
        .args(["-ex", "thread apply all bt 25"])
        .stdin(std::process::Stdio::null())
        .output();
    if let Ok(out) = out
        .as_ref()
        .map(|o| &o.stdout)
        .map(|b| String::from_utf8_lossy(b))
        && !out.trim().is_empty()
    {
        eprintln!("---- rank {rank} (pid {pid}): stacks\n{out}");
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// libtest's command line with any number of name filters, as libtest takes them
/// (`cargo test --test gpu -- all_gather reduce_scatter` runs the trials whose names
/// contain either): libtest-mimic takes one, so the filters are taken out before it
/// parses the rest, and applied by [`keep_filtered`].
pub fn arguments(mut raw: impl Iterator<Item = String>) -> (libtest_mimic::Arguments, Vec<String>) {
    // The options that take a value (libtest-mimic 0.8).
    const VALUED: [&str; 6] = [
        "--test-threads",
        "--logfile",
        "--skip",
        "--color",
        "--format",
        "-Z",
    ];
    let mut rest: Vec<String> = raw.next().into_iter().collect(); // the program
    let mut filters = Vec::new();
    while let Some(a) = raw.next() {
        if VALUED.contains(&a.as_str()) {
            rest.push(a);
            rest.extend(raw.next());
        } else if a.starts_with('-') {
            rest.push(a);
        } else {
            filters.push(a);
        }
    }
    (libtest_mimic::Arguments::from_iter(rest), filters)
}

/// Keep the trials whose names match one of `filters` (all of them when there is none).
pub fn keep_filtered(trials: &mut Vec<Trial>, filters: &[String], exact: bool) {
    if filters.is_empty() {
        return;
    }
    trials.retain(|t| {
        (filters.iter()).any(|f| {
            if exact {
                t.name() == f
            } else {
                t.name().contains(f.as_str())
            }
        })
    });
}
