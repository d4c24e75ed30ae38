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
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, CommRole, DataMover,
    Refused, Region, Segment, SegmentMemory, SegmentProvider, StreamOps, Window,
};
use crate::control::{Exchange, LocalExchange};
use crate::core::{Fence, StreamId};
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ffi::{RawComm, RawWindow};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    if !ffi::driver_present() {
        return Err(Error::LibraryUnavailable {
            library: "libcuda (CUDA driver)",
            hint: "no NVIDIA driver on this machine; use the host backend",
        });
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(ffi::cuda("cuDeviceGetCount"))
}

/// The memory of one `ncclMemAlloc` segment. Dropping it without
/// [`SegmentProvider::free`] leaks the device memory on purpose (a pool does that when
/// its device cannot drain in time).
#[derive(Debug)]
struct NcclMemory {
    ptr: u64,
    size_bytes: u64,
}

impl SegmentMemory for NcclMemory {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn device_ptr(&self) -> Option<u64> {
        Some(self.ptr)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Fences as CUDA events, garbage-collected once known complete; and the streams
/// that have recorded any, for draining.
#[derive(Default)]
struct FenceTable {
    next: BTreeMap<StreamId, u64>,
    events: BTreeMap<(StreamId, u64), CudaEvent>,
    /// Largest fence known complete, per stream: waits on it or earlier are skipped.
    done: BTreeMap<StreamId, u64>,
    streams: BTreeMap<StreamId, Arc<CudaStream>>,
    spare: Vec<CudaEvent>,
}

/// Events kept per stream before completed ones are collected.
const FENCES_PER_STREAM: usize = 64;

struct Comm {
    raw: Mutex<RawComm>,
    owned: bool,
}

/// One rank of NCCL: a device context and its communicators. Segments and windows
/// belong to the pools (as owned handles); this type keeps no table of them.
///
/// Make the ranks of a single process with [`NcclBackend::local_world`] (one per GPU,
/// to be driven by one thread each), or adopt a host runtime's communicator with
/// [`NcclBackend::from_raw`]. Both return [`Backend`]s; reach this type again through
/// [`Backend::downcast_ref`].
pub struct NcclBackend {
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    comms: Vec<Comm>,
    /// Registrations made per communicator (window ordinals).
    ordinals: Mutex<Vec<u64>>,
    fences: Mutex<FenceTable>,
}

impl fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .field("comms", &self.comms.len())
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
    /// before NCCL 2.27; [`Error::InvalidConfig`] for no devices, a device listed twice
    /// or one that is not present; [`Error::Cuda`] / [`Error::Nccl`] from
    /// initialisation.
    pub fn local_world(devices: &[usize], config: NcclWorldConfig) -> Result<Vec<Backend>> {
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
        let results: Vec<Result<Backend>> = std::thread::scope(|s| {
            let handles: Vec<_> = contexts
                .into_iter()
                .zip(exchanges)
                .enumerate()
                .map(|(rank, (ctx, exchange))| {
                    let (roles, ids) = (&roles, &ids);
                    s.spawn(move || -> Result<Backend> {
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
                        NcclBackend::assemble(
                            rank,
                            n,
                            version,
                            ctx,
                            infos,
                            comms,
                            Arc::new(exchange),
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Internal {
                            what: "a rank's initialisation thread panicked".into(),
                        })
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
    ) -> Result<Backend> {
        let info = BackendInfo::new(
            BackendKind::Nccl,
            rank,
            world,
            version,
            ffi::segment_granularity(ctx.ordinal()),
            infos,
        )?;
        let n = comms.len();
        let parts = Arc::new(NcclBackend {
            rank,
            world,
            ctx,
            comms,
            ordinals: Mutex::new(vec![0; n]),
            fences: Mutex::new(FenceTable::default()),
        });
        Backend::new(info, exchange, parts)
    }

    /// Adopt communicators created by a host runtime (one rank per process is the
    /// normal case). The backend does not destroy them.
    ///
    /// `comms` lists each communicator with its role and the CTA policy it was
    /// created with, in the order segments are to be registered; every rank must pass
    /// the same list. `exchange` carries the pool's agreement among the ranks.
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
    ) -> Result<Backend> {
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
        let Some((rank, world)) = rank_size else {
            return Err(Error::InvalidConfig("no communicators".into()));
        };
        NcclBackend::assemble(rank, world, version, ctx, infos, owned, exchange)
    }

    /// The raw handle of communicator `comm` (index into
    /// [`BackendInfo::communicators`]), for calling NCCL directly beside the pool
    /// (benchmarks, interop).
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
        stream.cuda_stream().ok_or(Error::WrongStream)
    }

    /// The device address of a region's first byte.
    fn ptr(region: &Region<'_>) -> Result<u64> {
        region.device_ptr().ok_or(Error::Internal {
            what: "a host segment reached the NCCL backend".into(),
        })
    }

    /// What both collectives start with: the counts checked against the regions, the
    /// send and receive device addresses, the CUDA stream with this device's context
    /// bound, and the communicator, held locked.
    fn collective_parts<'s>(
        &self,
        name: &'static str,
        a: &CollArgs<'s>,
        reduce: bool,
    ) -> Result<(u64, u64, &'s Arc<CudaStream>, MutexGuard<'_, RawComm>)> {
        a.check_counts(name, self.world, reduce)?;
        let send = Self::ptr(&a.send)?;
        let recv = Self::ptr(&a.recv)?;
        let cs = self.cuda_of(a.stream)?;
        self.bind()?;
        Ok((send, recv, cs, self.comm(a.comm)?))
    }

    fn comm(&self, c: usize) -> Result<MutexGuard<'_, RawComm>> {
        self.comms
            .get(c)
            .map(|c| lock(&c.raw))
            .ok_or_else(|| Error::InvalidCollective {
                op: "NCCL call",
                detail: format!("no communicator {c}"),
            })
    }

    fn memory(segment: &Segment) -> Result<&NcclMemory> {
        segment.memory::<NcclMemory>().ok_or(Error::Internal {
            what: "a segment of another backend reached the NCCL backend".into(),
        })
    }
}

impl SegmentProvider for NcclBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        self.bind()?;
        let ptr = ffi::mem_alloc(size_bytes)?;
        Ok(Segment::new(Box::new(NcclMemory { ptr, size_bytes })))
    }

    unsafe fn register(&self, segment: &Segment, comm: usize) -> Result<Option<Window>> {
        let mem = Self::memory(segment)?;
        self.bind()?;
        let raw = self.comm(comm)?;
        // SAFETY: `raw` is this backend's live communicator, held locked; the segment
        // is one whole ncclMemAlloc allocation of this device (from `allocate`), and
        // the caller guarantees it is not registered on this communicator yet and that
        // every rank registers in the same order.
        let win = unsafe { ffi::window_register(&raw, mem.ptr, mem.size_bytes) }?;
        let mut ordinals = lock(&self.ordinals);
        ordinals[comm] += 1;
        Ok(win.map(|w| Window::new(comm, ordinals[comm], Box::new(w))))
    }

    unsafe fn deregister(&self, window: Window) -> std::result::Result<(), Refused<Window>> {
        let comm = window.comm();
        let ordinal = window.ordinal();
        let raw_window = match window.into_handle::<RawWindow>() {
            Ok(w) => *w,
            Err(window) => {
                return Err(Refused {
                    handle: window,
                    error: Error::Internal {
                        what: "a window of another backend reached the NCCL backend".into(),
                    },
                });
            }
        };
        let result = self.bind().and_then(|()| self.comm(comm)).and_then(|raw| {
            // SAFETY: the window was registered on this communicator by `register`
            // (the caller's contract) and is consumed here; `raw` is live and held
            // locked; the caller guarantees no work uses it.
            unsafe { ffi::window_deregister(&raw, RawWindow(raw_window.0)) }
        });
        result.map_err(|error| Refused {
            handle: Window::new(comm, ordinal, Box::new(raw_window)),
            error,
        })
    }

    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        let ptr = match Self::memory(&segment) {
            Ok(m) => m.ptr,
            Err(error) => {
                return Err(Refused {
                    handle: segment,
                    error,
                });
            }
        };
        let result = self.bind().and_then(|()| {
            // SAFETY: the caller guarantees the segment came from `allocate` (so `ptr`
            // is an ncclMemAlloc pointer), that no window covers it and no work uses
            // it; it is consumed here, so freed once.
            unsafe { ffi::mem_free(ptr) }
        });
        result.map_err(|error| Refused {
            handle: segment,
            error,
        })
    }
}

impl StreamOps for NcclBackend {
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
        let sid = stream.id();
        t.streams.entry(sid).or_insert_with(|| cs.clone());
        let next = t.next.entry(sid).or_insert(0);
        *next += 1;
        let fence = *next;
        t.events.insert((sid, fence), event);
        // Collect this stream's completed events once there are many: completion of
        // fence k means every earlier fence on the stream is complete too.
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

    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>> {
        let t = lock(&self.fences);
        let range = (stream, 0)..=(stream, u64::MAX);
        let newest = t
            .events
            .range(range)
            .rev()
            .find(|(_, e)| e.is_complete())
            .map(|(k, _)| k.1);
        let collected = t.done.get(&stream).copied();
        Ok(newest.max(collected).map(Fence))
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        ffi::is_capturing(cs)
    }

    fn drain(&self, deadline: Instant) -> Result<bool> {
        self.bind()?;
        // One event after everything enqueued so far on every stream that fenced.
        let streams: Vec<Arc<CudaStream>> = lock(&self.fences).streams.values().cloned().collect();
        let events = streams
            .iter()
            .map(|s| s.record_event(None).map_err(ffi::cuda("cuEventRecord")))
            .collect::<Result<Vec<CudaEvent>>>()?;
        // Poll, never block in the driver: a peer stuck in a collective would hold a
        // blocking synchronise forever.
        loop {
            if events.iter().all(CudaEvent::is_complete) {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl DataMover for NcclBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        let dst = Self::ptr(&region.sub(0, data.len() as u64)?)?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: `dst..dst+len` lies inside a live segment of this device (the region
        // is checked against its segment, which the caller's buffer keeps alive).
        unsafe { ffi::copy_to_device(dst, data, cs) }
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        let src = Self::ptr(&region.sub(0, out.len() as u64)?)?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: as in `write`.
        unsafe { ffi::copy_to_host(src, out, cs) }
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
}

impl Collectives for NcclBackend {
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        let (send, recv, cs, raw) = self.collective_parts("all_gather", a, false)?;
        // SAFETY: both regions lie inside live segments of this device (regions are
        // checked against their segments, which the caller's buffers keep alive), with
        // the sizes checked above; the pool keeps the segments until the stream has
        // passed (frees are fenced); `raw` is held locked.
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
        // The pools released their segments and windows before this (they hold the
        // backend), each after draining for at most its own timeout. Everything here is
        // local: `ncclCommAbort` (not the collective destroy), which also ends NCCL
        // operations still in flight, as is left when a peer died.
        let _ = self.bind();
        lock(&self.fences).events.clear();
        let owned: Vec<RawComm> = self
            .comms
            .drain(..)
            .filter(|c| c.owned)
            .map(|c| c.raw.into_inner().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let abort = move |comms: Vec<RawComm>| {
            for raw in comms {
                // SAFETY: the communicator was created by this backend (`owned`), the
                // pools deregistered their windows (or leaked them on purpose), and it
                // is consumed here.
                if let Err(e) = unsafe { ffi::comm_abort(raw) } {
                    tracing::error!("symmpool: ncclCommAbort failed: {e}");
                }
            }
        };
        if matches!(self.drain(Instant::now()), Ok(true)) {
            abort(owned);
            return;
        }
        // Work is still running (a stuck collective, or a kernel that never ends). An
        // abort waits for the device where it unmaps leaked windows, so it runs on a
        // thread of its own and the drop returns now.
        tracing::warn!(
            "symmpool: rank {}: device work still in flight; aborting its communicators in the background",
            self.rank
        );
        let ctx = self.ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("symmpool-abort".into())
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                abort(owned);
            });
        if let Err(e) = spawned {
            tracing::error!(
                "symmpool: could not start the abort thread ({e}); communicators leaked"
            );
        }
    }
}
