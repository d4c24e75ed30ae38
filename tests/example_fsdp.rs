//! The FSDP example on the host backend: the loss falls, every mode follows the same
//! trajectory, nothing registers after the first step, `--json` has every field, and
//! the collectives carry their identity (tags and `end_step`) under every check.

#[path = "../examples/fsdp_step/main.rs"]
#[allow(dead_code, unreachable_pub)]
mod fsdp_step;

use fsdp_step::{Args, Calibrate, Check, Mode, Spread, Summary, check, run_host};

#[test]
fn every_mode_learns_the_same_trajectory() {
    let args = Args::host(Mode::ALL.to_vec());
    let results = run_host(&args).unwrap();
    check(&results).unwrap();
    assert_eq!(results.len(), 4);
    let base = &results[0].losses;
    assert_eq!(base.len(), args.steps);
    assert!(
        base[args.steps - 1] < base[0] / 100.0,
        "loss fell by 100x: {base:?}"
    );
    for r in &results {
        // f32 on the host, same sums in the same order: equal up to rounding.
        let diffs: Vec<f64> = (r.losses.iter().zip(base))
            .map(|(a, b)| ((a - b) / b).abs() as f64)
            .collect();
        assert!(
            Spread::of(&diffs).max < 1e-5,
            "{:?}: {:?}",
            r.mode,
            r.losses
        );
        assert_eq!(r.registrations_after_first_step, 0);
    }
    let paths = |m: Mode| {
        let r = results.iter().find(|r| r.mode == m).unwrap();
        (
            r.all_gather_paths.as_str(),
            r.reduce_scatter_paths.as_str(),
            r.registrations,
        )
    };
    assert_eq!(paths(Mode::Ring), ("PlainKernel", "PlainKernel", 0));
    assert_eq!(paths(Mode::Symm).0, "SymmetricKernel");
    assert_eq!(paths(Mode::Ce).0, "CopyEngine");
    assert!(paths(Mode::Auto).2 > 0);
}

#[test]
fn auto_calibrates_when_asked_and_the_fixed_modes_do_not() {
    // On the host backend symmpool says no calibration is needed: none by default.
    let args = Args {
        steps: 4,
        ..Args::host(Mode::COMPARED.to_vec())
    };
    let results = run_host(&args).unwrap();
    assert!(results.iter().all(|r| r.calibration.is_none()));
    // `--calibrate always`: auto measures the paths over the run's one size (the
    // shard, hidden² / ranks f32s) and takes the fastest; the others keep theirs.
    let args = Args {
        calibrate: Calibrate::Always,
        ..args
    };
    let results = run_host(&args).unwrap();
    check(&results).unwrap();
    for r in &results {
        let Some(c) = &r.calibration else {
            assert_ne!(r.mode, Mode::Auto);
            continue;
        };
        assert_eq!(r.mode, Mode::Auto);
        let shard = (args.hidden * args.hidden / args.ranks * 4) as u64;
        assert_eq!(
            (c.reason.as_str(), c.min_bytes, c.max_bytes),
            ("asked", shard, shard)
        );
        assert!(
            c.line().starts_with("calibrated (asked): all-gather: "),
            "{}",
            c.line()
        );
        // One size measured: each collective takes one path at every size.
        assert!(matches!(c.plain_all_gather_bands[..], [] | [(0, u64::MAX)]));
        let json = serde_json::to_string(r).unwrap();
        assert!(
            json.contains("\"calibration\":{\"reason\":\"asked\""),
            "{json}"
        );
    }
    let paths = |m: Mode| {
        let r = results.iter().find(|r| r.mode == m).unwrap();
        (r.all_gather_paths.clone(), r.reduce_scatter_paths.clone())
    };
    assert_eq!(
        paths(Mode::Ring),
        ("PlainKernel".into(), "PlainKernel".into())
    );
    assert_eq!(paths(Mode::Symm).0, "SymmetricKernel");
    assert_eq!(paths(Mode::Ce).0, "CopyEngine");
    // Auto's paths are those its calibrated policy picks at the shard's size.
    let auto = results.iter().find(|r| r.mode == Mode::Auto).unwrap();
    let c = auto.calibration.as_ref().unwrap();
    let want_ag = if !c.plain_all_gather_bands.is_empty() {
        "PlainKernel"
    } else if c.ce_all_gather_min_bytes == 0 {
        "CopyEngine"
    } else {
        "SymmetricKernel"
    };
    let want_rs = if c.symmetric_reduce_scatter_bands.is_empty() {
        "PlainKernel"
    } else {
        "SymmetricKernel"
    };
    assert_eq!(paths(Mode::Auto), (want_ag.into(), want_rs.into()));
}

#[test]
fn the_none_mode_runs_the_step_without_collectives() {
    let args = Args {
        steps: 4,
        ..Args::host(Mode::COMPARED.to_vec())
    };
    let results = run_host(&args).unwrap();
    check(&results).unwrap();
    let none = results.iter().find(|r| r.mode == Mode::None).unwrap();
    // No collective ran, nothing registered, and its meaningless losses are zeros
    // (finite, so the summary survives JSON).
    assert_eq!(
        (
            none.all_gather_paths.as_str(),
            none.reduce_scatter_paths.as_str()
        ),
        ("", "")
    );
    assert_eq!(none.registrations, 0);
    assert!(none.losses.iter().all(|&l| l == 0.0), "{:?}", none.losses);
    let back: Summary = serde_json::from_str(&serde_json::to_string(none).unwrap()).unwrap();
    assert_eq!(back.losses, none.losses);
    // Every mode carries its step time over ring's and none's (none's own is 1).
    assert_eq!(none.over_none, Some(1.0));
    let auto = results.iter().find(|r| r.mode == Mode::Auto).unwrap();
    let v = serde_json::to_value(auto).unwrap();
    let (over_ring, over_none) = (v["over_ring"].as_f64(), v["over_none"].as_f64());
    assert!(
        over_ring.is_some_and(|x| x > 0.0) && over_none.is_some_and(|x| x > 0.0),
        "{v}"
    );
    // The communicating modes still agree, `none` left out.
    assert!(fsdp_step::loss_disagreement(&results) < 1e-5);
}

#[test]
fn json_summary_has_every_field() {
    let args = Args {
        steps: 5,
        ..Args::host(vec![Mode::Auto])
    };
    let results = run_host(&args).unwrap();
    let v = serde_json::to_value(&results[0]).unwrap();
    for key in [
        "backend",
        "ranks",
        "mode",
        "steps",
        "sm_margin",
        "median_step_ms",
        "first_loss",
        "last_loss",
        "registrations",
        "registrations_first_step",
        "registrations_after_first_step",
        "segments",
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "all_gather_paths",
        "reduce_scatter_paths",
        "calibration",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    // No calibration on the host backend unless asked (`--calibrate always`).
    assert_eq!(v["calibration"], serde_json::Value::Null);
    assert_eq!(v["backend"], "host");
    assert_eq!(v["mode"], "auto");
    assert_eq!(v["registrations_after_first_step"], 0);
    assert!(
        v["peak_reserved_bytes"].as_u64().unwrap() >= v["peak_allocated_bytes"].as_u64().unwrap()
    );
    // A launcher of rank processes reads the summaries back.
    let back: Summary = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(
        (back.mode, back.losses),
        (Mode::Auto, results[0].losses.clone())
    );
    // The median is over the steps after the first (which grows the pool).
    let later = Spread::of(&results[0].step_ms[1..]);
    assert_eq!(v["median_step_ms"].as_f64().unwrap(), later.median);
}

#[test]
fn the_summary_says_how_the_collectives_know_who_they_are() {
    let args = Args {
        steps: 3,
        ..Args::host(vec![Mode::Auto, Mode::None])
    };
    let results = run_host(&args).unwrap();
    check(&results).unwrap();
    let json = |m: Mode| serde_json::to_value(results.iter().find(|r| r.mode == m)).unwrap();
    let (auto, none) = (json(Mode::Auto), json(Mode::None));
    assert_eq!(auto["identity"], "tags (step, layer, op) + end_step");
    assert_eq!(auto["check"], "async");
    assert_eq!(none["identity"], "no collectives");
    assert_eq!(
        fsdp_step::identity_line(&results),
        "tags (step, layer, op) + end_step, check async; none: no collectives"
    );
    // A run of `none` alone issues no collective, and says so.
    let alone = run_host(&Args {
        steps: 2,
        ..Args::host(vec![Mode::None])
    })
    .unwrap();
    assert_eq!(fsdp_step::identity_line(&alone), "no collectives");
    // One rank has no peer to compare with: the check runs as off, and the line says so.
    let one = run_host(&Args {
        steps: 2,
        ranks: 1,
        check: Check::Strict,
        ..Args::host(vec![Mode::Auto])
    })
    .unwrap();
    assert_eq!(
        fsdp_step::identity_line(&one),
        "tags (step, layer, op) + end_step, check off (one rank)"
    );
}

#[test]
fn strict_and_async_checks_train_with_equal_losses_on_threads() {
    let losses = |mode: Check| {
        let args = Args {
            steps: 5,
            check: mode,
            ..Args::host(vec![Mode::Auto, Mode::Symm])
        };
        let results = run_host(&args).unwrap();
        check(&results).unwrap();
        assert!(results.iter().all(|r| r.check == mode));
        assert_eq!(results[0].losses, results[1].losses, "{mode:?}");
        results[0].losses.clone()
    };
    let off = losses(Check::Off);
    // f32 on the host, the same sums in the same order: the checks change nothing.
    assert_eq!(losses(Check::Strict), off);
    assert_eq!(losses(Check::Async), off);
}

#[test]
fn strict_and_async_checks_train_with_equal_losses_as_processes() {
    let run = |mode: &str| {
        let mut job = Job::start_on_free_port("example_rank_entry", 2, |_| {
            vec![("CHILD_STEPS", "5".into()), ("CHILD_CHECK", mode.into())]
        });
        let codes = job.wait(&[0, 1], Duration::from_secs(120));
        assert_eq!(codes, vec![0, 0], "{mode}: {:?}", job.seen);
        let identity = job.expect(0, "identity: ", Duration::from_secs(5));
        assert_eq!(
            identity,
            format!("tags (step, layer, op) + end_step, check {mode}")
        );
        let losses = job.expect(0, "@@losses ", Duration::from_secs(5));
        serde_json::from_str::<Vec<f32>>(&losses).unwrap()
    };
    let strict = run("strict");
    assert_eq!(strict.len(), 5);
    assert!(strict[4] < strict[0], "the loss fell: {strict:?}");
    assert_eq!(run("async"), strict);
}

#[test]
fn spread_of_a_sample() {
    let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]);
    assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
    assert_eq!(Spread::of(&[4.0, 1.0, 2.0]).median, 2.0);
    assert!(Spread::of(&[]).median.is_nan());
}

mod common;

use common::procs::{CHILD, Job};
use std::time::{Duration, Instant};

/// The child role: one rank of the example, from the launcher-style environment.
#[test]
fn example_rank_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    let mut args = Args::host(vec![Mode::Auto]);
    args.ranks = world;
    args.hidden = 48; // 48² splits over 2, 3, 4 and 6 ranks
    args.steps = std::env::var("CHILD_STEPS").map_or(30, |s| s.parse().unwrap());
    if let Ok(c) = std::env::var("CHILD_CHECK") {
        args.check = clap::ValueEnum::from_str(&c, false).unwrap();
    }
    args.quiet = false;
    args.processes = true;
    let code = match fsdp_step::launch::run_as_rank(&args) {
        Ok(Some(results)) => {
            check(&results).unwrap();
            // The summary as the example prints it (its text), and the losses.
            fsdp_step::print(&args, &results);
            let losses = serde_json::to_string(&results[0].losses).unwrap();
            println!("@@losses {losses}");
            println!("@@done");
            0
        }
        Ok(None) => {
            println!("@@done");
            0
        }
        Err(e) => {
            println!("@@error {e}");
            1
        }
    };
    std::process::exit(code);
}

fn shm_entries() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn the_example_runs_as_one_process_per_rank() {
    let mut job = Job::start_on_free_port("example_rank_entry", 3, |_| Vec::new());
    let codes = job.wait(&[0, 1, 2], Duration::from_secs(120));
    assert_eq!(codes, vec![0, 0, 0], "{:?}", job.seen);
    for r in 0..3 {
        job.expect(r, "@@done", Duration::from_secs(5));
    }
}

#[test]
fn kill_9_of_a_rank_during_a_training_step_stops_every_other_rank_naming_it() {
    let before = shm_entries();
    let victim = 2;
    let mut job = Job::start_on_free_port("example_rank_entry", 3, |_| {
        vec![("CHILD_STEPS", "100000".to_string())]
    });
    // Rank 0 prints a line per step: the ranks are training.
    job.expect(0, "[auto] step  20 ", Duration::from_secs(120));
    let t0 = Instant::now();
    job.children[victim].kill().unwrap();
    let codes = job.wait(&[0, 1], Duration::from_secs(60));
    let took = t0.elapsed();
    assert_eq!(codes, vec![1, 1], "{:?}", job.seen);
    for r in [0, 1] {
        let e = job.expect(r, "@@error ", Duration::from_secs(5));
        assert!(
            e.contains(&format!("rank {victim} was lost")),
            "rank {r}: {e}"
        );
    }
    assert!(
        took < Duration::from_secs(10),
        "the others stopped after {took:?}"
    );
    drop(job); // reaps every child
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

#[test]
fn the_trace_is_chrome_json_with_every_operation() {
    use fsdp_step::trace;
    let args = Args {
        steps: 3,
        trace: Some(std::path::PathBuf::from("unused")),
        ..Args::host(vec![Mode::Auto, Mode::None])
    };
    run_host(&args).unwrap();
    let all = trace::take();
    let path = std::env::temp_dir().join(format!("fsdp_trace_{}.json", std::process::id()));
    trace::write(&path, &all).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let svg = std::fs::read_to_string(trace::svg_path(&path)).unwrap();
    std::fs::remove_file(trace::svg_path(&path)).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("auto, rank 0, step 2"),
        "{svg}"
    );
    let events = v["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    // Steps 1 and 2 of two modes on two ranks (the warm-up step is left out).
    for e in &spans {
        assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["pid"].as_u64().unwrap() < 2 && e["tid"].as_u64().unwrap() < 4);
        assert!([1, 2].contains(&e["args"]["step"].as_u64().unwrap()), "{e}");
    }
    let names = |tid: u64| -> std::collections::BTreeSet<&str> {
        (spans.iter())
            .filter(|e| e["tid"] == tid && e["cat"] == "auto")
            .map(|e| e["name"].as_str().unwrap())
            .collect()
    };
    let set = |v: &[&'static str]| v.iter().copied().collect();
    assert_eq!(
        names(1),
        set(&["copy", "gemm", "gemm dW", "gemm dX", "loss", "wait"])
    );
    assert_eq!(names(2), set(&["all-gather", "wait"]));
    assert_eq!(names(3), set(&["reduce-scatter", "sgd", "wait"]));
    // The step boundary (`end_step`) is a host call of every step that communicates.
    assert!(names(0).is_superset(&set(&[
        "all-gather",
        "reduce-scatter",
        "gemm",
        "end_step",
        "step",
        "sync"
    ])));
    // Every row is named, for both ranks.
    let rows: Vec<&str> = (events.iter())
        .filter(|e| e["name"] == "thread_name" && e["pid"] == 1)
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(rows, ["host", "compute", "all-gather", "reduce-scatter"]);
    // Forward: layer l+1's all-gather is issued before layer l's GEMM (host order).
    let host_at = |name: &str, layer: u64| {
        (spans.iter())
            .find(|e| {
                e["tid"] == 0
                    && e["pid"] == 0
                    && e["cat"] == "auto"
                    && e["name"] == name
                    && e["args"]["layer"] == layer
                    && e["args"]["step"] == 1
            })
            .unwrap()["ts"]
            .as_f64()
            .unwrap()
    };
    assert!(host_at("all-gather", 1) < host_at("gemm", 0));
    let summary = trace::summary(&all, 0);
    assert!(
        summary.contains("auto") && summary.contains("none"),
        "{summary}"
    );
}

/// The example's exit status sorts failures by [`symmpool::ErrorKind`]: fixing the
/// program, fixing the settings, retrying with less and restarting get different
/// statuses, none of them 0 or the check's 1.
#[test]
fn exit_codes_follow_the_error_kind() {
    use symmpool::{Error, ErrorKind};
    let code = |e: Error| fsdp_step::exit_code(e.kind());
    let usage = code(Error::ZeroSize);
    let config = code(Error::InvalidConfig("x".into()));
    let oom = code(Error::PeerOutOfMemory {
        segment_bytes: 1,
        ranks: vec![1],
    });
    let restart = code(Error::PeerLost {
        rank: 1,
        op: "x",
        detail: "y".into(),
    });
    let codes = [usage, config, oom, restart];
    for (i, a) in codes.iter().enumerate() {
        assert!(*a > 1, "{codes:?}");
        assert!(codes[i + 1..].iter().all(|b| b != a), "{codes:?}");
    }
    assert_eq!(fsdp_step::exit_code(ErrorKind::Timeout), restart);
}

#[test]
fn a_deeper_prefetch_changes_no_loss() {
    // `--prefetch 3` issues three layers' all-gathers ahead, `--prefetch 8` every
    // layer's at once (4 layers), and layer 0's for the next step comes at the end of
    // each step but the last: the same data reach every GEMM. (The host
    // math is synchronous: this checks the schedule's data, not its stream order.)
    let losses = |prefetch| {
        let args = Args {
            steps: 4,
            prefetch,
            ..Args::host(vec![Mode::Auto])
        };
        let results = run_host(&args).unwrap();
        check(&results).unwrap();
        results[0].losses.clone()
    };
    let one = losses(1);
    assert_eq!(one, losses(3));
    assert_eq!(one, losses(8));
}

#[test]
fn each_step_runs_every_mode_once_in_an_order_that_changes() {
    // The modes of `--compare` run once per step, in an order drawn from the step's
    // number (the same on every rank): a permutation each step, not always the same one.
    let n = Mode::COMPARED.len();
    let orders: Vec<Vec<usize>> = (0..20).map(|s| fsdp_step::mode_order(s, n)).collect();
    for order in &orders {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "{order:?}");
    }
    let firsts: std::collections::BTreeSet<usize> = orders.iter().map(|o| o[0]).collect();
    assert!(
        firsts.len() > 1,
        "the same mode first every step: {orders:?}"
    );
    assert_eq!(orders[3], fsdp_step::mode_order(3, n), "not reproducible");
    assert_eq!(fsdp_step::mode_order(0, 1), vec![0]);
}

#[test]
fn the_sm_margin_option_reaches_the_args() {
    use clap::Parser;
    let resolve = |argv: &[&str]| fsdp_step::Cli::try_parse_from(argv).map(|c| c.resolve(0));
    // On NCCL, 12 unless told: the GEMMs of a mode that communicates leave 12 SMs to it.
    let nccl = |extra: &[&str]| {
        let argv = [&["fsdp_step", "--backend", "nccl"][..], extra].concat();
        resolve(&argv)
    };
    assert_eq!(nccl(&[]).unwrap().sm_margin, 12);
    assert_eq!(nccl(&["--sm-margin", "0"]).unwrap().sm_margin, 0);
    assert_eq!(nccl(&["--sm-margin", "24"]).unwrap().sm_margin, 24);
    assert!(nccl(&["--sm-margin=-1"]).is_err());
    assert!(nccl(&["--sm-margin", "many"]).is_err());
    // The host has no SMs to leave: 0 whatever was asked.
    let host = resolve(&["fsdp_step", "--backend", "host", "--sm-margin", "24"]).unwrap();
    assert_eq!(host.sm_margin, 0);
    // The summary carries the margin of the modes that communicate, 0 for `none`.
    let results = run_host(&Args {
        steps: 3,
        sm_margin: 5,
        ..Args::host(vec![Mode::Auto, Mode::None])
    })
    .unwrap();
    let margin = |m: Mode| results.iter().find(|r| r.mode == m).unwrap().sm_margin;
    assert_eq!((margin(Mode::Auto), margin(Mode::None)), (5, 0));
}

/// The example program, built as `cargo build --example fsdp_step` builds it with this
/// test's profile and features (nothing to do when it is up to date): its path.
fn example_program() -> std::path::PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args([
        "build",
        "--example",
        "fsdp_step",
        "--manifest-path",
        manifest,
    ])
    .args(["--message-format", "json-render-diagnostics"]);
    if !cfg!(feature = "nccl") {
        cmd.arg("--no-default-features");
    }
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let out = cmd.output().expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo build --example fsdp_step failed"
    );
    // The last artifact of the example names its executable.
    (String::from_utf8_lossy(&out.stdout).lines())
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "fsdp_step")
        .find_map(|v| v["executable"].as_str().map(std::path::PathBuf::from))
        .expect("cargo names the example's executable")
}

/// What a run of the example printed, and how it ended.
struct Ran {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

/// Run the example with `args`, bounded by `limit`: killed past it (with its ranks,
/// which die with their launcher), and the test fails.
fn run_example(program: &std::path::Path, args: &[&str], limit: Duration) -> Ran {
    run_example_in(program, args, limit, None)
}

/// [`run_example`], with its temporary files in `tmp` (`TMPDIR`) when given.
fn run_example_in(
    program: &std::path::Path,
    args: &[&str],
    limit: Duration,
    tmp: Option<&std::path::Path>,
) -> Ran {
    use std::io::Read;
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut cmd = std::process::Command::new(program);
    if let Some(dir) = tmp {
        cmd.env("TMPDIR", dir);
    }
    let mut child = Killed(
        cmd.args(args)
            // The example's own default log level (warn), whatever the test's is.
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the example starts"),
    );
    let read = |mut from: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = from.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.0.stdout.take().unwrap()));
    let stderr = read(Box::new(child.0.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < limit,
            "fsdp_step {args:?} did not end within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(child);
    Ran {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// The summary of a `--json` run (one mode).
fn json_summary(ran: &Ran) -> Summary {
    let line = (ran.stdout.lines().find(|l| l.starts_with('{')))
        .unwrap_or_else(|| panic!("no summary: {}\n{}", ran.stdout, ran.stderr));
    serde_json::from_str(line).unwrap()
}

#[test]
fn the_example_survives_a_lost_rank_and_trains_on_as_a_fresh_smaller_job_would() {
    let program = example_program();
    let dir = std::env::temp_dir().join(format!("fsdp-survive-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let state = state.to_str().unwrap();
    let limit = Duration::from_secs(300);
    let common = ["--backend", "host", "--steps", "10", "--json"];
    // Rank 3 of 4 kills itself (SIGKILL) inside a reduce-scatter of step 3; the launcher
    // expects that death, so the job succeeds when the survivors do.
    let survive = [
        &common[..],
        &["--nproc", "4", "--survive", "--save-state", state],
    ]
    .concat();
    let ran = run_example(&program, &survive, limit);
    assert!(ran.status.success(), "{:?}: {}", ran.status, ran.stderr);
    assert!(
        ran.stderr.contains("rank 3 kills itself (SIGKILL)"),
        "{}",
        ran.stderr
    );
    let r = json_summary(&ran);
    check(std::slice::from_ref(&r)).unwrap();
    assert_eq!(r.backend, "shm", "ranks as processes on the host");
    // The world size at the start and at the end.
    assert_eq!((r.ranks, r.ranks_at_end), (4, 3));
    // A loss the survivors go on past is no failure: no ERROR line.
    assert!(!ran.stderr.contains("ERROR"), "{}", ran.stderr);
    let s = r.survival.clone().expect("a lost rank survived");
    assert_eq!(s.lost_ranks, [3]);
    assert_eq!((s.world_size_before, s.world_size_after), (4, 3));
    assert_eq!((s.rank_before, s.rank_after, s.lost_in_step), (0, 0, 3));
    assert!(s.error.contains("rank 3 was lost"), "{}", s.error);
    // What happened, without the advice for a job that stops there.
    assert!(!s.error.contains("broken for good"), "{}", s.error);
    // Step 3's parameters were being kept when the rank was lost (a step's are whole
    // once its end has synchronised): the survivors go on from step 2.
    assert_eq!(s.resumed_at_step, 2);
    assert!(
        0.0 < s.shrink_ms && s.shrink_ms < s.first_collective_ms,
        "{s:?}"
    );
    assert!(s.first_collective_ms < s.first_step_ms, "{s:?}");
    // Every segment kept; the registered pools registered each anew on the survivors'
    // communicators, the data pool (unregistered) none; nothing more registered later.
    let shrunk: Vec<(&str, bool, bool)> = (s.pools.iter())
        .map(|p| (p.pool.as_str(), p.segments > 0, p.registrations > 0))
        .collect();
    assert_eq!(
        shrunk,
        [
            ("parameters", true, true),
            ("gradients", true, true),
            ("data", true, false)
        ]
    );
    assert_eq!(s.registrations_first_step_after, 0);
    assert_eq!(r.registrations_after_first_step, 0);
    // The losses: one per step, those of steps 0-1 at world size 4 and of steps 2-9
    // at world size 3, falling at both sizes.
    assert_eq!(r.losses.len(), 10);
    let (before, after) = r.losses_around_the_loss();
    assert_eq!((before.len(), after.len()), (2, 8));
    assert!(before[1] < before[0], "{before:?}");
    assert!(after.iter().all(|l| l.is_finite()), "{after:?}");
    assert!(after[7] < after[0] / 2.0, "{after:?}");
    let lines = fsdp_step::survival_lines(&r).join("\n");
    for want in [
        "lost: rank 3 of 4, in step 3: rank 3 was lost",
        "went on from step 2",
        "losses at world size 4: steps 0-1: ",
        "losses at world size 3: steps 2-9: ",
    ] {
        assert!(lines.contains(want), "{want:?} in {lines}");
    }
    // A fresh 3-rank job from the state the survivors went on from: the same losses,
    // to the bit (f32 on the host, the same sums in the same order); so the survivors'
    // shards, data and gradient scale after the shrink are those of a 3-rank job.
    let resume = [&common[..], &["--nproc", "3", "--resume", state]].concat();
    let fresh = run_example(&program, &resume, limit);
    assert!(
        fresh.status.success(),
        "{:?}: {}",
        fresh.status,
        fresh.stderr
    );
    let f = json_summary(&fresh);
    assert!(f.survival.is_none());
    assert_eq!(f.first_step, 2);
    assert_eq!(f.losses, after);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_example_heals_back_to_four_ranks_and_trains_on_as_a_fresh_four_rank_job_would() {
    let program = example_program();
    let dir = std::env::temp_dir().join(format!("fsdp-heal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let state = state.to_str().unwrap();
    let limit = Duration::from_secs(300);
    let common = ["--backend", "host", "--steps", "10", "--json"];
    // Rank 3 of 4 dies in step 3; the launcher starts its replacement; the survivors
    // grow back at the start of step 5 (the default, two steps after the loss).
    let heal = [
        &common[..],
        &["--nproc", "4", "--survive", "--heal", "--save-state", state],
    ]
    .concat();
    let ran = run_example_in(&program, &heal, limit, Some(&dir));
    assert!(ran.status.success(), "{:?}: {}", ran.status, ran.stderr);
    assert!(
        ran.stderr.contains("rank 3 kills itself (SIGKILL)"),
        "{}",
        ran.stderr
    );
    // A loss the survivors go on past, and heal, is no failure: no ERROR line.
    assert!(!ran.stderr.contains("ERROR"), "{}", ran.stderr);
    let r = json_summary(&ran);
    check(std::slice::from_ref(&r)).unwrap();
    assert_eq!((r.backend.as_str(), r.ranks, r.ranks_at_end), ("shm", 4, 4));
    let s = r.survival.clone().expect("a lost rank survived");
    assert_eq!(
        (s.lost_ranks, s.lost_in_step, s.resumed_at_step),
        (vec![3], 3, 2)
    );
    assert_eq!((s.world_size_before, s.world_size_after), (4, 3));
    // The heal: at step 5, world size 3 → 4, the newcomer in the lost rank's place.
    let h = r.heal.clone().expect("the world grew back");
    assert_eq!(
        (h.at_step, h.world_size_before, h.world_size_after),
        (5, 3, 4)
    );
    assert_eq!(h.newcomers, [3]);
    assert_eq!((h.rank_before, h.rank_after), (Some(0), 0));
    assert!(
        0.0 < h.grow_ms && h.grow_ms < h.first_collective_ms,
        "{h:?}"
    );
    assert!(h.first_collective_ms < h.first_step_ms, "{h:?}");
    // The newcomer's times, gathered on rank 0: it waited for the survivors, then
    // joined and made its first collective at world size 4.
    assert!(
        h.newcomer_waited_ms > 0.0 && h.newcomer_first_collective_ms > 0.0,
        "{h:?}"
    );
    // Every pool grown with its segments, each registered anew where the pool
    // registers, and no block pinned: the survivors dropped their buffers first.
    let grown: Vec<(&str, bool, bool, u64)> = (h.pools.iter())
        .map(|p| {
            let registered = p.registrations > 0;
            (p.pool.as_str(), p.segments > 0, registered, p.pinned_blocks)
        })
        .collect();
    assert_eq!(
        grown,
        [
            ("parameters", true, true, 0),
            ("gradients", true, true, 0),
            ("data", true, false, 0)
        ]
    );
    assert_eq!(h.registrations_first_step_after, 0);
    assert_eq!(r.registrations_after_first_step, 0);
    // The `--json` object names every field of the heal.
    let line = ran.stdout.lines().find(|l| l.starts_with('{')).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    for key in [
        "at_step",
        "world_size_before",
        "world_size_after",
        "newcomers",
        "grow_ms",
        "first_collective_ms",
        "newcomer_first_collective_ms",
        "newcomer_waited_ms",
        "pools",
        "registrations_first_step_after",
    ] {
        assert!(v["heal"].get(key).is_some(), "no heal.{key} in {line}");
    }
    for key in ["segments", "registrations", "pinned_blocks", "pinned_bytes"] {
        assert!(v["heal"]["pools"][0].get(key).is_some(), "{line}");
    }
    // The losses at world size 4 (steps 0-1), 3 (2-4) and 4 again (5-9).
    assert_eq!(r.losses.len(), 10);
    let (before, at_three) = r.losses_around_the_loss();
    let after = fsdp_step::heal::losses_after(&r);
    assert_eq!((before.len(), at_three.len(), after.len()), (2, 3, 5));
    assert!(after[4] < after[0], "{after:?}");
    let lines = fsdp_step::survival_lines(&r).join("\n");
    for want in [
        "losses at world size 4: steps 0-1: ",
        "losses at world size 3: steps 2-4: ",
        "heal: rank 3 joined in step 5, world size 3 → 4; ",
        "  the newcomer: admitted ",
        "  parameters segments: 1, window registrations on the new communicators: 2, \
         pinned blocks: 0",
        "losses at world size 4 again: steps 5-9: ",
    ] {
        assert!(lines.contains(want), "{want:?} in {lines}");
    }
    // The file that handed the newcomer its state went with the job.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["state"], "{left:?}");
    // A fresh 4-rank job from the state at the heal: the healed job's losses from
    // there, to the bit; so the grown pools, the newcomer's shards and data, and the
    // gradient scale are those of a 4-rank job.
    let resume = [&common[..], &["--nproc", "4", "--resume", state]].concat();
    let fresh = run_example(&program, &resume, limit);
    assert!(
        fresh.status.success(),
        "{:?}: {}",
        fresh.status,
        fresh.stderr
    );
    let f = json_summary(&fresh);
    assert!(f.survival.is_none() && f.heal.is_none());
    assert_eq!((f.first_step, f.ranks_at_end), (5, 4));
    assert_eq!(f.losses, after);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_heal_demo_says_what_happened_and_no_error() {
    let program = example_program();
    let args = [
        "--backend",
        "host",
        "--steps",
        "8",
        "--nproc",
        "4",
        "--survive",
        "--heal",
        "--heal-at-step",
        "6",
    ];
    let ran = run_example(&program, &args, Duration::from_secs(300));
    assert!(ran.status.success(), "{:?}: {}", ran.status, ran.stderr);
    let all = format!("{}\n{}", ran.stdout, ran.stderr);
    assert!(!all.contains("ERROR"), "{all}");
    assert!(!all.contains("restart"), "{all}");
    // As it happens: the loss, the shrink, then the heal before step 6 runs.
    let lines: Vec<&str> = ran.stdout.lines().collect();
    let at = |prefix: &str| {
        (lines.iter().position(|l| l.starts_with(prefix)))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {all}"))
    };
    let healed = at("healed: rank 3 joined at the start of step 6, world size 3 → 4; ");
    assert!(at("shrunk: ") < healed, "{all}");
    assert_eq!(at("[auto] step   5 "), healed - 1, "{all}");
    assert_eq!(at("[auto] step   6 "), healed + 1, "{all}");
    assert!(
        ran.stdout.contains(
            "summary: shm backend, 4 ranks (4 at the start; rank 3 lost in step 3, replaced \
             in step 6), "
        ),
        "{all}"
    );
}

#[test]
fn the_survive_demo_says_what_happened_in_a_few_lines_and_no_error() {
    let program = example_program();
    let args = [
        "--backend",
        "host",
        "--steps",
        "6",
        "--nproc",
        "4",
        "--survive",
    ];
    let ran = run_example(&program, &args, Duration::from_secs(300));
    assert!(ran.status.success(), "{:?}: {}", ran.status, ran.stderr);
    let all = format!("{}\n{}", ran.stdout, ran.stderr);
    // No ERROR, and no advice to restart a job that went on; the loss at WARN once at
    // most (the store's host), or not at all.
    assert!(!all.contains("ERROR"), "{all}");
    assert!(
        !all.contains("broken for good") && !all.contains("restart"),
        "{all}"
    );
    assert!(all.matches("WARN").count() <= 1, "{all}");
    // The loss, the shrink and the new world size, as they happen (rank 0's lines).
    let lines: Vec<&str> = ran.stdout.lines().collect();
    let at = |prefix: &str| {
        (lines.iter().position(|l| l.starts_with(prefix)))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {all}"))
    };
    let (lost, shrunk) = (
        at("lost: rank 3 of 4, in step 3: rank 3 was lost"),
        at("shrunk: "),
    );
    assert_eq!(shrunk, lost + 1, "{all}");
    assert!(
        lines[shrunk].contains("world size 4 → 3") && lines[shrunk].contains("from step 2"),
        "{}",
        lines[shrunk]
    );
    // Step 2 runs again, marked, at the new world size; step 3 once, after it.
    let again: Vec<&&str> = (lines.iter())
        .filter(|l| l.contains(" step   2 "))
        .collect();
    assert_eq!(again.len(), 2, "{all}");
    assert!(!again[0].contains("again"), "{}", again[0]);
    assert!(again[1].ends_with("(again, world 3)"), "{}", again[1]);
    assert_eq!(at("[auto] step   2"), lost - 1, "{all}");
    let third: Vec<&&str> = lines.iter().filter(|l| l.contains(" step   3 ")).collect();
    assert!(third.len() == 1 && !third[0].contains("again"), "{all}");
    // The summary says the world size at the end and at the start.
    assert!(
        ran.stdout
            .contains("summary: shm backend, 3 ranks (4 at the start; rank 3 lost in step 3), "),
        "{all}"
    );
}

#[test]
fn the_survive_options_resolve_and_refuse_what_cannot_survive() {
    use clap::Parser;
    let resolve = |argv: &[&str]| {
        let argv = [&["fsdp_step", "--backend", "host"][..], argv].concat();
        fsdp_step::Cli::try_parse_from(argv).map(|c| c.resolve(0))
    };
    // The last rank, in step 3; hidden 64 grows to 66, whose square splits over 4 and 3.
    let args = resolve(&["--nproc", "4", "--survive"]).unwrap();
    let s = args.survive.clone().unwrap();
    assert_eq!((s.victim, s.kill_at_step, args.hidden), (3, 3, 66));
    let args = resolve(&["--nproc", "3", "--survive", "--victim", "1"]).unwrap();
    assert_eq!((args.survive.unwrap().victim, args.hidden), (1, 66));
    let args = resolve(&["--nproc", "2", "--survive", "--kill-at-step", "5"]).unwrap();
    let s = args.survive.unwrap();
    assert_eq!((s.victim, s.kill_at_step, args.hidden), (1, 5, 64));
    // Options that need --survive, or that cannot go with it.
    assert!(resolve(&["--nproc", "4", "--victim", "2"]).is_err());
    assert!(resolve(&["--nproc", "4", "--survive", "--compare"]).is_err());
    assert!(resolve(&["--nproc", "4", "--survive", "--trace", "t.json"]).is_err());
    // What the resolved arguments are checked for (a usage error, exit status 2).
    let refused = |change: &dyn Fn(&mut Args, &mut fsdp_step::Survive), processes| {
        let mut args = resolve(&["--nproc", "4", "--survive"]).unwrap();
        let mut s = args.survive.clone().unwrap();
        change(&mut args, &mut s);
        s.check(&args, processes).unwrap_err()
    };
    assert!(refused(&|_, _| {}, false).contains("ranks as processes"));
    assert!(refused(&|_, s| s.victim = 0, true).contains("rank 0 hosts the store"));
    assert!(refused(&|_, s| s.victim = 4, true).contains("from 1 to 3"));
    assert!(refused(&|_, s| s.kill_at_step = 30, true).contains("--steps 30"));
    assert!(refused(&|a, _| a.modes = vec![Mode::None], true).contains("communicates"));
    assert!(refused(&|a, _| a.hidden = 64, true).contains("pass --hidden 66"));
    assert!(refused(&|a, _| a.ranks = 1, true).contains("at least 2 ranks"));
}

#[test]
fn the_heal_options_resolve_and_refuse_what_cannot_heal() {
    use clap::Parser;
    let resolve = |argv: &[&str]| {
        let argv = [&["fsdp_step", "--backend", "host"][..], argv].concat();
        fsdp_step::Cli::try_parse_from(argv).map(|c| c.resolve(0))
    };
    // Two steps after the loss by default; auto keeps its default thresholds (a
    // newcomer has no calibration to share).
    let args = resolve(&["--nproc", "4", "--survive", "--heal"]).unwrap();
    assert_eq!(args.survive.clone().unwrap().heal_at, Some(5));
    assert_eq!(args.calibrate, Calibrate::Never);
    let args = resolve(&["--nproc", "4", "--survive", "--heal", "--heal-at-step", "9"]);
    assert_eq!(args.unwrap().survive.unwrap().heal_at, Some(9));
    let args = resolve(&["--nproc", "4", "--survive"]).unwrap();
    assert_eq!(args.survive.unwrap().heal_at, None);
    // Options that need --heal or --survive, or that cannot go with --heal.
    assert!(resolve(&["--nproc", "4", "--heal"]).is_err());
    assert!(resolve(&["--nproc", "4", "--survive", "--heal-at-step", "5"]).is_err());
    let always = [
        "--nproc",
        "4",
        "--survive",
        "--heal",
        "--calibrate",
        "always",
    ];
    assert!(resolve(&always).is_err());
    // The heal comes after the loss and before the end.
    let refused = |heal_at: usize| {
        let mut args = resolve(&["--nproc", "4", "--survive", "--heal"]).unwrap();
        let mut s = args.survive.take().unwrap();
        s.heal_at = Some(heal_at);
        s.check(&args, true)
    };
    for at in [1, 3, 30] {
        let err = refused(at).unwrap_err();
        assert!(err.contains("after --kill-at-step 3 and before"), "{err}");
    }
    assert!(refused(4).is_ok() && refused(29).is_ok());
}

#[test]
fn a_resumed_job_takes_its_model_shape_from_the_state_unless_given() {
    use clap::Parser;
    let resolve = |argv: &[&str]| {
        let argv = [&["fsdp_step", "--backend", "host"][..], argv].concat();
        let cli = fsdp_step::Cli::try_parse_from(argv).unwrap();
        (cli.resolve(0), (cli.layers, cli.hidden))
    };
    let dir = std::env::temp_dir().join(format!("fsdp-fit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state");
    // A state of 3 layers of 66² values (a 3-rank survive run's hidden size), at step 2.
    let layers = vec![vec![0.5f32; 66 * 66]; 3];
    (fsdp_step::survive::State { step: 2, layers })
        .save(&path)
        .unwrap();
    let fit = |argv: &[&str]| {
        let (mut args, given) = resolve(argv);
        fsdp_step::survive::State::fit_file(&path, &mut args, given).map(|()| args)
    };
    // Two ranks default to hidden 64 and 4 layers; the state's shape wins.
    let args = fit(&["--nproc", "2"]).unwrap();
    assert_eq!((args.layers, args.hidden), (3, 66));
    // Given explicitly, a different shape is refused, naming what the state holds.
    let err = fit(&["--nproc", "2", "--hidden", "64"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("3 layers of 4356 values, not 3 of 64²"),
        "{err}"
    );
    let err = fit(&["--nproc", "2", "--layers", "4"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("not 4 of 66²"), "{err}");
    // 66² does not split over 5 ranks: a configuration error, not a failed run.
    let err = fit(&["--nproc", "5"]).unwrap_err().to_string();
    assert!(err.contains("do not split over 5 ranks"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
