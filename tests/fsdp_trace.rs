//! The FSDP-like trace through the core: no growth after the first step, and bounded
//! reserved memory.

mod common;

use common::fsdp_trace::{
    TraceOp, buffers, example, layer_sizes, random_layer_sizes, trace, trace_of,
};
use symmpool::__core::{
    AllocError, AllocRequest, Allocator, CoreConfig, CoreStats, Placement, StreamId,
};

fn replay(core: &mut Allocator, ops: &[TraceOp], live: &mut [Option<Placement>]) {
    for op in ops {
        match *op {
            TraceOp::Alloc { id, bytes } => {
                let req = AllocRequest::new(bytes, StreamId(0));
                let p = match core.alloc(req) {
                    Err(AllocError::NeedsGrowth(g)) => {
                        core.add_segment(g).unwrap();
                        // A growth never moves a live block.
                        for p in live.iter().flatten() {
                            assert_eq!(
                                core.locate(p.block),
                                Ok((p.segment, p.offset_bytes, p.size_bytes))
                            );
                        }
                        core.alloc(req).unwrap()
                    }
                    other => other.unwrap(),
                };
                assert!(live[id].replace(p).is_none());
            }
            TraceOp::Free { id } => {
                let p = live[id].take().unwrap();
                core.free(p.block, &[]).unwrap();
            }
        }
    }
}

#[test]
fn trace_stops_growing_after_the_first_step_with_bounded_reserve() {
    let mut core = Allocator::new(CoreConfig::default()).unwrap();
    let mut live = vec![None; buffers()];
    let step = trace(1);
    replay(&mut core, &step, &mut live);
    core.check_invariants().unwrap();
    let after_first = core.stats();
    for _ in 0..50 {
        replay(&mut core, &step, &mut live);
    }
    core.check_invariants().unwrap();
    let s = core.stats();
    assert_eq!(
        s.num_growths, after_first.num_growths,
        "growth after the first step"
    );
    let ratio = s.reserved_bytes.peak as f64 / s.allocated_bytes.peak as f64;
    eprintln!(
        "segments {} reserved peak {} MiB allocated peak {} MiB ratio {ratio:.3}",
        s.segments.current,
        s.reserved_bytes.peak >> 20,
        s.allocated_bytes.peak >> 20
    );
    assert!(ratio <= 1.10, "peak reserved / peak allocated = {ratio:.3}");
}

#[test]
fn adversarial_sizes_stop_growing_too() {
    // 32 layers with sizes drawn log-uniformly from 1 MiB to 256 MiB: no two layers
    // alike, the worst case for a segment-based pool. Growth must still stop after the
    // first step; the reserve bound is looser (the figure is in BENCHMARKS.md).
    let mut core = Allocator::new(CoreConfig::default()).unwrap();
    let mut live = vec![None; buffers()];
    let step = common::fsdp_trace::trace_of(&common::fsdp_trace::random_layer_sizes(), 1);
    replay(&mut core, &step, &mut live);
    let after_first = core.stats().num_growths;
    for _ in 0..20 {
        replay(&mut core, &step, &mut live);
        core.check_invariants().unwrap();
    }
    let s = core.stats();
    assert_eq!(s.num_growths, after_first);
    let ratio = s.reserved_bytes.peak as f64 / s.allocated_bytes.peak as f64;
    eprintln!("adversarial: peak reserved / peak allocated = {ratio:.3}");
    assert!(ratio <= 1.9, "ratio {ratio:.3}");
}

fn ratio(s: &CoreStats) -> f64 {
    s.reserved_bytes.peak as f64 / s.allocated_bytes.peak as f64
}

/// Figures of one replay: after the first step, after `steps` steps, and after a
/// fit-to-peak followed by `steps` more.
struct Figures {
    first: CoreStats,
    steady: CoreStats,
    fitted: CoreStats,
}

/// Replay `setup`, reset the peaks, then `steps` steps (no growth allowed after the first), fit to the
/// peak, and replay `steps` more (no growth allowed at all).
fn figures(name: &str, cfg: CoreConfig, setup: &[TraceOp], step: &[TraceOp], n: usize) -> Figures {
    let steps = 5;
    let mut core = Allocator::new(cfg).unwrap();
    let mut live = vec![None; n];
    replay(&mut core, setup, &mut live);
    // The window of fit-to-peak starts after the setup: blocks allocated before it
    // and still live are not counted again.
    core.reset_peak();
    replay(&mut core, step, &mut live);
    core.check_invariants().unwrap();
    let first = core.stats();
    for _ in 1..steps {
        replay(&mut core, step, &mut live);
    }
    core.check_invariants().unwrap();
    let steady = core.stats();
    assert_eq!(
        steady.num_growths, first.num_growths,
        "{name}: growth after step 1"
    );
    let plan = core.plan_fit_to_peak();
    assert_eq!(plan, core.clone().plan_fit_to_peak());
    core.apply_fit_plan(&plan).unwrap();
    core.check_invariants().unwrap();
    core.reset_peak();
    let before = core.stats().num_growths;
    for _ in 0..steps {
        replay(&mut core, step, &mut live);
    }
    core.check_invariants().unwrap();
    let fitted = core.stats();
    assert_eq!(
        fitted.num_growths, before,
        "{name}: growth after fit-to-peak"
    );
    eprintln!(
        "{name}: step 1: {} segments ({} large), peak reserved {} MiB / peak allocated {} \
         MiB = {:.3}; fit plan {:?} MiB; after fit: {} segments, {:.3}",
        steady.segments.current,
        steady.large.segments.current,
        steady.reserved_bytes.peak >> 20,
        steady.allocated_bytes.peak >> 20,
        ratio(&steady),
        plan.add
            .iter()
            .map(|g| g.segment_bytes >> 20)
            .collect::<Vec<_>>(),
        fitted.segments.current,
        ratio(&fitted),
    );
    Figures {
        first,
        steady,
        fitted,
    }
}

#[test]
fn registered_policy_on_the_llama_trace() {
    let f = figures(
        "llama/registered",
        CoreConfig::registered(),
        &[],
        &trace_of(&layer_sizes(), 1),
        buffers(),
    );
    // The floor: at most 3 segments at peak reserved ≤ 1.15 × peak allocated,
    // no growth after step 1 (asserted by `figures`). Caching needs 7 segments; the
    // defaults reach 3 (1 small of 32 MiB + 2 large of 448 MiB) at 1.140.
    assert!(
        f.first.segments.current <= 3,
        "{}",
        f.first.segments.current
    );
    assert_eq!(f.steady.segments.current, f.first.segments.current);
    assert!(ratio(&f.steady) <= 1.15, "{:.3}", ratio(&f.steady));
    assert!(f.fitted.segments.current <= 2);
    assert!(ratio(&f.fitted) <= 1.15, "{:.3}", ratio(&f.fitted));
}

#[test]
fn registered_policy_on_the_adversarial_trace() {
    let f = figures(
        "random/registered",
        CoreConfig::registered(),
        &[],
        &trace_of(&random_layer_sizes(), 1),
        buffers(),
    );
    // The floor: ≤ 1.9 (the defaults: 1.506 with 1 small + 2 large segments).
    assert!(ratio(&f.steady) <= 1.9, "{:.3}", ratio(&f.steady));
    assert!(f.first.segments.current <= 4);
    assert!(f.fitted.segments.current <= 2);
}

#[test]
fn the_example_workload_under_both_policies() {
    let caching = figures(
        "example/caching",
        CoreConfig::default(),
        &example::setup(),
        &example::step(),
        example::buffers(),
    );
    let registered = figures(
        "example/registered",
        CoreConfig::registered(),
        &example::setup(),
        &example::step(),
        example::buffers(),
    );
    // One segment per live 64 MiB or 32 MiB buffer with caching (14). The issue's
    // floors for the registered policy: at most 4 segments, and at most 2 after
    // warm-up sizing. The defaults take 2 large segments (a 448 MiB chunk holding the
    // 256 MiB of shards and part of the step, a 448 MiB chunk for the rest of the
    // step) at 1.556; fit-to-peak keeps the first (the shards live there) and replaces
    // the second with one of 352 MiB: 2 segments at 1.389 (no small segment: what no
    // collective touches lives in the example's unregistered pool).
    assert!(caching.first.segments.current >= 9);
    assert!(registered.first.segments.current <= 4);
    assert!(registered.fitted.segments.current <= 2);
    assert!(ratio(&registered.fitted) <= ratio(&registered.steady));
}

#[test]
fn registered_placements_are_deterministic() {
    let step = trace_of(&random_layer_sizes(), 2);
    let run = || {
        let mut core = Allocator::new(CoreConfig::registered()).unwrap();
        let mut live = vec![None; buffers()];
        replay(&mut core, &step, &mut live);
        let plan = core.plan_fit_to_peak();
        core.apply_fit_plan(&plan).unwrap();
        replay(&mut core, &step, &mut live);
        (plan, core.snapshot())
    };
    assert_eq!(run(), run());
}
