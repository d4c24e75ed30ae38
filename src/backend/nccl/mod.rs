//! The NCCL backend: segments from `ncclMemAlloc`, one `ncclCommWindowRegister(..,
//! NCCL_WIN_COLL_SYMMETRIC)` per (segment, communicator), collectives through NCCL.
//!
//! Each rank has up to three communicators over the same ranks (see [`CommRole`](super::CommRole)):
//! a default-policy one whose windows run NCCL's symmetric kernels, a
//! `CTAPolicy = NCCL_CTA_POLICY_ZERO` one (NCCL ≥ 2.28) whose windows run the
//! copy-engine all-gather, and a default-policy one where nothing is registered, for
//! the collectives that run faster on NCCL's ring. NCCL is loaded at run time (an
//! NCCL the process already has first, see `ffi`); a missing library or one older than
//! 2.27 is an error, never a panic.
//!
//! # Making a backend
//!
//! | how | ranks | communicators |
//! |---|---|---|
//! | [`NcclBackend::from_env`] / [`NcclBackend::launch`] | one process per GPU (torchrun, srun, mpirun) | created by the crate: rank 0 makes one `ncclUniqueId` per communicator and publishes them over the [`Exchange`](crate::control::Exchange) |
//! | [`NcclBackend::adopt`] | one process per GPU, with a runtime's communicator (PyTorch's `_comm_ptr()`) | split from it by the crate (`ncclCommSplit`), the parent untouched |
//! | [`NcclBackend::local_world`] | one thread per GPU of this process | created by the crate |
//! | [`NcclBackend::from_raw`] | any | used as they are (tests, interop) |
//!
//! # Deadlines, aborts and the watchdog
//!
//! The communicators the crate makes are **non-blocking**. Every NCCL call that can
//! wait on peers (creation, split, window registration and deregistration, a
//! collective's enqueue, which connects to the peers the first time) returns at once
//! and is polled with `ncclCommGetAsyncError` (pauses from 20 µs doubling to 5 ms)
//! until it is done or its deadline passes: one [`Deadline`] for the
//! whole set-up ([`NcclConfig::setup_timeout`] from the constructor's call: its exchange
//! round and every communicator's creation), and [`NcclConfig::call_timeout`] from each
//! later call for the rest. At the deadline the rank aborts
//! **all** its communicators (`ncclCommAbort`) and the call fails with
//! [`Error::NcclTimeout`]; the backend is then broken for good: every later
//! allocation, registration, collective or new stream fails with
//! [`Error::NcclAborted`] (releases — deregister, free — still work once the aborts
//! have returned; memory whose abort has not returned in 10 s is leaked instead).
//!
//! A collective can also hang *after* its enqueue, on the device, when a peer dies
//! inside it. Each enqueued collective records a CUDA event; a watchdog thread per
//! backend looks every [`NcclConfig::watchdog_interval`] (100 ms) at the events and at
//! `ncclCommGetAsyncError` of each communicator. A collective still incomplete after
//! [`NcclConfig::watchdog_timeout`] (10 minutes), an asynchronous NCCL error or a
//! failed device aborts the communicators (which ends the stuck kernels) and breaks
//! the backend: the next call fails with [`Error::NcclWatchdog`] (or
//! [`Error::NcclAborted`]). So a surviving rank learns of a lost peer within
//! `watchdog_timeout + watchdog_interval` of the collective's enqueue, and within
//! `call_timeout` in a call that waits on peers.
//!
//! `ncclCommAbort` itself can block without bound when a peer was killed (it joins
//! NCCL's proxy threads; NVIDIA/nccl issue 1777). It runs on a thread of its own: the
//! call that breaks the backend returns at once (the abort flag it sets still ends the
//! stuck kernels); releasing a window of an aborted communicator waits for its abort
//! at most 10 s (after that the window and its segment are leaked, never freed under
//! a running abort); dropping a backend with no device work in flight waits for the
//! aborts at most 10 s, one with work in flight not at all, and aborts still running
//! then are left to their threads, their communicators leaked.
//!
//! Communicators passed to [`NcclBackend::from_raw`] are never aborted by the crate
//! (they are not its own), and a blocking one is not bounded by any deadline: a call
//! on it can wait forever.
//!
//! # Layout
//!
//! | file | what |
//! |---|---|
//! | `build.rs` | the constructors, all through one builder: load, device, set-up round, communicators, assembly |
//! | `setup.rs` | the set-up round (versions, nodes, unique ids) over the exchange |
//! | `comm.rs` | the communicators: per-communicator mutex, polling against a deadline, aborts |
//! | `watchdog.rs` | the watchdog thread and the events it watches |
//! | `health.rs` | the backend's health, the polling backoff, the watch list (device-free) |
//! | `streams.rs` | `Stream`'s CUDA side, fences as events, drains, copies, timing |
//! | `ffi/` | every NCCL call (`mod.rs`), NCCL's loader and function table (`table.rs`), raw CUDA driver calls (`cuda.rs`) |
//! | `mod.rs` | [`NcclBackend`]: segments, windows and collectives, teardown |

mod build;
mod comm;
mod config;
mod ffi;
mod health;
mod setup;
mod streams;
mod watchdog;

pub use config::{NcclConfig, NcclWorldConfig};

use super::{
    CollArgs, Collectives, Refused, Region, Segment, SegmentMemory, SegmentProvider, StreamOps,
    Window,
};
use crate::Deadline;
use crate::error::{Error, NcclVersion, Result};
use comm::{ABORT_WAIT, AbortThreads, Shared, Waited};
use cudarc::driver::{CudaContext, CudaStream};
use ffi::{RawComm, RawWindow, Status};
use health::Cause;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use streams::FenceTable;
use watchdog::Watchdog;

pub use cudarc::driver::sys::CUstream;
pub use cudarc::nccl::sys::ncclComm_t;

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

/// One rank of NCCL: a device context and its communicators. Segments and windows
/// belong to the pools (as owned handles); this type keeps no table of them.
///
/// Make it with [`NcclBackend::from_env`] (one process per GPU),
/// [`NcclBackend::adopt`] (a runtime's communicator), [`NcclBackend::local_world`]
/// (one thread per GPU) or [`NcclBackend::from_raw`]. All return [`Backend`](super::Backend)s;
/// reach this type again through [`Backend::downcast_ref`](super::Backend::downcast_ref). See the [module](self) for the
/// deadlines and the watchdog.
pub struct NcclBackend {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    /// Registrations made per communicator (window ordinals).
    ordinals: Mutex<Vec<u64>>,
    fences: Mutex<FenceTable>,
    /// Streams adopted from raw handles, by handle: one [`StreamId`](crate::core::StreamId) per raw stream.
    raw_streams: Mutex<HashMap<usize, crate::stream::Stream>>,
    watchdog: Watchdog,
}

impl fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shared;
        let broken = if s.health.is_broken() { ", broken" } else { "" };
        write!(
            f,
            "NcclBackend(rank {} of {}, device {}, {} communicators{broken})",
            self.rank,
            self.world,
            s.ctx.ordinal(),
            s.comms.len()
        )
    }
}

impl NcclBackend {
    /// The raw handle of communicator `comm` (index into
    /// [`BackendInfo::communicators`](super::BackendInfo::communicators)), for calling NCCL directly beside the pool
    /// (benchmarks, interop); `None` if there is no such communicator or it was
    /// aborted.
    ///
    /// Using the handle is `unsafe` on the caller's side: NCCL calls on it must not
    /// overlap with this backend's (it serialises its own calls only), and it must not
    /// be used after the backend is dropped or broken.
    pub fn raw_comm(&self, comm: usize) -> Option<ncclComm_t> {
        let c = self.shared.comms.get(comm)?;
        (!c.state.lock().aborted).then_some(c.raw.0)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &NcclConfig {
        &self.shared.config
    }

    /// `Ok` while the backend is usable; the error every later call gets once it is
    /// broken (a deadline passed, the watchdog fired, NCCL reported an error, or
    /// [`abort`](Self::abort) was called).
    ///
    /// # Errors
    /// [`Error::NcclWatchdog`] or [`Error::NcclAborted`].
    pub fn health(&self) -> Result<()> {
        self.shared.health.check()
    }

    /// Abort this rank's NCCL communicators now (for example when the application
    /// learnt of a lost peer elsewhere) and break the backend: later calls fail with
    /// [`Error::NcclAborted`] naming `reason`. Stuck collectives end. Local; returns at
    /// once: the aborts run on threads of their own (`ncclCommAbort` can block), and
    /// dropping the backend waits for them at most 10 s.
    pub fn abort(&self, reason: &str) {
        let _ = self.shared.fail(Cause::Failed(format!(
            "aborted by the application: {reason}"
        )));
    }

    fn bind(&self) -> Result<()> {
        self.shared
            .ctx
            .bind_to_thread()
            .map_err(ffi::cuda("cuCtxSetCurrent"))
    }

    /// The device address of a region's first byte.
    fn ptr(region: &Region<'_>) -> Result<u64> {
        region.device_ptr().ok_or(Error::Internal {
            what: "a host segment reached the NCCL backend".into(),
        })
    }

    fn memory(segment: &Segment) -> Result<&NcclMemory> {
        segment.memory::<NcclMemory>().ok_or(Error::Internal {
            what: "a segment of another backend reached the NCCL backend".into(),
        })
    }

    /// Enqueue a collective: checks, the call under the communicator's mutex, polling
    /// of an `ncclInProgress` within the call timeout, then the watchdog's event.
    fn collective(
        &self,
        name: &'static str,
        a: &CollArgs<'_>,
        reduce: bool,
        enqueue: impl FnOnce(RawComm, u64, u64, &Arc<CudaStream>) -> Result<Status>,
    ) -> Result<()> {
        self.shared.health.check()?;
        a.check_counts(name, self.world, reduce)?;
        let send = Self::ptr(&a.send)?;
        let recv = Self::ptr(&a.recv)?;
        let cs = self.cuda_of(a.stream)?;
        self.bind()?;
        let deadline = self.shared.call_deadline();
        let (_, waited) =
            (self.shared).call(a.comm, name, deadline, |raw| enqueue(raw, send, recv, cs))?;
        self.shared.conclude(waited, name)?;
        if self.shared.config.watchdog_enabled() && !ffi::is_capturing(cs)? {
            self.shared.watch(name, a.comm, cs)?;
        }
        Ok(())
    }
}

impl SegmentProvider for NcclBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        self.shared.health.check()?;
        self.bind()?;
        let ptr = ffi::mem_alloc(size_bytes)?;
        Ok(Segment::new(Box::new(NcclMemory { ptr, size_bytes })))
    }

    unsafe fn register(&self, segment: &Segment, comm: usize) -> Result<Option<Window>> {
        self.shared.health.check()?;
        let mem = Self::memory(segment)?;
        self.bind()?;
        let op = "ncclCommWindowRegister";
        let (registering, waited) = self.shared.call(
            comm,
            op,
            self.shared.call_deadline(),
            // SAFETY: `raw` is this backend's live communicator, held locked by `call`;
            // the segment is one whole ncclMemAlloc allocation of this device (from
            // `allocate`), and the caller guarantees it is not registered on this
            // communicator yet and that every rank registers in the same order.
            |raw| unsafe { ffi::window_register(raw, mem.ptr, mem.size_bytes) },
        )?;
        if !matches!(waited, Waited::Done) {
            registering.abandon();
            self.shared.conclude(waited, op)?;
            return Err(Error::Internal {
                what: "a registration neither finished nor failed".into(),
            });
        }
        let win = registering.finish();
        let mut ordinals = self.ordinals.lock();
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
        let op = "ncclCommWindowDeregister";
        let handle = raw_window.0;
        let deadline = Deadline::after(ABORT_WAIT);
        match self
            .shared
            .comms
            .get(comm)
            .and_then(|c| c.aborted_by(deadline))
        {
            // The window went with its communicator (ncclCommAbort releases it).
            Some(true) => return Ok(()),
            // The abort still runs and may still release this window: the caller must
            // not free the segment under it (it leaks it instead).
            Some(false) => {
                return Err(Refused {
                    handle: Window::new(comm, ordinal, Box::new(RawWindow(handle))),
                    error: Error::NcclAborted {
                        reason: format!(
                            "ncclCommAbort of communicator {comm} had not returned after {ABORT_WAIT:?}; the window and its segment are leaked"
                        ),
                    },
                });
            }
            None => {}
        }
        let result = self.bind().and_then(|()| {
            let (_, waited) = self.shared.call(
                comm,
                op,
                self.shared.call_deadline(),
                // SAFETY: the window was registered on this communicator by `register`
                // (the caller's contract) and is consumed here; `raw` is live and held
                // locked by `call`; the caller guarantees no work uses it.
                |raw| unsafe { ffi::window_deregister(raw, RawWindow(handle)) },
            )?;
            self.shared.conclude(waited, op)
        });
        result.map_err(|error| Refused {
            handle: Window::new(comm, ordinal, Box::new(RawWindow(handle))),
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
        // An abort still running may still release a window on this memory (one being
        // registered when the backend broke is in no pool's list): never free under it.
        let deadline = Deadline::after(ABORT_WAIT);
        if let Some(c) = self
            .shared
            .comms
            .iter()
            .position(|c| c.aborted_by(deadline) == Some(false))
        {
            return Err(Refused {
                handle: segment,
                error: Error::NcclAborted {
                    reason: format!(
                        "ncclCommAbort of communicator {c} had not returned after {ABORT_WAIT:?}; the segment is leaked"
                    ),
                },
            });
        }
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

impl Collectives for NcclBackend {
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        let (count, dt) = (a.count, ffi::dtype(a.dtype));
        self.collective("ncclAllGather", a, false, |raw, send, recv, cs| {
            // SAFETY: both regions lie inside live segments of this device (regions are
            // checked against their segments, which the caller's buffers keep alive),
            // with the sizes checked by `collective`; the pool keeps the segments until
            // the stream has passed (frees are fenced); `raw` is held locked.
            unsafe { ffi::all_gather(raw, send, recv, count, dt, cs.cu_stream() as _) }
        })
    }

    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        let (count, dt, op) = (a.count, ffi::dtype(a.dtype), ffi::red_op(a.op));
        self.collective("ncclReduceScatter", a, true, |raw, send, recv, cs| {
            // SAFETY: as in `all_gather`.
            unsafe { ffi::reduce_scatter(raw, send, recv, count, dt, op, cs.cu_stream() as _) }
        })
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        // The pools released their segments and windows before this (they hold the
        // backend), each after draining for at most its own timeout. Everything here is
        // local: `ncclCommAbort` (not the collective destroy), which also ends NCCL
        // operations still in flight, as is left when a peer died.
        self.watchdog.stop();
        let _ = self.bind();
        self.fences.lock().clear();
        self.shared.watch.lock().clear();
        // With nothing in flight, wait (boundedly) for the aborts to release NCCL's
        // resources; with work still running (a stuck collective, a kernel that never
        // ends) the aborts wait for the device, so leave them to their thread at once.
        let idle = matches!(self.drain(Instant::now()), Ok(true));
        if !idle {
            tracing::warn!(
                "symmpool: rank {}: device work still in flight; aborting its communicators in the background",
                self.rank
            );
        }
        let (threads, wait) = if idle {
            (AbortThreads::One, ABORT_WAIT)
        } else {
            (AbortThreads::PerCommunicator, Duration::ZERO)
        };
        let deadline = Deadline::after(wait);
        self.shared.abort_all(threads);
        // These aborts and any started earlier (by a timeout, the watchdog or an NCCL
        // error) get the same bound.
        let pending = (self.shared.comms.iter())
            .filter(|c| c.aborted_by(deadline) == Some(false))
            .count();
        if pending > 0 && idle {
            tracing::warn!(
                "symmpool: rank {}: {pending} ncclCommAbort calls had not returned after {wait:?}; they go on in the background and their communicators are leaked",
                self.rank
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::build::context;
    use super::*;
    use crate::control::{Exchange, LocalExchange};

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine without a driver every entry point returns LibraryUnavailable; on
        // a GPU machine they may succeed. Either way nothing panics.
        if ffi::driver_present() {
            return;
        }
        assert!(matches!(
            device_count(),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(
            nccl_version(),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(context(0), Err(Error::LibraryUnavailable { .. })));
        let ex: Arc<dyn Exchange> = Arc::new(LocalExchange::group(1).remove(0));
        assert!(matches!(
            NcclBackend::from_env(ex.clone(), NcclConfig::default()),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(
            NcclBackend::local_world(&[0], NcclConfig::default()),
            Err(Error::LibraryUnavailable { .. })
        ));
        // SAFETY: fails before the handle is looked at (no driver).
        let adopted =
            unsafe { NcclBackend::adopt(std::ptr::null_mut(), 0, ex, NcclConfig::default()) };
        assert!(matches!(adopted, Err(Error::LibraryUnavailable { .. })));
    }
}
