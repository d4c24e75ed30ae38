//! One step of a layer loop that reuses one persistent gather buffer, as a rank of
//! the identity tests runs it (`tests/coll_identity.rs` on threads,
//! `tests/shm_pools.rs` on processes): what the rank does differently (a skipped
//! layer, more layers, an extra allocation, one that grows the pool) and what it saw.

use std::time::{Duration, Instant};
use symmpool::{Coll, CollectiveCalls, Error, Stream, SymmBuffer, SymmPool};

/// Layers of the loop.
pub const LAYERS: usize = 8;
/// f32 elements per rank of the persistent gather buffer.
pub const CHUNK: usize = 256;
/// An allocation no segment of the step can serve: it grows the pool.
pub const GROWTH_BYTES: u64 = 3 << 30;

/// What one rank saw.
#[derive(Debug)]
pub struct Seen {
    /// Collectives attempted; the first failing one (1-based) with its error.
    pub calls: usize,
    pub first: Option<(usize, Error)>,
    /// Whether the failing call's buffer still held what this rank wrote before it.
    pub untouched: bool,
    /// Calls that returned `Ok` with another call's data: a peer's chunk not from the
    /// same layer.
    pub wrong_ok: usize,
    /// `end_step`'s error (also made after a failed call: it returns the verdict).
    pub end: Option<Error>,
    /// From the rank's first collective to the end of `end_step`.
    pub elapsed: Duration,
}

/// How one rank runs its step.
#[derive(Clone, Copy)]
pub struct Plan {
    /// Layers to run (their gathers use the one persistent buffer).
    pub layers: usize,
    /// A layer this rank skips.
    pub skip: Option<usize>,
    /// Tag each gather with its layer.
    pub tagged: bool,
    /// Allocate one buffer more (from the cache: no growth) before this layer
    /// (`layers`: after the last one).
    pub extra_alloc_before: Option<usize>,
    /// Allocate one buffer more that grows the pool before this layer.
    pub extra_growth_before: Option<usize>,
}

impl Plan {
    pub fn layers(layers: usize, tagged: bool) -> Plan {
        Plan {
            layers,
            skip: None,
            tagged,
            extra_alloc_before: None,
            extra_growth_before: None,
        }
    }
}

/// One step of a layer loop on `pool`: one all-gather per layer on one persistent
/// buffer, then `end_step`.
pub fn step(pool: &SymmPool, plan: Plan) -> Seen {
    let coll = Coll::new(pool).unwrap();
    let stream = Stream::host();
    let world = pool.world_size();
    let rank = pool.rank();
    // Room in the cache for the extra allocation, so that it needs no growth.
    drop(pool.alloc(1 << 20, &stream).unwrap());
    let gathered: SymmBuffer = pool.alloc((world * CHUNK * 4) as u64, &stream).unwrap();
    let mut seen = Seen {
        calls: 0,
        first: None,
        untouched: false,
        wrong_ok: 0,
        end: None,
        elapsed: Duration::ZERO,
    };
    let mut extra = Vec::new();
    let start = Instant::now();
    for layer in 0..=plan.layers {
        if plan.extra_alloc_before == Some(layer) {
            extra.push(pool.alloc(4096, &stream).unwrap());
        }
        if plan.extra_growth_before == Some(layer) {
            match pool.alloc(GROWTH_BYTES, &stream) {
                Ok(b) => extra.push(b),
                Err(e) => {
                    seen.first = Some((seen.calls + 1, e));
                    break;
                }
            }
        }
        if layer == plan.layers || plan.skip == Some(layer) {
            continue;
        }
        seen.calls += 1;
        // Every element this rank's and this layer's, so a move is visible.
        let pattern = vec![(rank * 1000 + layer) as f32; world * CHUNK];
        gathered.write(&pattern).unwrap();
        let ran = if plan.tagged {
            let tag = (1u64 << 32) | layer as u64; // step 1, this layer
            coll.tagged(tag)
                .all_gather_in_place::<f32>(&gathered, &stream)
        } else {
            coll.all_gather_in_place::<f32>(&gathered, &stream)
        };
        match ran {
            Err(e) => {
                seen.untouched = gathered.read::<f32>().unwrap() == pattern;
                seen.first = Some((seen.calls, e));
                break;
            }
            Ok(_) => {
                // Every rank's chunk must be that rank's data of this layer.
                let got = gathered.read::<f32>().unwrap();
                let right = (0..world).all(|r| {
                    (got[r * CHUNK..(r + 1) * CHUNK].iter())
                        .all(|&v| v == (r * 1000 + layer) as f32)
                });
                if !right {
                    seen.wrong_ok += 1;
                }
            }
        }
    }
    seen.end = coll.end_step().err();
    seen.elapsed = start.elapsed();
    seen
}

/// The divergence a rank reports: its first call's error if that is one, else
/// `end_step`'s.
pub fn divergence(seen: &Seen) -> String {
    let errors = seen.first.iter().map(|(_, e)| e).chain(seen.end.iter());
    for e in errors {
        if let Error::CollectiveDivergence(d) = e {
            return d.to_string();
        }
    }
    panic!("no divergence reported: {seen:?}")
}
