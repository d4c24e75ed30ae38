//! The NCCL and raw CUDA driver calls the crate makes, with checked results.
//!
//! This is the only module that calls NCCL or the driver's raw API.
//!
//! # Why the crate loads NCCL itself
//!
//! The rule is "cudarc for everything, own FFI only where cudarc lacks it". cudarc
//! (0.19) binds NCCL through a private `OnceLock<libloading::Library>` that tries
//! `libnccl.so`, `libnccl.so.<cuda major>`, ... but never `libnccl.so.2`, and has no
//! public way to choose the library. Inside a PyTorch process that is wrong in a way
//! no caller can fix: PyTorch has already loaded its own NCCL (`libnccl.so.2`, e.g. 2.28.9
//! from the `nvidia-nccl` wheel), while `dlopen("libnccl.so")` maps the system's NCCL
//! (e.g. 2.28.3) as a *second copy*; handing PyTorch's communicator to the second copy
//! is undefined behaviour. So NCCL is the one library this crate loads with its own
//! symbol table ([`Syms`]), by [`candidates`]:
//!
//! 1. `$SYMMPOOL_NCCL_LIBRARY`, when set (a path or file name, loaded as given);
//! 2. `libnccl.so.2` **already loaded** in the process (`RTLD_NOLOAD`): PyTorch's, or
//!    any other runtime's, so every communicator lives in one copy of NCCL;
//! 3. `libnccl.so.2` from the loader path (what pip wheels and distribution packages
//!    ship);
//! 4. `libnccl.so` (a development install's symlink).
//!
//! Only cudarc's NCCL *types* (`cudarc::nccl::sys`: the config struct, the unique id,
//! the handles, the data-type and operation enums) are used; no cudarc NCCL function
//! is called. The CUDA driver stays with cudarc. NCCL's return values are read as C
//! `int`s, never as cudarc's `ncclResult_t` enum, so a code that a newer NCCL adds
//! cannot be an invalid enum value.
//!
//! # Non-blocking communicators
//!
//! Every communicator the crate makes is non-blocking (`config.blocking = 0`): the calls
//! that wait on peers return [`Status::InProgress`] and the caller polls
//! [`async_state`] until it is done or its deadline passes, then aborts
//! ([`comm_abort`]). Out-parameters that NCCL may write after returning `ncclInProgress`
//! (the new communicator, the window) live in boxes that are leaked, not freed, if the
//! call never completes.

#![deny(clippy::cast_possible_truncation)]

use crate::error::{Error, NcclVersion, Result};
use cudarc::driver::DriverError;
use cudarc::nccl::sys;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

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
const IN_PROGRESS: c_int = 7;
/// The variable that names the NCCL library to load, before the defaults.
pub(crate) const LIBRARY_VAR: &str = "SYMMPOOL_NCCL_LIBRARY";

/// Map a CUDA driver error.
pub(crate) fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        code: e.0 as i32,
        message: format!("{e:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Loading

/// One way of finding the NCCL library, in the order [`candidates`] lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Candidate {
    /// `dlopen(name, RTLD_NOLOAD | RTLD_NOW)`: only a copy the process already has.
    AlreadyLoaded(&'static str),
    /// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`: from the loader path (or a path).
    Load(String),
}

/// Where to look for NCCL, first to last (a pure function of the override variable).
pub(crate) fn candidates(override_name: Option<&str>) -> Vec<Candidate> {
    let mut list = Vec::with_capacity(4);
    if let Some(name) = override_name.map(str::trim).filter(|n| !n.is_empty()) {
        list.push(Candidate::Load(name.to_string()));
    }
    list.push(Candidate::AlreadyLoaded("libnccl.so.2"));
    list.push(Candidate::Load("libnccl.so.2".into()));
    list.push(Candidate::Load("libnccl.so".into()));
    list
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut sys::ncclUniqueId) -> c_int;
type InitRankConfigFn = unsafe extern "C" fn(
    *mut sys::ncclComm_t,
    c_int,
    sys::ncclUniqueId,
    c_int,
    *mut sys::ncclConfig_t,
) -> c_int;
type SplitFn = unsafe extern "C" fn(
    sys::ncclComm_t,
    c_int,
    c_int,
    *mut sys::ncclComm_t,
    *mut sys::ncclConfig_t,
) -> c_int;
type CommFn = unsafe extern "C" fn(sys::ncclComm_t) -> c_int;
type CommIntFn = unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(sys::ncclComm_t) -> *const c_char;
type MemAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type MemFreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type WindowRegisterFn = unsafe extern "C" fn(
    sys::ncclComm_t,
    *mut c_void,
    usize,
    *mut sys::ncclWindow_t,
    c_int,
) -> c_int;
type WindowDeregisterFn = unsafe extern "C" fn(sys::ncclComm_t, sys::ncclWindow_t) -> c_int;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type ReduceScatterFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;

/// NCCL's functions, resolved once from the library [`candidates`] found.
struct Syms {
    get_unique_id: GetUniqueIdFn,
    init_rank_config: InitRankConfigFn,
    split: SplitFn,
    abort: CommFn,
    get_async_error: CommIntFn,
    count: CommIntFn,
    user_rank: CommIntFn,
    cu_device: CommIntFn,
    error_string: ErrorStringFn,
    last_error: LastErrorFn,
    mem_alloc: MemAllocFn,
    mem_free: MemFreeFn,
    window_register: WindowRegisterFn,
    window_deregister: WindowDeregisterFn,
    all_gather: AllGatherFn,
    reduce_scatter: ReduceScatterFn,
}

/// What loading found: the version, and the functions when all of them resolved.
struct Loaded {
    version: NcclVersion,
    syms: Option<Syms>,
}

/// A copied-out function pointer of `lib`, or the missing symbol's name.
///
/// # Safety
/// `T` is the exact C signature of `name` in the loaded NCCL, and `lib` is never
/// unloaded (it is leaked by [`loaded`]).
unsafe fn sym<T: Copy>(
    lib: &libloading::os::unix::Library,
    name: &'static str,
) -> Result<T, &'static str> {
    // SAFETY: the caller guarantees the signature and that the library stays loaded,
    // so the copied pointer stays valid.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| name)
}

/// A symbol of the leaked NCCL library, typed as the field it initialises.
macro_rules! resolve {
    ($lib:expr, $name:literal) => {{
        // SAFETY: every field of `Syms` has the C signature of its function in nccl.h
        // 2.27 and 2.28 (`ncclResult_t` read as `int`), and the library is leaked.
        unsafe { sym($lib, $name) }?
    }};
}

fn open(candidate: &Candidate) -> Option<libloading::os::unix::Library> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    let result = match candidate {
        // SAFETY: RTLD_NOLOAD maps nothing new: it returns a handle to a library that is
        // already loaded (its initialisers have run) or fails.
        Candidate::AlreadyLoaded(name) => unsafe {
            Library::open(Some(*name), libc::RTLD_NOLOAD | RTLD_NOW)
        },
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions; it is
        // never unloaded (leaked below), so its finalisers never run under us.
        Candidate::Load(name) => unsafe {
            Library::open(Some(name.as_str()), RTLD_NOW | RTLD_LOCAL)
        },
    };
    match result {
        Ok(lib) => Some(lib),
        Err(e) => {
            tracing::debug!("symmpool: NCCL candidate {candidate:?}: {e}");
            None
        }
    }
}

fn loaded() -> Option<&'static Loaded> {
    static LOADED: OnceLock<Option<Loaded>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let requested = std::env::var(LIBRARY_VAR).ok();
            let (candidate, lib) = candidates(requested.as_deref())
                .into_iter()
                .find_map(|c| open(&c).map(|lib| (c, lib)))?;
            // Never unloaded: function pointers into it are kept for the process.
            let lib: &'static libloading::os::unix::Library = Box::leak(Box::new(lib));
            // SAFETY: `ncclGetVersion(int*)` has this signature in every NCCL 2.x.
            let get_version = unsafe { sym::<GetVersionFn>(lib, "ncclGetVersion") }.ok()?;
            let mut code: c_int = 0;
            // SAFETY: a valid out-pointer; ncclGetVersion has no other precondition.
            if unsafe { get_version(&mut code) } != SUCCESS {
                return None;
            }
            let version = NcclVersion::from_code(code);
            tracing::info!("symmpool: NCCL {version} from {candidate:?}");
            let syms = (|| -> Result<Syms, &'static str> {
                Ok(Syms {
                    get_unique_id: resolve!(lib, "ncclGetUniqueId"),
                    init_rank_config: resolve!(lib, "ncclCommInitRankConfig"),
                    split: resolve!(lib, "ncclCommSplit"),
                    abort: resolve!(lib, "ncclCommAbort"),
                    get_async_error: resolve!(lib, "ncclCommGetAsyncError"),
                    count: resolve!(lib, "ncclCommCount"),
                    user_rank: resolve!(lib, "ncclCommUserRank"),
                    cu_device: resolve!(lib, "ncclCommCuDevice"),
                    error_string: resolve!(lib, "ncclGetErrorString"),
                    last_error: resolve!(lib, "ncclGetLastError"),
                    mem_alloc: resolve!(lib, "ncclMemAlloc"),
                    mem_free: resolve!(lib, "ncclMemFree"),
                    window_register: resolve!(lib, "ncclCommWindowRegister"),
                    window_deregister: resolve!(lib, "ncclCommWindowDeregister"),
                    all_gather: resolve!(lib, "ncclAllGather"),
                    reduce_scatter: resolve!(lib, "ncclReduceScatter"),
                })
            })();
            let syms = match syms {
                Ok(s) => Some(s),
                Err(missing) => {
                    tracing::warn!("symmpool: NCCL {version} lacks {missing}");
                    None
                }
            };
            Some(Loaded { version, syms })
        })
        .as_ref()
}

const NO_NCCL: Error = Error::LibraryUnavailable {
    library: "libnccl",
    hint: "install NCCL >= 2.27 so that libnccl.so.2 (or libnccl.so) is on the loader path, or name it in SYMMPOOL_NCCL_LIBRARY",
};

/// The resolved functions, or why there are none.
fn api() -> Result<&'static Syms> {
    let l = loaded().ok_or(NO_NCCL)?;
    l.syms.as_ref().ok_or(if l.version < NcclVersion::WINDOWS {
        Error::NcclTooOld {
            found: l.version,
            required: NcclVersion::WINDOWS,
            feature: "symmetric windows",
        }
    } else {
        Error::LibraryUnavailable {
            library: "libnccl",
            hint: "the NCCL found lacks a function symmpool needs (the log names it)",
        }
    })
}

/// Load NCCL (see the module documentation) and read its version; checks the CUDA
/// driver first.
///
/// # Errors
/// [`Error::LibraryUnavailable`] if either library cannot be loaded.
pub(crate) fn load() -> Result<NcclVersion> {
    if !driver_present() {
        return Err(Error::LibraryUnavailable {
            library: "libcuda (CUDA driver)",
            hint: "no NVIDIA driver on this machine; use the host backend",
        });
    }
    loaded().map(|l| l.version).ok_or(NO_NCCL)
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

// ---------------------------------------------------------------------------------------
// Results

/// How a call on a non-blocking communicator went, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Finished.
    Done,
    /// `ncclInProgress`: poll [`async_state`] until done.
    InProgress,
}

fn c_str(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: NCCL returns NUL-terminated strings that live at least until the next
    // call on the same communicator (ncclGetLastError) or forever (ncclGetErrorString);
    // the text is copied out at once.
    Some(
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The error for result `code` of `op`, with NCCL's last error message on `comm`.
fn nccl_err(op: &'static str, code: c_int, comm: Option<&RawComm>) -> Error {
    let mut message = match api() {
        // SAFETY: ncclGetErrorString accepts any value and returns a static string.
        Ok(s) => c_str(unsafe { (s.error_string)(code) }).unwrap_or_else(|| "unknown".into()),
        Err(_) => "unknown".into(),
    };
    if let (Some(comm), Ok(s)) = (comm, api()) {
        // SAFETY: `comm` is a live communicator (the caller's contract for the call that
        // failed); ncclGetLastError only reads its last message.
        if let Some(last) = c_str(unsafe { (s.last_error)(comm.0) }).filter(|m| !m.is_empty()) {
            message = format!("{message}: {last}");
        }
    }
    Error::Nccl { op, code, message }
}

fn status(op: &'static str, code: c_int, comm: Option<&RawComm>) -> Result<Status> {
    match code {
        SUCCESS => Ok(Status::Done),
        IN_PROGRESS => Ok(Status::InProgress),
        other => Err(nccl_err(op, other, comm)),
    }
}

fn check(op: &'static str, code: c_int, comm: Option<&RawComm>) -> Result<()> {
    match status(op, code, comm)? {
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

/// `x` as a `usize` for NCCL, or an error naming the call (only on 32-bit targets).
fn to_usize(op: &'static str, x: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| Error::Nccl {
        op,
        code: INVALID_ARGUMENT,
        message: format!("{x} does not fit the address space"),
    })
}

/// `x` as a C `int` for NCCL, or an error naming the call.
fn to_int(op: &'static str, x: usize) -> Result<c_int> {
    c_int::try_from(x).map_err(|_| Error::Nccl {
        op,
        code: INVALID_ARGUMENT,
        message: format!("{x} does not fit a C int"),
    })
}

// ---------------------------------------------------------------------------------------
// Communicators

/// A fresh `ncclUniqueId`, as its 128 bytes.
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    let s = api()?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    let code = unsafe { (s.get_unique_id)(&mut id) };
    check("ncclGetUniqueId", code, None)?;
    Ok(id.internal.map(|b| b as u8))
}

/// A config filled as `NCCL_CONFIG_INITIALIZER` does, non-blocking (`blocking = 0`),
/// with `CTAPolicy` set and resources not shared with a parent (`splitShare = 0`, so
/// aborting a child never touches the communicator it was split from).
pub(crate) fn config(cta_policy: c_int) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
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
/// as long as calls on it do not overlap; [`super::NcclBackend`] serialises its calls
/// on each communicator with a mutex.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawComm(pub(crate) sys::ncclComm_t);

// SAFETY: an ncclComm_t is a heap handle not tied to the creating thread; the backend
// serialises the calls NCCL requires to be serialised.
unsafe impl Send for RawComm {}
// SAFETY: sharing the handle value gives no access by itself; every NCCL call on it goes
// through the backend's per-communicator mutex.
unsafe impl Sync for RawComm {}

/// A communicator being made: its handle (valid as soon as the call returned, so that
/// it can be polled or aborted), and the boxes NCCL may still write into while the call
/// is in progress.
#[derive(Debug)]
pub(crate) struct Starting {
    /// The new communicator; it must be polled until ready.
    pub(crate) comm: RawComm,
    slot: Box<sys::ncclComm_t>,
    config: Box<sys::ncclConfig_t>,
}

impl Starting {
    /// The call completed or was aborted: NCCL no longer writes into the boxes.
    pub(crate) fn finish(self) -> RawComm {
        RawComm(*self.slot)
    }

    /// The call never completed: leak the boxes, which NCCL may still write into.
    pub(crate) fn abandon(self) -> RawComm {
        let comm = self.comm;
        std::mem::forget(self.slot);
        std::mem::forget(self.config);
        comm
    }
}

/// Start `ncclCommInitRankConfig` on a non-blocking config.
///
/// # Errors
/// The NCCL error (after aborting the half-made communicator).
pub(crate) fn comm_init(
    nranks: usize,
    id: &[u8; 128],
    rank: usize,
    cta_policy: c_int,
) -> Result<Starting> {
    let s = api()?;
    let op = "ncclCommInitRankConfig";
    let (nranks, rank) = (to_int(op, nranks)?, to_int(op, rank)?);
    let id = sys::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    };
    let mut slot: Box<sys::ncclComm_t> = Box::new(std::ptr::null_mut());
    let mut config = Box::new(config(cta_policy));
    // SAFETY: both boxes are valid for NCCL to write into until the call completes or
    // is aborted (they are leaked otherwise, see `Starting`); `id` is passed by value;
    // the caller made this rank's device current.
    let code = unsafe { (s.init_rank_config)(&mut *slot, nranks, id, rank, &mut *config) };
    started(op, code, slot, config)
}

/// Start `ncclCommSplit(parent, 0, key, &child, config)` with a non-blocking config.
///
/// # Safety
/// `parent` is a live communicator that nothing else calls NCCL on during this call,
/// and every rank of it makes the same call at the same point.
///
/// # Errors
/// The NCCL error.
pub(crate) unsafe fn comm_split(
    parent: RawComm,
    key: usize,
    cta_policy: c_int,
) -> Result<Starting> {
    let s = api()?;
    let op = "ncclCommSplit";
    let key = to_int(op, key)?;
    let mut slot: Box<sys::ncclComm_t> = Box::new(std::ptr::null_mut());
    let mut config = Box::new(config(cta_policy));
    // SAFETY: the caller guarantees the parent; the boxes outlive the call's completion
    // (see `Starting`).
    let code = unsafe { (s.split)(parent.0, 0, key, &mut *slot, &mut *config) };
    started(op, code, slot, config)
}

fn started(
    op: &'static str,
    code: c_int,
    slot: Box<sys::ncclComm_t>,
    config: Box<sys::ncclConfig_t>,
) -> Result<Starting> {
    let comm = RawComm(*slot);
    match status(op, code, (!comm.0.is_null()).then_some(&comm)) {
        Ok(_) if !comm.0.is_null() => Ok(Starting { comm, slot, config }),
        Ok(_) => Err(Error::Nccl {
            op,
            code,
            message: "NCCL returned no communicator".into(),
        }),
        Err(e) => {
            if !comm.0.is_null() {
                // SAFETY: the half-made communicator is ours and nothing else holds it;
                // NCCL asks for an abort of a communicator whose creation failed.
                let _ = unsafe { comm_abort(comm) };
            }
            Err(e)
        }
    }
}

/// The state of a non-blocking communicator's last call: `ncclCommGetAsyncError`.
///
/// # Safety
/// `comm` is live (not aborted) and the caller holds its mutex.
///
/// # Errors
/// The asynchronous error, as [`Error::Nccl`] naming `op`.
pub(crate) unsafe fn async_state(op: &'static str, comm: RawComm) -> Result<Status> {
    let s = api()?;
    let mut state: c_int = SUCCESS;
    // SAFETY: the caller guarantees a live communicator; `state` is a valid out-pointer
    // of the size of `ncclResult_t` (a C enum: an int).
    let code = unsafe { (s.get_async_error)(comm.0, &mut state) };
    check("ncclCommGetAsyncError", code, Some(&comm))?;
    status(op, state, Some(&comm))
}

/// (rank, size, device) of a communicator.
///
/// # Safety
/// `comm` is live and nothing else calls NCCL on it concurrently.
pub(crate) unsafe fn comm_rank_size_device(comm: RawComm) -> Result<(usize, usize, usize)> {
    let s = api()?;
    let (mut rank, mut size, mut dev) = (0 as c_int, 0 as c_int, 0 as c_int);
    // SAFETY: `comm.0` is live (the caller's contract); out-pointers are valid.
    let code = unsafe { (s.user_rank)(comm.0, &mut rank) };
    check("ncclCommUserRank", code, Some(&comm))?;
    // SAFETY: as above.
    let code = unsafe { (s.count)(comm.0, &mut size) };
    check("ncclCommCount", code, Some(&comm))?;
    // SAFETY: as above.
    let code = unsafe { (s.cu_device)(comm.0, &mut dev) };
    check("ncclCommCuDevice", code, Some(&comm))?;
    let u = |x: c_int| usize::try_from(x).unwrap_or(usize::MAX);
    Ok((u(rank), u(size), u(dev)))
}

/// `ncclCommAbort`: local teardown; also ends the calls and device work still in
/// progress on the communicator, and releases its windows. It can block (it frees
/// memory, which waits for the device, and joins NCCL's threads), so callers run it
/// on a thread of its own.
///
/// # Safety
/// - `comm` is a live communicator created by this crate (not adopted);
/// - nothing uses it again, and no other thread is inside an NCCL call on it (it was
///   marked aborted under its mutex, so no call starts on it later).
pub(crate) unsafe fn comm_abort(comm: RawComm) -> Result<()> {
    let s = api()?;
    // SAFETY: the caller guarantees `comm.0` is live, owned and never used again.
    let code = unsafe { (s.abort)(comm.0) };
    // An abort is complete when it returns, even on a non-blocking communicator.
    match code {
        SUCCESS | IN_PROGRESS => Ok(()),
        other => Err(nccl_err("ncclCommAbort", other, None)),
    }
}

// ---------------------------------------------------------------------------------------
// Memory and windows

/// `ncclMemAlloc` of `size` bytes on the current device: cuMem (VMM) memory that
/// windows accept, rounded up to the recommended granularity.
///
/// # Errors
/// [`Error::DeviceOutOfMemory`] with NCCL's code and message.
pub(crate) fn mem_alloc(size: u64) -> Result<u64> {
    let s = api()?;
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
        other => match nccl_err("ncclMemAlloc", other, None) {
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
pub(crate) unsafe fn mem_free(ptr: u64) -> Result<()> {
    let s = api()?;
    // SAFETY: the caller guarantees a single free of an `ncclMemAlloc` pointer that
    // nothing uses any more.
    check(
        "ncclMemFree",
        unsafe { (s.mem_free)(ptr as *mut c_void) },
        None,
    )
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

/// A window registration in progress: the box NCCL writes the handle into.
#[derive(Debug)]
pub(crate) struct Registering {
    slot: Box<sys::ncclWindow_t>,
}

impl Registering {
    /// The registration completed: the window (`None`: NCCL gave a NULL window, no
    /// symmetric support). The slot is leaked, not freed (8 bytes per registration):
    /// should an NCCL version write it after reporting completion, it writes into
    /// memory nobody else uses.
    pub(crate) fn finish(self) -> Option<RawWindow> {
        let w = *Box::leak(self.slot);
        (!w.is_null()).then_some(RawWindow(w))
    }

    /// The registration never completed: leak the box NCCL may still write into.
    pub(crate) fn abandon(self) {
        std::mem::forget(self.slot);
    }
}

/// Start `ncclCommWindowRegister(comm, ptr, size, &win, NCCL_WIN_COLL_SYMMETRIC)`.
///
/// # Collective
/// Every rank of `comm`, same order.
///
/// # Safety
/// - `comm` is live and the caller holds its mutex;
/// - `ptr..ptr + size` is one whole `ncclMemAlloc` allocation on `comm`'s device,
///   not yet registered on `comm`.
pub(crate) unsafe fn window_register(comm: RawComm, ptr: u64, size: u64) -> Result<Registering> {
    let s = api()?;
    let op = "ncclCommWindowRegister";
    let size = to_usize(op, size)?;
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
    status(op, code, Some(&comm))?;
    Ok(Registering { slot })
}

/// Start `ncclCommWindowDeregister`.
///
/// # Safety
/// - `win` came from [`window_register`] on `comm` (consumed here);
/// - `comm` is live, the caller holds its mutex, and no device work uses the window.
pub(crate) unsafe fn window_deregister(comm: RawComm, win: RawWindow) -> Result<Status> {
    let s = api()?;
    // SAFETY: the caller guarantees the window belongs to this live communicator and is
    // no longer in use.
    let code = unsafe { (s.window_deregister)(comm.0, win.0) };
    status("ncclCommWindowDeregister", code, Some(&comm))
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

/// Enqueue `ncclAllGather` (on a non-blocking communicator it may answer
/// [`Status::InProgress`]: poll before the next call on it).
///
/// # Safety
/// - `send` holds `count` elements and `recv` `count × nranks` elements of `dt`, both
///   live device memory of this rank that stays allocated until `stream` passes;
/// - `stream` is a live stream of the communicator's device;
/// - `comm` is live and the caller holds its mutex.
pub(crate) unsafe fn all_gather(
    comm: RawComm,
    send: u64,
    recv: u64,
    count: u64,
    dt: sys::ncclDataType_t,
    stream: sys::cudaStream_t,
) -> Result<Status> {
    let s = api()?;
    let count = to_usize("ncclAllGather", count)?;
    // SAFETY: the caller upholds this function's contract.
    let code = unsafe {
        (s.all_gather)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dt,
            comm.0,
            stream,
        )
    };
    status("ncclAllGather", code, Some(&comm))
}

/// Enqueue `ncclReduceScatter` (may answer [`Status::InProgress`], as
/// [`all_gather`]).
///
/// # Safety
/// As [`all_gather`], with `send` holding `count × nranks` and `recv` `count` elements.
pub(crate) unsafe fn reduce_scatter(
    comm: RawComm,
    send: u64,
    recv: u64,
    count: u64,
    dt: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    stream: sys::cudaStream_t,
) -> Result<Status> {
    let s = api()?;
    let count = to_usize("ncclReduceScatter", count)?;
    // SAFETY: the caller upholds this function's contract.
    let code = unsafe {
        (s.reduce_scatter)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dt,
            op,
            comm.0,
            stream,
        )
    };
    status("ncclReduceScatter", code, Some(&comm))
}

// ---------------------------------------------------------------------------------------
// CUDA driver (through cudarc)

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
///
/// # Errors
/// [`Error::Cuda`].
pub(crate) unsafe fn stream_context(
    stream: cudarc::driver::sys::CUstream,
) -> Result<cudarc::driver::sys::CUcontext> {
    use cudarc::driver::sys as cu;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller guarantees the stream handle; `ctx` is a valid out-pointer.
    let r = unsafe { cu::cuStreamGetCtx(stream, &mut ctx) };
    if r != cu::cudaError_enum::CUDA_SUCCESS {
        return Err(cuda("cuStreamGetCtx")(DriverError(r)));
    }
    Ok(ctx)
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

/// Wait, polling, until the work enqueued so far on `stream` is done, or fail with
/// [`Error::Timeout`] at `deadline` (a stream stuck behind a collective whose peer
/// died must not hold the caller forever).
pub(crate) fn wait_stream(
    op: &'static str,
    stream: &cudarc::driver::CudaStream,
    deadline: std::time::Instant,
) -> Result<()> {
    let started = std::time::Instant::now();
    let event = stream.record_event(None).map_err(cuda("cuEventRecord"))?;
    let mut pause = std::time::Duration::from_micros(20);
    loop {
        if event.is_complete() {
            return Ok(());
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                op,
                waited: now.saturating_duration_since(started),
                missing_ranks: Vec::new(),
            });
        }
        std::thread::sleep(pause.min(deadline.saturating_duration_since(now)));
        pause = (pause * 2).min(std::time::Duration::from_millis(5));
    }
}

/// Copy `data` to device address `dst` on `stream` and wait for the copy; the wait for
/// the stream's earlier work ends at `deadline`.
///
/// # Safety
/// `dst..dst + data.len()` is live device memory of `stream`'s context.
///
/// # Errors
/// [`Error::Timeout`] (nothing was copied), [`Error::Cuda`].
pub(crate) unsafe fn copy_to_device(
    dst: u64,
    data: &[u8],
    stream: &cudarc::driver::CudaStream,
    deadline: std::time::Instant,
) -> Result<()> {
    // First the stream's earlier work, with a deadline: then the copy below waits for
    // nothing but itself.
    wait_stream("writing to a buffer (its stream is busy)", stream, deadline)?;
    // SAFETY: the caller guarantees the destination. `data` outlives the copy: a
    // transfer from pageable host memory is staged before the call returns (CUDA
    // Runtime API, "API synchronization behavior", memcpy async), and the stream is
    // synchronised below anyway, with only this copy left on it.
    unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyHtoDAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}

/// Copy device address `src` into `out` on `stream` and wait for the copy; the wait
/// for the stream's earlier work ends at `deadline`.
///
/// # Safety
/// `src..src + out.len()` is live device memory of `stream`'s context.
///
/// # Errors
/// [`Error::Timeout`] (nothing was copied), [`Error::Cuda`].
pub(crate) unsafe fn copy_to_host(
    src: u64,
    out: &mut [u8],
    stream: &cudarc::driver::CudaStream,
    deadline: std::time::Instant,
) -> Result<()> {
    wait_stream("reading a buffer (its stream is busy)", stream, deadline)?;
    // SAFETY: the caller guarantees the source. `out` outlives the copy: a transfer to
    // pageable host memory returns only once complete (CUDA Runtime API, "API
    // synchronization behavior"), and the stream, with only this copy left on it, is
    // synchronised before returning.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, stream.cu_stream()) }
        .map_err(cuda("cuMemcpyDtoHAsync"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_the_initializer_non_blocking() {
        let c = config(NCCL_CTA_POLICY_ZERO);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert!(
            c.version >= 22700,
            "CTAPolicy is ignored below config version 2.27"
        );
        assert_eq!(c.CTAPolicy, 2);
        assert_eq!(c.blocking, 0, "every communicator is non-blocking");
        assert_eq!(c.splitShare, 0, "children never share a parent's resources");
        assert_eq!(c.cgaClusterSize, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
        assert_eq!(config(NCCL_CTA_POLICY_DEFAULT).CTAPolicy, 0);
    }

    #[test]
    fn loader_prefers_an_already_loaded_libnccl_so_2() {
        assert_eq!(
            candidates(None),
            vec![
                Candidate::AlreadyLoaded("libnccl.so.2"),
                Candidate::Load("libnccl.so.2".into()),
                Candidate::Load("libnccl.so".into()),
            ]
        );
        assert_eq!(candidates(Some("  ")), candidates(None));
        let with = candidates(Some("/opt/nccl/lib/libnccl.so.2"));
        assert_eq!(
            with[0],
            Candidate::Load("/opt/nccl/lib/libnccl.so.2".into())
        );
        assert_eq!(with[1..], candidates(None)[..]);
    }

    #[test]
    fn result_codes() {
        assert_eq!(status("x", SUCCESS, None).unwrap(), Status::Done);
        assert_eq!(status("x", IN_PROGRESS, None).unwrap(), Status::InProgress);
        // A code no cudarc enum knows (e.g. 2.30's ncclTimeout = 8, or a later one) is
        // an error, never an invalid enum value.
        for code in [3, 6, 8, 42] {
            match status("op", code, None) {
                Err(Error::Nccl { op, code: c, .. }) => assert_eq!((op, c), ("op", code)),
                other => panic!("{other:?}"),
            }
        }
        assert!(check("x", IN_PROGRESS, None).is_err());
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
