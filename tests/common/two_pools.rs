//! The FSDP pattern on one rank: a parameter pool whose buffers are all-gathered on one
//! thread and a gradient pool whose buffers are reduce-scattered on another, each pool
//! with communicators of its own, each thread alternating allocations (some of which
//! grow its pool) and collectives, in interleavings that differ between the ranks.
//! A thread's outcome is its first failure: a call's error, or "wrong data" when a
//! result is not what every rank put in.

use std::sync::Barrier;
use symmpool::{Coll, CollectiveCalls, ReduceOp, Stream, SymmBuffer, SymmPool};

/// f32 elements per rank of the smallest gathered buffer.
const CHUNK: usize = 1024;

/// Yield `n` times: the threads of a rank interleave differently from one rank to the
/// next (nothing waits on it; it only shifts who runs first).
fn shuffle(n: usize) {
    for _ in 0..n {
        std::thread::yield_now();
    }
}

/// The parameter thread: per iteration, allocate a gathered buffer (growing the pool
/// every few iterations: the last three buffers stay alive), fill this rank's shard,
/// all-gather it in place and check every rank's shard.
fn params_thread(pool: &SymmPool, coll: &Coll, iterations: usize) -> Result<(), String> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let mut live: Vec<SymmBuffer> = Vec::new();
    for i in 0..iterations {
        shuffle((rank * 7 + i * 3) % 5);
        let n = CHUNK * (1 + i % 4) + i * 4096;
        let buf = pool
            .alloc((world * n * 4) as u64, &stream)
            .map_err(|e| format!("params iteration {i}: alloc: {e}"))?;
        let shard: Vec<f32> = (0..n)
            .map(|k| (rank * 100_000 + i * 100 + k % 97) as f32)
            .collect();
        let fill = || -> symmpool::Result<()> {
            buf.view::<f32>()?
                .slice(rank * n, n)?
                .copy_from_host(&shard)
        };
        fill().map_err(|e| format!("params iteration {i}: write: {e}"))?;
        shuffle((rank + i) % 3);
        coll.tagged(0)
            .all_gather_in_place::<f32>(&buf, &stream)
            .map_err(|e| format!("params iteration {i}: all-gather: {e}"))?;
        let all = buf
            .read::<f32>()
            .map_err(|e| format!("params iteration {i}: read: {e}"))?;
        for r in 0..world {
            for k in [0, n / 2, n - 1] {
                let want = (r * 100_000 + i * 100 + k % 97) as f32;
                if all[r * n + k] != want {
                    return Err(format!(
                        "params iteration {i}: wrong data: rank {r}'s element {k} is {}, expected {want}",
                        all[r * n + k]
                    ));
                }
            }
        }
        live.push(buf);
        if live.len() > 3 {
            live.remove(0);
        }
    }
    Ok(())
}

/// The gradient thread: per iteration, allocate an input of every rank's gradients
/// and an output shard, reduce-scatter (sum) and check the shard.
fn grads_thread(pool: &SymmPool, coll: &Coll, iterations: usize) -> Result<(), String> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let mut live: Vec<SymmBuffer> = Vec::new();
    for i in 0..iterations {
        shuffle((rank * 5 + i) % 4);
        let n = CHUNK * (1 + (i + 1) % 3) + i * 2048;
        let step = |what: &str, e: symmpool::Error| format!("grads iteration {i}: {what}: {e}");
        let input = pool
            .alloc((world * n * 4) as u64, &stream)
            .map_err(|e| step("alloc input", e))?;
        let output = pool
            .alloc((n * 4) as u64, &stream)
            .map_err(|e| step("alloc output", e))?;
        let mine: Vec<f32> = (0..world * n).map(|k| (k % 89 + rank + i) as f32).collect();
        input.write(&mine).map_err(|e| step("write", e))?;
        shuffle((rank * 3 + i) % 4);
        coll.tagged(0)
            .reduce_scatter::<f32>(&input, &output, ReduceOp::Sum, &stream)
            .map_err(|e| step("reduce-scatter", e))?;
        let got = output.read::<f32>().map_err(|e| step("read", e))?;
        let ranks = (world * (world - 1) / 2) as f32;
        for k in [0, n / 3, n - 1] {
            let want = world as f32 * (((rank * n + k) % 89 + i) as f32) + ranks;
            if got[k] != want {
                return Err(format!(
                    "grads iteration {i}: wrong data: element {k} is {}, expected {want}",
                    got[k]
                ));
            }
        }
        live.push(input);
        if live.len() > 2 {
            live.remove(0);
        }
    }
    Ok(())
}

/// One rank's part: handles for both pools (collective, in order), then the two
/// threads, started together; each thread's outcome.
pub fn params_and_grads(
    params: &SymmPool,
    grads: &SymmPool,
    iterations: usize,
) -> [Result<(), String>; 2] {
    let colls = Coll::new(params).and_then(|p| Ok((p, Coll::new(grads)?)));
    let (pc, gc) = match colls {
        Ok(c) => c,
        Err(e) => return [Err(format!("Coll::new: {e}")), Err("not run".into())],
    };
    let start = Barrier::new(2);
    let out = std::thread::scope(|s| {
        let a = s.spawn(|| {
            start.wait();
            params_thread(params, &pc, iterations)
        });
        let b = s.spawn(|| {
            start.wait();
            grads_thread(grads, &gc, iterations)
        });
        [
            a.join()
                .unwrap_or_else(|_| Err("the params thread panicked".into())),
            b.join()
                .unwrap_or_else(|_| Err("the grads thread panicked".into())),
        ]
    });
    let ended = pc.wait_checks().and_then(|()| gc.wait_checks());
    match (out, ended) {
        (out, Ok(())) => out,
        ([a, b], Err(e)) => [a.and(Err(format!("wait_checks: {e}"))), b],
    }
}
