//! The FSDP example on the host backend: the loss falls, every mode follows the same
//! trajectory, nothing registers after the first step, and `--json` has every field.

#[path = "../examples/fsdp_step.rs"]
#[allow(dead_code, unreachable_pub)]
mod fsdp_step;

use fsdp_step::{Args, Mode, check, json_summary, run_host};
use symmpool::coll::Path;

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
        for (a, b) in r.losses.iter().zip(base) {
            // f32 on the host, same sums in the same order: equal up to rounding.
            assert!(((a - b) / b).abs() < 1e-5, "{}: {a} vs {b}", r.mode.name());
        }
        assert_eq!(r.regs_after_first, 0);
    }
    let paths = |m: Mode| {
        let r = results.iter().find(|r| r.mode == m).unwrap();
        (
            r.ag_paths[0],
            r.rs_paths[0],
            r.stats.registrations.iter().sum::<u64>(),
        )
    };
    assert_eq!(paths(Mode::Ring), (Path::PlainKernel, Path::PlainKernel, 0));
    assert_eq!(paths(Mode::Symm).0, Path::SymmetricKernel);
    assert_eq!(paths(Mode::Ce).0, Path::CopyEngine);
    assert!(paths(Mode::Auto).2 > 0);
}

#[test]
fn json_summary_has_every_field() {
    let args = Args {
        steps: 5,
        ..Args::host(vec![Mode::Auto])
    };
    let results = run_host(&args).unwrap();
    let v = json_summary(&args, "host", &results[0]);
    for key in [
        "backend",
        "ranks",
        "mode",
        "steps",
        "median_step_ms",
        "first_loss",
        "last_loss",
        "registrations",
        "registrations_after_first_step",
        "segments",
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "all_gather_paths",
        "reduce_scatter_paths",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["backend"], "host");
    assert_eq!(v["mode"], "auto");
    assert_eq!(v["registrations_after_first_step"], 0);
    assert!(
        v["peak_reserved_bytes"].as_u64().unwrap() >= v["peak_allocated_bytes"].as_u64().unwrap()
    );
}
