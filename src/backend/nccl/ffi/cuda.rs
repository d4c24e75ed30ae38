//! The CUDA driver calls the crate makes beyond cudarc's safe layer, with checked results.

use crate::error::{Error, Result};
use cudarc::driver::DriverError;
use std::ffi::c_int;

/// Map a CUDA driver error.
pub(crate) fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        code: e.0 as i32,
        message: format!("{e:?}"),
    }
}

/// Bind `ctx` to the calling thread (`cuCtxSetCurrent`).
pub(crate) fn bind(ctx: &cudarc::driver::CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))
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

/// The context a raw stream belongs to (`cuStreamGetCtx`).
///
/// # Safety
/// `stream` is a live stream handle (or one of the special handles `0`, `0x1`, `0x2`).
pub(crate) unsafe fn stream_context(
    stream: cudarc::driver::sys::CUstream,
) -> Result<cudarc::driver::sys::CUcontext> {
    use cudarc::driver::sys as cu;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller guarantees the stream handle; `ctx` is a valid out-pointer.
    let r = unsafe { cu::cuStreamGetCtx(stream, &mut ctx) };
    r.result().map(|()| ctx).map_err(cuda("cuStreamGetCtx"))
}

/// Whether a stream is capturing a CUDA graph (`cuStreamIsCapturing`).
pub(crate) fn is_capturing(stream: &cudarc::driver::CudaStream) -> Result<bool> {
    use cudarc::driver::sys as cu;
    // SAFETY: `stream` is a live cudarc stream (it owns the handle for this borrow).
    let status = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }
        .map_err(cuda("cuStreamIsCapturing"))?;
    Ok(status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Copy `data` to device address `dst` on `stream` and wait for the copy. Call it on
/// an idle stream (the caller waits for its earlier work first, with a deadline), so
/// that the synchronise waits for nothing but this copy.
///
/// # Safety
/// `dst..dst + data.len()` is live device memory of `stream`'s context.
pub(crate) unsafe fn copy_to_device(
    dst: u64,
    data: &[u8],
    stream: &cudarc::driver::CudaStream,
) -> Result<()> {
    // SAFETY: the caller guarantees the destination. `data` outlives the copy: a
    // transfer from pageable host memory is staged before the call returns (CUDA
    // Runtime API, "API synchronization behavior", memcpy async), and the stream is
    // synchronised below anyway.
    unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyHtoDAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}

/// Copy device address `src` into `out` on `stream` and wait for the copy; on an idle
/// stream, as [`copy_to_device`].
///
/// # Safety
/// `src..src + out.len()` is live device memory of `stream`'s context.
pub(crate) unsafe fn copy_to_host(
    src: u64,
    out: &mut [u8],
    stream: &cudarc::driver::CudaStream,
) -> Result<()> {
    // SAFETY: the caller guarantees the source. `out` outlives the copy: a transfer to
    // pageable host memory returns only once complete (CUDA Runtime API, "API
    // synchronization behavior"), and the stream is synchronised before returning.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyDtoHAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}
