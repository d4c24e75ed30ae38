//! [`Math`] on NCCL GPUs: bf16 buffers, cuBLAS GEMMs (through cudarc) on three CUDA
//! streams per rank (compute, all-gather, reduce-scatter), events between them. Buffers reach cuBLAS and cudarc as typed
//! device views ([`CudaView`]), never as raw addresses; the cuBLAS calls are in
//! `examples/support/gpu_math.rs` (`cublas` here), shared with the GPU tests and benchmark.

use super::cli::Args;
use super::cublas;
use super::ranks::{StepBarrier, on_rank_threads};
use super::report::Summary;
use super::run::Start;
use super::trainer::{Math, On};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaStream, DeviceSlice, DriverError};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use symmpool::backend::{NcclBackend, NcclConfig};
use symmpool::{Backend, CudaView, Result, Stream, SymmBuffer, bf16};

/// One rank's GPU math: the three streams of [`On`], a cuBLAS handle on each, and
/// the events it records between them (made once, recorded again).
pub struct GpuMath {
    streams: [Stream; 3],
    blas: [cublas::Blas; 3],
    /// Events without timing, for the streams' waits.
    events: Rc<Events>,
    /// Events with timing, for the timeline's markers.
    timing: Rc<Events>,
    /// cuBLAS's SM count target for the compute stream's calls in a step that
    /// communicates: the device's SMs less `--sm-margin` (0, all of them, when the
    /// margin is 0).
    sm_target: usize,
}

/// Spare CUDA events of one kind. A wait enqueued on an event takes the event's state
/// when it is enqueued, so an event can be recorded again as soon as its [`Event`] is
/// dropped (after the waits on it were enqueued): a step records its events without
/// creating or destroying any.
struct Events {
    ctx: Arc<cudarc::driver::CudaContext>,
    flags: CUevent_flags,
    spare: RefCell<Vec<CudaEvent>>,
}

/// A recorded event; dropped, it goes back to its [`Events`].
pub struct Event {
    event: Option<CudaEvent>,
    home: Rc<Events>,
}

impl Event {
    fn get(&self) -> &CudaEvent {
        self.event.as_ref().expect("an event until dropped")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            self.home.spare.borrow_mut().push(e);
        }
    }
}

impl Events {
    fn new(ctx: Arc<cudarc::driver::CudaContext>, flags: CUevent_flags) -> Rc<Events> {
        Rc::new(Events {
            ctx,
            flags,
            spare: RefCell::new(Vec::new()),
        })
    }

    /// A spare event (or a new one) recorded on `stream`.
    fn record(self: &Rc<Self>, stream: &CudaStream) -> Result<Event> {
        let spare = self.spare.borrow_mut().pop();
        let event = match spare {
            Some(e) => e,
            None => (self.ctx.new_event(Some(self.flags))).map_err(driver("cuEventCreate"))?,
        };
        event.record(stream).map_err(driver("cuEventRecord"))?;
        Ok(Event {
            event: Some(event),
            home: self.clone(),
        })
    }
}

/// The index of `on` in [`GpuMath`]'s arrays.
fn index(on: On) -> usize {
    match on {
        On::Compute => 0,
        On::AllGather => 1,
        On::ReduceScatter => 2,
    }
}

fn not_nccl() -> symmpool::Error {
    symmpool::Error::InvalidConfig("not an NCCL backend".into())
}

/// A CUDA driver failure of `op`.
fn driver(op: &'static str) -> impl FnOnce(DriverError) -> symmpool::Error {
    move |x| symmpool::Error::Cuda {
        op,
        code: x.0 as i32,
        message: format!("{x:?}"),
    }
}

/// The buffer's bf16 elements as a device view to read.
fn bf16s(b: &SymmBuffer) -> Result<CudaView<'_, bf16>> {
    b.view::<bf16>()?.cuda()
}

impl GpuMath {
    fn cuda(&self, on: On) -> &Arc<CudaStream> {
        self.stream(on).cuda_stream().expect("cuda stream")
    }
    fn blas(&self, on: On) -> &cublas::Blas {
        &self.blas[index(on)]
    }
}

impl Math for GpuMath {
    type E = bf16;
    fn stream(&self, on: On) -> &Stream {
        &self.streams[index(on)]
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
        c: &mut SymmBuffer,
    ) -> Result<()> {
        let cfg = cublas::dense(ta, tb, m, n, k, alpha, beta)?;
        self.blas(on)
            .gemm_bf16(&cfg, &bf16s(a)?, &bf16s(b)?, &mut c.cuda_mut()?)
    }
    fn axpy(
        &self,
        on: On,
        alpha: f32,
        x: &SymmBuffer,
        chunk: usize,
        y: &mut SymmBuffer,
    ) -> Result<()> {
        let mut y = y.cuda_mut::<bf16>()?;
        let n = y.len();
        let x = x.view::<bf16>()?.slice(chunk * n, n)?.cuda()?;
        self.blas(on).axpy_bf16(alpha, &x, &mut y)
    }
    fn scal(&self, on: On, alpha: f32, x: &mut SymmBuffer) -> Result<()> {
        self.blas(on).scal_bf16(alpha, &mut x.cuda_mut()?)
    }
    fn copy(&self, on: On, src: &SymmBuffer, dst: &mut SymmBuffer) -> Result<()> {
        let (src, mut dst) = (src.view::<u8>()?.cuda()?, dst.cuda_mut::<u8>()?);
        if dst.len() < src.len() {
            return Err(symmpool::Error::BadView(format!(
                "copying {} bytes into {}",
                src.len(),
                dst.len()
            )));
        }
        self.cuda(on)
            .memcpy_dtod(&src, &mut dst)
            .map_err(driver("cuMemcpyDtoDAsync"))
    }
    fn sumsq_into(&self, on: On, x: &SymmBuffer, out: &mut SymmBuffer, slot: usize) -> Result<()> {
        let (_, out) = out.cuda_mut::<f32>()?.split_at_mut(slot)?;
        let (mut out, _) = out.split_at_mut(1)?;
        self.blas(on).sumsq_bf16(&bf16s(x)?, &mut out)
    }
    type Ev = Event;
    fn record(&self, on: On) -> Result<Self::Ev> {
        self.events.record(self.cuda(on))
    }
    fn wait_for(&self, to: On, ev: &Self::Ev) -> Result<()> {
        self.cuda(to)
            .wait(ev.get())
            .map_err(driver("cuStreamWaitEvent"))
    }
    fn sync(&self) -> Result<()> {
        for on in On::ALL {
            self.cuda(on)
                .synchronize()
                .map_err(driver("cuStreamSynchronize"))?;
        }
        Ok(())
    }
    type Mark = Event;
    fn mark(&self, on: On) -> Result<Self::Mark> {
        self.timing.record(self.cuda(on))
    }
    fn elapsed_us(&self, from: &Self::Mark, to: &Self::Mark) -> Result<f64> {
        let ms = (from.get())
            .elapsed_ms(to.get())
            .map_err(driver("cuEventElapsedTime"))?;
        Ok(f64::from(ms) * 1e3)
    }
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>> {
        out.read::<f32>()
    }
    fn share_sms(&self, communicating: bool) -> Result<()> {
        // cuBLAS plans the compute stream's calls for the SMs left (0: all of them).
        let target = if communicating { self.sm_target } else { 0 };
        self.blas(On::Compute).set_sm_count_target(target)
    }
}

/// Train on `args.ranks` local GPUs, a thread per rank; returns rank 0's summaries.
pub fn run(args: &Args) -> Result<Vec<Summary>> {
    let devices: Vec<usize> = (0..args.ranks).collect();
    let backends = NcclBackend::local_world(&devices, NcclConfig::default())?;
    let barrier = StepBarrier::new(args.ranks);
    on_rank_threads(backends, &barrier, |b| {
        let nccl = b.downcast_ref::<NcclBackend>().ok_or_else(not_nccl)?;
        // Before the pools: a margin the device cannot leave stops here, with nothing
        // to release.
        let math = GpuMath::new(nccl, args.sm_margin)?;
        let pools = super::make_pools(&args.modes, args.check, &b)?;
        let out = super::run::run_one_rank(&math, Start::New(pools), args, &barrier);
        math.sync()?;
        out
    })
}

impl GpuMath {
    /// cuBLAS on three streams of the backend's device, whose GEMMs may leave
    /// `sm_margin` SMs to the communication ([`Math::share_sms`]).
    ///
    /// # Errors
    /// [`symmpool::Error::InvalidConfig`] if `sm_margin` is not below the device's SM
    /// count; CUDA and cuBLAS errors.
    fn new(nccl: &NcclBackend, sm_margin: usize) -> Result<GpuMath> {
        let cuda = [
            nccl.cuda_stream()?,
            nccl.cuda_stream()?,
            nccl.cuda_stream()?,
        ];
        let blas = [
            cublas::Blas::new(cuda[0].clone())?,
            cublas::Blas::new(cuda[1].clone())?,
            cublas::Blas::new(cuda[2].clone())?,
        ];
        let ctx = cuda[0].context().clone();
        let sms = sm_count(&ctx, sm_margin)?;
        Ok(GpuMath {
            sm_target: if sm_margin == 0 { 0 } else { sms - sm_margin },
            events: Events::new(ctx.clone(), CUevent_flags::CU_EVENT_DISABLE_TIMING),
            timing: Events::new(ctx, CUevent_flags::CU_EVENT_DEFAULT),
            streams: cuda.map(Stream::cuda),
            blas,
        })
    }
}

/// The SMs of the device of `ctx`, checked to be more than `sm_margin`.
///
/// # Errors
/// [`symmpool::Error::InvalidConfig`] if the margin would leave no SM; a CUDA error if
/// the driver does not answer.
fn sm_count(ctx: &cudarc::driver::CudaContext, sm_margin: usize) -> Result<usize> {
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver("cuDeviceGetAttribute"))?;
    let sms = usize::try_from(sms).map_err(|_| symmpool::Error::Cuda {
        op: "cuDeviceGetAttribute",
        code: 0,
        message: format!("{sms} multiprocessors"),
    })?;
    if sm_margin >= sms {
        return Err(symmpool::Error::InvalidConfig(format!(
            "--sm-margin {sm_margin} leaves no SM of the device's {sms}"
        )));
    }
    Ok(sms)
}

/// This process's rank on NCCL, set up from the launcher's environment, with
/// `sm_margin` checked against its device before any pool exists.
pub fn process_backend(
    exchange: std::sync::Arc<dyn symmpool::Exchange>,
    sm_margin: usize,
) -> Result<Backend> {
    let backend = NcclBackend::from_env(exchange, symmpool::backend::NcclConfig::default())?;
    let nccl = backend.downcast_ref::<NcclBackend>().ok_or_else(not_nccl)?;
    sm_count(nccl.context(), sm_margin)?;
    Ok(backend)
}

/// Train this process's rank on its GPU, from its pools (made, or joined by a
/// newcomer).
pub fn run_process_rank(
    backend: &Backend,
    pools: Start,
    args: &Args,
    barrier: &dyn super::ranks::StepSync,
) -> Result<Vec<Summary>> {
    let nccl = backend.downcast_ref::<NcclBackend>().ok_or_else(not_nccl)?;
    let math = GpuMath::new(nccl, args.sm_margin)?;
    let out = super::run::run_one_rank(&math, pools, args, barrier);
    math.sync()?;
    out
}
