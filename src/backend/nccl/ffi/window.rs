//! NCCL's symmetric memory: `ncclMemAlloc`/`ncclMemFree` and window registration.

use super::{NCCL_WIN_COLL_SYMMETRIC, RawComm, SUCCESS, Syms, check, fit, nccl_err, status};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::c_void;

/// `ncclMemAlloc` of `size` bytes on the current device: cuMem (VMM) memory that
/// windows accept, rounded up to the recommended granularity.
///
/// # Errors
/// [`Error::DeviceOutOfMemory`] with NCCL's code and message.
pub(crate) fn mem_alloc(s: &Syms, size: u64) -> Result<u64> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let oom = |code: i32, message: String| Error::DeviceOutOfMemory {
        segment_bytes: size,
        op: "ncclMemAlloc",
        code,
        message,
    };
    let n = usize::try_from(size).map_err(|_| oom(0, "larger than the address space".into()))?;
    // SAFETY: `ptr` is a valid out-pointer; the caller made the device current.
    let code = unsafe { (s.mem_alloc)(&mut ptr, n) };
    match code {
        SUCCESS if !ptr.is_null() => Ok(ptr as u64),
        SUCCESS => Err(oom(0, "ncclMemAlloc returned NULL".into())),
        other => match nccl_err(s, "ncclMemAlloc", other, None) {
            Error::Nccl { code, message, .. } => Err(oom(code, message)),
            e => Err(e),
        },
    }
}

/// `ncclMemFree`.
///
/// # Safety
/// - `ptr` came from [`mem_alloc`] and is freed once;
/// - no window covers it any more and no device work still uses it.
pub(crate) unsafe fn mem_free(s: &Syms, ptr: u64) -> Result<()> {
    // SAFETY: the caller guarantees a single free of an `ncclMemAlloc` pointer that
    // nothing uses any more.
    check(
        s,
        "ncclMemFree",
        unsafe { (s.mem_free)(ptr as *mut c_void) },
        None,
    )
}

/// A registered window handle (non-NULL).
#[derive(Debug)]
pub(crate) struct RawWindow(pub(crate) sys::ncclWindow_t);

// SAFETY: a window handle is an opaque heap pointer owned by its communicator; it is
// only passed back to NCCL under that communicator's serialisation.
unsafe impl Send for RawWindow {}

// SAFETY: a shared `&RawWindow` gives no access but reading the handle value; NCCL is
// only handed the handle under its communicator's serialisation.
unsafe impl Sync for RawWindow {}

/// A window registration in progress: the box NCCL writes the handle into.
pub(crate) struct Registering {
    slot: Box<sys::ncclWindow_t>,
}

impl Registering {
    /// The registration completed: the window (`None`: NCCL gave a NULL window, no
    /// symmetric support). On a `blocking` communicator NCCL wrote the slot before
    /// returning and the box is freed. On a non-blocking one the slot is leaked, not
    /// freed (8 bytes per registration): should an NCCL version write it after
    /// reporting completion, it writes into memory nobody else uses.
    pub(crate) fn finish(self, blocking: bool) -> Option<RawWindow> {
        let w = if blocking {
            *self.slot
        } else {
            let slot = Box::into_raw(self.slot);
            // SAFETY: a leaked box stays valid; read once, volatile, as NCCL's thread
            // wrote it.
            unsafe { std::ptr::read_volatile(slot) }
        };
        (!w.is_null()).then_some(RawWindow(w))
    }
}

/// Start `ncclCommWindowRegister(comm, ptr, size, &win, NCCL_WIN_COLL_SYMMETRIC)`. On a
/// blocking communicator it returns once every rank registered (it ends with a
/// bootstrap barrier: src/dev_runtime.cc 2.28.3 543–594, 789–822); on a non-blocking
/// one it may still run when it returns (poll [`async_state`](super::async_state)).
///
/// # Collective
/// Every rank of `comm`, same order.
///
/// # Safety
/// - `comm` is live and the caller has the exclusive use of it;
/// - `ptr..ptr + size` is one whole `ncclMemAlloc` allocation on `comm`'s device,
///   not yet registered on `comm`.
pub(crate) unsafe fn window_register(
    s: &Syms,
    comm: RawComm,
    ptr: u64,
    size: u64,
) -> Result<Registering> {
    let op = "ncclCommWindowRegister";
    let size = fit(op, size)?;
    let mut slot: Box<sys::ncclWindow_t> = Box::new(std::ptr::null_mut());
    // SAFETY: the caller guarantees the communicator and the allocation; the box stays
    // valid until the call completes (or is leaked, see `Registering`).
    let code = unsafe {
        (s.window_register)(
            comm.0,
            ptr as *mut c_void,
            size,
            &mut *slot,
            NCCL_WIN_COLL_SYMMETRIC,
        )
    };
    match status(s, op, code, Some(&comm)) {
        Ok(_) => Ok(Registering { slot }),
        Err(e) => {
            // NCCL may have written the slot before failing: leaked, nobody reads it.
            std::mem::forget(slot);
            Err(e)
        }
    }
}

/// Start `ncclCommWindowDeregister` (polled as [`window_register`] on a non-blocking
/// communicator).
///
/// # Safety
/// - `win` came from [`window_register`] on `comm` (consumed here);
/// - `comm` is live, the caller has the exclusive use of it, and no device work uses
///   the window.
pub(crate) unsafe fn window_deregister(s: &Syms, comm: RawComm, win: RawWindow) -> Result<()> {
    // SAFETY: the caller guarantees the window belongs to this live communicator and is
    // no longer in use.
    let code = unsafe { (s.window_deregister)(comm.0, win.0) };
    status(s, "ncclCommWindowDeregister", code, Some(&comm)).map(drop)
}
