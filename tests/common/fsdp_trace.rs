//! An FSDP-like allocation trace, shared by the trace test and the core benchmark.
//!
//! Per step, for each of `LAYERS` layers in order (forward): allocate the layer's
//! all-gather buffer, then free the previous layer's. Backward, in reverse layer
//! order: re-gather the layer's parameters (prefetched while the layer above still
//! holds its own), allocate its unsharded gradient (the reduce-scatter input) and its
//! gradient shard (the reduce-scatter output), then free the layer above's parameters,
//! gradient and shard. Layer sizes are fixed per model and mixed from 1 MiB to 256 MiB.

#![allow(dead_code, clippy::needless_range_loop)]

/// One call of the trace: allocate buffer `id` of `bytes`, or free buffer `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate buffer `id`.
    Alloc { id: usize, bytes: u64 },
    /// Free buffer `id`.
    Free { id: usize },
}

/// Layers in the model.
pub const LAYERS: usize = 32;
/// Ranks the gradient shards are cut for.
pub const WORLD: u64 = 8;

const MIB: u64 = 1 << 20;

/// Layer sizes of a Llama-like model with hidden size 4096, FSDP-wrapped per
/// attention and per MLP block, bf16: the embedding (32000 × 4096, 250 MiB), 15 pairs of
/// attention (4 × 4096², plus its norm: 128 MiB + 8 KiB) and MLP (3 × 4096 × 10880 plus
/// its norm: 255 MiB + 8 KiB) units, and the final norm with a 1 MiB bias/scale bundle.
pub fn layer_sizes() -> Vec<u64> {
    let h: u64 = 4096;
    let mut v = vec![32000 * h * 2];
    for _ in 0..(LAYERS - 2) / 2 {
        v.push(4 * h * h * 2 + h * 2);
        v.push(3 * h * 10880 * 2 + h * 2);
    }
    v.push(MIB + h * 2);
    assert_eq!(v.len(), LAYERS);
    v
}

/// Adversarial layer sizes: a fixed mix from 1 MiB to 256 MiB (seeded, log-uniform, plus
/// both extremes), not multiples of 512 where a real model's would not be.
pub fn random_layer_sizes() -> Vec<u64> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..LAYERS)
        .map(|l| match l {
            0 => 256 * MIB,
            l if l == LAYERS - 1 => MIB,
            _ => {
                let log2 = (next() % 9) as u32; // 1 MiB .. 256 MiB
                let base = MIB << log2;
                // Jitter within the octave, in 2-byte (bf16) elements.
                base + (next() % base) / 2 * 2
            }
        })
        .map(|b: u64| b.min(256 * MIB))
        .collect()
}

/// The trace for `steps` steps. Buffer ids are unique per step (and reused across
/// steps), so `id` indexes a table of live buffers of size `buffers()`.
pub fn trace(steps: usize) -> Vec<TraceOp> {
    trace_of(&layer_sizes(), steps)
}

/// The trace for `steps` steps over the given per-layer all-gather sizes.
pub fn trace_of(sizes: &[u64], steps: usize) -> Vec<TraceOp> {
    let sizes = sizes.to_vec();
    let ag = |l: usize| l;
    let grad = |l: usize| LAYERS + l;
    let shard = |l: usize| 2 * LAYERS + l;
    let mut ops = Vec::new();
    for _ in 0..steps {
        // Forward: gather layer l, then drop layer l-1; the last layer stays for backward.
        for l in 0..LAYERS {
            ops.push(TraceOp::Alloc {
                id: ag(l),
                bytes: sizes[l],
            });
            if l > 0 {
                ops.push(TraceOp::Free { id: ag(l - 1) });
            }
        }
        // Backward: layer l re-gathers (prefetched while l+1 is live), gets its gradient
        // and gradient shard; then layer l+1's buffers go.
        for l in (0..LAYERS).rev() {
            if l + 1 < LAYERS {
                ops.push(TraceOp::Alloc {
                    id: ag(l),
                    bytes: sizes[l],
                });
            }
            ops.push(TraceOp::Alloc {
                id: grad(l),
                bytes: sizes[l],
            });
            ops.push(TraceOp::Alloc {
                id: shard(l),
                bytes: sizes[l].div_ceil(WORLD),
            });
            if l + 1 < LAYERS {
                ops.push(TraceOp::Free { id: ag(l + 1) });
                ops.push(TraceOp::Free { id: grad(l + 1) });
                ops.push(TraceOp::Free { id: shard(l + 1) });
            }
        }
        ops.push(TraceOp::Free { id: ag(0) });
        ops.push(TraceOp::Free { id: grad(0) });
        ops.push(TraceOp::Free { id: shard(0) });
    }
    ops
}

/// Size of the live-buffer table the ids index.
pub fn buffers() -> usize {
    3 * LAYERS
}

/// The `fsdp_step` example's workload on its registered pool: 8 layers of hidden 4096
/// in f32 on 2 ranks. Each layer's weight is 4096 × 4096 f32 = 64 MiB gathered and
/// 32 MiB per rank sharded.
pub mod example {
    use super::TraceOp;

    /// Layers.
    pub const LAYERS: usize = 8;
    /// Ranks.
    pub const WORLD: u64 = 2;
    const H: u64 = 4096;
    /// One gathered weight (and one unsharded weight gradient): 64 MiB.
    pub const FULL: u64 = H * H * 4;
    const SHARD: u64 = FULL / WORLD;

    fn shard(l: usize) -> usize {
        l
    }
    fn ag(l: usize) -> usize {
        LAYERS + l
    }
    fn dw(l: usize) -> usize {
        2 * LAYERS + l
    }
    fn dw_shard(l: usize) -> usize {
        3 * LAYERS + l
    }

    /// Size of the live-buffer table the ids index.
    pub fn buffers() -> usize {
        4 * LAYERS
    }

    /// The persistent buffers of the registered pool, allocated once before the first
    /// step and never freed: the parameter shards (8 × 32 MiB), the all-gathers'
    /// inputs. The activations, their gradients and the loss sum live in the
    /// example's unregistered pool (no collective touches them).
    pub fn setup() -> Vec<TraceOp> {
        (0..LAYERS)
            .map(|l| TraceOp::Alloc {
                id: shard(l),
                bytes: SHARD,
            })
            .collect()
    }

    /// One training step, as `examples/fsdp_step.rs` allocates it: forward gathers
    /// layer l+1 before dropping layer l; backward gathers layer l-1 ahead, allocates
    /// layer l's weight gradient and its shard, drops layer l's parameters, and keeps
    /// one gradient pair alive (the previous layer's goes when the next is made).
    pub fn step() -> Vec<TraceOp> {
        let mut ops = vec![TraceOp::Alloc {
            id: ag(0),
            bytes: FULL,
        }];
        for l in 0..LAYERS {
            if l + 1 < LAYERS {
                ops.push(TraceOp::Alloc {
                    id: ag(l + 1),
                    bytes: FULL,
                });
            }
            ops.push(TraceOp::Free { id: ag(l) });
        }
        ops.push(TraceOp::Alloc {
            id: ag(LAYERS - 1),
            bytes: FULL,
        });
        let mut prev: Option<usize> = None;
        for l in (0..LAYERS).rev() {
            if l > 0 {
                ops.push(TraceOp::Alloc {
                    id: ag(l - 1),
                    bytes: FULL,
                });
            }
            ops.push(TraceOp::Alloc {
                id: dw(l),
                bytes: FULL,
            });
            ops.push(TraceOp::Alloc {
                id: dw_shard(l),
                bytes: SHARD,
            });
            ops.push(TraceOp::Free { id: ag(l) });
            if let Some(p) = prev {
                ops.push(TraceOp::Free { id: dw(p) });
                ops.push(TraceOp::Free { id: dw_shard(p) });
            }
            prev = Some(l);
        }
        if let Some(p) = prev {
            ops.push(TraceOp::Free { id: dw(p) });
            ops.push(TraceOp::Free { id: dw_shard(p) });
        }
        ops
    }
}
