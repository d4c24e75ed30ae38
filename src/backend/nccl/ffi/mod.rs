//! The NCCL and raw CUDA driver calls the crate makes, with checked results: the only
//! module that calls NCCL or the driver's raw API (the loader and function table in
//! [`table`], memory and windows in [`window`], the driver in [`cuda`]). Every function
//! takes the function table ([`Syms`]) it calls through: the real NCCL ([`api`]) or, in
//! the crate's tests, a fake one. A failed call is [`Error::Nccl`] naming it, with
//! NCCL's code and message ([`Error::Cuda`] in [`cuda`]), unless a function says otherwise.
//!
//! A call on a non-blocking communicator may answer `ncclInProgress` (or succeed while
//! it still runs): the caller polls [`async_state`] until it is done, whatever it
//! answered. Out-parameters that NCCL may write after that answer (the new
//! communicator, the window) live in boxes that are leaked, not freed, if the call
//! never completes.

#![deny(clippy::cast_possible_truncation)]

mod cuda;
mod table;
mod window;

pub(crate) use cuda::*;
#[cfg(test)]
pub(crate) use table::RevokeFn;
pub(crate) use table::{GrowFns, NO_DRIVER, Syms, api, load};
pub(crate) use window::*;

use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::{CStr, c_char, c_int, c_void};

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
/// `ncclSuccess`.
const SUCCESS: c_int = 0;
/// `ncclInvalidArgument`.
const INVALID_ARGUMENT: c_int = 4;
/// `ncclInProgress`: a non-blocking call has not finished yet.
pub(crate) const IN_PROGRESS: c_int = 7;
/// `NCCL_REVOKE_DEFAULT` (nccl.h.in, 2.28.7+).
const REVOKE_DEFAULT: c_int = 0;

/// How a call on a non-blocking communicator went, when it did not fail.
#[derive(Debug, PartialEq)]
pub(crate) enum Status {
    /// Finished.
    Done,
    /// `ncclInProgress`: poll [`async_state`] until done.
    InProgress,
}

fn c_str(ptr: *const c_char) -> Option<String> {
    (!ptr.is_null()).then(|| {
        // SAFETY: NCCL returns NUL-terminated strings that live at least until the next
        // call on the same communicator (ncclGetLastError) or forever
        // (ncclGetErrorString); the text is copied out at once.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The error for result `code` of `op`, with NCCL's last error message on `comm`.
fn nccl_err(s: &Syms, op: &'static str, code: c_int, comm: Option<&RawComm>) -> Error {
    // SAFETY: ncclGetErrorString accepts any value and returns a static string.
    let mut message = c_str(unsafe { (s.error_string)(code) }).unwrap_or_else(|| "unknown".into());
    if let Some(comm) = comm {
        // SAFETY: `comm` is a live communicator (the caller's contract for the call that
        // failed); ncclGetLastError only reads its last message.
        if let Some(last) = c_str(unsafe { (s.last_error)(comm.0) }).filter(|m| !m.is_empty()) {
            message = format!("{message}: {last}");
        }
    }
    Error::Nccl { op, code, message }
}

fn status(s: &Syms, op: &'static str, code: c_int, comm: Option<&RawComm>) -> Result<Status> {
    match code {
        SUCCESS => Ok(Status::Done),
        IN_PROGRESS => Ok(Status::InProgress),
        other => Err(nccl_err(s, op, other, comm)),
    }
}

fn check(s: &Syms, op: &'static str, code: c_int, comm: Option<&RawComm>) -> Result<()> {
    match status(s, op, code, comm)? {
        Status::Done => Ok(()),
        // Only calls documented as synchronous use `check`; a non-blocking answer from
        // one of them is reported, not ignored.
        Status::InProgress => Err(Error::Nccl {
            op,
            code,
            message: "unexpected ncclInProgress".into(),
        }),
    }
}

/// `x` as the `T` (a `usize`, a C `int`) NCCL takes, or an error naming the call.
fn fit<T: TryFrom<U>, U: Copy + std::fmt::Display>(op: &'static str, x: U) -> Result<T> {
    T::try_from(x).map_err(|_| Error::Nccl {
        op,
        code: INVALID_ARGUMENT,
        message: format!("{x} does not fit a {}", std::any::type_name::<T>()),
    })
}

/// The error of a call that made no communicator.
pub(crate) fn no_comm(op: &'static str, code: c_int) -> Error {
    Error::Nccl {
        op,
        code,
        message: "NCCL returned no communicator".into(),
    }
}

/// The communicator NCCL wrote into `slot`, if any.
///
/// # Safety
/// `slot` is valid for reads, and no thread of NCCL writes it any more.
pub(crate) unsafe fn read_slot(slot: *const sys::ncclComm_t) -> Option<RawComm> {
    // SAFETY: the caller's contract; volatile, as NCCL's thread may have written it.
    let c = unsafe { std::ptr::read_volatile(slot) };
    (!c.is_null()).then_some(RawComm(c))
}

/// A fresh `ncclUniqueId`, as its 128 bytes.
pub(crate) fn unique_id(s: &Syms) -> Result<[u8; 128]> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    let code = unsafe { (s.get_unique_id)(&mut id) };
    check(s, "ncclGetUniqueId", code, None)?;
    Ok(id.internal.map(|b| b as u8))
}

/// A config filled as `NCCL_CONFIG_INITIALIZER` does, blocking or not, with `CTAPolicy`
/// set and resources not shared with a parent (`splitShare = 0`, so aborting a child
/// never touches the communicator it was split from).
///
/// NCCL honours a child's own config in `ncclCommSplit` (`parseCommConfig` when the
/// config is not NULL, `ncclCommInitChildComm`, src/init.cc, NCCL 2.28.3–2.30.7), so a
/// blocking child can be split off a non-blocking parent.
pub(crate) fn config(cta_policy: c_int, blocking: bool) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: CONFIG_VERSION,
        blocking: c_int::from(blocking),
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: 0,
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
/// as long as calls on it do not overlap; the communicator layer serialises the calls
/// on each communicator (see `comm.rs`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawComm(pub(crate) sys::ncclComm_t);

// SAFETY: an ncclComm_t is a heap handle not tied to the creating thread; the backend
// serialises the calls NCCL requires to be serialised.
unsafe impl Send for RawComm {}
// SAFETY: sharing the handle value gives no access by itself; every NCCL call on it goes
// through the communicator layer, which serialises them.
unsafe impl Sync for RawComm {}

/// Which call makes a communicator, and so what is polled.
#[derive(Clone, Copy)]
pub(crate) enum Making {
    /// `ncclCommInitRankConfig`: the new communicator is written before the call
    /// returns and is what is polled.
    Init,
    /// `ncclCommSplit`: the parent is polled (see [`comm_split`]).
    Split,
}

/// A communicator being made: which call makes it, the handle to poll with
/// [`async_state`] until the call is done (the new communicator for an init, the
/// parent for a split that NCCL runs in the background), and the boxes NCCL may still
/// write into while the call is in progress.
pub(crate) struct Starting {
    pub(crate) poll: RawComm,
    pub(crate) making: Making,
    slot: Box<sys::ncclComm_t>,
    config: Box<sys::ncclConfig_t>,
}

impl Starting {
    /// The new communicator, `None` if NCCL wrote none (a split that failed or was
    /// aborted early); the boxes are freed.
    ///
    /// # Safety
    /// NCCL no longer writes into the boxes: the poll of [`Starting::poll`] said the
    /// call is done or failed.
    pub(crate) unsafe fn finish(self) -> Option<RawComm> {
        // SAFETY: the slot is a live box, and NCCL writes it no more (the caller's
        // contract).
        unsafe { read_slot(&raw const *self.slot) }
    }

    /// The call never completed: leak the boxes, which NCCL may still write into, and
    /// hand back the slot, to be read ([`read_slot`]) only once NCCL's job ended (the
    /// parent's abort returned).
    pub(crate) fn abandon(self) -> *const sys::ncclComm_t {
        std::mem::forget(self.config);
        Box::into_raw(self.slot)
    }
}

/// Start `ncclCommInitRankConfig` on a non-blocking config of the default CTA policy
/// (the control communicator); a half-made communicator is aborted on failure.
pub(crate) fn comm_init(s: &Syms, nranks: usize, id: &[u8; 128], rank: usize) -> Result<Starting> {
    let op = "ncclCommInitRankConfig";
    let (nranks, rank) = (fit(op, nranks)?, fit(op, rank)?);
    let id = sys::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    };
    // SAFETY: both boxes are valid for NCCL to write into until the call completes or
    // is aborted (they are leaked otherwise, see `Starting`); `id` is passed by value;
    // the caller made this rank's device current.
    started(s, op, |slot, config| unsafe {
        (s.init_rank_config)(slot, nranks, id, rank, config)
    })
}

/// A creation call `op`, made by `call` with the boxes of the new communicator and of
/// a non-blocking config of the default CTA policy, that writes the new communicator
/// before it returns (an init, a grow): what is polled until it is done; a half-made
/// communicator is aborted on failure.
fn started(
    s: &Syms,
    op: &'static str,
    call: impl FnOnce(&mut sys::ncclComm_t, &mut sys::ncclConfig_t) -> c_int,
) -> Result<Starting> {
    let mut slot: Box<sys::ncclComm_t> = Box::new(std::ptr::null_mut());
    let mut config = Box::new(config(NCCL_CTA_POLICY_DEFAULT, false));
    let code = call(&mut slot, &mut config);
    let comm = RawComm(*slot);
    if comm.0.is_null() {
        return Err(status(s, op, code, None).err().unwrap_or(no_comm(op, code)));
    }
    match status(s, op, code, Some(&comm)) {
        Ok(_) => Ok(Starting {
            poll: comm,
            making: Making::Init,
            slot,
            config,
        }),
        Err(e) => {
            // SAFETY: the half-made communicator is ours and nothing else holds it;
            // NCCL asks for an abort of a communicator whose creation failed.
            let _ = unsafe { comm_abort(s, comm) };
            Err(e)
        }
    }
}

/// `ncclCommGetUniqueId` on `comm`: the id of its next grow, made by the grow's root,
/// which also sends it to `comm`'s ranks 0 and n - 1 over NCCL's bootstrap, where
/// their `ncclCommGrow` reads it. One id per grow, the next only once that grow
/// completed (`nccl.h.in`, 2.29.2+).
///
/// # Safety
/// `comm` is live, and nothing else calls NCCL on it concurrently.
pub(crate) unsafe fn grow_unique_id(s: &Syms, fns: &GrowFns, comm: RawComm) -> Result<[u8; 128]> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `comm` is live (the caller's contract); `id` is a valid out-pointer.
    let code = unsafe { (fns.unique_id)(comm.0, &mut id) };
    check(s, "ncclCommGetUniqueId", code, Some(&comm))?;
    Ok(id.internal.map(|b| b as u8))
}

/// Start `ncclCommGrow` into a communicator of `nranks` on a non-blocking config of
/// the default CTA policy: on a rank of `parent`, which keeps its rank (`id` only on
/// the grow's root: [`grow_unique_id`]'s), or on a newcomer (`parent` `None`) at
/// `rank` (at least `parent`'s size) with the root's `id` (`nccl.h.in`, 2.29.2+). The
/// new communicator is written before the call returns and is what is polled.
///
/// # Safety
/// `parent`, if any, is live and nothing else calls NCCL on it until the grow is
/// done; the root sent its id before any rank of `parent` calls this (NCCL's ranks
/// 0 and n - 1 wait for it inside the call, with no deadline).
pub(crate) unsafe fn comm_grow(
    s: &Syms,
    fns: &GrowFns,
    parent: Option<RawComm>,
    nranks: usize,
    id: Option<&[u8; 128]>,
    rank: Option<usize>,
) -> Result<Starting> {
    let op = "ncclCommGrow";
    let nranks = fit(op, nranks)?;
    let rank = rank.map_or(Ok(-1), |r| fit(op, r))?;
    let id = id.map(|id| sys::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    });
    let id_ptr = id.as_ref().map_or(std::ptr::null(), |id| &raw const *id);
    let parent = parent.map_or(std::ptr::null_mut(), |p| p.0);
    // SAFETY: the caller's contract for `parent`; NCCL copies `id` before the call
    // returns; the boxes are valid for NCCL to write into until the call completes
    // or is aborted (leaked otherwise, see `Starting`).
    started(s, op, |slot, config| unsafe {
        (fns.grow)(parent, nranks, id_ptr, rank, slot, config)
    })
}

/// Start `ncclCommSplit(parent, 0, key, &child, config)`, the child blocking or not.
///
/// Off a non-blocking parent NCCL runs the split on a thread of its own and writes the
/// child when that job ends (NCCL user guide, "Fault Tolerance" example; src/init.cc
/// 2.28.3 1567–1570), whatever it answered: `ncclInProgress` for a non-blocking child
/// config, `ncclSuccess` at once for a blocking one (`ncclCommSplit`'s `NCCLCHECK` lets
/// the group's `ncclInProgress` through; seen on NCCL 2.28.3, one H200). So the parent
/// is what is polled, and the child is read only once the poll says done
/// ([`Starting::finish`]). Every parent is treated so, whatever its kind (the crate's
/// control communicator is non-blocking; a runtime's may be either): off a blocking
/// parent the split is done on return, and polling the parent is right all the same.
///
/// # Safety
/// `parent` is a live communicator that nothing else calls NCCL on during this call
/// (and, on a non-blocking parent, until the split is done), and every rank of it
/// makes the same call at the same point.
pub(crate) unsafe fn comm_split(
    s: &Syms,
    parent: RawComm,
    key: usize,
    cta_policy: c_int,
    blocking: bool,
) -> Result<Starting> {
    let op = "ncclCommSplit";
    let key = fit(op, key)?;
    let mut slot: Box<sys::ncclComm_t> = Box::new(std::ptr::null_mut());
    let mut config = Box::new(config(cta_policy, blocking));
    // SAFETY: the caller guarantees the parent; the boxes outlive the call's completion
    // (see `Starting`).
    let code = unsafe { (s.split)(parent.0, 0, key, &raw mut *slot, &raw mut *config) };
    status(s, op, code, Some(&parent))?;
    Ok(Starting {
        poll: parent,
        making: Making::Split,
        slot,
        config,
    })
}

/// The state of a communicator's last call: `ncclCommGetAsyncError`. On a blocking
/// communicator it only reads the communicator's asynchronous result (there is no
/// group job to join), which is what a watchdog may do while another thread is inside
/// NCCL on it (PyTorch's watchdog does).
///
/// The asynchronous error is reported as [`Error::Nccl`] naming `op`.
///
/// # Safety
/// `comm` is live (not aborted); on a non-blocking communicator the caller has
/// exclusive use of it (the call joins NCCL's thread of the previous call).
pub(crate) unsafe fn async_state(s: &Syms, op: &'static str, comm: RawComm) -> Result<Status> {
    let mut state: c_int = SUCCESS;
    // SAFETY: the caller guarantees a live communicator; `state` is a valid out-pointer
    // of the size of `ncclResult_t` (a C enum: an int).
    let code = unsafe { (s.get_async_error)(comm.0, &mut state) };
    check(s, "ncclCommGetAsyncError", code, Some(&comm))?;
    status(s, op, state, Some(&comm))
}

/// [rank, size, device] of a communicator.
///
/// # Safety
/// `comm` is live and nothing else calls NCCL on it concurrently.
pub(crate) unsafe fn comm_rank_size_device(s: &Syms, comm: RawComm) -> Result<[usize; 3]> {
    let mut found = [0usize; 3];
    let queries = [
        (s.user_rank, "ncclCommUserRank"),
        (s.count, "ncclCommCount"),
        (s.cu_device, "ncclCommCuDevice"),
    ];
    for ((query, op), out) in queries.into_iter().zip(&mut found) {
        let mut x: c_int = 0;
        // SAFETY: `comm.0` is live (the caller's contract); `x` is a valid out-pointer.
        check(s, op, unsafe { query(comm.0, &mut x) }, Some(&comm))?;
        *out = usize::try_from(x).unwrap_or(usize::MAX);
    }
    Ok(found)
}

/// `ncclCommAbort`: local teardown; also ends the calls and device work still in
/// progress on the communicator, and releases its windows. It can block (it frees
/// memory, which waits for the device, and joins NCCL's threads), so callers run it
/// on a thread of its own.
///
/// # Safety
/// - `comm` is a live communicator created by this crate (not adopted);
/// - nothing uses it again, and no other thread is inside an NCCL call on it, or (the
///   documented race of a blocking communicator whose owner did not leave NCCL in
///   time) the caller accepts that such a thread may touch it while it is freed.
pub(crate) unsafe fn comm_abort(s: &Syms, comm: RawComm) -> Result<()> {
    // SAFETY: the caller guarantees `comm.0` is live, owned and never used again.
    let code = unsafe { (s.abort)(comm.0) };
    // An abort is complete when it returns, even on a non-blocking communicator.
    status(s, "ncclCommAbort", code, None).map(drop)
}

/// `ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT)`: "stops all in-flight operations" on
/// the communicator (sets its abort flags, waits for its streams, stops its proxy,
/// clears the flags) and frees nothing, so that a thread stuck inside NCCL on it
/// returns before the communicator is aborted (nccl.h.in 2.28.7+, `ncclCommRevoke`;
/// src/init.cc 2.30.7 2928–3022). `Ok(false)` without the symbol (NCCL < 2.28.7).
///
/// # Safety
/// `comm` is a live communicator created by this crate, not yet aborted. Another
/// thread may be inside an NCCL call on it (that is what revoking is for).
pub(crate) unsafe fn comm_revoke(s: &Syms, comm: RawComm) -> Result<bool> {
    let Some(revoke) = s.revoke else {
        return Ok(false);
    };
    // SAFETY: the caller guarantees a live communicator of the crate's.
    let code = unsafe { revoke(comm.0, REVOKE_DEFAULT) };
    status(s, "ncclCommRevoke", code, None).map(|_| true)
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

/// One collective call, as NCCL takes it: which one (with its reduction), the `send`
/// and `recv` device addresses, and `count` elements per rank (as
/// [`CollArgs::count`](crate::backend::CollArgs::count)) of `dtype`.
pub(crate) struct CollCall {
    pub(crate) kind: CollKind,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) count: u64,
    pub(crate) dtype: sys::ncclDataType_t,
}

/// Which collective a [`CollCall`] is.
pub(crate) enum CollKind {
    /// `ncclAllGather`.
    AllGather,
    /// `ncclReduceScatter` with this reduction.
    ReduceScatter(sys::ncclRedOp_t),
    /// `ncclAllReduce` with this reduction.
    AllReduce(sys::ncclRedOp_t),
}

impl CollCall {
    /// NCCL's name of the call.
    pub(crate) fn name(&self) -> &'static str {
        match self.kind {
            CollKind::AllGather => "ncclAllGather",
            CollKind::ReduceScatter(_) => "ncclReduceScatter",
            CollKind::AllReduce(_) => "ncclAllReduce",
        }
    }
}

/// Enqueue `call` on `comm` and `stream`: `ncclAllGather`, `ncclReduceScatter` or
/// `ncclAllReduce`, and nothing else. On a blocking communicator it returns once the
/// work is on the stream; on a non-blocking one it may still run when it returns
/// (poll [`async_state`] before the next call on it).
///
/// # Safety
/// - for an all-gather `send` holds `count` elements and `recv` `count × nranks`
///   elements of the type (the other way round for a reduce-scatter; both `count`
///   for an all-reduce, possibly the same address), both live device
///   memory of this rank that stays allocated until `stream` passes;
/// - `stream` is a live stream of the communicator's device;
/// - `comm` is live and the caller has the exclusive use of it.
pub(crate) unsafe fn collective(
    s: &Syms,
    comm: RawComm,
    call: &CollCall,
    stream: sys::cudaStream_t,
) -> Result<()> {
    let op = call.name();
    let n = fit(op, call.count)?;
    let (send, recv) = (call.send as *const c_void, call.recv as *mut c_void);
    let code = match call.kind {
        // SAFETY: the caller upholds this function's contract.
        CollKind::AllGather => unsafe { (s.all_gather)(send, recv, n, call.dtype, comm.0, stream) },
        // SAFETY: as above.
        CollKind::ReduceScatter(red) => unsafe {
            (s.reduce_scatter)(send, recv, n, call.dtype, red, comm.0, stream)
        },
        // SAFETY: as above.
        CollKind::AllReduce(red) => unsafe {
            (s.all_reduce)(send, recv, n, call.dtype, red, comm.0, stream)
        },
    };
    status(s, op, code, Some(&comm)).map(drop)
}

/// Have `f` run at process exit (`atexit(3)`): after `main` returns or `exit` is
/// called, before the handlers registered earlier (those of the CUDA driver and NCCL,
/// once they are loaded). Returns whether it was registered.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `atexit` only stores the pointer of a function that takes and returns
    // nothing, which `f`'s type guarantees; `f` is a plain `fn` item, valid for the
    // whole life of the process.
    unsafe { libc::atexit(f) == 0 }
}

#[cfg(test)]
#[path = "../../../../tests/unit/backend/nccl/ffi.rs"]
mod tests;
