//! A registered pool's small class grows logarithmically like the
//! large class, so many small live tensors take few segments and few windows.

mod common;

use common::rng::Rng;
use std::thread;
use std::time::Duration;
use symmpool::{Group, GroupConfig, PoolConfig, Stream, SymmBuffer, SymmPool};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// What one rank ends with: segments, windows (registrations), reserved and peak
/// allocated bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    segments: u64,
    windows: u64,
    reserved_bytes: u64,
    peak_allocated_bytes: u64,
}

/// 1 000 live tensors of random sizes 64 KiB–4 MiB (uniform, seeded: the same
/// sequence on every rank), allocated straight from a pool with the default
/// (registered) configuration on the host backend.
fn thousand_tensors(world: usize, seed: u64) -> Vec<Outcome> {
    let groups = Group::host(
        world,
        &GroupConfig::default().with_timeout(Duration::from_secs(30)),
    )
    .unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let mut rng = Rng(seed);
    let sizes: Vec<u64> = (0..1000)
        .map(|_| 64 * KIB + rng.next() % (4 * MIB - 64 * KIB + 1))
        .collect();
    thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|pool| {
                let sizes = &sizes;
                s.spawn(move || {
                    let stream = Stream::host();
                    let live: Vec<SymmBuffer> = sizes
                        .iter()
                        .map(|&size| pool.alloc(size, &stream).unwrap())
                        .collect();
                    let m = pool.memory_stats();
                    let get = |k: &str| m[k].as_u64().unwrap();
                    let out = Outcome {
                        segments: get("segment.all.current"),
                        windows: m
                            .iter()
                            .filter(|(k, _)| k.starts_with("windows."))
                            .map(|(_, v)| v.as_u64().unwrap())
                            .sum(),
                        reserved_bytes: get("reserved_bytes.all.current"),
                        peak_allocated_bytes: get("allocated_bytes.all.peak"),
                    };
                    drop(live);
                    pool.close().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn thousand_small_and_medium_tensors_take_few_segments() {
    for seed in [26, 1, 2] {
        check(seed);
    }
}

fn check(seed: u64) {
    let outs = thousand_tensors(2, seed);
    assert!(
        outs.windows(2).all(|w| w[0] == w[1]),
        "ranks differ: {outs:?}"
    );
    let o = outs[0];
    let ratio = o.reserved_bytes as f64 / o.peak_allocated_bytes as f64;
    eprintln!(
        "seed {seed}: segments {} windows {} reserved/peak {ratio:.3} ({} / {} MiB)",
        o.segments,
        o.windows,
        o.reserved_bytes / MIB,
        o.peak_allocated_bytes / MIB
    );
    assert!(o.segments <= 8, "{o:?}");
    assert!(o.windows <= 16, "{o:?}");
    assert!(ratio <= 1.5, "{o:?}");
}
