//! The NCCL and raw CUDA driver calls the crate makes, through `cudarc::nccl::sys` and
//! `cudarc::driver::{sys, result}`, with checked results.
//!
//! This is the only module that calls NCCL or the driver's raw API. cudarc binds the
//! functions but has no safe wrapper for windows, `ncclMemAlloc`, communicator
//! configs, allocation granularity or capture status, so they are wrapped here. Every
//! function returns the crate's [`Error`] instead of panicking.

#![deny(clippy::cast_possible_truncation)]

use crate::error::{Error, NcclVersion, Result};
use cudarc::driver::DriverError;
use cudarc::nccl::sys;
use std::ffi::{CStr, c_int, c_void};

/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h, 2.27+): every rank's buffer sits at the same
/// offset of its window in every collective.
pub(crate) const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;
/// `NCCL_CTA_POLICY_DEFAULT` (nccl.h, 2.27+).
pub(crate) const NCCL_CTA_POLICY_DEFAULT: c_int = 0x00;
/// `NCCL_CTA_POLICY_ZERO` (nccl.h, 2.28+): copy-engine collectives.
pub(crate) const NCCL_CTA_POLICY_ZERO: c_int = 0x02;
/// `NCCL_API_MAGIC`, the config's magic (nccl.h).
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "use the default" (nccl.h).
const UNDEF: c_int = i32::MIN;
/// The config struct version this binding describes (`ncclConfig_v22800`).
const CONFIG_VERSION: u32 = 22800;

/// Map a CUDA driver error.
pub(crate) fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        code: e.0 as i32,
        message: format!("{e:?}"),
    }
}

fn nccl_err(op: &'static str, r: sys::ncclResult_t) -> Error {
    // SAFETY: ncclGetErrorString returns a pointer to a static, NUL-terminated string
    // for any result value.
    let ptr = unsafe { sys::ncclGetErrorString(r) };
    let message = if ptr.is_null() {
        String::from("unknown")
    } else {
        // SAFETY: non-null, static and NUL-terminated (see above).
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    };
    Error::Nccl {
        op,
        code: r as i32,
        message,
    }
}

/// `x` as a `usize` for NCCL, or an error naming the call (only on 32-bit targets).
fn to_usize(op: &'static str, x: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| Error::Nccl {
        op,
        code: sys::ncclResult_t::ncclInvalidArgument as i32,
        message: format!("{x} does not fit the address space"),
    })
}

/// `x` as a C `int` for NCCL, or an error naming the call.
fn to_int(op: &'static str, x: usize) -> Result<c_int> {
    c_int::try_from(x).map_err(|_| Error::Nccl {
        op,
        code: sys::ncclResult_t::ncclInvalidArgument as i32,
        message: format!("{x} does not fit a C int"),
    })
}

fn check(op: &'static str, r: sys::ncclResult_t) -> Result<()> {
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(()),
        other => Err(nccl_err(op, other)),
    }
}

/// Load NCCL and the CUDA driver and read NCCL's version.
///
/// # Errors
/// [`Error::LibraryUnavailable`] if either library cannot be loaded (cudarc would
/// panic at first use; this checks first).
pub(crate) fn load() -> Result<NcclVersion> {
    if !driver_present() {
        return Err(Error::LibraryUnavailable {
            library: "libcuda (CUDA driver)",
            hint: "no NVIDIA driver on this machine; use the host backend",
        });
    }
    // SAFETY: as above.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::LibraryUnavailable {
            library: "libnccl",
            hint: "install NCCL >= 2.27 so that `libnccl.so` is on the loader path (a pip install ships only libnccl.so.2: add a libnccl.so symlink)",
        });
    }
    let mut code: c_int = 0;
    // SAFETY: the library is present (checked above); `code` is a valid out-pointer.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut code) })?;
    Ok(NcclVersion::from_code(code))
}

/// Refuse versions older than `required` for `feature`.
///
/// # Errors
/// [`Error::NcclTooOld`].
pub(crate) fn require(
    found: NcclVersion,
    required: NcclVersion,
    feature: &'static str,
) -> Result<()> {
    if found < required {
        return Err(Error::NcclTooOld {
            found,
            required,
            feature,
        });
    }
    Ok(())
}

/// A fresh `ncclUniqueId`.
pub(crate) fn unique_id() -> Result<sys::ncclUniqueId> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
    Ok(id)
}

/// A config filled as `NCCL_CONFIG_INITIALIZER` does, with `CTAPolicy` set.
pub(crate) fn config(cta_policy: c_int) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: CONFIG_VERSION,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: cta_policy,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// A raw communicator handle. NCCL allows a communicator to be used from any thread
/// as long as calls on it do not overlap; [`super::NcclBackend`] keeps each behind a
/// mutex.
#[derive(Debug)]
pub(crate) struct RawComm(pub(crate) sys::ncclComm_t);

// SAFETY: an ncclComm_t is a heap handle not tied to the creating thread; every use
// goes through a `Mutex<RawComm>`, which serialises the calls NCCL requires to be
// serialised.
unsafe impl Send for RawComm {}

/// `ncclCommInitRankConfig` (blocking: returns once every rank has joined).
///
/// # Errors
/// The NCCL error.
pub(crate) fn comm_init(
    nranks: usize,
    id: sys::ncclUniqueId,
    rank: usize,
    cta_policy: c_int,
) -> Result<RawComm> {
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    let mut cfg = config(cta_policy);
    let op = "ncclCommInitRankConfig";
    let (nranks, rank) = (to_int(op, nranks)?, to_int(op, rank)?);
    // SAFETY: `comm` and `cfg` are valid for the call; `id` is passed by value; the
    // caller has made this rank's device current.
    let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, nranks, id, rank, &mut cfg) };
    check("ncclCommInitRankConfig", r)?;
    Ok(RawComm(comm))
}

/// (rank, size) of a communicator.
pub(crate) fn comm_rank_size(comm: &RawComm) -> Result<(usize, usize)> {
    let (mut rank, mut size) = (0 as c_int, 0 as c_int);
    // SAFETY: `comm.0` is a live communicator; out-pointers are valid.
    check("ncclCommUserRank", unsafe {
        sys::ncclCommUserRank(comm.0, &mut rank)
    })?;
    // SAFETY: as above.
    check("ncclCommCount", unsafe {
        sys::ncclCommCount(comm.0, &mut size)
    })?;
    Ok((rank as usize, size as usize))
}

/// `ncclCommAbort`: local teardown that never waits for peers.
///
/// # Safety
/// - `comm` is a live communicator created by this crate (not adopted);
/// - nothing uses it again (it is consumed), and its windows are deregistered.
pub(crate) unsafe fn comm_abort(comm: RawComm) -> Result<()> {
    // SAFETY: the caller guarantees `comm.0` is live, owned and never used again.
    check("ncclCommAbort", unsafe { sys::ncclCommAbort(comm.0) })
}

/// `ncclMemAlloc` of `size` bytes on the current device: cuMem (VMM) memory that
/// windows accept, rounded up to the recommended granularity.
///
/// # Errors
/// [`Error::DeviceOutOfMemory`] with NCCL's code and message.
pub(crate) fn mem_alloc(size: u64) -> Result<u64> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let oom = |code: i32, message: String| Error::DeviceOutOfMemory {
        segment_bytes: size,
        op: "ncclMemAlloc",
        code,
        message,
    };
    let n = usize::try_from(size).map_err(|_| oom(0, "larger than the address space".into()))?;
    // SAFETY: `ptr` is a valid out-pointer; the caller made the device current.
    let r = unsafe { sys::ncclMemAlloc(&mut ptr, n) };
    match r {
        sys::ncclResult_t::ncclSuccess if !ptr.is_null() => Ok(ptr as u64),
        sys::ncclResult_t::ncclSuccess => Err(oom(0, "ncclMemAlloc returned NULL".into())),
        other => match nccl_err("ncclMemAlloc", other) {
            Error::Nccl { code, message, .. } => Err(oom(code, message)),
            e => Err(e),
        },
    }
}

/// Whether the CUDA driver library can be loaded (cudarc panics at first use if not).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The segment granularity of a device: `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` for
/// pinned device memory with POSIX-FD handles (what `ncclMemAlloc` rounds to), at least
/// 2 MiB (NCCL 2.27's window rule), as a power of two. 2 MiB if the query fails.
pub(crate) fn segment_granularity(ordinal: usize) -> u64 {
    use cudarc::driver::sys as cu;
    const MIN: u64 = 2 << 20;
    let prop = cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: cu::CUmemLocation {
            type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: c_int::try_from(ordinal).unwrap_or(0),
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: cu::CUmemAllocationProp_st__bindgen_ty_1 {
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
        cu::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    };
    if r != cu::cudaError_enum::CUDA_SUCCESS || granularity == 0 {
        tracing::warn!("symmpool: cuMemGetAllocationGranularity failed ({r:?}); assuming 2 MiB");
        return MIN;
    }
    (granularity as u64).max(MIN).next_power_of_two()
}

/// Whether a stream is capturing a CUDA graph (`cuStreamIsCapturing`).
///
/// # Errors
/// [`Error::Cuda`].
pub(crate) fn is_capturing(stream: &cudarc::driver::CudaStream) -> Result<bool> {
    use cudarc::driver::sys as cu;
    // SAFETY: `stream` is a live cudarc stream (it owns the handle for this borrow).
    let status = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }
        .map_err(cuda("cuStreamIsCapturing"))?;
    Ok(status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Copy `data` to device address `dst` on `stream` and wait for the copy.
///
/// # Safety
/// `dst..dst + data.len()` is live device memory of `stream`'s context.
///
/// # Errors
/// [`Error::Cuda`].
pub(crate) unsafe fn copy_to_device(
    dst: u64,
    data: &[u8],
    stream: &cudarc::driver::CudaStream,
) -> Result<()> {
    // SAFETY: the caller guarantees the destination; `data` outlives the copy, which is
    // synchronised before returning.
    unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyHtoDAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}

/// Copy device address `src` into `out` on `stream` and wait for the copy.
///
/// # Safety
/// `src..src + out.len()` is live device memory of `stream`'s context.
///
/// # Errors
/// [`Error::Cuda`].
pub(crate) unsafe fn copy_to_host(
    src: u64,
    out: &mut [u8],
    stream: &cudarc::driver::CudaStream,
) -> Result<()> {
    // SAFETY: the caller guarantees the source; `out` outlives the copy, which is
    // synchronised before returning.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyDtoHAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}

/// `ncclMemFree`.
///
/// # Safety
/// - `ptr` came from [`mem_alloc`] and is freed once;
/// - no window covers it any more and no device work still uses it.
pub(crate) unsafe fn mem_free(ptr: u64) -> Result<()> {
    // SAFETY: the caller guarantees a single free of an `ncclMemAlloc` pointer that
    // nothing uses any more.
    check("ncclMemFree", unsafe {
        sys::ncclMemFree(ptr as *mut c_void)
    })
}

/// A registered window handle (non-NULL).
#[derive(Debug)]
pub(crate) struct RawWindow(pub(crate) sys::ncclWindow_t);

// SAFETY: a window handle is an opaque heap pointer owned by its communicator; it is
// only passed back to NCCL under that communicator's mutex.
unsafe impl Send for RawWindow {}

// SAFETY: a shared `&RawWindow` gives no access but reading the handle value; NCCL is
// only handed the handle under its communicator's mutex.
unsafe impl Sync for RawWindow {}

/// `ncclCommWindowRegister(comm, ptr, size, &win, NCCL_WIN_COLL_SYMMETRIC)`.
/// `Ok(None)` is NCCL's "success with a NULL window": no symmetric support.
///
/// # Collective
/// Every rank of `comm`, same order.
///
/// # Safety
/// - `comm` is live and the caller holds its mutex;
/// - `ptr..ptr + size` is one whole `ncclMemAlloc` allocation on `comm`'s device,
///   not yet registered on `comm`.
pub(crate) unsafe fn window_register(
    comm: &RawComm,
    ptr: u64,
    size: u64,
) -> Result<Option<RawWindow>> {
    let mut win: sys::ncclWindow_t = std::ptr::null_mut();
    let size = to_usize("ncclCommWindowRegister", size)?;
    // SAFETY: the caller guarantees the communicator and the allocation; `win` is a
    // valid out-pointer.
    let r = unsafe {
        sys::ncclCommWindowRegister(
            comm.0,
            ptr as *mut c_void,
            size,
            &mut win,
            NCCL_WIN_COLL_SYMMETRIC,
        )
    };
    check("ncclCommWindowRegister", r)?;
    Ok((!win.is_null()).then_some(RawWindow(win)))
}

/// `ncclCommWindowDeregister` (local).
///
/// # Safety
/// - `win` came from [`window_register`] on `comm` (consumed here);
/// - `comm` is live, the caller holds its mutex, and no device work uses the window.
pub(crate) unsafe fn window_deregister(comm: &RawComm, win: RawWindow) -> Result<()> {
    // SAFETY: the caller guarantees the window belongs to this live communicator and is
    // no longer in use.
    check("ncclCommWindowDeregister", unsafe {
        sys::ncclCommWindowDeregister(comm.0, win.0)
    })
}

pub(crate) fn dtype(d: crate::dtype::DType) -> sys::ncclDataType_t {
    use crate::dtype::DType;
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

pub(crate) fn red_op(op: crate::dtype::ReduceOp) -> sys::ncclRedOp_t {
    use crate::dtype::ReduceOp;
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

/// `ncclAllGather`.
///
/// # Safety
/// - `send` holds `count` elements and `recv` `count × nranks` elements of `dt`, both
///   live device memory of this rank that stays allocated until `stream` passes;
/// - `stream` is a live stream of the communicator's device;
/// - `comm` is live and the caller holds its mutex.
pub(crate) unsafe fn all_gather(
    comm: &RawComm,
    send: u64,
    recv: u64,
    count: u64,
    dt: sys::ncclDataType_t,
    stream: sys::cudaStream_t,
) -> Result<()> {
    let count = to_usize("ncclAllGather", count)?;
    // SAFETY: the caller upholds this function's contract.
    let r = unsafe {
        sys::ncclAllGather(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dt,
            comm.0,
            stream,
        )
    };
    check("ncclAllGather", r)
}

/// `ncclReduceScatter`.
///
/// # Safety
/// As [`all_gather`], with `send` holding `count × nranks` and `recv` `count` elements.
pub(crate) unsafe fn reduce_scatter(
    comm: &RawComm,
    send: u64,
    recv: u64,
    count: u64,
    dt: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    stream: sys::cudaStream_t,
) -> Result<()> {
    let count = to_usize("ncclReduceScatter", count)?;
    // SAFETY: the caller upholds this function's contract.
    let r = unsafe {
        sys::ncclReduceScatter(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dt,
            op,
            comm.0,
            stream,
        )
    };
    check("ncclReduceScatter", r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_matches_the_initializer() {
        let c = config(NCCL_CTA_POLICY_ZERO);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert!(
            c.version >= 22700,
            "CTAPolicy is ignored below config version 2.27"
        );
        assert_eq!(c.CTAPolicy, 2);
        assert_eq!(c.blocking, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn version_gate() {
        let old = NcclVersion::new(2, 26, 5);
        match require(old, NcclVersion::WINDOWS, "symmetric windows") {
            Err(Error::NcclTooOld {
                found, required, ..
            }) => {
                assert_eq!((found, required), (old, NcclVersion::new(2, 27, 0)));
            }
            other => panic!("{other:?}"),
        }
        assert!(require(NcclVersion::new(2, 28, 3), NcclVersion::COPY_ENGINE, "ce").is_ok());
        assert_eq!(NcclVersion::from_code(22803), NcclVersion::new(2, 28, 3));
        assert_eq!(NcclVersion::from_code(2708), NcclVersion::new(2, 7, 8));
    }
}
