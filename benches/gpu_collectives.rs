//! GPU benchmark on the two-GPU machine (prints `skipped: ..` elsewhere).
//!
//! Sections (default: all), each a table:
//! - `alloc`: 10 000 FSDP-like alloc/free calls through the pool, against
//!   `ncclMemAlloc` + window register + deregister + free per call; registrations and
//!   time per call for both.
//! - `regcost`: cost of growing the pool by one segment (ncclMemAlloc + one window per
//!   registering communicator), per segment size.
//! - `ag`: all-gather busbw per size (64 KiB..512 MiB per rank): raw NCCL ring on plain
//!   (unregistered) buffers, raw symmetric kernel, raw copy engine, and the crate's
//!   automatic path (with the path it reports).
//! - `rs`: reduce-scatter (bf16, sum) busbw per size: raw ring, raw symmetric, crate.
//! - `ar`: all-reduce (bf16, sum, out of place) busbw per size: raw `ncclAllReduce` on
//!   plain buffers, raw on registered buffers (NCCL's symmetric kernel), crate.
//! - `overlap`: 20 bf16 8192³ cuBLAS GEMMs alone and beside 20 all-gathers of
//!   256 MiB/rank per mode.
//!
//! busbw follows nccl-tests: bytes per rank × (ranks − 1) / time (all-reduce: bytes ×
//! 2 (ranks − 1) / ranks / time). Every figure is the
//! median of 5 repetitions; modes are interleaved within a repetition.
//!
//! Run: `cargo bench --bench gpu_collectives -- [alloc] [regcost] [ag] [rs] [ar] [overlap]`

#[cfg(feature = "nccl")]
#[path = "../tests/common/fsdp_trace.rs"]
mod fsdp_trace;
#[cfg(feature = "nccl")]
#[path = "../examples/support/gpu_math.rs"]
mod gpu_math;

fn main() {
    #[cfg(feature = "nccl")]
    gpu::main();
    #[cfg(not(feature = "nccl"))]
    println!("skipped: built without the `nccl` feature");
}

#[cfg(feature = "nccl")]
mod gpu {
    use super::{fsdp_trace, gpu_math};
    use cudarc::driver::CudaEvent;
    use cudarc::nccl::sys as nccl;
    use std::ffi::c_void;
    use std::sync::{Arc, Barrier};
    use std::time::Instant;
    use symmpool::backend::{NcclBackend, NcclConfig};
    use symmpool::coll::{self, Path};
    use symmpool::{
        Coll, CollectiveCalls, Group, GroupConfig, PoolConfig, ReduceOp, Stream, SymmBuffer,
        SymmPool, bf16,
    };

    const MIB: u64 = 1 << 20;
    const REPS: usize = 15;
    const SYMM: usize = 0;
    const CE: usize = 1;
    const PLAIN: usize = 2;

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    }

    /// Interquartile range over the median, in percent: the noise of one column.
    fn spread(v: &[f64]) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
        (q(0.75) - q(0.25)) / q(0.5) * 100.0
    }

    struct Rank {
        backend: symmpool::Backend,
        reg: SymmPool,
        /// The collectives of `reg`.
        coll: Coll,
        plain: SymmPool,
        stream: Stream,
        barrier: Arc<Barrier>,
    }

    impl Rank {
        fn nccl(&self) -> &NcclBackend {
            self.backend.downcast_ref::<NcclBackend>().unwrap()
        }
        fn cu(&self) -> nccl::cudaStream_t {
            self.stream.cuda_stream().unwrap().cu_stream() as _
        }
        fn comm(&self, c: usize) -> nccl::ncclComm_t {
            self.nccl().raw_comm(c).unwrap()
        }
        fn sync(&self) {
            self.stream.cuda_stream().unwrap().synchronize().unwrap();
        }
        /// Time `iters` calls of `f` on this rank's stream (after 3 warm-ups), in ms
        /// per call. Every rank runs it; the ranks start together.
        fn time(&self, iters: usize, mut f: impl FnMut()) -> f64 {
            for _ in 0..3 {
                f();
            }
            self.sync();
            self.barrier.wait();
            let ctx = self.nccl().context();
            let (a, b): (CudaEvent, CudaEvent) = (
                ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .unwrap(),
                ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .unwrap(),
            );
            let cs = self.stream.cuda_stream().unwrap();
            a.record(cs).unwrap();
            for _ in 0..iters {
                f();
            }
            b.record(cs).unwrap();
            b.synchronize().unwrap();
            let ms = a.elapsed_ms(&b).unwrap() as f64;
            self.barrier.wait();
            ms / iters as f64
        }
    }

    /// Raw in-place all-gather of `bytes` per rank in `buf` on communicator `c`.
    fn raw_ag(r: &Rank, buf: &SymmBuffer, bytes: u64, c: usize) {
        let base = buf.device_ptr().unwrap();
        let send = base + r.backend_rank() as u64 * bytes;
        // SAFETY: `buf` holds world × bytes; the stream is this rank's; calls on the
        // communicator come only from this thread.
        let res = unsafe {
            nccl::ncclAllGather(
                send as *const c_void,
                base as *mut c_void,
                bytes as usize,
                nccl::ncclDataType_t::ncclUint8,
                r.comm(c),
                r.cu(),
            )
        };
        // The communicators are non-blocking, so the enqueue is waited for (the first
        // call on a communicator connects to the peers).
        // SAFETY: as above: the communicator is live and only this thread calls it.
        let res = unsafe { raw_done(r.comm(c), res) };
        assert_eq!(res, nccl::ncclResult_t::ncclSuccess);
    }

    fn raw_rs(r: &Rank, input: &SymmBuffer, output: &SymmBuffer, bytes: u64, c: usize) {
        // SAFETY: input holds world × bytes, output bytes; see raw_ag.
        let res = unsafe {
            nccl::ncclReduceScatter(
                input.device_ptr().unwrap() as *const c_void,
                output.device_ptr().unwrap() as *mut c_void,
                (bytes / 2) as usize,
                nccl::ncclDataType_t::ncclBfloat16,
                nccl::ncclRedOp_t::ncclSum,
                r.comm(c),
                r.cu(),
            )
        };
        // The communicators are non-blocking, so the enqueue is waited for (the first
        // call on a communicator connects to the peers).
        // SAFETY: as above: the communicator is live and only this thread calls it.
        let res = unsafe { raw_done(r.comm(c), res) };
        assert_eq!(res, nccl::ncclResult_t::ncclSuccess);
    }

    /// Raw out-of-place all-reduce (bf16, sum) of `bytes` on communicator `c`.
    fn raw_ar(r: &Rank, input: &SymmBuffer, output: &SymmBuffer, bytes: u64, c: usize) {
        // SAFETY: input and output hold `bytes` each; see raw_ag.
        let res = unsafe {
            nccl::ncclAllReduce(
                input.device_ptr().unwrap() as *const c_void,
                output.device_ptr().unwrap() as *mut c_void,
                (bytes / 2) as usize,
                nccl::ncclDataType_t::ncclBfloat16,
                nccl::ncclRedOp_t::ncclSum,
                r.comm(c),
                r.cu(),
            )
        };
        // SAFETY: as in raw_rs.
        let res = unsafe { raw_done(r.comm(c), res) };
        assert_eq!(res, nccl::ncclResult_t::ncclSuccess);
    }

    impl Rank {
        fn backend_rank(&self) -> usize {
            self.reg.rank()
        }
        /// Number of ranks, as u64 for byte arithmetic.
        fn world(&self) -> u64 {
            self.reg.world_size() as u64
        }
    }

    fn sizes() -> Vec<u64> {
        vec![
            64 << 10,
            128 << 10,
            256 << 10,
            512 << 10,
            MIB,
            2 * MIB,
            4 * MIB,
            8 * MIB,
            16 * MIB,
            32 * MIB,
            64 * MIB,
            256 * MIB,
            512 * MIB,
        ]
    }

    fn iters_for(bytes: u64) -> usize {
        if bytes >= 64 * MIB {
            12
        } else if bytes >= 4 * MIB {
            60
        } else if bytes >= MIB {
            500
        } else {
            2000
        }
    }

    /// The crate's documented start-up step: measure the paths on this machine and
    /// use the thresholds derived from rank 0's figures on every rank.
    fn section_calibrate(r: &Rank) {
        let cfg = coll::CalibrateConfig::default().with_range(64 << 10, 512 * MIB);
        let start = Instant::now();
        let cal = r.coll.calibrate(&r.stream, &cfg).unwrap();
        let secs = start.elapsed().as_secs_f64();
        if r.backend_rank() == 0 {
            println!("\n[calibrate] {:.2} s; busbw GB/s per path (rank 0)", secs);
            println!(
                "{:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "bytes/rank",
                "ag symm",
                "ag ce",
                "ag ring",
                "rs symm",
                "rs ring",
                "ar symm",
                "ar ring"
            );
            let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
            for m in &cal.measurements {
                println!(
                    "{:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                    m.bytes,
                    f(m.all_gather[0]),
                    f(m.all_gather[1]),
                    f(m.all_gather[2]),
                    f(m.reduce_scatter[0]),
                    f(m.reduce_scatter[1]),
                    f(m.all_reduce[0]),
                    f(m.all_reduce[1])
                );
            }
            println!(
                "policy: copy-engine all-gather from {} B/rank; symmetric reduce-scatter bands {:?}; symmetric all-reduce bands {:?}; plain all-gather bands {:?}",
                cal.policy.ce_all_gather_min_bytes,
                cal.policy.symmetric_reduce_scatter_bands,
                cal.policy.symmetric_all_reduce_bands,
                cal.policy.plain_all_gather_bands
            );
            println!("policy: {}", cal.policy);
        }
        r.coll.set_path_policy(cal.policy);
    }

    /// Busbw (GB/s) and interquartile spread of each way (mode) of running one
    /// collective size; the last mode is the crate's, the others raw NCCL paths.
    struct Modes {
        bw: Vec<f64>,
        spreads: Vec<f64>,
    }

    /// Times `modes` modes `REPS` times each (`time_mode(mode)` returns milliseconds
    /// per call), rotating the order so that no mode always follows the same other one.
    fn measure_modes(
        r: &Rank,
        modes: usize,
        bytes: u64,
        mut time_mode: impl FnMut(usize) -> f64,
    ) -> Modes {
        let mut t = vec![Vec::new(); modes];
        for rep in 0..REPS {
            for i in 0..modes {
                let mode = (i + rep) % modes;
                t[mode].push(time_mode(mode));
            }
        }
        let spreads = t.iter().map(|v| spread(v)).collect();
        let bw = t
            .into_iter()
            .map(|v| bytes as f64 * (r.world() - 1) as f64 / (median(v) * 1e-3) / 1e9)
            .collect();
        Modes { bw, spreads }
    }

    impl Modes {
        /// One table row: every mode's busbw, the crate's path, the crate over the best
        /// raw path (the first of equals), and the spreads of those two.
        fn print(&self, bytes: u64, path: Path) {
            let own = self.bw.len() - 1;
            let best_i = (0..own).fold(0, |b, i| if self.bw[i] > self.bw[b] { i } else { b });
            let cells: String = self.bw.iter().map(|v| format!(" {v:>9.1}")).collect();
            println!(
                "{bytes:<12}{cells} {:>16} {:>9.3} {:>6.1}% {:>6.1}%",
                format!("{path:?}"),
                self.bw[own] / self.bw[best_i],
                self.spreads[best_i],
                self.spreads[own]
            );
        }
    }

    fn section_ag(r: &Rank) {
        let lead = r.backend_rank() == 0;
        if lead {
            println!(
                "\n[ag] all-gather in place, bytes per rank; busbw GB/s; median of {REPS}; IQR: interquartile range of the repetitions over the median"
            );
            println!(
                "{:<12} {:>9} {:>9} {:>9} {:>9} {:>16} {:>9} {:>7} {:>7}",
                "bytes/rank",
                "ring",
                "symm",
                "ce",
                "crate",
                "crate path",
                "crate/best",
                "IQR best",
                "IQR crate"
            );
        }
        for bytes in sizes() {
            let reg = r.reg.alloc(r.world() * bytes, &r.stream).unwrap();
            let plain = r.plain.alloc(r.world() * bytes, &r.stream).unwrap();
            let iters = iters_for(bytes);
            let mut path = Path::PlainKernel;
            let m = measure_modes(r, 4, bytes, |mode| match mode {
                0 => r.time(iters, || raw_ag(r, &plain, bytes, PLAIN)),
                1 => r.time(iters, || raw_ag(r, &reg, bytes, SYMM)),
                2 => r.time(iters, || raw_ag(r, &reg, bytes, CE)),
                _ => r.time(iters, || {
                    path = r
                        .coll
                        .tagged(0)
                        .all_gather_in_place::<u8>(&reg, &r.stream)
                        .unwrap()
                        .path;
                }),
            });
            if lead {
                m.print(bytes, path);
            }
        }
    }

    fn section_rs(r: &Rank) {
        let lead = r.backend_rank() == 0;
        if lead {
            println!(
                "\n[rs] reduce-scatter bf16 sum, output bytes per rank; busbw GB/s; median of {REPS}"
            );
            println!(
                "{:<12} {:>9} {:>9} {:>9} {:>16} {:>9} {:>7} {:>7}",
                "bytes/rank",
                "ring",
                "symm",
                "crate",
                "crate path",
                "crate/best",
                "IQR best",
                "IQR crate"
            );
        }
        for bytes in sizes() {
            let (ri, ro) = (
                r.reg.alloc(r.world() * bytes, &r.stream).unwrap(),
                r.reg.alloc(bytes, &r.stream).unwrap(),
            );
            let (pi, po) = (
                r.plain.alloc(r.world() * bytes, &r.stream).unwrap(),
                r.plain.alloc(bytes, &r.stream).unwrap(),
            );
            let iters = iters_for(bytes);
            let mut path = Path::PlainKernel;
            let m = measure_modes(r, 3, bytes, |mode| match mode {
                0 => r.time(iters, || raw_rs(r, &pi, &po, bytes, PLAIN)),
                1 => r.time(iters, || raw_rs(r, &ri, &ro, bytes, SYMM)),
                _ => r.time(iters, || {
                    path = r
                        .coll
                        .tagged(0)
                        .reduce_scatter::<bf16>(&ri, &ro, ReduceOp::Sum, &r.stream)
                        .unwrap()
                        .path;
                }),
            });
            if lead {
                m.print(bytes, path);
            }
        }
    }

    fn section_ar(r: &Rank) {
        let lead = r.backend_rank() == 0;
        if lead {
            println!(
                "\n[ar] all-reduce bf16 sum out of place, bytes per rank; busbw GB/s; median of {REPS}"
            );
            println!(
                "{:<12} {:>9} {:>9} {:>9} {:>16} {:>9} {:>7} {:>7}",
                "bytes/rank",
                "plain",
                "symm",
                "crate",
                "crate path",
                "crate/best",
                "IQR best",
                "IQR crate"
            );
        }
        for bytes in sizes() {
            let (ri, ro) = (
                r.reg.alloc(bytes, &r.stream).unwrap(),
                r.reg.alloc(bytes, &r.stream).unwrap(),
            );
            let (pi, po) = (
                r.plain.alloc(bytes, &r.stream).unwrap(),
                r.plain.alloc(bytes, &r.stream).unwrap(),
            );
            let iters = iters_for(bytes);
            let mut path = Path::PlainKernel;
            // measure_modes counts bytes × (ranks − 1); an all-reduce moves
            // 2 (ranks − 1) / ranks of its bytes.
            let counted = 2 * bytes / r.world();
            let m = measure_modes(r, 3, counted, |mode| match mode {
                0 => r.time(iters, || raw_ar(r, &pi, &po, bytes, PLAIN)),
                1 => r.time(iters, || raw_ar(r, &ri, &ro, bytes, SYMM)),
                _ => r.time(iters, || {
                    path = r
                        .coll
                        .tagged(0)
                        .all_reduce::<bf16>(&ri, &ro, ReduceOp::Sum, &r.stream)
                        .unwrap()
                        .path;
                }),
            });
            if lead {
                m.print(bytes, path);
            }
        }
    }

    fn section_overlap(r: &Rank) {
        let lead = r.backend_rank() == 0;
        let bytes = 256 * MIB;
        let (gemms, ags, n) = (20usize, 20usize, 8192usize);
        let compute = r.nccl().cuda_stream().unwrap();
        let blas = gpu_math::Blas::new(compute.clone()).unwrap();
        let compute_s = Stream::cuda(compute.clone());
        let mut mats = r.plain.alloc((3 * n * n * 2) as u64, &compute_s).unwrap();
        fill(r, &mats);
        // A, B and C: three n×n bf16 matrices inside `mats`.
        let (ab, mut c) = (mats.cuda_mut::<bf16>().unwrap())
            .split_at_mut(2 * n * n)
            .unwrap();
        let (a, b) = ab.split_at_mut(n * n).unwrap();
        let gemm = gpu_math::dense(false, false, n, n, n, 1.0, 0.0).unwrap();
        let reg = r.reg.alloc(r.world() * bytes, &r.stream).unwrap();
        let plain = r.plain.alloc(r.world() * bytes, &r.stream).unwrap();
        let ctx = r.nccl().context();
        let ev = || {
            ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap()
        };
        let modes = ["none", "ring", "symm", "ce", "crate"];
        let mut gemm_ms = vec![Vec::new(); modes.len()];
        let mut ag_bw = vec![Vec::new(); modes.len()];
        for _ in 0..REPS {
            for (mi, mode) in modes.iter().enumerate() {
                blas.gemm_bf16(&gemm, &a, &b, &mut c).unwrap();
                compute.synchronize().unwrap();
                r.sync();
                r.barrier.wait();
                let (g0, g1, a0, a1) = (ev(), ev(), ev(), ev());
                g0.record(&compute).unwrap();
                for _ in 0..gemms {
                    blas.gemm_bf16(&gemm, &a, &b, &mut c).unwrap();
                }
                g1.record(&compute).unwrap();
                let cs = r.stream.cuda_stream().unwrap();
                a0.record(cs).unwrap();
                for _ in 0..ags {
                    match *mode {
                        "none" => {}
                        "ring" => raw_ag(r, &plain, bytes, PLAIN),
                        "symm" => raw_ag(r, &reg, bytes, SYMM),
                        "ce" => raw_ag(r, &reg, bytes, CE),
                        _ => {
                            r.coll
                                .tagged(0)
                                .all_gather_in_place::<u8>(&reg, &r.stream)
                                .unwrap();
                        }
                    }
                }
                a1.record(cs).unwrap();
                compute.synchronize().unwrap();
                r.sync();
                gemm_ms[mi].push(g0.elapsed_ms(&g1).unwrap() as f64);
                let am = a0.elapsed_ms(&a1).unwrap() as f64;
                ag_bw[mi].push(if mi == 0 {
                    0.0
                } else {
                    bytes as f64 * (r.world() - 1) as f64 * ags as f64 / (am * 1e-3) / 1e9
                });
                r.barrier.wait();
            }
        }
        if lead {
            println!(
                "\n[overlap] {gemms} bf16 {n}^3 GEMMs beside {ags} all-gathers of {bytes} B/rank; median of {REPS} interleaved reps"
            );
            println!(
                "{:<6} {:>10} {:>10} {:>12} {:>12}",
                "mode", "gemm ms", "TFLOP/s", "gemm/alone", "ag busbw"
            );
            let alone = median(gemm_ms[0].clone());
            for (mi, mode) in modes.iter().enumerate() {
                let g = median(gemm_ms[mi].clone());
                let tf = 2.0 * (n as f64).powi(3) * gemms as f64 / (g * 1e-3) / 1e12;
                println!(
                    "{:<6} {:>10.2} {:>10.0} {:>12.3} {:>12.1}",
                    mode,
                    g,
                    tf,
                    g / alone,
                    median(ag_bw[mi].clone())
                );
            }
        }
    }

    /// Random-ish bf16 data (not zeros: zeros run faster).
    fn fill(r: &Rank, buf: &SymmBuffer) {
        let n = (buf.len_bytes() / 2) as usize;
        let mut x: u32 = 0x1234_5678 ^ r.backend_rank() as u32;
        let host: Vec<bf16> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                bf16::from_f32((x & 0xffff) as f32 / 65536.0 - 0.5)
            })
            .collect();
        buf.write(&host).unwrap();
    }

    fn section_regcost(r: &Rank, group: &Group) {
        let lead = r.backend_rank() == 0;
        if lead {
            println!(
                "\n[regcost] growth by one segment: ncclMemAlloc + {} window registrations; median of 5 (ms, this rank)",
                group
                    .backend()
                    .communicators()
                    .iter()
                    .filter(|c| c.registers)
                    .count()
            );
            println!("{:<12} {:>12} {:>12}", "bytes", "reserve ms", "per window");
        }
        for bytes in [2 * MIB, 64 * MIB, 1024 * MIB] {
            let mut t = Vec::new();
            for _ in 0..5 {
                let pool = SymmPool::new(group, PoolConfig::default()).unwrap();
                r.barrier.wait();
                let start = Instant::now();
                pool.reserve(bytes).unwrap();
                t.push(start.elapsed().as_secs_f64() * 1e3);
                pool.close().unwrap();
            }
            let m = median(t);
            if lead {
                println!("{:<12} {:>12.2} {:>12.2}", bytes, m, m / 2.0);
            }
        }
    }

    /// The outcome of a raw call on one of the backend's communicators, which are
    /// non-blocking: their asynchronous state is read until it is no longer in
    /// progress (NCCL 2.28 can answer `ncclSuccess` to a window registration that is
    /// still running), for at most 60 s.
    ///
    /// # Safety
    /// `comm` is live and no other thread calls NCCL on it meanwhile.
    unsafe fn raw_done(comm: nccl::ncclComm_t, code: nccl::ncclResult_t) -> nccl::ncclResult_t {
        use nccl::ncclResult_t::{ncclInProgress, ncclSuccess};
        if code != ncclSuccess && code != ncclInProgress {
            return code;
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let mut state = ncclSuccess;
            // SAFETY: the caller's contract; `state` is a valid out-pointer.
            let got = unsafe { nccl::ncclCommGetAsyncError(comm, &mut state) };
            if got != ncclSuccess {
                return got;
            }
            if state != ncclInProgress || Instant::now() > deadline {
                return state;
            }
            std::thread::yield_now();
        }
    }

    /// Window registrations made by `pool`, over its communicators.
    fn registrations(pool: &SymmPool) -> u64 {
        (pool.memory_stats().iter())
            .filter(|(k, _)| k.starts_with("registrations."))
            .filter_map(|(_, v)| v.as_u64())
            .sum()
    }

    fn section_alloc(r: &Rank, group: &Group) {
        let lead = r.backend_rank() == 0;
        let ops = fsdp_trace::trace(1);
        let steps = 10_000usize.div_ceil(ops.len());
        let pool = SymmPool::new(group, PoolConfig::default()).unwrap();
        let mut live: Vec<Option<SymmBuffer>> = (0..fsdp_trace::buffers()).map(|_| None).collect();
        let mut step_times = Vec::new();
        let mut regs_after_first = 0;
        let mut calls = 0usize;
        for s in 0..steps {
            r.barrier.wait();
            let before = registrations(&pool);
            let start = Instant::now();
            for op in &ops {
                match *op {
                    fsdp_trace::TraceOp::Alloc { id, bytes } => {
                        live[id] = Some(pool.alloc(bytes, &r.stream).unwrap())
                    }
                    fsdp_trace::TraceOp::Free { id } => live[id] = None,
                }
                calls += 1;
            }
            step_times.push(start.elapsed().as_secs_f64());
            let added = registrations(&pool) - before;
            if s > 0 {
                regs_after_first += added;
            }
        }
        let registered = registrations(&pool);
        let first = step_times[0];
        let rest: f64 = step_times[1..].iter().sum();
        let rest_calls = (steps - 1) * ops.len();
        // Raw: ncclMemAlloc + register on one communicator + deregister + free per
        // allocation, for the first 40 allocations of the trace.
        let comm = r.nccl().raw_comm(SYMM).unwrap();
        let granularity = group.backend().granularity_bytes() as usize;
        let mut raw_times = Vec::new();
        for op in ops
            .iter()
            .filter_map(|o| match o {
                fsdp_trace::TraceOp::Alloc { bytes, .. } => Some(*bytes),
                _ => None,
            })
            .take(40)
        {
            r.barrier.wait();
            let start = Instant::now();
            r.nccl().context().bind_to_thread().unwrap();
            let mut p: *mut c_void = std::ptr::null_mut();
            let mut w: nccl::ncclWindow_t = std::ptr::null_mut();
            // What a per-call allocator maps and registers: whole pages of the
            // registration granularity (a window of a partial page is refused).
            let size = (op as usize).next_multiple_of(granularity);
            // SAFETY: plain NCCL calls with valid out-pointers on this rank's device;
            // the window covers the whole fresh allocation and is released before it;
            // each call on the (non-blocking) communicator is waited for before the next.
            unsafe {
                assert_eq!(
                    nccl::ncclMemAlloc(&mut p, size),
                    nccl::ncclResult_t::ncclSuccess
                );
                let code = nccl::ncclCommWindowRegister(comm, p, size, &mut w, 1);
                assert_eq!(raw_done(comm, code), nccl::ncclResult_t::ncclSuccess);
                let code = nccl::ncclCommWindowDeregister(comm, w);
                assert_eq!(raw_done(comm, code), nccl::ncclResult_t::ncclSuccess);
                assert_eq!(nccl::ncclMemFree(p), nccl::ncclResult_t::ncclSuccess);
            }
            raw_times.push(start.elapsed().as_secs_f64());
        }
        let raw_mean = raw_times.iter().sum::<f64>() / raw_times.len() as f64;
        drop(live);
        pool.close().unwrap();
        if lead {
            println!(
                "\n[alloc] {calls} FSDP-like alloc/free calls ({steps} steps of {} calls, 32 layers, 1-256 MiB)",
                ops.len()
            );
            println!(
                "{:<34} {:>14} {:>14} {:>16}",
                "", "registrations", "time/call", "total"
            );
            println!(
                "{:<34} {:>14} {:>11.2} us {:>13.1} ms",
                "pool, first step (warm-up)",
                registered - regs_after_first,
                first / ops.len() as f64 * 1e6,
                first * 1e3
            );
            println!(
                "{:<34} {:>14} {:>11.3} us {:>13.1} ms",
                "pool, later steps",
                regs_after_first,
                rest / rest_calls as f64 * 1e6,
                rest * 1e3
            );
            println!(
                "{:<34} {:>14} {:>11.2} ms {:>13.1} s",
                "ncclMemAlloc+register per alloc",
                calls / 2,
                raw_mean * 1e3,
                raw_mean * (calls / 2) as f64
            );
            println!(
                "(raw: mean of the first {} allocations of the trace, extrapolated to {} allocations)",
                raw_times.len(),
                calls / 2
            );
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with("--"))
            .collect();
        let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
        let count = match symmpool::backend::nccl::device_count() {
            Ok(n) => n,
            Err(e) => {
                println!("skipped: {e}");
                return;
            }
        };
        if count < 2 {
            println!("skipped: needs at least 2 GPUs, found {count}");
            return;
        }
        let version = symmpool::backend::nccl::nccl_version().unwrap();
        // Every visible GPU (2 on the project's machine; 4 or 8 for the scaling run).
        let devices: Vec<usize> = (0..count).collect();
        let backends = match NcclBackend::local_world(&devices, NcclConfig::default()) {
            Ok(b) => b,
            Err(e) => {
                println!("skipped: {e}");
                return;
            }
        };
        println!(
            "gpu_collectives: {count} GPUs, NCCL {version}, communicators {:?}",
            backends[0].communicators()
        );
        let barrier = Arc::new(Barrier::new(count));
        let auto = PoolConfig::default();
        std::thread::scope(|s| {
            for b in backends {
                let barrier = barrier.clone();
                let auto = auto.clone();
                let want = &want;
                s.spawn(move || {
                    // Every pool of the rank is on the backend's communicators: one group.
                    let group = Group::new(b, GroupConfig::default()).unwrap();
                    let backend = group.backend().clone();
                    let reg = SymmPool::new(&group, auto).unwrap();
                    let r = Rank {
                        coll: Coll::new(&reg).unwrap(),
                        reg,
                        plain: SymmPool::new(&group, PoolConfig::default().with_register(false))
                            .unwrap(),
                        stream: backend.streams().new_stream().unwrap(),
                        backend: backend.clone(),
                        barrier,
                    };
                    if want("alloc") {
                        section_alloc(&r, &group);
                    }
                    if want("regcost") {
                        section_regcost(&r, &group);
                    }
                    if want("ag") || want("rs") || want("ar") {
                        section_calibrate(&r);
                    }
                    if want("ag") {
                        section_ag(&r);
                    }
                    if want("rs") {
                        section_rs(&r);
                    }
                    if want("ar") {
                        section_ar(&r);
                    }
                    if want("overlap") {
                        section_overlap(&r);
                    }
                    r.reg.close().ok();
                    r.plain.close().ok();
                });
            }
        });
        println!("\ndone");
    }
}
