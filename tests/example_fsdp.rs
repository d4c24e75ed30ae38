//! The FSDP example on the host backend: the loss falls, every mode follows the same
//! trajectory, nothing registers after the first step, and `--json` has every field.

#[path = "../examples/fsdp_step/main.rs"]
#[allow(dead_code, unreachable_pub)]
mod fsdp_step;

use fsdp_step::{Args, Mode, Spread, Summary, check, run_host};

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
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
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
fn spread_of_a_sample() {
    let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]);
    assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
    assert_eq!(Spread::of(&[4.0, 1.0, 2.0]).median, 2.0);
    assert!(Spread::of(&[]).median.is_nan());
}
