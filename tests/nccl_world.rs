//! `scripts/nccl-world.sh` and the trials of `examples/nccl_world.rs`, without a GPU:
//! the script's ranks, logs, process ids, exit codes, bound and fault injection on
//! small shell commands; then the trials on the shared-memory backend, as ranks of
//! worlds the script starts (this test binary re-executes itself as every rank, running
//! [`rank_entry`]), the faults included: `kill -9` of rank 1 and of rank 0 (which hosts
//! the store) inside a collective and inside a registration, and `SIGSTOP` of a rank.
//! The same trials run on NCCL in the GPU check (`scripts/gpu-check.sh run world`).
#![cfg(target_os = "linux")]

#[allow(dead_code)]
#[path = "../examples/nccl_world.rs"]
mod nccl_world;

#[path = "../examples/fsdp_step/main.rs"]
#[allow(dead_code, unreachable_pub, unused_imports)]
mod fsdp_step;

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Set in a rank: the trials' arguments (space-separated).
const ARGS: &str = "NCCL_WORLD_TEST_ARGS";

/// A rank of a world the script started: run the trials of `$NCCL_WORLD_TEST_ARGS` and
/// exit with their status (a no-op in an ordinary test run).
#[test]
fn rank_entry() {
    let Ok(args) = std::env::var(ARGS) else {
        return;
    };
    let cli =
        nccl_world::Cli::parse_from(std::iter::once("nccl_world").chain(args.split_whitespace()));
    let code = match nccl_world::run(&cli) {
        Ok(()) => 0,
        Err(e) => {
            let rank = std::env::var("RANK").unwrap_or_default();
            println!("[rank {rank}] FAILED: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Set in a rank of the example's world: its `--check` (every mode runs).
const FSDP: &str = "NCCL_WORLD_TEST_FSDP_CHECK";

/// A rank of the example, every mode (`--compare`) as one process per rank, as the
/// GPU check runs it on NCCL: rank 0 prints each mode's losses (a no-op in an
/// ordinary test run).
#[test]
fn fsdp_rank_entry() {
    let Ok(check) = std::env::var(FSDP) else {
        return;
    };
    let mut args = fsdp_step::Args::host(fsdp_step::Mode::COMPARED.to_vec());
    args.ranks = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    args.hidden = 48; // 48² splits over 2 and 3 ranks
    args.steps = 4;
    args.check = clap::ValueEnum::from_str(&check, false).unwrap();
    args.processes = true;
    let code = match fsdp_step::launch::run_as_rank(&args) {
        Ok(Some(results)) => {
            for r in &results {
                println!("@@losses {} {:?}", r.mode.name(), r.losses);
            }
            i32::from(fsdp_step::check(&results).is_err())
        }
        Ok(None) => 0,
        Err(e) => {
            println!("@@error {e}");
            1
        }
    };
    std::process::exit(code);
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/nccl-world.sh")
}

/// A fresh folder for one world, removed when dropped.
struct Folder(PathBuf);

impl Folder {
    fn new(name: &str) -> Folder {
        let dir =
            std::env::temp_dir().join(format!("nccl-world-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Folder(dir)
    }

    fn log(&self, rank: usize) -> String {
        std::fs::read_to_string(self.0.join(format!("rank{rank}.log"))).unwrap_or_default()
    }

    fn pid(&self, rank: usize) -> u32 {
        let text = std::fs::read_to_string(self.0.join(format!("rank{rank}.pid"))).unwrap();
        text.trim().parse().unwrap()
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run the script (`options`, then `--`, then `command`) with `env`: its exit code and
/// output, and how long it took. The script bounds the world itself (`-t`).
fn world(
    dir: &Folder,
    options: &[&str],
    env: &[(&str, String)],
    command: &[&str],
) -> (i32, String, Duration) {
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(script())
        .args(["-d", dir.0.to_str().unwrap()])
        .args(options)
        .arg("--")
        .args(command)
        .env_remove(ARGS)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("bash runs the script");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text, t0.elapsed())
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

#[test]
fn the_script_starts_ranks_with_the_launchers_variables_and_reports_each() {
    let dir = Folder::new("basics");
    let rank = "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE \
                host=$NCCL_HOSTID addr=$MASTER_ADDR port=$MASTER_PORT job=$SYMMPOOL_JOB_ID \
                pid=$$ dir=$SYMMPOOL_WORLD_DIR; [ $RANK != 2 ] || exit 3";
    let (code, out, _) = world(&dir, &["-n", "3", "-t", "60"], &[], &["sh", "-c", rank]);
    assert_eq!(code, 1, "rank 2 failed, so the world did: {out}");
    let mut port = None;
    for r in 0..3 {
        let log = dir.log(r);
        let pid = dir.pid(r);
        for want in [
            format!("rank={r} world=3 local={r}/3 host=simnode{r} addr=127.0.0.1 port="),
            format!("pid={pid} dir={}", dir.0.display()),
        ] {
            assert!(log.contains(&want), "rank {r}: {log}");
        }
        let p = log
            .split("port=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap();
        assert!(port.is_none_or(|q| q == p), "one port for all: {log}");
        port = Some(p.to_string());
        let status = if r == 2 { "exit 3" } else { "exit 0" };
        assert!(
            out.contains(&format!("rank {r} (pid {pid}): {status}")),
            "{out}"
        );
    }
    // --same-node leaves NCCL_HOSTID alone.
    let (code, _, _) = world(
        &dir,
        &["-n", "2", "--same-node"],
        &[],
        &["sh", "-c", "echo host=${NCCL_HOSTID:-none}"],
    );
    assert_eq!(code, 0);
    assert!(dir.log(1).contains("host=none"), "{}", dir.log(1));
}

#[test]
fn the_script_kills_every_rank_past_its_bound() {
    let dir = Folder::new("bound");
    let (code, out, took) = world(&dir, &["-n", "2", "-t", "2"], &[], &["sleep", "60"]);
    assert_eq!(code, 124, "{out}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert!(out.contains("still running after 2 s; killed"), "{out}");
    for r in 0..2 {
        assert!(!alive(dir.pid(r)), "rank {r} was left running");
    }
}

#[test]
fn the_script_signals_the_victims_own_process_at_the_point() {
    // Rank 0 marks the point, waits a little and exits; rank 1 waits to be signalled.
    let rank = "if [ $RANK = 0 ]; then touch $SYMMPOOL_WORLD_DIR/fault-point; \
                while [ ! -e $SYMMPOOL_WORLD_DIR/fault-at ]; do sleep 0.05; done; \
                echo fault=$SYMMPOOL_WORLD_FAULT; else exec sleep 60; fi";
    for (sig, said) in [
        ("KILL", "killed by SIGKILL"),
        ("STOP", "still stopped once the others were done; killed"),
    ] {
        let dir = Folder::new(sig);
        let fault = format!("{sig}:1");
        let opts = ["-n", "2", "-t", "60", "--fault", fault.as_str()];
        let (code, out, took) = world(&dir, &opts, &[], &["sh", "-c", rank]);
        assert_eq!(code, 0, "{out}");
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(
            out.contains(&format!("rank 1 (pid {}): {said}", dir.pid(1))),
            "{out}"
        );
        assert!(
            dir.log(0).contains(&format!("fault={sig}:1")),
            "{}",
            dir.log(0)
        );
        let at: f64 = std::fs::read_to_string(dir.0.join("fault-at"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(at > 1e9, "seconds since the epoch: {at}");
        assert!(!alive(dir.pid(1)));
    }
    // A world that never reaches the point fails (and is not left running).
    let dir = Folder::new("no-point");
    let opts = ["-n", "2", "-t", "60", "--fault", "KILL:1"];
    let (code, out, _) = world(&dir, &opts, &[], &["sh", "-c", "exit 0"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("never reached the fault's point"), "{out}");
}

/// Run the trials `args` on `ranks` ranks of the shared-memory backend (this binary
/// as every rank), `fault` injected; the script's output.
fn trials(name: &str, ranks: usize, args: &str, fault: Option<&str>) -> (Folder, String) {
    let dir = Folder::new(name);
    let exe = std::env::current_exe().unwrap();
    let n = ranks.to_string();
    let mut opts = vec!["-n", n.as_str(), "-t", "240"];
    if let Some(f) = fault {
        opts.extend(["--fault", f]);
    }
    let env = [
        (ARGS, format!("--backend shm {args}")),
        // A frozen rank is lost after 1 s here (5 s by default), and the bounds get
        // 4 s of slack for a busy machine.
        ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "1000".into()),
        ("SYMMPOOL_HEARTBEAT_INTERVAL_MS", "200".into()),
        ("SYMMPOOL_WORLD_SLACK_MS", "4000".into()),
    ];
    let command = [
        exe.to_str().unwrap(),
        "rank_entry",
        "--exact",
        "--nocapture",
    ];
    let (code, out, took) = world(&dir, &opts, &env, &command);
    let logs: String = (0..ranks).map(|r| dir.log(r)).collect();
    assert_eq!(code, 0, "{name} ({took:?}): {out}\n{logs}");
    (dir, out)
}

#[test]
fn the_trials_pass_on_two_and_three_ranks_of_the_host_backend() {
    for ranks in [2, 3] {
        let args = "collectives two-pools graph hostcost";
        let (dir, _) = trials(&format!("trials{ranks}"), ranks, args, None);
        for r in 0..ranks {
            let log = dir.log(r);
            for want in [
                "RESULT collectives ok",
                "RESULT two-pools ok",
                "RESULT graph skipped",
                "RESULT hostcost skipped",
                // The script's pid file is the rank's own process.
                &format!("pid {}", dir.pid(r)),
            ] {
                assert!(
                    log.contains(want),
                    "rank {r} of {ranks}: {want:?} in\n{log}"
                );
            }
        }
    }
}

#[test]
fn a_lost_rank_ends_the_others_calls_with_peer_lost_naming_it() {
    for (trial, fault) in [
        ("fault-collective", "KILL:1"),
        ("fault-collective", "KILL:0"),
        ("fault-registration", "KILL:1"),
        ("fault-registration", "KILL:0"),
        ("fault-collective", "STOP:1"),
    ] {
        let name = format!("{trial}-{}", fault.replace(':', "-"));
        let (sig, victim) = fault.split_once(':').unwrap();
        let (dir, out) = trials(&name, 2, trial, Some(fault));
        let survivor = 1 - victim.parse::<usize>().unwrap();
        let log = dir.log(survivor);
        let kind = trial.trim_start_matches("fault-");
        let want = format!(
            "RESULT fault-{kind} SIG{sig} of rank {victim}: ok kind=peer_lost names={victim} "
        );
        assert!(log.contains(&want), "{name}: {want:?} in\n{log}\n{out}");
    }
}

#[test]
fn the_survivors_of_a_rank_killed_in_a_collective_shrink_and_gather_again() {
    let (dir, out) = trials("fault-shrink-KILL-1", 3, "fault-shrink", Some("KILL:1"));
    for (r, new) in [(0, 0), (2, 1)] {
        let log = dir.log(r);
        let want = format!(
            "RESULT fault-shrink SIGKILL of rank 1: ok rank={r}->{new} world=3->2 lost=[1] "
        );
        assert!(log.contains(&want), "{want:?} in\n{log}\n{out}");
    }
}

#[test]
fn compare_losses_accepts_equal_runs_and_names_a_diverging_one() {
    let dir = Folder::new("losses");
    let line = |backend: &str, mode: &str, losses: &[f64]| {
        format!(
            "{{\"backend\":\"{backend}\",\"check\":\"off\",\"mode\":\"{mode}\",\"losses\":{losses:?}}}\n"
        )
    };
    let host = dir.0.join("host.log");
    let near = dir.0.join("near.log");
    let far = dir.0.join("far.log");
    std::fs::write(&host, line("host", "ring", &[1.0, 0.5, 0.25])).unwrap();
    let near_text = "noise\n".to_string()
        + &line("nccl", "ring", &[1.01, 0.51, 0.26])
        + &line("nccl", "auto", &[1.01, 0.51, 0.26])
        + &line("nccl", "none", &[9.0, 9.0, 9.0]);
    std::fs::write(&near, near_text).unwrap();
    let far_text =
        line("nccl", "ring", &[1.0, 0.5, 0.25]) + &line("nccl", "auto", &[1.0, 0.5, 0.3]);
    std::fs::write(&far, far_text).unwrap();
    let run = |files: &[&PathBuf]| {
        let mut args = vec!["nccl_world", "compare-losses", "--tolerance", "0.1"];
        for f in files {
            args.extend(["--losses", f.to_str().unwrap()]);
        }
        nccl_world::run(&nccl_world::Cli::parse_from(args))
    };
    assert_eq!(run(&[&host, &near]), Ok(()));
    let e = run(&[&host, &far]).unwrap_err();
    assert!(e.contains("far.log nccl check off auto"), "{e}");
    assert!(run(&[&host]).is_ok());
}

#[test]
fn the_example_trains_every_mode_as_one_process_per_rank() {
    // Every mode's pools on one backend per rank: each mode needs its own communicator
    // set (one collectives handle per set), or the second mode fails at its handle.
    let exe = std::env::current_exe().unwrap();
    let command = [
        exe.to_str().unwrap(),
        "fsdp_rank_entry",
        "--exact",
        "--nocapture",
    ];
    for (ranks, check) in [("2", "strict"), ("3", "off")] {
        let dir = Folder::new(&format!("fsdp-{ranks}"));
        let env = [(FSDP, check.to_string())];
        let (code, out, _) = world(&dir, &["-n", ranks, "-t", "240"], &env, &command);
        let log = dir.log(0);
        assert_eq!(code, 0, "{out}\n{log}\n{}", dir.log(1));
        let losses: Vec<&str> = (log.lines())
            .filter_map(|l| l.strip_prefix("@@losses "))
            .collect();
        assert_eq!(losses.len(), 5, "{log}");
        let trained: Vec<&str> = (losses.iter())
            .filter(|l| !l.starts_with("none "))
            .map(|l| l.split_once(' ').unwrap().1)
            .collect();
        assert!(trained.iter().all(|l| *l == trained[0]), "{losses:?}");
    }
}
