//! [`Math`] on NCCL GPUs: bf16 buffers, cuBLAS GEMMs (through cudarc) on two CUDA
//! streams per rank, events between them. The cuBLAS calls are in
//! `examples/support/gpu_math.rs` (`cublas` here), shared with the GPU tests and benchmark.

use super::cli::{Args, Mode};
use super::cublas;
use super::ranks::{StepBarrier, on_rank_threads};
use super::report::Summary;
use super::trainer::{Math, On};
use cudarc::driver::CudaStream;
use std::sync::Arc;
use symmpool::backend::{NcclBackend, NcclWorldConfig};
use symmpool::{Backend, Result, Stream, SymmBuffer, SymmPool, bf16};

/// One rank's GPU math: a compute and a communication stream, a cuBLAS handle on each.
pub struct GpuMath {
    compute: Stream,
    comm: Stream,
    blas_compute: cublas::Blas,
    blas_comm: cublas::Blas,
}

fn e(s: String) -> symmpool::Error {
    symmpool::Error::InvalidConfig(s)
}

fn ptr(b: &SymmBuffer) -> Result<u64> {
    b.device_ptr()
        .ok_or_else(|| e("not a device buffer".into()))
}

impl GpuMath {
    fn cuda(&self, on: On) -> &Arc<CudaStream> {
        self.stream(on).cuda_stream().expect("cuda stream")
    }
    fn blas(&self, on: On) -> &cublas::Blas {
        if on == On::Compute {
            &self.blas_compute
        } else {
            &self.blas_comm
        }
    }
}

impl Math for GpuMath {
    type E = bf16;
    fn stream(&self, on: On) -> &Stream {
        if on == On::Compute {
            &self.compute
        } else {
            &self.comm
        }
    }
    fn gemm(
        &self,
        on: On,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &SymmBuffer,
        b: &SymmBuffer,
        beta: f32,
        c: &SymmBuffer,
    ) -> Result<()> {
        let (lda, ldb) = (if ta { k } else { m }, if tb { n } else { k });
        // SAFETY: the buffers are live pool buffers of this rank's device with the
        // sizes the shapes imply (allocated by the trainer for exactly these).
        unsafe {
            self.blas(on).gemm_bf16(
                ta,
                tb,
                m,
                n,
                k,
                alpha,
                ptr(a)?,
                lda,
                ptr(b)?,
                ldb,
                beta,
                ptr(c)?,
                m,
            )
        }
        .map_err(e)
    }
    fn axpy(&self, on: On, alpha: f32, x: &SymmBuffer, y: &SymmBuffer) -> Result<()> {
        let n = (x.len_bytes() / 2) as usize;
        // SAFETY: x and y are live buffers of n bf16 elements.
        unsafe { self.blas(on).axpy_bf16(n, alpha, ptr(x)?, ptr(y)?) }.map_err(e)
    }
    fn scal(&self, on: On, alpha: f32, x: &SymmBuffer) -> Result<()> {
        // SAFETY: x is a live buffer of len/2 bf16 elements.
        unsafe {
            self.blas(on)
                .scal_bf16((x.len_bytes() / 2) as usize, alpha, ptr(x)?)
        }
        .map_err(e)
    }
    fn copy(&self, on: On, src: &SymmBuffer, dst: &SymmBuffer) -> Result<()> {
        // SAFETY: both are live device buffers of at least src.len_bytes() bytes.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                ptr(dst)?,
                ptr(src)?,
                src.len_bytes() as usize,
                self.cuda(on).cu_stream(),
            )
        }
        .map_err(|x| e(format!("cuMemcpyDtoDAsync: {x:?}")))
    }
    fn sumsq_into(&self, on: On, x: &SymmBuffer, out: &SymmBuffer, slot: usize) -> Result<()> {
        // SAFETY: x holds len/2 bf16 elements; out holds at least slot+1 f32.
        unsafe {
            self.blas(on).sumsq_bf16(
                (x.len_bytes() / 2) as usize,
                ptr(x)?,
                ptr(out)? + 4 * slot as u64,
            )
        }
        .map_err(e)
    }
    type Ev = cudarc::driver::CudaEvent;
    fn record(&self, on: On) -> Result<Self::Ev> {
        self.cuda(on)
            .record_event(None)
            .map_err(|x| e(format!("cuEventRecord: {x:?}")))
    }
    fn wait_for(&self, to: On, ev: &Self::Ev) -> Result<()> {
        self.cuda(to)
            .wait(ev)
            .map_err(|x| e(format!("cuStreamWaitEvent: {x:?}")))
    }
    fn sync(&self) -> Result<()> {
        self.cuda(On::Compute)
            .synchronize()
            .map_err(|x| e(format!("{x:?}")))?;
        self.cuda(On::Comm)
            .synchronize()
            .map_err(|x| e(format!("{x:?}")))
    }
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>> {
        out.read::<f32>()
    }
}

/// Train on `args.ranks` local GPUs, a thread per rank; returns rank 0's summaries.
pub fn run(args: &Args) -> Result<Vec<Summary>> {
    let devices: Vec<usize> = (0..args.ranks).collect();
    let backends = NcclBackend::local_world(&devices, NcclWorldConfig::default())?;
    let barrier = StepBarrier::new(args.ranks);
    on_rank_threads(backends, &barrier, |b| {
        let nccl = b
            .downcast_ref::<NcclBackend>()
            .ok_or_else(|| e("not an NCCL backend".into()))?;
        let pools = args
            .modes
            .iter()
            .map(|m| Ok((*m, super::make_pool(*m, b.clone())?)))
            .collect::<Result<Vec<(Mode, _)>>>()?;
        let math = GpuMath::new(nccl)?;
        let out = super::run_one_rank(&math, pools, args, &barrier);
        math.sync()?;
        out
    })
}

impl GpuMath {
    /// cuBLAS on a compute and a communication stream of the backend's device.
    fn new(nccl: &NcclBackend) -> Result<GpuMath> {
        let (compute, comm) = (nccl.cuda_stream()?, nccl.cuda_stream()?);
        Ok(GpuMath {
            blas_compute: cublas::Blas::new(compute.clone()).map_err(e)?,
            blas_comm: cublas::Blas::new(comm.clone()).map_err(e)?,
            compute: Stream::cuda(compute),
            comm: Stream::cuda(comm),
        })
    }
}

/// This process's rank on NCCL, set up from the launcher's environment.
pub fn process_backend(exchange: std::sync::Arc<dyn symmpool::Exchange>) -> Result<Backend> {
    NcclBackend::from_env(exchange, symmpool::backend::NcclConfig::default())
}

/// Train this process's rank on its GPU.
pub fn run_process_rank(
    backend: &Backend,
    pools: Vec<(Mode, SymmPool)>,
    args: &Args,
    barrier: &dyn super::ranks::StepSync,
) -> Result<Vec<Summary>> {
    let nccl = backend
        .downcast_ref::<NcclBackend>()
        .ok_or_else(|| e("not an NCCL backend".into()))?;
    let math = GpuMath::new(nccl)?;
    let out = super::run_one_rank(&math, pools, args, barrier);
    math.sync()?;
    out
}
