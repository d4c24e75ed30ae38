//! Pool buffers as DLPack capsules (`torch.utils.dlpack.from_dlpack`): a one-dimensional
//! `uint8` CUDA tensor over the buffer, whose deleter returns the block to the pool.

use crate::live;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, c_void};

/// `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` (DLPack 0.8 layout, the unversioned one every consumer takes).
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What the managed tensor owns: its shape, and the address the buffer is kept under.
struct Ctx {
    shape: [i64; 1],
    ptr: u64,
}

const KDL_CUDA: i32 = 2;
const KDL_UINT: u8 = 1;
const NAME: &CStr = c"dltensor";

/// The deleter the consumer calls when the tensor dies (from any thread, with or
/// without the GIL): forget the buffer, which returns its block to the pool.
unsafe extern "C" fn deleter(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` was made by `Box::into_raw` in `capsule` and the DLPack
    // protocol calls the deleter exactly once, so we own it again here.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: `manager_ctx` was made by `Box::into_raw` of a `Ctx` in `capsule`.
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Ctx>()) };
    // Never unwind into C.
    let _ = std::panic::catch_unwind(move || drop(live::remove(ctx.ptr)));
}

/// The capsule's destructor: if no consumer took the tensor (the name is still
/// `dltensor`), delete it here.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a live capsule; `PyCapsule_IsValid` sets no error.
    if unsafe { ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: the capsule is valid under this name, so its pointer is our managed
    // tensor.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) };
    if !managed.is_null() {
        // SAFETY: an unconsumed capsule still owns the tensor; nobody else deletes it.
        unsafe { deleter(managed.cast()) };
    }
}

/// A DLPack capsule over the live buffer at `ptr` (`len` bytes, CUDA device `device`).
/// If making the capsule fails, the buffer is forgotten (its block returns).
pub(crate) fn capsule(py: Python<'_>, ptr: u64, len: u64, device: usize) -> PyResult<PyObject> {
    let ctx = Box::into_raw(Box::new(Ctx {
        shape: [len as i64],
        ptr,
    }));
    let managed = Box::into_raw(Box::new(DlManagedTensor {
        dl_tensor: DlTensor {
            data: ptr as *mut c_void,
            device: DlDevice {
                device_type: KDL_CUDA,
                device_id: device as i32,
            },
            ndim: 1,
            dtype: DlDataType {
                code: KDL_UINT,
                bits: 8,
                lanes: 1,
            },
            // SAFETY: `ctx` is a live allocation we own until the deleter runs.
            shape: unsafe { (*ctx).shape.as_mut_ptr() },
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: ctx.cast(),
        deleter: Some(deleter),
    }));
    // SAFETY: the pointer is our boxed tensor, the name a static C string, and the
    // destructor frees it unless a consumer renamed the capsule (took ownership).
    let raw = unsafe {
        ffi::PyCapsule_New(
            managed.cast(),
            NAME.as_ptr(),
            Some(capsule_destructor as unsafe extern "C" fn(*mut ffi::PyObject)),
        )
    };
    if raw.is_null() {
        // SAFETY: no capsule owns the tensor, so we delete it (once).
        unsafe { deleter(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `raw` is a new reference we own.
    Ok(unsafe { PyObject::from_owned_ptr(py, raw) })
}
