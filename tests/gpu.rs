//! GPU tests through NCCL. Each declares how many GPUs it needs; with fewer it is
//! reported as ignored with the reason (a failure under `SYMMPOOL_REQUIRE_GPU=1`).
//!
//! One GPU (NCCL at world size 1): segments and windows, bounded teardown on a stream
//! that never finishes, cudarc access through `DevicePtr`/`DevicePtrMut` (every use on
//! other streams than the buffer's ordered against the others and its reuse, uses under
//! capture kept out of the buffer's events), collectives (all-reduce
//! with every reduction and type included) on NCCL's one-rank path, a step's collectives captured in a CUDA graph and replayed. Two GPUs: registration once per segment, collectives against a
//! host reference for every type, reduction and placement, stream-safe reuse under a
//! long-running kernel, bad input, checked collectives (every divergence kind of
//! `common::checked` under `Strict`, the ones that still pair up on the device under
//! `Async`). The trials run one at a time (each builds its own
//! NCCL world).
//!
//! Set-up in processes: the binary re-executes itself as the ranks of a scenario
//! (`SYMMPOOL_GPU_CHILD`, torchrun's variables, `CUDA_VISIBLE_DEVICES` unset; see
//! `common::gpu::spawn_ranks`), bounded, with every child killed on every path. One
//! GPU: set-up from the environment at world size 1, adoption of a communicator made
//! outside the crate, set-up (control communicator, blocking data communicators,
//! warm-up) under deadlines, the watchdog, raw streams. Two GPUs: set-up in two processes with collectives, and `kill -9` of one
//! rank inside a window registration and inside a collective.

#[cfg(not(feature = "nccl"))]
fn main() {
    println!("the GPU tests need the `nccl` feature");
}

#[cfg(feature = "nccl")]
fn main() {
    // A rank process of a multi-process trial runs its scenario instead of the trials.
    if let Ok(scenario) = std::env::var(common::gpu::CHILD_VAR) {
        gpu_tests::child_main(&scenario);
    }
    gpu_tests::main();
}

#[cfg(feature = "nccl")]
#[path = "common/mod.rs"]
mod common;

#[cfg(feature = "nccl")]
#[path = "../examples/support/gpu_math.rs"]
mod gpu_math;

#[cfg(feature = "nccl")]
mod gpu_tests {
    use super::common;
    use super::gpu_math;

    use common::figures::{count, per_comm, segments};
    use common::gpu::{on_ranks, trial};
    use std::time::{Duration, SystemTime};
    use symmpool::coll::Path;
    use symmpool::{
        Coll, CollectiveCalls, Element, Error, Group, GroupConfig, PoolConfig, ReduceOp, Stream,
        SymmPool, bf16, f16,
    };

    const MIB: u64 = 1 << 20;

    fn group() -> GroupConfig {
        GroupConfig::default().with_timeout(Duration::from_secs(60))
    }

    fn config() -> PoolConfig {
        PoolConfig::default()
    }

    /// A pool with [`config`] on `backend`, in a group of its own made with `group`.
    fn pool_on(backend: symmpool::Backend, group: GroupConfig) -> symmpool::Result<SymmPool> {
        SymmPool::new(&Group::new(backend, group)?, config())
    }

    /// SplitMix64, seeded per run (printed) so every run checks fresh data.
    use common::rng::Rng;

    trait Values {
        fn value<T: Element>(&mut self) -> T;
    }

    impl Values for Rng {
        /// A value in [-4, 4) with 7 significant bits: exact in bf16, so sums of two are
        /// exact in every type and NCCL's result must equal the host's bit for bit.
        fn value<T: Element>(&mut self) -> T {
            T::from_f64(((self.next() % 1024) as f64 - 512.0) / 128.0)
        }
    }

    fn seed() -> u64 {
        let s = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        eprintln!("seed {s}");
        s
    }

    fn gpu_registers_once_per_segment_and_communicator() {
        let pools = common::gpu::world(2, &group(), config());
        let out = on_ranks(&pools, |pool, stream| {
            let step = || {
                let bufs: Vec<_> = [3 * MIB, 64 * MIB, 4096, 100 * MIB, 3 * MIB, 256 * MIB]
                    .iter()
                    .map(|&b| pool.alloc(b, stream).unwrap())
                    .collect();
                bufs.iter()
                    .map(|b| (b.segment(), b.offset_bytes()))
                    .collect::<Vec<_>>()
            };
            let first_places = step();
            let first = pool.memory_stats();
            let later_places = step();
            let later = pool.memory_stats();
            assert_eq!(first_places, later_places);
            let per = |m: &symmpool::observe::MemoryStats, what: &str| per_comm(pool, m, what);
            let first = (
                count(&first, "segment.all.current"),
                per(&first, "registrations"),
                per(&first, "windows"),
                first["growth_seconds"].as_f64(),
            );
            let later_registrations = per(&later, "registrations");
            pool.close().unwrap();
            (first, later_registrations, first_places)
        });
        for ((segs, registrations, windows, growth_seconds), later, places) in &out {
            let segs = *segs;
            eprintln!(
                "registrations {registrations:?} segments {segs} growth {:.1} ms",
                growth_seconds * 1e3
            );
            // Six buffers (432 MiB and a page) in at least one large segment and the
            // small-block segment; the registered growth policy packs them into few.
            assert!((2..=6).contains(&segs), "{segs} segments");
            assert_eq!(registrations, &vec![segs, segs, 0]);
            assert_eq!(windows, &vec![segs, segs, 0], "NCCL gave non-NULL windows");
            assert_eq!(later, registrations, "second step registered");
            assert_eq!(places, &out[0].2, "ranks placed differently");
        }
    }

    fn all_gather_case<T: Element>(
        pools: &[SymmPool],
        count: usize,
        in_place: bool,
        seed: u64,
    ) -> Path {
        let world = pools.len();
        let size = std::mem::size_of::<T>();
        let out = on_ranks(pools, |pool, stream| {
            let coll = Coll::new(pool).unwrap();
            let r = pool.rank();
            let mut rng = Rng(seed ^ r as u64);
            let mine: Vec<T> = (0..count).map(|_| rng.value()).collect();
            let output = pool.alloc((world * count * size) as u64, stream).unwrap();
            output
                .write(&vec![T::from_f64(99.0); world * count])
                .unwrap();
            let report = if in_place {
                output
                    .view::<T>()
                    .unwrap()
                    .slice(r * count, count)
                    .unwrap()
                    .copy_from_host(&mine)
                    .unwrap();
                coll.tagged(0)
                    .all_gather_in_place::<T>(&output, stream)
                    .unwrap()
            } else {
                let input = pool.alloc((count * size) as u64, stream).unwrap();
                input.write(&mine).unwrap();
                coll.tagged(0)
                    .all_gather::<T>(&input, &output, stream)
                    .unwrap()
            };
            (report.path, output.read::<T>().unwrap())
        });
        let want: Vec<T> = (0..world)
            .flat_map(|r| {
                let mut rng = Rng(seed ^ r as u64);
                (0..count).map(move |_| rng.value::<T>())
            })
            .collect();
        for (_, got) in &out {
            assert!(
                got == &want,
                "{:?} all-gather count {count} in_place {in_place} differs",
                T::DTYPE
            );
        }
        assert!(
            out.iter().all(|o| o.0 == out[0].0),
            "ranks took different paths"
        );
        out[0].0
    }

    fn reduce_scatter_case<T: Element>(
        pools: &[SymmPool],
        count: usize,
        in_place: bool,
        op: ReduceOp,
        seed: u64,
    ) -> Path {
        let world = pools.len();
        let size = std::mem::size_of::<T>();
        let data = |r: usize| {
            let mut rng = Rng(seed ^ (r as u64 + 100));
            (0..world * count)
                .map(|_| rng.value::<T>())
                .collect::<Vec<T>>()
        };
        let out = on_ranks(pools, |pool, stream| {
            let coll = Coll::new(pool).unwrap();
            let r = pool.rank();
            let input = pool.alloc((world * count * size) as u64, stream).unwrap();
            input.write(&data(r)).unwrap();
            if in_place {
                let rep = coll
                    .tagged(0)
                    .reduce_scatter_in_place::<T>(&input, op, stream)
                    .unwrap();
                (
                    rep.path,
                    input.read::<T>().unwrap()[r * count..(r + 1) * count].to_vec(),
                )
            } else {
                let output = pool.alloc((count * size) as u64, stream).unwrap();
                output.write(&vec![T::from_f64(99.0); count]).unwrap();
                let rep = coll
                    .tagged(0)
                    .reduce_scatter::<T>(&input, &output, op, stream)
                    .unwrap();
                (rep.path, output.read::<T>().unwrap())
            }
        });
        let inputs: Vec<Vec<T>> = (0..world).map(data).collect();
        for (rank, (_, got)) in out.iter().enumerate() {
            for i in 0..count {
                let vals = inputs.iter().map(|d| d[rank * count + i].to_f64());
                let x = match op {
                    ReduceOp::Sum => vals.sum::<f64>(),
                    ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                    _ => unreachable!(),
                };
                let want = T::from_f64(x);
                assert!(
                    got[i] == want,
                    "{:?} {op:?} rank {rank} element {i}: {:?} != {want:?}",
                    T::DTYPE,
                    got[i]
                );
            }
        }
        out[0].0
    }

    /// NCCL's all-reduce of `inputs` (one per rank) as the host computes it: in rank
    /// order, rounding to `T` after each step; floating-point averages scale each
    /// input by 1/ranks first, integer ones divide the (wrapped) sum.
    fn all_reduce_reference<T: Element>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
        let n = inputs.len() as f64;
        let premul = op == ReduceOp::Avg && T::DTYPE != symmpool::DType::U8;
        (0..inputs[0].len())
            .map(|i| {
                let mut vals = inputs.iter().map(|d| {
                    let x = d[i].to_f64();
                    if premul { T::from_f64(x / n) } else { d[i] }
                });
                let first = vals.next().unwrap();
                let acc = vals.fold(first, |a, b| {
                    let (a, b) = (a.to_f64(), b.to_f64());
                    T::from_f64(match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + b,
                        ReduceOp::Prod => a * b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                    })
                });
                if op == ReduceOp::Avg && !premul {
                    T::from_f64(acc.to_f64() / n)
                } else {
                    acc
                }
            })
            .collect()
    }

    fn all_reduce_case<T: Element>(
        pools: &[SymmPool],
        count: usize,
        in_place: bool,
        op: ReduceOp,
        seed: u64,
    ) -> Path {
        let world = pools.len();
        let size = std::mem::size_of::<T>();
        let data = |r: usize| {
            let mut rng = Rng(seed ^ (r as u64 + 200));
            (0..count).map(|_| rng.value::<T>()).collect::<Vec<T>>()
        };
        let out = on_ranks(pools, |pool, stream| {
            let coll = Coll::new(pool).unwrap();
            let input = pool.alloc((count * size) as u64, stream).unwrap();
            input.write(&data(pool.rank())).unwrap();
            if in_place {
                let rep = coll
                    .tagged(0)
                    .all_reduce_in_place::<T>(&input, op, stream)
                    .unwrap();
                (rep.path, input.read::<T>().unwrap())
            } else {
                let output = pool.alloc((count * size) as u64, stream).unwrap();
                output.write(&vec![T::from_f64(99.0); count]).unwrap();
                let rep = coll
                    .tagged(0)
                    .all_reduce::<T>(&input, &output, op, stream)
                    .unwrap();
                (rep.path, output.read::<T>().unwrap())
            }
        });
        let want = all_reduce_reference(op, &(0..world).map(data).collect::<Vec<_>>());
        for (rank, (_, got)) in out.iter().enumerate() {
            if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
                panic!(
                    "{:?} {op:?} all-reduce x{count} in_place {in_place} rank {rank} element {i}: {:?} != {:?}",
                    T::DTYPE,
                    got[i],
                    want[i]
                );
            }
        }
        assert!(
            out.iter().all(|o| o.0 == out[0].0),
            "ranks took different paths"
        );
        out[0].0
    }

    /// Every reduction on every element type, both placements, at `count` elements.
    fn all_reduce_cases(pools: &[SymmPool], count: usize, seed: u64) {
        use ReduceOp::{Avg, Max, Min, Prod, Sum};
        for in_place in [false, true] {
            for op in [Sum, Avg, Max, Min, Prod] {
                let p = all_reduce_case::<f32>(pools, count, in_place, op, seed);
                eprintln!("all_reduce f32 {op:?} x{count} in_place={in_place}: {p:?}");
                all_reduce_case::<bf16>(pools, count, in_place, op, seed);
                all_reduce_case::<f16>(pools, count, in_place, op, seed);
                all_reduce_case::<u8>(pools, count, in_place, op, seed);
            }
        }
    }

    fn gpu_collectives_match_a_host_reference() {
        let pools = common::gpu::world(2, &group(), config());
        let seed = seed();
        // Element counts whose byte sizes are not multiples of 512, small (symmetric
        // kernel) and large (copy engine / ring) per rank.
        for count in [1, 1000, 123_457, 10_000_001] {
            for in_place in [false, true] {
                let p = all_gather_case::<f32>(&pools, count, in_place, seed);
                eprintln!("all_gather f32 x{count} in_place={in_place}: {p:?}");
                all_gather_case::<f16>(&pools, count, in_place, seed);
                all_gather_case::<bf16>(&pools, count, in_place, seed);
                all_gather_case::<u8>(&pools, count, in_place, seed);
                let p = reduce_scatter_case::<bf16>(&pools, count, in_place, ReduceOp::Sum, seed);
                eprintln!("reduce_scatter bf16 x{count} in_place={in_place}: {p:?}");
                reduce_scatter_case::<f32>(&pools, count, in_place, ReduceOp::Sum, seed);
                reduce_scatter_case::<f16>(&pools, count, in_place, ReduceOp::Sum, seed);
                reduce_scatter_case::<u8>(&pools, count, in_place, ReduceOp::Sum, seed);
                reduce_scatter_case::<f32>(&pools, count, in_place, ReduceOp::Max, seed);
            }
        }
        // The automatic choice took every path somewhere above.
        assert_eq!(
            all_gather_case::<f32>(&pools, 1000, true, seed),
            Path::SymmetricKernel
        );
        assert_eq!(
            all_gather_case::<f32>(&pools, 10_000_001, true, seed),
            Path::CopyEngine
        );
        assert_eq!(
            reduce_scatter_case::<f32>(&pools, 10_000_001, false, ReduceOp::Sum, seed),
            Path::PlainKernel
        );
        assert_eq!(
            reduce_scatter_case::<f32>(&pools, 1000, false, ReduceOp::Sum, seed),
            Path::SymmetricKernel
        );
        for count in [1, 1000, 123_457] {
            all_reduce_cases(&pools, count, seed);
        }
        all_reduce_case::<f32>(&pools, 10_000_001, false, ReduceOp::Avg, seed);
        assert_eq!(
            all_reduce_case::<bf16>(&pools, 10_000_001, true, ReduceOp::Sum, seed),
            Path::SymmetricKernel
        );
        assert_eq!(
            all_reduce_case::<f32>(&pools, 1000, false, ReduceOp::Max, seed),
            Path::PlainKernel
        );
    }

    fn gpu_block_freed_under_a_long_kernel_is_not_overwritten_early() {
        let pools = common::gpu::world(2, &group(), config());
        let results = on_ranks(&pools, |pool, stream_a| {
            let stream_b = pool.new_stream().unwrap();
            let cuda_a = stream_a.cuda_stream().unwrap().clone();
            let blas = gpu_math::Blas::new(cuda_a.clone()).unwrap();
            let n = 8192usize;
            // Scratch for a long GEMM chain on stream A (not from the pool's cached sizes).
            let mut scratch = pool.alloc((3 * n * n * 2) as u64, stream_a).unwrap();
            // A, B and C: three n×n bf16 matrices inside `scratch`.
            let (ab, mut c) = (scratch.cuda_mut::<bf16>().unwrap())
                .split_at_mut(2 * n * n)
                .unwrap();
            let (a, b) = ab.split_at_mut(n * n).unwrap();
            let gemm = gpu_math::dense(false, false, n, n, n, 1.0, 0.0).unwrap();
            let len = 4 * MIB;
            let x = pool.alloc(len, stream_a).unwrap();
            let y = pool.alloc(len, stream_a).unwrap();
            x.write(&vec![7u8; len as usize]).unwrap();
            let (xp, yp) = (x.device_ptr().unwrap(), y.device_ptr().unwrap());
            let (x_seg, x_off) = (x.segment(), x.offset_bytes());
            // Stream A: ~100 ms of GEMMs, then read X into Y.
            for _ in 0..60 {
                blas.gemm_bf16(&gemm, &a, &b, &mut c).unwrap();
            }
            // SAFETY: x and y are live 4 MiB device buffers of this rank.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(yp, xp, len as usize, cuda_a.cu_stream())
                    .unwrap();
            }
            // Free X while stream A still has to read it, and take the same block on B.
            drop(x);
            let x2 = pool.alloc(len, &stream_b).unwrap();
            assert_eq!(
                (x2.segment(), x2.offset_bytes()),
                (x_seg, x_off),
                "cache hit on the same block"
            );
            // Overwrite it on stream B right away: the pool's wait must hold this back.
            let cuda_b = stream_b.cuda_stream().unwrap().clone();
            // SAFETY: x2 is a live 4 MiB device buffer.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    x2.device_ptr().unwrap(),
                    0xEE,
                    len as usize,
                    cuda_b.cu_stream(),
                )
                .unwrap();
            }
            cuda_b.synchronize().unwrap();
            cuda_a.synchronize().unwrap();
            let got = y.read::<u8>().unwrap();
            // Control: without the pool's wait the same pattern corrupts Y (shows the race
            // is real on this machine).
            let z = pool.alloc(len, stream_a).unwrap();
            let w = pool.alloc(len, stream_a).unwrap();
            z.write(&vec![7u8; len as usize]).unwrap();
            for _ in 0..60 {
                blas.gemm_bf16(&gemm, &a, &b, &mut c).unwrap();
            }
            // SAFETY: z and w are live 4 MiB buffers; the raw memset on B bypasses the pool.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    w.device_ptr().unwrap(),
                    z.device_ptr().unwrap(),
                    len as usize,
                    cuda_a.cu_stream(),
                )
                .unwrap();
                cudarc::driver::result::memset_d8_async(
                    z.device_ptr().unwrap(),
                    0xEE,
                    len as usize,
                    cuda_b.cu_stream(),
                )
                .unwrap();
            }
            cuda_b.synchronize().unwrap();
            cuda_a.synchronize().unwrap();
            let control = w.read::<u8>().unwrap();
            drop((x2, y, z, w, scratch));
            (got.iter().all(|&v| v == 7), control.contains(&0xEE))
        });
        for (safe, raced) in results {
            assert!(
                safe,
                "the reused block was overwritten before stream A read it"
            );
            assert!(
                raced,
                "control: the unsynchronised overwrite did not race (test too short?)"
            );
        }
    }

    fn gpu_bad_input_is_a_clear_error_and_the_pool_stays_usable() {
        let pools = common::gpu::world(2, &group(), config());
        let out = on_ranks(&pools, |pool, stream| {
            assert!(matches!(pool.alloc(0, stream), Err(Error::ZeroSize)));
            assert!(matches!(
                pool.alloc(u64::MAX, stream),
                Err(Error::TooLarge { .. })
            ));
            assert!(matches!(
                pool.alloc_aligned(4096, 12345, stream),
                Err(Error::BadAlignment { .. })
            ));
            let keep = pool.alloc(MIB, stream).unwrap();
            keep.write(&[5u8; 64]).unwrap();
            // More than the GPU has: ncclMemAlloc fails; every rank gets the error.
            let err = pool.alloc(512 << 30, stream).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::PoolLimit { .. } | Error::DeviceOutOfMemory { .. }
                ),
                "{err:?}"
            );
            assert_eq!(&keep.read::<u8>().unwrap()[..64], &[5u8; 64]);
            let again = pool.alloc(8 * MIB, stream).unwrap();
            drop((keep, again));
            // A host stream on the NCCL backend is refused.
            let host = Stream::host();
            assert!(matches!(pool.alloc(4096, &host), Err(Error::WrongStream)));
            pool.close().unwrap();
            assert!(matches!(pool.alloc(4096, stream), Err(Error::PoolClosed)));
        });
        assert_eq!(out.len(), 2);
    }

    /// One GPU: segments come from `ncclMemAlloc`, are registered once per registering
    /// communicator, and `close` deregisters and frees them all.
    fn one_gpu_segments_windows_and_close() {
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let stream = pool.new_stream().unwrap();
        let bufs: Vec<_> = [3 * MIB, 64 * MIB, 4096]
            .iter()
            .map(|&b| pool.alloc(b, &stream).unwrap())
            .collect();
        let stats = pool.memory_stats();
        let segs = count(&stats, "segment.all.current");
        let (registrations, windows) = (
            per_comm(pool, &stats, "registrations"),
            per_comm(pool, &stats, "windows"),
        );
        let registering: Vec<bool> = pool
            .backend()
            .communicators()
            .iter()
            .map(|c| c.registers)
            .collect();
        eprintln!(
            "roles {:?} registrations {registrations:?} windows {windows:?} segments {segs} granularity {} B",
            (pool.backend().communicators().iter())
                .map(|c| c.role)
                .collect::<Vec<_>>(),
            pool.backend().granularity_bytes()
        );
        for (c, &r) in registering.iter().enumerate() {
            assert_eq!(registrations[c], if r { segs } else { 0 });
            assert!(windows[c] <= registrations[c]);
        }
        for b in &bufs {
            let p = b.device_ptr().unwrap();
            assert_eq!(
                (p - b.offset_bytes()) % pool.backend().granularity_bytes(),
                0,
                "segment bases are granularity-aligned"
            );
        }
        drop(bufs);
        pool.close().unwrap();
        let after = pool.memory_stats();
        assert_eq!(count(&after, "segment.all.current"), 0);
        let after_windows = per_comm(pool, &after, "windows");
        assert_eq!(after_windows, vec![0; after_windows.len()]);
        assert_eq!(per_comm(pool, &after, "deregistrations"), windows);
    }

    /// A host function that holds its stream until released (or 60 s pass).
    extern "C" fn hold_stream(user: *mut std::ffi::c_void) {
        // SAFETY: `user` is the `Arc<(Mutex<bool>, Condvar)>` leaked by `stuck_stream`, kept
        // alive by that leak until this function has run.
        let gate = unsafe { &*(user as *const (std::sync::Mutex<bool>, std::sync::Condvar)) };
        let mut released = gate.0.lock().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !*released && std::time::Instant::now() < deadline {
            released = gate
                .1
                .wait_timeout(released, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }

    /// Make `stream` stop at a host function until the returned gate is opened.
    fn stuck_stream(
        stream: &Stream,
    ) -> std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)> {
        stuck_cuda(stream.cuda_stream().unwrap())
    }

    /// [`stuck_stream`] for a cudarc stream.
    fn stuck_cuda(
        cs: &cudarc::driver::CudaStream,
    ) -> std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)> {
        let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let user = std::sync::Arc::into_raw(gate.clone()) as *mut std::ffi::c_void;
        // SAFETY: `cs` is a live stream; `hold_stream` only reads the gate behind `user`,
        // which is leaked (one strong count) and so outlives the call.
        let r = unsafe {
            cudarc::driver::sys::cuLaunchHostFunc(cs.cu_stream(), Some(hold_stream), user)
        };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        gate
    }

    /// Open a gate of [`stuck_stream`].
    fn open(gate: &(std::sync::Mutex<bool>, std::sync::Condvar)) {
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }

    /// Whether `event` completes within `bound` (polled).
    fn completes_within(event: &cudarc::driver::CudaEvent, bound: Duration) -> bool {
        let until = std::time::Instant::now() + bound;
        while !event.is_complete() {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// One GPU: a pool dropped while its stream never finishes (a peer stuck in a
    /// collective looks like this) returns within its timeout and leaks its memory on
    /// purpose instead of freeing it under running work.
    fn one_gpu_drop_on_a_stuck_stream_returns_within_the_timeout() {
        let timeout = Duration::from_secs(2);
        let pools = common::gpu::world(1, &group().with_timeout(timeout), config());
        let pool = pools.into_iter().next().unwrap();
        let stream = pool.new_stream().unwrap();
        let buf = pool.alloc(8 * MIB, &stream).unwrap();
        let gate = stuck_stream(&stream);
        drop(buf); // its fence comes after the stuck host function
        assert!(
            matches!(pool.trim(), Err(Error::Timeout { .. })),
            "trim drains with a deadline"
        );
        let started = std::time::Instant::now();
        drop(pool);
        let took = started.elapsed();
        eprintln!("drop took {took:?} (timeout {timeout:?})");
        assert!(
            took >= timeout && took < timeout + Duration::from_secs(1),
            "{took:?}"
        );
        open(&gate);
        stream.cuda_stream().unwrap().synchronize().unwrap();
    }

    /// One GPU: cudarc reads and writes pool buffers through `DevicePtr`/`DevicePtrMut`,
    /// with no raw address in the caller's code.
    fn one_gpu_cudarc_reads_and_writes_pool_buffers() {
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let stream = pool.new_stream().unwrap();
        let cs = stream.cuda_stream().unwrap().clone();
        let buf = pool.alloc(4096 * 4, &stream).unwrap();
        let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        buf.write(&data).unwrap();
        let view = buf.view::<f32>().unwrap().slice(1000, 96).unwrap();
        let mut host = vec![0f32; 96];
        cs.memcpy_dtoh(&view.cuda().unwrap(), &mut host).unwrap();
        cs.synchronize().unwrap();
        assert_eq!(host, data[1000..1096]);
        let mut buf = buf;
        let (mut dst, _) = (buf.cuda_mut::<f32>().unwrap()).split_at_mut(96).unwrap();
        cs.memcpy_htod(&host, &mut dst).unwrap();
        cs.synchronize().unwrap();
        assert_eq!(buf.read::<f32>().unwrap()[..96], data[1000..1096]);
        drop(buf);
        pool.close().unwrap();
    }

    /// How a test reads a pool buffer on another stream.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Through {
        /// A `CudaView`, as cudarc asks for it on that stream.
        View,
        /// The raw address (the control: nothing orders the use).
        Raw,
    }

    /// Copy `src` (a pool buffer) into `dst` on `on`, through a view or raw.
    fn copy_on(
        on: &Arc<cudarc::driver::CudaStream>,
        src: &symmpool::SymmBuffer,
        dst: &mut cudarc::driver::CudaSlice<u8>,
        through: Through,
    ) {
        use cudarc::driver::DevicePtrMut;
        match through {
            Through::View => on
                .memcpy_dtod(&src.view::<u8>().unwrap().cuda().unwrap(), dst)
                .unwrap(),
            Through::Raw => {
                let len = src.len_bytes() as usize;
                let (d, _record) = dst.device_ptr_mut(on);
                // SAFETY: `src` and `dst` are live device buffers of `len` bytes.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        d,
                        src.device_ptr().unwrap(),
                        len,
                        on.cu_stream(),
                    )
                    .unwrap()
                }
            }
        }
    }

    /// One GPU: a `CudaView` used on a stream other than its buffer's is ordered like
    /// cudarc's own slices. Another stream, held at a host function, reads a buffer
    /// (through a view) that is then freed and taken again on a third stream, which
    /// overwrites it: the overwrite waits for the held read, whether a `Stream` wraps
    /// the reading stream (the pool records it) or not (an event joined at the free).
    /// And a view's stream waits for the memory's earlier users: a block freed on its
    /// stream under held work and taken again there is read on another stream only
    /// after that work. Controls through raw addresses show both races on this device.
    /// One CUDA stream has one id however it is wrapped.
    fn one_gpu_cuda_views_order_uses_on_other_streams() {
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let nccl = pool.backend().downcast_ref::<NcclBackend>().unwrap();
        let home = pool.new_stream().unwrap(); // the buffers' stream
        let reuse = pool.new_stream().unwrap(); // where freed memory is taken again
        let wrapped = pool.new_stream().unwrap(); // a reader a `Stream` wraps
        let bare = nccl.cuda_stream().unwrap(); // a reader no `Stream` wraps
        let wrapped_cs = wrapped.cuda_stream().unwrap().clone();
        let len = 4 * MIB as usize;

        // Stream identity: by context and raw handle, however often it is wrapped.
        assert_eq!(Stream::cuda(wrapped_cs.clone()).id(), wrapped.id());
        // SAFETY: a live stream of device 0's primary context, alive until after the
        // pool and the backend are dropped (`wrapped_cs` goes last).
        let adopted = unsafe { Stream::from_raw_cuda(pool.backend(), wrapped_cs.cu_stream()) };
        assert_eq!(adopted.unwrap().id(), wrapped.id());
        for _ in 0..100 {
            let again = Stream::cuda(wrapped_cs.clone());
            assert_eq!(again.id(), wrapped.id());
            drop(pool.alloc(4096, &again).unwrap());
        }

        // Free under a held read on `on`, take the memory again on `reuse`, overwrite
        // it there: (whether the overwrite completed while the read was held, whether
        // the read saw the data from before the free).
        let read_then_reuse = |on: &Arc<cudarc::driver::CudaStream>, through: Through| {
            let x = pool.alloc(len as u64, &home).unwrap();
            x.write(&vec![7u8; len]).unwrap();
            let mut y = on.alloc_zeros::<u8>(len).unwrap();
            on.synchronize().unwrap();
            let gate = stuck_cuda(on);
            copy_on(on, &x, &mut y, through);
            let (segment, offset) = (x.segment(), x.offset_bytes());
            drop(x);
            let mut x2 = pool.alloc(len as u64, &reuse).unwrap();
            assert_eq!((x2.segment(), x2.offset_bytes()), (segment, offset));
            let cs = reuse.cuda_stream().unwrap();
            cs.memset_zeros(&mut x2.cuda_mut::<u8>().unwrap()).unwrap();
            let overwritten = cs.record_event(None).unwrap();
            // Ordered, the overwrite cannot complete while the read is held: a second
            // shows it does not. Unordered, it completes at once.
            let bound = match through {
                Through::View => Duration::from_secs(1),
                Through::Raw => Duration::from_secs(30),
            };
            let early = completes_within(&overwritten, bound);
            open(&gate);
            on.synchronize().unwrap();
            cs.synchronize().unwrap();
            let mut got = vec![0u8; len];
            on.memcpy_dtoh(&y, &mut got).unwrap();
            on.synchronize().unwrap();
            drop(x2);
            (early, got.iter().all(|&b| b == 7))
        };
        for (name, on) in [("wrapped", &wrapped_cs), ("bare", &bare)] {
            let (early, intact) = read_then_reuse(on, Through::View);
            assert!(!early, "{name}: the reuse did not wait for the held read");
            assert!(intact, "{name}: the read saw the memory overwritten");
        }
        let (early, intact) = read_then_reuse(&bare, Through::Raw);
        assert!(early && !intact, "control: raw reads race with the reuse");

        // A block freed on `home` under held work, taken again on `home` (no wait: the
        // same stream), then read on `on`: (whether the read completed while the work
        // was held, whether it saw what the work wrote).
        let reuse_then_read = |on: &Arc<cudarc::driver::CudaStream>, through: Through| {
            let hs = home.cuda_stream().unwrap();
            let b1 = pool.alloc(len as u64, &home).unwrap();
            b1.write(&vec![7u8; len]).unwrap();
            let mut y = on.alloc_zeros::<u8>(len).unwrap();
            on.synchronize().unwrap();
            let gate = stuck_cuda(hs);
            // SAFETY: b1 is a live device buffer of `len` bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    b1.device_ptr().unwrap(),
                    0x11,
                    len,
                    hs.cu_stream(),
                )
                .unwrap();
            }
            let (segment, offset) = (b1.segment(), b1.offset_bytes());
            drop(b1);
            let b2 = pool.alloc(len as u64, &home).unwrap();
            assert_eq!((b2.segment(), b2.offset_bytes()), (segment, offset));
            copy_on(on, &b2, &mut y, through);
            let read = on.record_event(None).unwrap();
            let bound = match through {
                Through::View => Duration::from_secs(1),
                Through::Raw => Duration::from_secs(30),
            };
            let early = completes_within(&read, bound);
            open(&gate);
            hs.synchronize().unwrap();
            on.synchronize().unwrap();
            let mut got = vec![0u8; len];
            on.memcpy_dtoh(&y, &mut got).unwrap();
            on.synchronize().unwrap();
            drop(b2);
            (early, got.iter().all(|&b| b == 0x11))
        };
        for (name, on) in [("wrapped", &wrapped_cs), ("bare", &bare)] {
            let (early, after) = reuse_then_read(on, Through::View);
            assert!(!early, "{name}: the read did not wait for the earlier user");
            assert!(
                after,
                "{name}: the read saw the memory before its earlier user wrote"
            );
        }
        let (early, after) = reuse_then_read(&bare, Through::Raw);
        assert!(
            early && !after,
            "control: raw reads race with earlier users"
        );

        // Nothing failed on the way (a failure inside the views is returned here).
        drop(pool.alloc(4096, &home).unwrap());
        pool.close().unwrap();
        drop(pools);
        drop((home, reuse, wrapped, bare, wrapped_cs));
    }

    /// One GPU: views order every use of a buffer across streams, not only a stream's
    /// first, as cudarc's read and write events do. Each case holds the first use at a
    /// host function: a read on B after a write on A waits for the write (and sees it);
    /// a write on A after a read on B waits for the read (which sees the old data); a
    /// pool call on the buffer's own stream after a write on A waits for it. Without
    /// the ordering each later use completes at once and sees the wrong bytes.
    fn one_gpu_cuda_views_order_every_use_across_streams() {
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let nccl = pool.backend().downcast_ref::<NcclBackend>().unwrap();
        let home = pool.new_stream().unwrap();
        let (a, b) = (nccl.cuda_stream().unwrap(), nccl.cuda_stream().unwrap());
        let len = 4 * MIB as usize;
        let mut x = pool.alloc(len as u64, &home).unwrap();
        x.write(&vec![7u8; len]).unwrap();
        let filled = |v: u8| a.clone_htod(&vec![v; len]).unwrap();
        let (src22, src33, src44) = (filled(0x22), filled(0x33), filled(0x44));
        let mut y = b.alloc_zeros::<u8>(len).unwrap();
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        let all = |got: &[u8], v: u8| got.iter().all(|&g| g == v);
        let copy_out = |y: &cudarc::driver::CudaSlice<u8>| {
            let mut got = vec![0u8; len];
            b.memcpy_dtoh(y, &mut got).unwrap();
            b.synchronize().unwrap();
            got
        };

        // Write on A (held), then read on B.
        let gate = stuck_cuda(&a);
        a.memcpy_dtod(&src22, &mut x.cuda_mut::<u8>().unwrap())
            .unwrap();
        b.memcpy_dtod(&x.view::<u8>().unwrap().cuda().unwrap(), &mut y)
            .unwrap();
        let read = b.record_event(None).unwrap();
        let early = completes_within(&read, Duration::from_secs(1));
        open(&gate);
        a.synchronize().unwrap();
        assert!(!early, "the read on B did not wait for the write on A");
        assert!(all(&copy_out(&y), 0x22), "the read on B missed A's write");

        // Read on B (held), then write on A.
        let gate = stuck_cuda(&b);
        b.memcpy_dtod(&x.view::<u8>().unwrap().cuda().unwrap(), &mut y)
            .unwrap();
        a.memcpy_dtod(&src33, &mut x.cuda_mut::<u8>().unwrap())
            .unwrap();
        let written = a.record_event(None).unwrap();
        let early = completes_within(&written, Duration::from_secs(1));
        open(&gate);
        a.synchronize().unwrap();
        assert!(!early, "the write on A did not wait for the read on B");
        assert!(
            all(&copy_out(&y), 0x22),
            "the read on B saw A's later write"
        );
        assert!(all(&x.read::<u8>().unwrap(), 0x33));

        // Write on A (held), then the pool's own read on the buffer's stream, on a
        // thread of its own: still waiting a second later, and then it sees the write.
        let gate = stuck_cuda(&a);
        a.memcpy_dtod(&src44, &mut x.cuda_mut::<u8>().unwrap())
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (early, got) = std::thread::scope(|s| {
            let x = &x;
            s.spawn(move || tx.send(x.read::<u8>()).unwrap());
            let early = rx.recv_timeout(Duration::from_secs(1)).ok();
            open(&gate);
            let waited = early.is_none();
            let got = early.unwrap_or_else(|| {
                (rx.recv_timeout(Duration::from_secs(60))).expect("the pool's read never returned")
            });
            (!waited, got)
        });
        assert!(!early, "the pool's read did not wait for A's write");
        assert!(all(&got.unwrap(), 0x44), "the pool's read missed A's write");

        // Nothing failed on the way (a failure inside the views is returned here).
        drop(pool.alloc(4096, &home).unwrap());
        drop(x);
        pool.close().unwrap();
        drop(pools);
        drop((home, a, b));
    }

    /// One GPU: a view used on a stream that captures a CUDA graph waits for no event
    /// recorded outside the capture (CUDA would refuse the capture); the graph's
    /// launches do the use, ordered by the stream they run on.
    fn one_gpu_cuda_views_under_capture_keep_the_capture() {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let (home, capturing) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
        let cs = capturing.cuda_stream().unwrap().clone();
        let len = MIB as usize;
        let x = pool.alloc(len as u64, &home).unwrap();
        let mut y = pool.alloc(len as u64, &capturing).unwrap();
        // Events of x's on other streams before the capture, which it must not wait for.
        let other = pool.new_stream().unwrap();
        let os = other.cuda_stream().unwrap();
        let mut scratch = os.alloc_zeros::<u8>(len).unwrap();
        os.memcpy_dtod(&x.view::<u8>().unwrap().cuda().unwrap(), &mut scratch)
            .unwrap();
        os.synchronize().unwrap();
        cs.synchronize().unwrap();
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        let copied = cs.memcpy_dtod(
            &x.view::<u8>().unwrap().cuda().unwrap(),
            &mut y.cuda_mut::<u8>().unwrap(),
        );
        let graph = cs.end_capture(CUgraphInstantiate_flags(0));
        copied.unwrap();
        let graph = graph.unwrap().expect("a graph with the copy");
        for replay in 0..3u8 {
            x.write(&vec![replay + 1; len]).unwrap();
            home.cuda_stream().unwrap().synchronize().unwrap();
            graph.launch().unwrap();
            cs.synchronize().unwrap();
            let got = y.read::<u8>().unwrap();
            assert!(got.iter().all(|&v| v == replay + 1), "replay {replay}");
        }
        drop(graph);
        // Nothing failed on the way (a failure inside the views is returned here).
        drop(pool.alloc(4096, &home).unwrap());
        drop((x, y, scratch));
        pool.close().unwrap();
        drop(pools);
        drop((home, capturing, other));
    }

    /// One GPU: the collectives run through NCCL's one-rank path and move the data.
    fn one_gpu_collectives_at_world_size_one() {
        let pools = common::gpu::world(1, &group(), config());
        let seed = seed();
        for count in [1, 1000, 123_457] {
            for in_place in [false, true] {
                all_gather_case::<f32>(&pools, count, in_place, seed);
                all_gather_case::<bf16>(&pools, count, in_place, seed);
                reduce_scatter_case::<f32>(&pools, count, in_place, ReduceOp::Sum, seed);
                reduce_scatter_case::<bf16>(&pools, count, in_place, ReduceOp::Sum, seed);
            }
        }
    }

    /// One GPU: FSDP's two pools (parameters, gradients) on one backend, the gradient
    /// pool in a group of its own, over communicators of its own (`Group::split`: split
    /// off the control communicator and warmed up when it is made), each used from its own thread with its own stream
    /// and collectives handle: 20 interleaved rounds of growth and collectives, every
    /// one right.
    fn one_gpu_two_pools_on_two_threads_with_their_own_communicators() {
        let params = common::gpu::world(1, &group(), config()).remove(0);
        let own = params.group().split("grads").unwrap();
        let grads = SymmPool::new(&own, config().with_name("grads")).unwrap();
        let colls = [Coll::new(&params).unwrap(), Coll::new(&grads).unwrap()];
        std::thread::scope(|s| {
            for (pool, coll) in [&params, &grads].into_iter().zip(&colls) {
                s.spawn(move || {
                    let stream = pool.new_stream().unwrap();
                    let mut kept = Vec::new();
                    for i in 0..20usize {
                        let n = 1024 << (i % 8);
                        let buf = pool.alloc(4 * n as u64, &stream).unwrap();
                        buf.write(&vec![i as f32; n]).unwrap();
                        coll.tagged(0)
                            .all_gather_in_place::<f32>(&buf, &stream)
                            .unwrap();
                        coll.tagged(0)
                            .all_reduce_in_place::<f32>(&buf, ReduceOp::Sum, &stream)
                            .unwrap();
                        assert_eq!(buf.read::<f32>().unwrap(), vec![i as f32; n], "{i}");
                        kept.push(buf); // grow the pool now and then
                    }
                });
            }
        });
        drop(colls);
        grads.close().unwrap();
        params.close().unwrap();
    }

    /// One GPU: all-reduce through NCCL's one-rank path, every reduction and element
    /// type, both placements, on the symmetric kernel's path (sum on floating point)
    /// and the plain one.
    fn one_gpu_all_reduce_at_world_size_one() {
        let pools = common::gpu::world(1, &group(), config());
        let seed = seed();
        for count in [1, 1000, 123_457] {
            all_reduce_cases(&pools, count, seed);
        }
        assert_eq!(
            all_reduce_case::<f32>(&pools, 1000, true, ReduceOp::Sum, seed),
            Path::SymmetricKernel
        );
        assert_eq!(
            all_reduce_case::<u8>(&pools, 1000, true, ReduceOp::Sum, seed),
            Path::PlainKernel
        );
    }

    /// One GPU: a step's collectives (an all-gather and a reduce-scatter on pool
    /// buffers reserved before the capture) are captured into a CUDA graph on a
    /// blocking data communicator and replayed ten times with fresh inputs, each replay
    /// moving the data; the pool's growth is refused while the stream captures, and no
    /// completion event is recorded under capture (the watchdog stays quiet).
    fn one_gpu_captures_a_steps_collectives_in_a_cuda_graph_and_replays_them() {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let pools = common::gpu::world(1, &group(), config());
        let pool = &pools[0];
        let nccl = pool.backend().downcast_ref::<NcclBackend>().unwrap();
        assert!(
            (0..pool.backend().communicators().len()).all(|c| nccl.is_blocking(c) == Some(true)),
            "data communicators are blocking"
        );
        let coll = Coll::new(pool).unwrap();
        let stream = pool.new_stream().unwrap();
        pool.reserve(8 * MIB).unwrap();
        let count = 64 * 1024;
        let bytes = (count * 4) as u64;
        let ag_in = pool.alloc(bytes, &stream).unwrap();
        let ag_out = pool.alloc(bytes, &stream).unwrap();
        let rs_in = pool.alloc(bytes, &stream).unwrap();
        let rs_out = pool.alloc(bytes, &stream).unwrap();
        let before = segments(pool);
        let cs = stream.cuda_stream().unwrap().clone();
        cs.synchronize().unwrap();
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        assert!(
            pool.reserve(8 * MIB).is_err(),
            "growth is refused while the stream captures"
        );
        let captured = (|| -> symmpool::Result<()> {
            coll.tagged(0).all_gather::<f32>(&ag_in, &ag_out, &stream)?;
            coll.tagged(0)
                .reduce_scatter::<f32>(&rs_in, &rs_out, ReduceOp::Sum, &stream)?;
            Ok(())
        })();
        let graph = cs.end_capture(CUgraphInstantiate_flags(0));
        captured.expect("collectives under capture");
        let graph = graph.unwrap().expect("a graph with the collectives");
        assert_eq!(segments(pool), before);
        for replay in 0..10 {
            let a: Vec<f32> = (0..count).map(|i| (i * 3 + replay) as f32).collect();
            let b: Vec<f32> = (0..count).map(|i| (i * 7 + 2 * replay) as f32).collect();
            ag_in.write(&a).unwrap();
            rs_in.write(&b).unwrap();
            graph.launch().unwrap();
            // At world size 1 the all-gather and the reduce-scatter are copies.
            assert_eq!(ag_out.read::<f32>().unwrap(), a, "replay {replay}");
            assert_eq!(rs_out.read::<f32>().unwrap(), b, "replay {replay}");
        }
        assert!(
            nccl.health().is_ok(),
            "the watchdog saw nothing to time out"
        );
        drop(graph);
        drop((ag_in, ag_out, rs_in, rs_out));
        pool.close().unwrap();
    }

    // ---------------------------------------------------------------------------------
    // NCCL set-up, adoption, deadlines, watchdog, raw streams; one process per GPU.

    use std::sync::Arc;
    use symmpool::backend::nccl::CUstream;
    use symmpool::backend::{
        CollArgs, NcclBackend, NcclConfig, Refused, Segment, SegmentProvider, Window,
    };
    use symmpool::{DType, Exchange, LocalExchange};

    /// One GPU: NCCL reports a world-size-1 backend made from the environment, in a
    /// process of its own, through a store on 127.0.0.1 (`collectives` scenario).
    fn one_gpu_from_env_in_a_process_at_world_size_one() {
        let status = common::gpu::spawn_ranks("collectives", 1).wait(Duration::from_secs(180));
        assert!(status[0].success(), "rank 0: {:?}", status[0]);
    }

    /// Two GPUs, two processes: set-up from torchrun's variables, pools and
    /// collectives checked against the expected values.
    fn two_gpus_from_env_in_two_processes() {
        let status = common::gpu::spawn_ranks("collectives", 2).wait(Duration::from_secs(240));
        for (r, s) in status.iter().enumerate() {
            assert!(s.success(), "rank {r}: {s:?}");
        }
    }

    /// Two GPUs, two processes: rank 1 is killed (SIGKILL) inside its first window
    /// registration; rank 0, in the same registration, gets a clear error within the
    /// call timeout (15 s) and exits; nothing hangs.
    fn two_gpus_kill_9_during_window_registration() {
        let status = common::gpu::spawn_ranks("kill-in-register", 2).wait(Duration::from_secs(180));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status[1].signal(),
            Some(9),
            "rank 1 was killed: {:?}",
            status[1]
        );
        assert!(
            status[0].success(),
            "rank 0 (the survivor): {:?}",
            status[0]
        );
    }

    /// Two GPUs, threads: the checked-collectives scenarios on NCCL (the same code as
    /// the host tests, `common::checked`). `Strict`: every divergence kind fails on
    /// both ranks at the divergent collective, before any data moves (the buffers are
    /// read back untouched). `Async`: within the bound, for the kinds whose divergent
    /// collectives still pair up on the device (same count, same communicator); where
    /// they do not (a skipped call, another count or path), NCCL waits on the device
    /// for a partner that never comes, and only the watchdog ends it, which is what
    /// `Strict` is for.
    fn gpu_checked_collectives_catch_every_divergence_on_nccl() {
        use common::checked::{ALL, Scenario, check_async, check_strict};
        use symmpool::backend::{NcclBackend, NcclConfig};
        let timeout = Duration::from_secs(5);
        let world = || NcclBackend::local_world(&[0, 1], NcclConfig::default()).unwrap();
        for s in ALL {
            let started = std::time::Instant::now();
            check_strict(world(), timeout, s);
            eprintln!(
                "Strict {s:?}: caught on both ranks before data moved ({:?})",
                started.elapsed()
            );
        }
        for s in [Scenario::FreeOrder, Scenario::CrossedPools] {
            let started = std::time::Instant::now();
            check_async(world(), timeout, s);
            eprintln!(
                "Async {s:?}: caught on both ranks within the bound ({:?})",
                started.elapsed()
            );
        }
    }

    /// Two GPUs, two processes: rank 1 is killed (SIGKILL) while rank 0's all-gather
    /// waits for it on the device; rank 0's watchdog (5 s) aborts the communicators and
    /// the next call fails; nothing hangs.
    fn two_gpus_kill_9_during_a_collective() {
        let status =
            common::gpu::spawn_ranks("kill-in-collective", 2).wait(Duration::from_secs(90));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status[1].signal(),
            Some(9),
            "rank 1 was killed: {:?}",
            status[1]
        );
        assert!(
            status[0].success(),
            "rank 0 (the survivor): {:?}",
            status[0]
        );
    }

    /// The entry point of a rank process (`SYMMPOOL_GPU_CHILD` set): runs the scenario
    /// and exits 0, or 1 on a panic (whose message is printed).
    pub fn child_main(scenario: &str) -> ! {
        let rank = std::env::var("RANK").unwrap_or_default();
        eprintln!("[rank {rank}] scenario {scenario}");
        let result = std::panic::catch_unwind(|| match scenario {
            "collectives" => child_collectives(),
            "kill-in-register" => child_kill_in_register(),
            "kill-in-collective" => child_kill_in_collective(),
            other => panic!("unknown scenario {other}"),
        });
        let code = i32::from(result.is_err());
        eprintln!("[rank {rank}] exits {code}");
        std::process::exit(code)
    }

    fn kill_myself() -> ! {
        // SAFETY: kill(2) on this process's own id; SIGKILL cannot be caught.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn child_collectives() {
        let backend = NcclBackend::launch(
            NcclConfig::default()
                .with_call_timeout(Duration::from_secs(30))
                .with_watchdog(Duration::from_secs(60)),
        )
        .expect("NcclBackend::launch");
        let (rank, world) = (backend.rank(), backend.world_size());
        assert_eq!(rank.to_string(), std::env::var("RANK").unwrap());
        assert_eq!(backend.info().nodes, 1, "one host");
        let nccl = backend.downcast_ref::<NcclBackend>().unwrap();
        assert_eq!(nccl.device(), rank, "LOCAL_RANK picks the GPU");
        eprintln!(
            "[rank {rank}] {:?} NCCL {}",
            backend.communicators(),
            backend.nccl_version()
        );
        let pool = pool_on(backend, group()).expect("pool");
        let coll = Coll::new(&pool).expect("collectives");
        let stream = pool.new_stream().unwrap();
        for n in [1usize, 1000, 3_000_001] {
            let input = pool.alloc((n * 4) as u64, &stream).unwrap();
            let output = pool.alloc((world * n * 4) as u64, &stream).unwrap();
            let mine: Vec<f32> = (0..n).map(|i| (rank * n + i) as f32).collect();
            input.write(&mine).unwrap();
            let rep = coll
                .tagged(0)
                .all_gather::<f32>(&input, &output, &stream)
                .unwrap();
            let want: Vec<f32> = (0..world * n).map(|i| i as f32).collect();
            assert_eq!(output.read::<f32>().unwrap(), want, "all-gather of {n}");
            eprintln!("[rank {rank}] all_gather x{n}: {:?}", rep.path);
            let whole = pool.alloc((world * n * 4) as u64, &stream).unwrap();
            let chunk = pool.alloc((n * 4) as u64, &stream).unwrap();
            whole
                .write(
                    &(0..world * n)
                        .map(|i| (i % 1000) as f32)
                        .collect::<Vec<_>>(),
                )
                .unwrap();
            let rep = coll
                .tagged(0)
                .reduce_scatter::<f32>(&whole, &chunk, ReduceOp::Sum, &stream)
                .unwrap();
            let want: Vec<f32> = (0..n)
                .map(|i| (world * ((rank * n + i) % 1000)) as f32)
                .collect();
            assert_eq!(chunk.read::<f32>().unwrap(), want, "reduce-scatter of {n}");
            eprintln!("[rank {rank}] reduce_scatter x{n}: {:?}", rep.path);
        }
        pool.close().unwrap();
    }

    /// A segment provider that kills its process at its first registration (after the
    /// pool's agreement, so the peer is inside `ncclCommWindowRegister`).
    #[derive(Debug)]
    struct KillAtRegister(Arc<dyn SegmentProvider>);

    impl SegmentProvider for KillAtRegister {
        fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
            self.0.allocate(size_bytes)
        }
        unsafe fn register(
            &self,
            _segment: &Segment,
            _comm: usize,
            _deadline: symmpool::Deadline,
        ) -> symmpool::Result<Option<Window>> {
            eprintln!("[rank 1] kill -9 inside the window registration");
            kill_myself()
        }
        unsafe fn deregister(
            &self,
            window: Window,
            deadline: symmpool::Deadline,
        ) -> std::result::Result<(), Refused<Window>> {
            // SAFETY: the caller's contract is passed on unchanged.
            unsafe { self.0.deregister(window, deadline) }
        }
        unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
            // SAFETY: the caller's contract is passed on unchanged.
            unsafe { self.0.free(segment) }
        }
    }

    fn child_kill_in_register() {
        let call_timeout = Duration::from_secs(15);
        let backend = NcclBackend::launch(NcclConfig::default().with_call_timeout(call_timeout))
            .expect("NcclBackend::launch");
        let rank = backend.rank();
        let backend = if rank == 1 {
            backend.with_segments(|inner| Arc::new(KillAtRegister(inner)))
        } else {
            backend
        };
        let pool = pool_on(backend, group().with_timeout(Duration::from_secs(20))).unwrap();
        let stream = pool.new_stream().unwrap();
        let started = std::time::Instant::now();
        let first = pool.alloc(4 * MIB, &stream);
        let took = started.elapsed();
        eprintln!("[rank {rank}] alloc after the peer died: {first:?} in {took:?}");
        assert!(
            first.is_err(),
            "a registration with a dead peer cannot succeed"
        );
        assert!(took < call_timeout + Duration::from_secs(10), "{took:?}");
        let again = pool.alloc(4 * MIB, &stream);
        eprintln!("[rank {rank}] next alloc: {again:?}");
        assert!(again.is_err(), "the pool stays failed");
        if let Some(nccl) = pool.backend().downcast_ref::<NcclBackend>() {
            eprintln!("[rank {rank}] backend health: {:?}", nccl.health());
        }
        drop(pool);
        eprintln!(
            "[rank {rank}] dropped the pool and backend in {:?}",
            started.elapsed()
        );
    }

    fn child_kill_in_collective() {
        let watchdog = Duration::from_secs(5);
        let backend = NcclBackend::launch(
            NcclConfig::default()
                .with_call_timeout(Duration::from_secs(15))
                .with_watchdog(watchdog),
        )
        .expect("NcclBackend::launch");
        let rank = backend.rank();
        let nccl = backend.downcast_ref::<NcclBackend>().unwrap();
        let plain = backend
            .communicators()
            .iter()
            .position(|c| !c.registers)
            .expect("a plain communicator");
        let stream = backend.streams().new_stream().unwrap();
        let g = backend.granularity_bytes();
        let send = backend.segments().allocate(g).unwrap();
        let recv = backend.segments().allocate(2 * g).unwrap();
        let count = g / 4;
        let gather = || {
            backend.collectives().all_gather(&CollArgs::new(
                plain,
                send.region(0, g).unwrap(),
                recv.region(0, 2 * g).unwrap(),
                count,
                DType::F32,
                ReduceOp::Sum,
                &stream,
                (None, None),
                symmpool::Deadline::after(Duration::from_secs(60)),
            ))
        };
        // Warm-up: connections made, both ranks alive.
        gather().expect("warm-up all-gather");
        stream.cuda_stream().unwrap().synchronize().unwrap();
        let barrier = backend
            .exchange()
            .open_channel(
                "test:barrier",
                symmpool::Deadline::after(Duration::from_secs(60)),
            )
            .unwrap();
        backend
            .exchange()
            .all_gather(
                barrier,
                "barrier",
                &[],
                symmpool::Deadline::after(Duration::from_secs(60)),
            )
            .unwrap();
        if rank == 1 {
            eprintln!("[rank 1] kill -9 before the next all-gather");
            kill_myself();
        }
        std::thread::sleep(Duration::from_millis(500));
        let started = std::time::Instant::now();
        let enqueued = gather();
        eprintln!("[rank 0] all-gather with a dead peer: {enqueued:?}");
        let bound = watchdog + Duration::from_secs(10);
        let error = match enqueued {
            Err(e) => e,
            Ok(()) => loop {
                if let Err(e) = nccl.health() {
                    break e;
                }
                assert!(
                    started.elapsed() < bound,
                    "no error after {:?}",
                    started.elapsed()
                );
                std::thread::sleep(Duration::from_millis(100));
            },
        };
        let took = started.elapsed();
        eprintln!("[rank 0] error after {took:?}: {error}");
        assert!(took < bound, "{took:?}");
        let next = gather();
        eprintln!("[rank 0] next all-gather: {next:?}");
        assert!(
            matches!(
                next,
                Err(Error::NcclWatchdog { .. } | Error::NcclAborted { .. })
            ),
            "{next:?}"
        );
        // The abort ended the stuck kernel: the stream drains.
        backend.streams().record_fence(&stream).unwrap();
        assert!(
            backend
                .streams()
                .drain(symmpool::Deadline::after(Duration::from_secs(10)))
                .unwrap(),
            "the stream drains after the abort"
        );
        eprintln!("[rank 0] stream drained after {:?}", started.elapsed());
        drop((send, recv)); // leaked on purpose: the process ends
        let dropping = std::time::Instant::now();
        drop(backend);
        let dropped = dropping.elapsed();
        eprintln!(
            "[rank 0] backend dropped in {dropped:?}; done in {:?}",
            started.elapsed()
        );
        // The aborts run on their own thread: a drop waits for them at most 10 s.
        assert!(dropped < Duration::from_secs(12), "drop took {dropped:?}");
    }

    /// The few raw NCCL functions a test calls to make a communicator outside the crate,
    /// from the same `libnccl.so.2` the crate loaded.
    struct RawNccl {
        _lib: libloading::os::unix::Library,
        get_unique_id: unsafe extern "C" fn(*mut cudarc::nccl::sys::ncclUniqueId) -> i32,
        init_rank: unsafe extern "C" fn(
            *mut cudarc::nccl::sys::ncclComm_t,
            i32,
            cudarc::nccl::sys::ncclUniqueId,
            i32,
        ) -> i32,
        count: unsafe extern "C" fn(cudarc::nccl::sys::ncclComm_t, *mut i32) -> i32,
        destroy: unsafe extern "C" fn(cudarc::nccl::sys::ncclComm_t) -> i32,
    }

    impl RawNccl {
        fn open() -> RawNccl {
            symmpool::backend::nccl::nccl_version().expect("the crate loads NCCL first");
            // SAFETY: RTLD_NOLOAD only returns the copy already loaded (the crate's).
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some("libnccl.so.2"),
                    libc::RTLD_NOLOAD | libloading::os::unix::RTLD_NOW,
                )
            }
            .expect("libnccl.so.2 is the copy the crate loaded");
            // SAFETY: the signatures are nccl.h's (ncclResult_t as int); the library stays
            // loaded while `RawNccl` holds it.
            unsafe {
                RawNccl {
                    get_unique_id: *lib.get(b"ncclGetUniqueId").unwrap(),
                    init_rank: *lib.get(b"ncclCommInitRank").unwrap(),
                    count: *lib.get(b"ncclCommCount").unwrap(),
                    destroy: *lib.get(b"ncclCommDestroy").unwrap(),
                    _lib: lib,
                }
            }
        }
    }

    /// One GPU: a communicator made outside the crate (plain, blocking
    /// `ncclCommInitRank`, world size 1) is adopted: the crate splits its non-blocking
    /// control communicator off it and its blocking data communicators off that, warms
    /// them up, pools and collectives run on them, and the parent is still usable (and
    /// destroyed by its owner) afterwards.
    fn one_gpu_adopts_a_communicator_made_outside_the_crate() {
        let nccl = RawNccl::open();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        ctx.bind_to_thread().unwrap();
        let mut id = cudarc::nccl::sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { (nccl.get_unique_id)(&mut id) }, 0);
        let mut parent: cudarc::nccl::sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer, device 0 current, world size 1.
        assert_eq!(unsafe { (nccl.init_rank)(&mut parent, 1, id, 0) }, 0);
        let exchange: Arc<dyn Exchange> = Arc::new(LocalExchange::group(1).remove(0));
        // SAFETY: `parent` is live on device 0, of the crate's NCCL, used by nobody else
        // during the call, and the exchange groups the same (single) rank.
        let backend = unsafe { NcclBackend::adopt(parent, 0, exchange, NcclConfig::default()) }
            .expect("adopt");
        eprintln!("adopted: {:?}", backend.communicators());
        assert_eq!(
            (backend.rank(), backend.world_size(), backend.info().nodes),
            (0, 1, 1)
        );
        let split = backend.downcast_ref::<NcclBackend>().unwrap();
        assert!(
            (0..backend.communicators().len()).all(|c| split.raw_comm(c) != Some(parent)),
            "the crate works on its own children"
        );
        assert!((0..backend.communicators().len()).all(|c| split.is_blocking(c) == Some(true)));
        eprintln!("warmed: {:?}", split.warmed());
        assert!(!split.warmed().is_empty());
        let pools = vec![pool_on(backend, group()).unwrap()];
        let seed = seed();
        for count in [1, 1000, 123_457] {
            all_gather_case::<f32>(&pools, count, false, seed);
            reduce_scatter_case::<bf16>(&pools, count, true, ReduceOp::Sum, seed);
        }
        pools[0].close().unwrap();
        drop(pools);
        let mut n = 0;
        // SAFETY: the parent is live (the crate never destroys it) and unused now.
        assert_eq!(unsafe { (nccl.count)(parent, &mut n) }, 0);
        assert_eq!(n, 1);
        // SAFETY: the parent is ours, live, and used by nothing any more.
        assert_eq!(unsafe { (nccl.destroy)(parent) }, 0);
    }

    /// One GPU: the control communicator is created non-blocking and polled; a set-up
    /// deadline that cannot be met is an `NcclTimeout` naming the step (creation,
    /// split, or a warm-up call) and leaves nothing behind: a world made right after
    /// works, warmed up on every (communicator, path) pair; registrations on the
    /// blocking data communicators finish under the call deadline.
    fn one_gpu_non_blocking_creation_and_registration_under_deadlines() {
        let zero = NcclConfig::default().with_setup_timeout(Duration::ZERO);
        match NcclBackend::local_world(&[0], zero) {
            Err(Error::NcclTimeout { op, waited }) => {
                eprintln!("set-up with a zero deadline: {op} after {waited:?}");
                assert!(
                    [
                        "ncclCommInitRankConfig",
                        "ncclCommSplit",
                        "ncclCommWindowRegister",
                        "ncclAllGather",
                        "ncclReduceScatter",
                        "ncclCommWindowDeregister",
                        "warm-up",
                    ]
                    .contains(&op),
                    "{op}"
                );
            }
            Ok(_) => eprintln!("NCCL finished creating at once (nothing to time out)"),
            Err(e) => panic!("{e}"),
        }
        let config_nccl = NcclConfig::default().with_call_timeout(Duration::from_secs(10));
        let backends =
            NcclBackend::local_world(&[0], config_nccl).expect("a world after the timeout");
        let pool = pool_on(backends.into_iter().next().unwrap(), group()).unwrap();
        let stream = pool.new_stream().unwrap();
        let started = std::time::Instant::now();
        let bufs: Vec<_> = [3 * MIB, 64 * MIB]
            .iter()
            .map(|&b| pool.alloc(b, &stream).unwrap())
            .collect();
        let registrations = per_comm(&pool, &pool.memory_stats(), "registrations");
        eprintln!("registrations {registrations:?} in {:?}", started.elapsed());
        assert!(registrations.iter().any(|&r| r > 0));
        let nccl = pool.backend().downcast_ref::<NcclBackend>().unwrap();
        assert!(nccl.health().is_ok());
        let roles = pool.backend().communicators();
        let warmed: Vec<_> = nccl
            .warmed()
            .iter()
            .map(|w| (w.role, w.collective))
            .collect();
        eprintln!("warmed: {warmed:?}");
        for (c, info) in roles.iter().enumerate() {
            assert!(
                nccl.warmed()
                    .iter()
                    .any(|w| w.comm == c && w.role == info.role),
                "communicator {c} warmed up"
            );
        }
        drop(bufs);
        pool.close().unwrap();
    }

    /// One GPU: a collective that never completes (its stream is held by a host
    /// function) trips the watchdog: the communicators are aborted and the next call
    /// fails with `NcclWatchdog`, within the watchdog timeout and one interval.
    fn one_gpu_watchdog_breaks_the_backend_when_a_collective_does_not_complete() {
        let watchdog = Duration::from_secs(2);
        let nccl_config = NcclConfig::default().with_watchdog(watchdog);
        let backend = NcclBackend::local_world(&[0], nccl_config)
            .unwrap()
            .remove(0);
        let pool = pool_on(backend, group()).unwrap();
        let coll = Coll::new(&pool).unwrap();
        let stream = pool.new_stream().unwrap();
        let input = pool.alloc(4096, &stream).unwrap();
        let output = pool.alloc(4096, &stream).unwrap();
        let gate = stuck_stream(&stream);
        let started = std::time::Instant::now();
        coll.tagged(0)
            .all_gather::<f32>(&input, &output, &stream)
            .expect("enqueued behind the host function");
        let nccl = pool.backend().downcast_ref::<NcclBackend>().unwrap();
        let error = loop {
            if let Err(e) = nccl.health() {
                break e;
            }
            assert!(
                started.elapsed() < watchdog + Duration::from_secs(5),
                "the watchdog did not fire"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let took = started.elapsed();
        eprintln!("watchdog after {took:?}: {error}");
        assert!(matches!(error, Error::NcclWatchdog { .. }), "{error:?}");
        assert!(took >= watchdog, "{took:?}");
        let next = coll.tagged(0).all_gather::<f32>(&input, &output, &stream);
        assert!(
            matches!(
                next,
                Err(Error::NcclWatchdog { .. } | Error::NcclAborted { .. })
            ),
            "{next:?}"
        );
        open(&gate);
        stream.cuda_stream().unwrap().synchronize().unwrap();
        drop((input, output));
        drop(pool);
    }

    /// One GPU: a runtime's raw `CUstream` maps to one stream id however often it is
    /// adopted; pools allocate and run collectives on it.
    fn one_gpu_raw_streams_keep_one_id() {
        let backend = NcclBackend::local_world(&[0], NcclConfig::default())
            .unwrap()
            .remove(0);
        let nccl = backend.downcast_ref::<NcclBackend>().unwrap();
        let a = nccl.cuda_stream().unwrap();
        let b = nccl.cuda_stream().unwrap();
        let raw_a: CUstream = a.cu_stream();
        // SAFETY: `a` and `b` are live streams of device 0's primary context, kept alive
        // past the backend (dropped at the end of this function, after the collectives
        // handle and the pool, the backend's last owners).
        let (s1, s2, s3) = unsafe {
            (
                Stream::from_raw_cuda(&backend, raw_a).unwrap(),
                Stream::from_raw_cuda(&backend, raw_a).unwrap(),
                nccl.stream_from_raw(b.cu_stream()).unwrap(),
            )
        };
        assert_eq!(s1.id(), s2.id(), "one id per raw stream");
        assert_ne!(s1.id(), s3.id());
        assert_eq!(s1.raw_cuda(), Some(raw_a));
        let pool = pool_on(backend, group()).unwrap();
        let coll = Coll::new(&pool).unwrap();
        let x = pool.alloc(MIB, &s1).unwrap();
        let y = pool.alloc(MIB, &s2).unwrap();
        x.write(&vec![1.5f32; 1024]).unwrap();
        coll.tagged(0).all_gather::<f32>(&x, &y, &s2).unwrap();
        assert_eq!(y.read::<f32>().unwrap()[..1024], vec![1.5f32; 1024][..]);
        drop((x, y));
        pool.close().unwrap();
        // The handle holds the pool, and the pool the backend, which records on the
        // adopted streams until it is dropped: both go before the raw streams do.
        drop(coll);
        drop(pool);
        drop((a, b));
    }

    /// On SIGABRT (a heap check failing inside C code), print the raw stack to stderr:
    /// module offsets that `addr2line -f -e <test binary>` resolves.
    extern "C" fn print_stack(_: libc::c_int) {
        let mut frames = [std::ptr::null_mut::<libc::c_void>(); 64];
        // SAFETY: `frames` holds 64 pointers; backtrace writes at most that many, and
        // backtrace_symbols_fd only reads them and writes to stderr (no allocation).
        unsafe {
            let n = libc::backtrace(frames.as_mut_ptr(), 64);
            libc::backtrace_symbols_fd(frames.as_ptr(), n, 2);
        }
    }

    pub fn main() {
        if std::env::var_os("SYMMPOOL_ABORT_BACKTRACE").is_some() {
            // SAFETY: installs a handler that only calls backtrace functions.
            unsafe {
                libc::signal(
                    libc::SIGABRT,
                    print_stack as extern "C" fn(libc::c_int) as libc::sighandler_t,
                )
            };
        }
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
        let (mut args, filters) = common::gpu::arguments(std::env::args());
        args.test_threads = Some(1);
        let mut trials = vec![
            trial(
                "one_gpu_segments_windows_and_close",
                1,
                one_gpu_segments_windows_and_close,
            ),
            trial(
                "one_gpu_drop_on_a_stuck_stream_returns_within_the_timeout",
                1,
                one_gpu_drop_on_a_stuck_stream_returns_within_the_timeout,
            ),
            trial(
                "one_gpu_cudarc_reads_and_writes_pool_buffers",
                1,
                one_gpu_cudarc_reads_and_writes_pool_buffers,
            ),
            trial(
                "one_gpu_cuda_views_order_uses_on_other_streams",
                1,
                one_gpu_cuda_views_order_uses_on_other_streams,
            ),
            trial(
                "one_gpu_cuda_views_order_every_use_across_streams",
                1,
                one_gpu_cuda_views_order_every_use_across_streams,
            ),
            trial(
                "one_gpu_cuda_views_under_capture_keep_the_capture",
                1,
                one_gpu_cuda_views_under_capture_keep_the_capture,
            ),
            trial(
                "one_gpu_collectives_at_world_size_one",
                1,
                one_gpu_collectives_at_world_size_one,
            ),
            trial(
                "one_gpu_two_pools_on_two_threads_with_their_own_communicators",
                1,
                one_gpu_two_pools_on_two_threads_with_their_own_communicators,
            ),
            trial(
                "one_gpu_all_reduce_at_world_size_one",
                1,
                one_gpu_all_reduce_at_world_size_one,
            ),
            trial(
                "one_gpu_captures_a_steps_collectives_in_a_cuda_graph_and_replays_them",
                1,
                one_gpu_captures_a_steps_collectives_in_a_cuda_graph_and_replays_them,
            ),
            trial(
                "one_gpu_from_env_in_a_process_at_world_size_one",
                1,
                one_gpu_from_env_in_a_process_at_world_size_one,
            ),
            trial(
                "one_gpu_adopts_a_communicator_made_outside_the_crate",
                1,
                one_gpu_adopts_a_communicator_made_outside_the_crate,
            ),
            trial(
                "one_gpu_non_blocking_creation_and_registration_under_deadlines",
                1,
                one_gpu_non_blocking_creation_and_registration_under_deadlines,
            ),
            trial(
                "one_gpu_watchdog_breaks_the_backend_when_a_collective_does_not_complete",
                1,
                one_gpu_watchdog_breaks_the_backend_when_a_collective_does_not_complete,
            ),
            trial(
                "one_gpu_raw_streams_keep_one_id",
                1,
                one_gpu_raw_streams_keep_one_id,
            ),
            trial(
                "two_gpus_from_env_in_two_processes",
                2,
                two_gpus_from_env_in_two_processes,
            ),
            trial(
                "two_gpus_kill_9_during_window_registration",
                2,
                two_gpus_kill_9_during_window_registration,
            ),
            trial(
                "two_gpus_kill_9_during_a_collective",
                2,
                two_gpus_kill_9_during_a_collective,
            ),
            trial(
                "gpu_registers_once_per_segment_and_communicator",
                2,
                gpu_registers_once_per_segment_and_communicator,
            ),
            trial(
                "gpu_collectives_match_a_host_reference",
                2,
                gpu_collectives_match_a_host_reference,
            ),
            trial(
                "gpu_block_freed_under_a_long_kernel_is_not_overwritten_early",
                2,
                gpu_block_freed_under_a_long_kernel_is_not_overwritten_early,
            ),
            trial(
                "gpu_bad_input_is_a_clear_error_and_the_pool_stays_usable",
                2,
                gpu_bad_input_is_a_clear_error_and_the_pool_stays_usable,
            ),
            trial(
                "gpu_checked_collectives_catch_every_divergence_on_nccl",
                2,
                gpu_checked_collectives_catch_every_divergence_on_nccl,
            ),
        ];
        common::gpu::keep_filtered(&mut trials, &filters, args.exact);
        libtest_mimic::run(&args, trials).exit();
    }
}
