//! GPU tests through NCCL. Each declares how many GPUs it needs; with fewer it is
//! reported as ignored with the reason (a failure under `SYMMPOOL_REQUIRE_GPU=1`).
//!
//! One GPU (NCCL at world size 1): segments and windows, bounded teardown on a stream
//! that never finishes, cudarc access through `DevicePtr`, collectives on NCCL's
//! one-rank path. Two GPUs: registration once per segment, collectives against a
//! host reference for every type and placement, stream-safe reuse under a
//! long-running kernel, bad input. The trials run one at a time (each builds its own
//! NCCL world).

#[cfg(not(feature = "nccl"))]
fn main() {
    println!("the GPU tests need the `nccl` feature");
}

#[cfg(feature = "nccl")]
fn main() {
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

    use common::gpu::{on_ranks, trial};
    use std::time::{Duration, SystemTime};
    use symmpool::coll::{self, Path};
    use symmpool::{Element, Error, PoolConfig, ReduceOp, Stream, SymmPool, bf16, f16};

    const MIB: u64 = 1 << 20;

    fn config() -> PoolConfig {
        PoolConfig::default().with_timeout(Duration::from_secs(60))
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
        let pools = common::gpu::world(2, config());
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
            let first = pool.stats();
            let later_places = step();
            let later = pool.stats();
            assert_eq!(first_places, later_places);
            pool.close().unwrap();
            (first, later, first_places)
        });
        for (first, later, places) in &out {
            let segs = first.core.segments.current;
            eprintln!(
                "registrations {:?} segments {segs} growth {:.1} ms",
                first.registrations,
                first.growth_seconds * 1e3
            );
            assert!(segs >= 3);
            assert_eq!(first.registrations, vec![segs, segs, 0]);
            assert_eq!(
                first.windows,
                vec![segs, segs, 0],
                "NCCL gave non-NULL windows"
            );
            assert_eq!(
                later.registrations, first.registrations,
                "second step registered"
            );
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
                coll::all_gather_in_place::<T>(&output, stream).unwrap()
            } else {
                let input = pool.alloc((count * size) as u64, stream).unwrap();
                input.write(&mine).unwrap();
                coll::all_gather::<T>(&input, &output, stream).unwrap()
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
            let r = pool.rank();
            let input = pool.alloc((world * count * size) as u64, stream).unwrap();
            input.write(&data(r)).unwrap();
            if in_place {
                let rep = coll::reduce_scatter_in_place::<T>(&input, op, stream).unwrap();
                (
                    rep.path,
                    input.read::<T>().unwrap()[r * count..(r + 1) * count].to_vec(),
                )
            } else {
                let output = pool.alloc((count * size) as u64, stream).unwrap();
                output.write(&vec![T::from_f64(99.0); count]).unwrap();
                let rep = coll::reduce_scatter::<T>(&input, &output, op, stream).unwrap();
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

    fn gpu_collectives_match_a_host_reference() {
        let pools = common::gpu::world(2, config());
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
    }

    fn gpu_block_freed_under_a_long_kernel_is_not_overwritten_early() {
        let pools = common::gpu::world(2, config());
        let results = on_ranks(&pools, |pool, stream_a| {
            let stream_b = pool.new_stream().unwrap();
            let cuda_a = stream_a.cuda_stream().unwrap().clone();
            let blas = gpu_math::Blas::new(cuda_a.clone()).unwrap();
            let n = 8192usize;
            // Scratch for a long GEMM chain on stream A (not from the pool's cached sizes).
            let scratch = pool.alloc((3 * n * n * 2) as u64, stream_a).unwrap();
            let s = scratch.device_ptr().unwrap();
            let (a, b, c) = (s, s + (n * n * 2) as u64, s + (2 * n * n * 2) as u64);
            let len = 4 * MIB;
            let x = pool.alloc(len, stream_a).unwrap();
            let y = pool.alloc(len, stream_a).unwrap();
            x.write(&vec![7u8; len as usize]).unwrap();
            let (xp, yp) = (x.device_ptr().unwrap(), y.device_ptr().unwrap());
            let (x_seg, x_off) = (x.segment(), x.offset_bytes());
            // Stream A: ~100 ms of GEMMs, then read X into Y.
            for _ in 0..60 {
                // SAFETY: a, b, c are three n×n bf16 matrices inside `scratch`, alive
                // until the end of this closure (after the synchronize below).
                unsafe {
                    blas.gemm_bf16(false, false, n, n, n, 1.0, a, n, b, n, 0.0, c, n)
                        .unwrap()
                };
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
                // SAFETY: as above.
                unsafe {
                    blas.gemm_bf16(false, false, n, n, n, 1.0, a, n, b, n, 0.0, c, n)
                        .unwrap()
                };
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
        let pools = common::gpu::world(2, config());
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
        let pools = common::gpu::world(1, config());
        let pool = &pools[0];
        let stream = pool.new_stream().unwrap();
        let bufs: Vec<_> = [3 * MIB, 64 * MIB, 4096]
            .iter()
            .map(|&b| pool.alloc(b, &stream).unwrap())
            .collect();
        let stats = pool.stats();
        let segs = stats.core.segments.current;
        let registering: Vec<bool> = pool
            .backend()
            .communicators()
            .iter()
            .map(|c| c.registers)
            .collect();
        eprintln!(
            "roles {:?} registrations {:?} windows {:?} segments {segs} granularity {} B",
            stats.roles,
            stats.registrations,
            stats.windows,
            pool.backend().granularity_bytes()
        );
        for (c, &r) in registering.iter().enumerate() {
            assert_eq!(stats.registrations[c], if r { segs } else { 0 });
            assert!(stats.windows[c] <= stats.registrations[c]);
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
        let after = pool.stats();
        assert_eq!(after.core.segments.current, 0);
        assert_eq!(after.windows, vec![0; after.windows.len()]);
        assert_eq!(after.deregistrations, stats.windows);
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
        let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let user = std::sync::Arc::into_raw(gate.clone()) as *mut std::ffi::c_void;
        let cs = stream.cuda_stream().unwrap();
        // SAFETY: `cs` is a live stream; `hold_stream` only reads the gate behind `user`,
        // which is leaked (one strong count) and so outlives the call.
        let r = unsafe {
            cudarc::driver::sys::cuLaunchHostFunc(cs.cu_stream(), Some(hold_stream), user)
        };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        gate
    }

    /// One GPU: a pool dropped while its stream never finishes (a peer stuck in a
    /// collective looks like this) returns within its timeout and leaks its memory on
    /// purpose instead of freeing it under running work.
    fn one_gpu_drop_on_a_stuck_stream_returns_within_the_timeout() {
        let timeout = Duration::from_secs(2);
        let pools = common::gpu::world(1, PoolConfig::default().with_timeout(timeout));
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
            took >= timeout && took < timeout + Duration::from_secs(3),
            "{took:?}"
        );
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        stream.cuda_stream().unwrap().synchronize().unwrap();
    }

    /// One GPU: cudarc reads and writes pool buffers through `DevicePtr`/`DevicePtrMut`,
    /// with no raw address in the caller's code.
    fn one_gpu_cudarc_reads_and_writes_pool_buffers() {
        let pools = common::gpu::world(1, config());
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
        let mut dst = buf
            .view::<f32>()
            .unwrap()
            .slice(0, 96)
            .unwrap()
            .cuda()
            .unwrap();
        cs.memcpy_htod(&host, &mut dst).unwrap();
        cs.synchronize().unwrap();
        assert_eq!(buf.read::<f32>().unwrap()[..96], data[1000..1096]);
        drop(buf);
        pool.close().unwrap();
    }

    /// One GPU: the collectives run through NCCL's one-rank path and move the data.
    fn one_gpu_collectives_at_world_size_one() {
        let pools = common::gpu::world(1, config());
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

    pub fn main() {
        let mut args = libtest_mimic::Arguments::from_args();
        args.test_threads = Some(1);
        let trials = vec![
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
                "one_gpu_collectives_at_world_size_one",
                1,
                one_gpu_collectives_at_world_size_one,
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
        ];
        libtest_mimic::run(&args, trials).exit();
    }
}
