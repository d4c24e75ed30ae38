//! The NCCL backend: segments from `ncclMemAlloc`, one `ncclCommWindowRegister(..,
//! NCCL_WIN_COLL_SYMMETRIC)` per (segment, communicator), collectives through NCCL.
//!
//! Each rank has up to three communicators over the same ranks (see [`CommRole`]):
//! a default-policy one whose windows run NCCL's symmetric kernels, a
//! `CTAPolicy = NCCL_CTA_POLICY_ZERO` one (NCCL ≥ 2.28) whose windows run the
//! copy-engine all-gather, and a default-policy one where nothing is registered, for
//! the collectives that run faster on NCCL's ring. NCCL is loaded at run time; a
//! missing library or one older than 2.27 is an error, never a panic.

mod ffi;

use super::{
    Backend, BackendKind, CollArgs, CommInfo, CommRole, Region, Registration, SegmentKey,
    check_counts,
};
use crate::core::{Fence, StreamId};
use crate::error::{Error, NcclVersion, Result};
use crate::exchange::{Exchange, LocalExchange};
use crate::stream::Stream;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ffi::{RawComm, RawWindow};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

pub use cudarc::nccl::sys::ncclComm_t;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which communicators a local world creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclWorldConfig {
    /// Create the copy-engine communicator (ignored before NCCL 2.28).
    pub copy_engine: bool,
    /// Create the unregistered communicator for ring collectives.
    pub plain: bool,
}

impl Default for NcclWorldConfig {
    fn default() -> Self {
        NcclWorldConfig {
            copy_engine: true,
            plain: true,
        }
    }
}

/// The NCCL version found at run time.
///
/// # Errors
/// [`Error::LibraryUnavailable`] if the CUDA driver or NCCL cannot be loaded.
pub fn nccl_version() -> Result<NcclVersion> {
    ffi::load()
}

/// Number of CUDA devices visible, or an error if the driver is missing or fails.
///
/// # Errors
/// [`Error::LibraryUnavailable`], [`Error::Cuda`].
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::LibraryUnavailable {
            library: "libcuda (CUDA driver)",
            hint: "no NVIDIA driver on this machine; use the host backend",
        });
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(ffi::cuda("cuDeviceGetCount"))
}

struct SegmentMem {
    ptr: u64,
    size: u64,
}

/// Fences as CUDA events, garbage-collected once known complete.
#[derive(Default)]
struct FenceTable {
    next: BTreeMap<StreamId, u64>,
    events: BTreeMap<(StreamId, u64), CudaEvent>,
    /// Largest fence known complete, per stream: waits on it or earlier are skipped.
    done: BTreeMap<StreamId, u64>,
    spare: Vec<CudaEvent>,
}

/// The segment granularity of a device: `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` for
/// pinned device memory with POSIX-FD handles (what `ncclMemAlloc` rounds to), at least
/// 2 MiB (NCCL 2.27's window rule), as a power of two. 2 MiB if the query fails.
fn segment_granularity(ordinal: usize) -> u64 {
    use cudarc::driver::sys;
    const MIN: u64 = 2 << 20;
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let mut granularity = 0usize;
    // SAFETY: `granularity` and `prop` are valid for the call, which only reads `prop`;
    // the driver library is loaded (the caller created a context first).
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    };
    if r != sys::cudaError_enum::CUDA_SUCCESS || granularity == 0 {
        log::warn!("symmpool: cuMemGetAllocationGranularity failed ({r:?}); assuming 2 MiB");
        return MIN;
    }
    (granularity as u64).max(MIN).next_power_of_two()
}

/// How long dropping a backend waits for its device to drain.
const DROP_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Events kept per stream before completed ones are collected.
const FENCES_PER_STREAM: usize = 64;

struct Comm {
    raw: Mutex<RawComm>,
    owned: bool,
}

/// One rank of NCCL: a device context, communicators, segments and windows.
///
/// Make the ranks of a single process with [`NcclBackend::local_world`] (one per GPU,
/// to be driven by one thread each), or adopt a host runtime's communicator with
/// [`NcclBackend::from_raw`].
pub struct NcclBackend {
    rank: usize,
    world: usize,
    /// Segment granularity in bytes (see `segment_granularity`).
    granularity: u64,
    version: NcclVersion,
    ctx: Arc<CudaContext>,
    infos: Vec<CommInfo>,
    comms: Vec<Comm>,
    exchange: Arc<dyn Exchange>,
    segments: Mutex<BTreeMap<SegmentKey, SegmentMem>>,
    windows: Mutex<BTreeMap<(SegmentKey, usize), RawWindow>>,
    fences: Mutex<FenceTable>,
}

impl fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("version", &self.version.to_string())
            .field("device", &self.ctx.ordinal())
            .field("comms", &self.infos)
            .finish()
    }
}

/// The CTA policy NCCL will apply: `NCCL_CTA_POLICY` in the environment overrides the
/// config (NCCL `init.cc`, "Comm config CTAPolicy reset to NCCL_CTA_POLICY").
fn effective_policy(requested: i32) -> i32 {
    match std::env::var("NCCL_CTA_POLICY")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("2") | Some("ZERO") => ffi::NCCL_CTA_POLICY_ZERO,
        Some("0") | Some("DEFAULT") => ffi::NCCL_CTA_POLICY_DEFAULT,
        Some("1") | Some("EFFICIENCY") => 1,
        _ => requested,
    }
}

impl NcclBackend {
    /// One backend per listed GPU of this process, in rank order: rank `i` drives
    /// device `devices[i]`. Communicators are created from one thread per rank with a
    /// shared `ncclUniqueId` per communicator, configured as `NCCL_CONFIG_INITIALIZER`
    /// with the role's CTA policy. Hand each backend to its own thread.
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`] without a driver or NCCL; [`Error::NcclTooOld`]
    /// before NCCL 2.27; [`Error::InvalidConfig`] for fewer than one device or a device
    /// listed twice; [`Error::Cuda`] / [`Error::Nccl`] from initialisation.
    pub fn local_world(devices: &[usize], config: NcclWorldConfig) -> Result<Vec<NcclBackend>> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        if devices.is_empty() {
            return Err(Error::InvalidConfig("no devices".into()));
        }
        let mut sorted = devices.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != devices.len() {
            return Err(Error::InvalidConfig("a device is listed twice".into()));
        }
        let count = device_count()?;
        if let Some(&d) = devices.iter().find(|&&d| d >= count) {
            return Err(Error::InvalidConfig(format!(
                "device {d} not present ({count} visible)"
            )));
        }
        let mut roles = vec![CommInfo::SYMMETRIC];
        if config.copy_engine && version >= NcclVersion::COPY_ENGINE {
            roles.push(CommInfo::COPY_ENGINE);
        }
        if config.plain {
            roles.push(CommInfo::PLAIN);
        }
        let ids = roles
            .iter()
            .map(|_| ffi::unique_id())
            .collect::<Result<Vec<_>>>()?;
        let n = devices.len();
        let exchanges = LocalExchange::group(n);
        // Every context first: a device that fails here fails the call before any rank
        // blocks in ncclCommInitRankConfig waiting for it.
        let contexts = devices
            .iter()
            .map(|&dev| CudaContext::new(dev).map_err(ffi::cuda("cuDevicePrimaryCtxRetain")))
            .collect::<Result<Vec<_>>>()?;
        let results: Vec<Result<NcclBackend>> = std::thread::scope(|s| {
            let handles: Vec<_> = contexts
                .into_iter()
                .zip(exchanges)
                .enumerate()
                .map(|(rank, (ctx, exchange))| {
                    let (roles, ids) = (&roles, &ids);
                    s.spawn(move || -> Result<NcclBackend> {
                        ctx.bind_to_thread().map_err(ffi::cuda("cuCtxSetCurrent"))?;
                        let mut comms = Vec::new();
                        let mut infos = Vec::new();
                        for (&info, id) in roles.iter().zip(ids) {
                            let raw = ffi::comm_init(n, *id, rank, info.cta_policy)?;
                            comms.push(Comm {
                                raw: Mutex::new(raw),
                                owned: true,
                            });
                            infos.push(CommInfo {
                                cta_policy: effective_policy(info.cta_policy),
                                ..info
                            });
                        }
                        Ok(NcclBackend::assemble(
                            rank,
                            n,
                            version,
                            ctx,
                            infos,
                            comms,
                            Arc::new(exchange),
                        ))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::InvalidConfig("rank init thread panicked".into()))
                    })
                })
                .collect()
        });
        results.into_iter().collect()
    }

    fn assemble(
        rank: usize,
        world: usize,
        version: NcclVersion,
        ctx: Arc<CudaContext>,
        infos: Vec<CommInfo>,
        comms: Vec<Comm>,
        exchange: Arc<dyn Exchange>,
    ) -> NcclBackend {
        NcclBackend {
            rank,
            world,
            granularity: segment_granularity(ctx.ordinal()),
            version,
            ctx,
            infos,
            comms,
            exchange,
            segments: Mutex::new(BTreeMap::new()),
            windows: Mutex::new(BTreeMap::new()),
            fences: Mutex::new(FenceTable::default()),
        }
    }

    /// Adopt communicators created by a host runtime (one rank per process is the
    /// normal case). The backend does not destroy them.
    ///
    /// `comms` lists each communicator with its role and the CTA policy it was
    /// created with, in the order segments are to be registered; every rank must pass
    /// the same list. `exchange` carries the pool's agreement among the ranks (a TCP
    /// store, MPI, ...).
    ///
    /// # Safety
    /// - every handle is a live `ncclComm_t` on the device of `ctx`, and all have the
    ///   same rank and size;
    /// - it stays live until this backend is dropped;
    /// - while this backend exists, nothing else calls NCCL on these communicators
    ///   concurrently with it (NCCL communicators are not thread-safe);
    /// - a communicator listed with role `CopyEngine` was created with
    ///   `CTAPolicy = NCCL_CTA_POLICY_ZERO` (else the reported path is wrong).
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`], [`Error::NcclTooOld`], [`Error::InvalidConfig`]
    /// if the communicators disagree on rank or size or the exchange on either.
    pub unsafe fn from_raw(
        ctx: Arc<CudaContext>,
        comms: Vec<(ncclComm_t, CommRole, i32)>,
        exchange: Arc<dyn Exchange>,
    ) -> Result<NcclBackend> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        if comms.is_empty() {
            return Err(Error::InvalidConfig("no communicators".into()));
        }
        let mut rank_size = None;
        let mut infos = Vec::new();
        let mut owned = Vec::new();
        for (raw, role, policy) in comms {
            let raw = RawComm(raw);
            let rs = ffi::comm_rank_size(&raw)?;
            if *rank_size.get_or_insert(rs) != rs {
                return Err(Error::InvalidConfig(
                    "communicators differ in rank or size".into(),
                ));
            }
            infos.push(CommInfo {
                role,
                cta_policy: effective_policy(policy),
                registers: role != CommRole::Plain,
            });
            owned.push(Comm {
                raw: Mutex::new(raw),
                owned: false,
            });
        }
        let (rank, world) = rank_size.expect("at least one communicator");
        if exchange.rank() != rank || exchange.world_size() != world {
            return Err(Error::InvalidConfig(
                "exchange and communicators disagree on rank or size".into(),
            ));
        }
        Ok(NcclBackend::assemble(
            rank, world, version, ctx, infos, owned, exchange,
        ))
    }

    /// The raw handle of communicator `comm` (index into
    /// [`communicators`](Backend::communicators)), for calling NCCL directly beside the
    /// pool (benchmarks, interop).
    ///
    /// Using the handle is `unsafe` on the caller's side: NCCL calls on it must not
    /// overlap with this backend's (it serialises its own calls only), and it must not
    /// be used after the backend is dropped.
    pub fn raw_comm(&self, comm: usize) -> Option<ncclComm_t> {
        self.comms.get(comm).map(|c| lock(&c.raw).0)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new non-blocking cudarc stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn cuda_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(ffi::cuda("cuStreamCreate"))
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(ffi::cuda("cuCtxSetCurrent"))
    }

    fn cuda_of<'s>(&self, stream: &'s Stream) -> Result<&'s Arc<CudaStream>> {
        stream.cuda_stream().ok_or_else(|| {
            Error::InvalidConfig("a host stream was passed to the NCCL backend".into())
        })
    }

    /// The device address of a region, checked against its segment (a caller's
    /// `device_ptr` is never trusted: the trait is public).
    fn ptr(&self, region: &Region) -> Result<u64> {
        let segs = lock(&self.segments);
        let seg = segs.get(&region.segment).ok_or(Error::ForeignBuffer)?;
        match region.offset_bytes.checked_add(region.len_bytes) {
            Some(end) if end <= seg.size => Ok(seg.ptr + region.offset_bytes),
            _ => Err(Error::BadView(format!(
                "range {}+{} outside segment of {} bytes",
                region.offset_bytes, region.len_bytes, seg.size
            ))),
        }
    }

    /// What both collectives start with: the counts checked against the regions (see
    /// [`check_counts`]), the send and receive device addresses (checked by `ptr`), the
    /// CUDA stream with this device's context bound, and the communicator, held locked.
    fn collective_parts<'s>(
        &self,
        name: &'static str,
        a: &CollArgs<'s>,
        reduce: bool,
    ) -> Result<(u64, u64, &'s Arc<CudaStream>, MutexGuard<'_, RawComm>)> {
        check_counts(name, a, self.world, reduce)?;
        let send = self.ptr(&a.send)?;
        let recv = self.ptr(&a.recv)?;
        let cs = self.cuda_of(a.stream)?;
        self.bind()?;
        Ok((send, recv, cs, self.comm(a.comm)?))
    }

    fn comm(&self, c: usize) -> Result<MutexGuard<'_, RawComm>> {
        self.comms
            .get(c)
            .map(|c| lock(&c.raw))
            .ok_or_else(|| Error::InvalidConfig(format!("no communicator {c}")))
    }
}

impl Backend for NcclBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Nccl
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn nccl_version(&self) -> NcclVersion {
        self.version
    }

    fn granularity_bytes(&self) -> u64 {
        // NCCL rounds ncclMemAlloc to CU_MEM_ALLOC_GRANULARITY_RECOMMENDED (2 MiB on
        // Hopper), and 2.27 requires 2 MiB-aligned window bases and sizes.
        self.granularity
    }

    fn communicators(&self) -> &[CommInfo] {
        &self.infos
    }

    fn exchange(&self) -> &dyn Exchange {
        self.exchange.as_ref()
    }

    fn alloc_segment(&self, id: SegmentKey, size_bytes: u64) -> Result<()> {
        self.bind()?;
        let ptr = ffi::mem_alloc(size_bytes)?;
        lock(&self.segments).insert(
            id,
            SegmentMem {
                ptr,
                size: size_bytes,
            },
        );
        Ok(())
    }

    fn free_segment(&self, id: SegmentKey) -> Result<()> {
        // Windows still covering the segment go first (NCCL's teardown order).
        let comms: Vec<usize> = lock(&self.windows)
            .keys()
            .filter(|(k, _)| *k == id)
            .map(|&(_, c)| c)
            .collect();
        for c in comms {
            self.deregister(id, c)?;
        }
        let Some(seg) = lock(&self.segments).remove(&id) else {
            return Ok(());
        };
        self.bind()?;
        // SAFETY: no window covers the segment any more (deregistered above), it came
        // from `mem_alloc` and is removed from the table, so it is freed once; the pool
        // frees segments only after draining the device or when growth failed before
        // any work used them.
        unsafe { ffi::mem_free(seg.ptr) }
    }

    fn register(&self, id: SegmentKey, comm: usize) -> Result<Registration> {
        let (ptr, size) = {
            let segs = lock(&self.segments);
            let s = segs.get(&id).ok_or(Error::ForeignBuffer)?;
            (s.ptr, s.size)
        };
        if lock(&self.windows).contains_key(&(id, comm)) {
            return Err(Error::InvalidConfig(
                "segment already registered on this communicator (one window per segment)".into(),
            ));
        }
        self.bind()?;
        let raw = self.comm(comm)?;
        // SAFETY: `raw` is this backend's live communicator, held locked; `ptr..ptr+size`
        // is one whole ncclMemAlloc allocation of this device (from `alloc_segment`),
        // not registered on this communicator (checked just above).
        match unsafe { ffi::window_register(&raw, ptr, size) }? {
            Some(win) => {
                lock(&self.windows).insert((id, comm), win);
                Ok(Registration::Symmetric)
            }
            None => Ok(Registration::Unsupported),
        }
    }

    fn deregister(&self, id: SegmentKey, comm: usize) -> Result<()> {
        let Some(win) = lock(&self.windows).remove(&(id, comm)) else {
            return Ok(());
        };
        self.bind()?;
        let raw = self.comm(comm)?;
        // SAFETY: `win` was registered on this communicator (it was in the table under
        // (id, comm)) and is removed from it; `raw` is live and held locked; the pool
        // drains the device before it deregisters.
        unsafe { ffi::window_deregister(&raw, win) }
    }

    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream::cuda(self.cuda_stream()?))
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        let cs = self.cuda_of(stream)?;
        let mut t = lock(&self.fences);
        let event = match t.spare.pop() {
            Some(e) => e,
            None => self
                .ctx
                .new_event(None)
                .map_err(ffi::cuda("cuEventCreate"))?,
        };
        event.record(cs).map_err(ffi::cuda("cuEventRecord"))?;
        let next = t.next.entry(stream.id()).or_insert(0);
        *next += 1;
        let fence = *next;
        t.events.insert((stream.id(), fence), event);
        // Collect this stream's completed events once there are many: completion of
        // fence k means every earlier fence on the stream is complete too.
        let sid = stream.id();
        let range = (sid, 0)..=(sid, u64::MAX);
        if t.events.range(range.clone()).count() > FENCES_PER_STREAM {
            let done = t
                .events
                .range(range)
                .rev()
                .find(|(_, e)| e.is_complete())
                .map(|(k, _)| k.1);
            if let Some(done) = done {
                let keep = t.events.split_off(&(sid, done + 1));
                let old = std::mem::replace(&mut t.events, keep);
                for ((s, f), e) in old {
                    if s == sid {
                        t.spare.push(e);
                    } else {
                        t.events.insert((s, f), e);
                    }
                }
                let w = t.done.entry(sid).or_insert(0);
                *w = (*w).max(done);
            }
        }
        Ok(Fence(fence))
    }

    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()> {
        let cs = self.cuda_of(stream)?;
        let t = lock(&self.fences);
        if t.done.get(&on).is_some_and(|&d| fence.0 <= d) {
            return Ok(());
        }
        match t.events.get(&(on, fence.0)) {
            Some(e) => cs.wait(e).map_err(ffi::cuda("cuStreamWaitEvent")),
            // Only collected events are missing, and those are complete.
            None => Ok(()),
        }
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: `cs` is a live stream of this context.
        let status = unsafe { cudarc::driver::result::stream::is_capturing(cs.cu_stream()) }
            .map_err(ffi::cuda("cuStreamIsCapturing"))?;
        Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(ffi::cuda("cuCtxSynchronize"))
    }

    fn write(&self, region: Region, data: &[u8], stream: &Stream) -> Result<()> {
        let dst = self.ptr(&Region {
            len_bytes: data.len() as u64,
            device_ptr: None,
            ..region
        })?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: `dst..dst+len` lies inside a live segment of this device (checked by
        // `ptr`); the copy is synchronised before `data` can go away.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, cs.cu_stream()) }
            .map_err(ffi::cuda("cuMemcpyHtoDAsync"))?;
        cs.synchronize().map_err(ffi::cuda("cuStreamSynchronize"))
    }

    fn read(&self, region: Region, out: &mut [u8], stream: &Stream) -> Result<()> {
        let src = self.ptr(&Region {
            len_bytes: out.len() as u64,
            device_ptr: None,
            ..region
        })?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: `src..src+len` lies inside a live segment; `out` outlives the copy,
        // which is synchronised before returning.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, cs.cu_stream()) }
            .map_err(ffi::cuda("cuMemcpyDtoHAsync"))?;
        cs.synchronize().map_err(ffi::cuda("cuStreamSynchronize"))
    }

    fn device_ptr(&self, region: Region) -> Option<u64> {
        self.ptr(&Region {
            device_ptr: None,
            ..region
        })
        .ok()
    }

    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        f()?;
        let end = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        end.synchronize().map_err(ffi::cuda("cuEventSynchronize"))?;
        start
            .elapsed_ms(&end)
            .map(f64::from)
            .map_err(ffi::cuda("cuEventElapsedTime"))
    }

    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        let (send, recv, cs, raw) = self.collective_parts("all_gather", a, false)?;
        // SAFETY: both regions lie inside live segments of this device (checked by
        // `ptr`), with the sizes the pool validated; the pool keeps the segments until
        // the stream has passed (frees are fenced); `raw` is held locked.
        unsafe {
            ffi::all_gather(
                &raw,
                send,
                recv,
                a.count,
                ffi::dtype(a.dtype),
                cs.cu_stream() as _,
            )
        }
    }

    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        let (send, recv, cs, raw) = self.collective_parts("reduce_scatter", a, true)?;
        // SAFETY: as in `all_gather`.
        unsafe {
            ffi::reduce_scatter(
                &raw,
                send,
                recv,
                a.count,
                ffi::dtype(a.dtype),
                ffi::red_op(a.op),
                cs.cu_stream() as _,
            )
        }
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        // Teardown order (DESIGN.md §2): drain, deregister, free, then the
        // communicators. Everything here is local: abort, not the collective destroy.
        // A device that does not drain in time keeps its memory (freeing it under
        // running work is worse than leaking it); the communicators are aborted anyway.
        let drained = match self.synchronize_within(DROP_DRAIN_TIMEOUT) {
            Ok(d) => d,
            Err(e) => {
                log::error!("symmpool: draining rank {} failed: {e}", self.rank);
                false
            }
        };
        if !drained {
            log::error!(
                "symmpool: rank {} did not drain; its segments are leaked",
                self.rank
            );
            lock(&self.segments).clear();
            lock(&self.windows).clear();
        }
        let _ = self.bind();
        let windows = std::mem::take(&mut *lock(&self.windows));
        for ((_, c), win) in windows {
            let Ok(raw) = self.comm(c) else { continue };
            // SAFETY: each window was registered on communicator `c`, which is still
            // live (aborted below) and held locked; the device drained above.
            let r = unsafe { ffi::window_deregister(&raw, win) };
            if let Err(e) = r {
                log::error!("symmpool: deregistering a window failed: {e}");
            }
        }
        let segments = std::mem::take(&mut *lock(&self.segments));
        for (_, seg) in segments {
            // SAFETY: every window is deregistered above, the device drained, and each
            // pointer came from `mem_alloc` and is freed once (the table is emptied).
            if let Err(e) = unsafe { ffi::mem_free(seg.ptr) } {
                log::error!("symmpool: ncclMemFree failed: {e}");
            }
        }
        lock(&self.fences).events.clear();
        for comm in self.comms.drain(..) {
            if comm.owned {
                let raw = comm.raw.into_inner().unwrap_or_else(|p| p.into_inner());
                // SAFETY: the communicator was created by this backend (`owned`), its
                // windows are deregistered, and it is consumed here.
                if let Err(e) = unsafe { ffi::comm_abort(raw) } {
                    log::error!("symmpool: ncclCommAbort failed: {e}");
                }
            }
        }
    }
}
