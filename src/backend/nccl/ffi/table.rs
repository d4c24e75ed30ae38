//! Finding NCCL and its function table.
//!
//! The rule is "cudarc for everything, own FFI only where cudarc lacks it". cudarc
//! (0.19) binds NCCL through a private `OnceLock<libloading::Library>` that tries
//! `libnccl.so`, `libnccl.so.<cuda major>`, ... but never `libnccl.so.2`, and has no
//! public way to choose the library. Inside a PyTorch process that is wrong in a way
//! no caller can fix: PyTorch has already loaded its own NCCL (`libnccl.so.2`, e.g. 2.28.9
//! from the `nvidia-nccl` wheel), while `dlopen("libnccl.so")` maps the system's NCCL
//! (e.g. 2.28.3) as a *second copy*; handing PyTorch's communicator to the second copy
//! is undefined behaviour. So NCCL is the one library this crate loads with its own
//! symbol table ([`Syms`], the one place a replacement NCCL would plug in), by [`candidates`]:
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

use super::{SUCCESS, driver_present, sys};
use crate::error::{Error, NcclVersion, Result};
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// The variable that names the NCCL library to load, before the defaults.
pub(crate) const LIBRARY_VAR: &str = "SYMMPOOL_NCCL_LIBRARY";

/// One way of finding the NCCL library, in the order [`candidates`] lists them.
#[derive(Debug, PartialEq)]
pub(crate) enum Candidate {
    /// `dlopen(name, RTLD_NOLOAD | RTLD_NOW)`: only a copy the process already has.
    AlreadyLoaded(&'static str),
    /// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`: from the loader path (or a path).
    Load(String),
}

/// Where to look for NCCL, first to last (a pure function of the override variable).
pub(crate) fn candidates(override_name: Option<&str>) -> Vec<Candidate> {
    let given = override_name.map(str::trim).filter(|n| !n.is_empty());
    let defaults = [
        Candidate::AlreadyLoaded("libnccl.so.2"),
        Candidate::Load("libnccl.so.2".into()),
        Candidate::Load("libnccl.so".into()),
    ];
    given
        .map(|n| Candidate::Load(n.into()))
        .into_iter()
        .chain(defaults)
        .collect()
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
pub(crate) type CommIntFn = unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> c_int;
pub(crate) type ReduceScatterFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
/// `ncclCommRevoke(comm, revokeFlags)` (NCCL >= 2.28.7, `nccl.h.in`).
pub(crate) type RevokeFn = unsafe extern "C" fn(sys::ncclComm_t, c_int) -> c_int;

/// `ncclCommGetUniqueId(comm, uniqueId)` and `ncclCommGrow(comm, nRanks, uniqueId,
/// rank, newcomm, config)` (NCCL >= 2.29.2, `nccl.h.in`).
#[derive(Clone, Copy)]
pub(crate) struct GrowFns {
    pub(crate) unique_id: unsafe extern "C" fn(sys::ncclComm_t, *mut sys::ncclUniqueId) -> c_int,
    pub(crate) grow: unsafe extern "C" fn(
        sys::ncclComm_t,
        c_int,
        *const sys::ncclUniqueId,
        c_int,
        *mut sys::ncclComm_t,
        *mut sys::ncclConfig_t,
    ) -> c_int,
}

/// Declares [`Syms`], each field with the NCCL function it is resolved from, and
/// [`resolve`], which resolves them all from a loaded library.
macro_rules! syms {
    ($($field:ident: $ty:ty = $name:literal,)*) => {
        /// NCCL's function table: resolved once from the library [`candidates`] found,
        /// or (in the crate's tests) a fake NCCL of Rust `extern "C"` functions behind
        /// the same types. Every NCCL call of the crate goes through one of these
        /// fields; the communicator layer holds the table it was made with ([`api`] for
        /// the real one).
        pub(crate) struct Syms {
            $(pub(crate) $field: $ty,)*
            /// `ncclCommRevoke`, NCCL >= 2.28.7 only (`None` before: the watchdog then
            /// aborts directly).
            pub(crate) revoke: Option<RevokeFn>,
            /// `ncclCommGetUniqueId` and `ncclCommGrow`, NCCL >= 2.29.2 only (`None`
            /// before: a grow makes a new set).
            pub(crate) grow: Option<GrowFns>,
        }

        /// Every function of [`Syms`] from `lib`, or the name of the first missing one.
        fn resolve(lib: &'static libloading::os::unix::Library) -> Result<Syms, &'static str> {
            Ok(Syms {
                // SAFETY: every field of `Syms` has the C signature of its function in
                // nccl.h 2.27 and 2.28 (`ncclResult_t` read as `int`), and the library
                // is leaked.
                $($field: unsafe { sym(lib, $name) }?,)*
                // SAFETY: `ncclCommRevoke(ncclComm_t, int)` in nccl.h 2.28.7+; the
                // library is leaked. Absent before 2.28.7, which is not an error.
                revoke: unsafe { sym(lib, "ncclCommRevoke") }.ok(),
                // SAFETY: `GrowFns`' fields have the C signatures of their functions in
                // nccl.h.in 2.29.2+; the library is leaked. Absent before, not an error.
                grow: match unsafe { (sym(lib, "ncclCommGetUniqueId"), sym(lib, "ncclCommGrow")) } {
                    (Ok(unique_id), Ok(grow)) => Some(GrowFns { unique_id, grow }),
                    _ => None,
                },
            })
        }
    };
}

syms! {
    get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> c_int = "ncclGetUniqueId",
    init_rank_config: unsafe extern "C" fn(
        *mut sys::ncclComm_t,
        c_int,
        sys::ncclUniqueId,
        c_int,
        *mut sys::ncclConfig_t,
    ) -> c_int = "ncclCommInitRankConfig",
    split: unsafe extern "C" fn(
        sys::ncclComm_t,
        c_int,
        c_int,
        *mut sys::ncclComm_t,
        *mut sys::ncclConfig_t,
    ) -> c_int = "ncclCommSplit",
    abort: unsafe extern "C" fn(sys::ncclComm_t) -> c_int = "ncclCommAbort",
    get_async_error: CommIntFn = "ncclCommGetAsyncError",
    count: CommIntFn = "ncclCommCount",
    user_rank: CommIntFn = "ncclCommUserRank",
    cu_device: CommIntFn = "ncclCommCuDevice",
    error_string: unsafe extern "C" fn(c_int) -> *const c_char = "ncclGetErrorString",
    last_error: unsafe extern "C" fn(sys::ncclComm_t) -> *const c_char = "ncclGetLastError",
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int = "ncclMemAlloc",
    mem_free: unsafe extern "C" fn(*mut c_void) -> c_int = "ncclMemFree",
    window_register: unsafe extern "C" fn(
        sys::ncclComm_t,
        *mut c_void,
        usize,
        *mut sys::ncclWindow_t,
        c_int,
    ) -> c_int = "ncclCommWindowRegister",
    window_deregister: unsafe extern "C" fn(sys::ncclComm_t, sys::ncclWindow_t) -> c_int =
        "ncclCommWindowDeregister",
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> c_int = "ncclAllGather",
    reduce_scatter: ReduceScatterFn = "ncclReduceScatter",
    // `ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)`: the shape
    // of `ncclReduceScatter`.
    all_reduce: ReduceScatterFn = "ncclAllReduce",
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
    (result.inspect_err(|e| tracing::debug!("symmpool: NCCL candidate {candidate:?}: {e}"))).ok()
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
            let syms = resolve(lib)
                .inspect_err(|m| tracing::warn!("symmpool: NCCL {version} lacks {m}"))
                .ok();
            Some(Loaded { version, syms })
        })
        .as_ref()
}

const NO_NCCL: Error = Error::LibraryUnavailable {
    library: "libnccl",
    hint: "install NCCL >= 2.27 so that libnccl.so.2 (or libnccl.so) is on the loader path, or name it in SYMMPOOL_NCCL_LIBRARY",
};

/// The resolved functions, or why there are none ([`Error::NcclTooOld`] before 2.27).
pub(crate) fn api() -> Result<&'static Syms> {
    let l = loaded().ok_or(NO_NCCL)?;
    require(l.version, NcclVersion::WINDOWS, "symmetric windows")?;
    l.syms.as_ref().ok_or(Error::LibraryUnavailable {
        library: "libnccl",
        hint: "the NCCL found lacks a function symmpool needs (the log names it)",
    })
}

/// The error of a machine without the CUDA driver.
pub(crate) const NO_DRIVER: Error = Error::LibraryUnavailable {
    library: "libcuda (CUDA driver)",
    hint: "no NVIDIA driver on this machine; use the host backend",
};

/// Load NCCL (see the module documentation) and read its version; checks the CUDA
/// driver first.
///
/// # Errors
/// [`Error::LibraryUnavailable`] if either library cannot be loaded.
pub(crate) fn load() -> Result<NcclVersion> {
    if !driver_present() {
        return Err(NO_DRIVER);
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

#[cfg(test)]
#[path = "../../../../tests/unit/backend/nccl/ffi/table.rs"]
mod tests;
