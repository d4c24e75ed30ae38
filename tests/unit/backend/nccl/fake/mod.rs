//! A fake NCCL and a fake device, for tests without a GPU: Rust `extern "C"`
//! functions behind NCCL's function table ([`Syms`]), each logging its call (name and
//! calling thread) on the communicator it was called on, and a [`Device`] that logs
//! its capture queries and event records.
//!
//! What the fake does not cover: NCCL's own behaviour (its threads, connections,
//! kernels, the real blocking of a registration on peers), CUDA (streams, events,
//! graphs: the fake device's events complete at once and its "capture" is a flag),
//! several ranks (every fake communicator is rank 0 of 1), and the cost of a call. It
//! shows which calls the crate makes, on which thread, and in which order.

use super::comm::{Binder, Comm, Device, Shared, finish_creation};
use super::config::NcclConfig;
use super::ffi::{self, RawComm, Syms};
use super::health::{Completion, Health};
use crate::backend::CommInfo;
use crate::deadline::Deadline;
use crate::error::Result;
use cudarc::nccl::sys;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::Duration;

/// One call the fake saw: the function and the thread that called it.
pub(super) type Call = (&'static str, ThreadId);

/// Orders the calls on every fake communicator: each call's stamp is the next tick.
static CLOCK: AtomicU64 = AtomicU64::new(0);

/// A fake communicator; its address is the `ncclComm_t`.
#[derive(Default)]
pub(super) struct FakeComm {
    pub(super) blocking: bool,
    /// Each call with its stamp ([`CLOCK`]).
    log: Mutex<Vec<(Call, u64)>>,
    /// Registrations block until the communicator is revoked or aborted.
    pub(super) stuck_register: AtomicBool,
    /// Registrations succeed with a NULL window (NCCL 2.29+ across `NCCL_HOSTID`
    /// "nodes": no symmetric memory on the communicator).
    pub(super) null_window: AtomicBool,
    /// Collectives block until the communicator is revoked or aborted (as an enqueue
    /// on a full work FIFO behind stuck work).
    pub(super) stuck_collective: AtomicBool,
    /// What its collectives answer (0: success).
    pub(super) collective_result: AtomicI32,
    /// What `ncclCommGetAsyncError` reports (0: success).
    pub(super) async_error: AtomicI32,
    /// How many revokes ended (a revoke clears NCCL's abort flags when done, so it
    /// ends only the calls already inside NCCL).
    revokes: AtomicU64,
    aborted: AtomicBool,
    /// A stuck registration reaches NCCL only after the first revoke ended (as a thread
    /// marked inside just before its call).
    pub(super) late_register: AtomicBool,
    /// Whether the last stuck registration was ended by the abort (freed under it)
    /// rather than by a revoke.
    pub(super) register_ended_by_abort: AtomicBool,
    /// Whether its creation ended (a child split off a non-blocking parent is not,
    /// until the parent's job ends); a call on it before then sets `used_unready`.
    ready: AtomicBool,
    pub(super) used_unready: AtomicBool,
    /// On a non-blocking parent: NCCL's thread writes a split's child before the call
    /// returns, while the job still runs (a thread may write it at any time).
    pub(super) early_split_write: AtomicBool,
    /// On a non-blocking parent: a split's job never ends, until the parent is aborted.
    pub(super) stuck_split: AtomicBool,
    /// Its abort waits (at most 2 s) until this many aborts sharing the rendezvous
    /// run at once (as aborts that each wait for the device).
    pub(super) abort_rendezvous: Mutex<Option<Arc<Rendezvous>>>,
    /// The last child split off it.
    pub(super) last_child: Mutex<Option<usize>>,
    /// A split in progress on this (non-blocking) parent: where to write the child
    /// (an address) and the child, written at the parent's next poll, as NCCL writes
    /// it when its job ends.
    pending_split: Mutex<Option<(usize, usize)>>,
    wake: Condvar,
    wake_lock: Mutex<()>,
}

impl FakeComm {
    fn make(blocking: bool, ready: bool) -> sys::ncclComm_t {
        let comm = Box::new(FakeComm {
            blocking,
            ready: AtomicBool::new(ready),
            ..FakeComm::default()
        });
        Box::into_raw(comm).cast()
    }

    fn note(&self, name: &'static str) {
        if !self.ready.load(Ordering::SeqCst) {
            self.used_unready.store(true, Ordering::SeqCst);
        }
        let stamp = CLOCK.fetch_add(1, Ordering::SeqCst);
        let call = (name, std::thread::current().id());
        self.log.lock().push((call, stamp));
    }

    /// A collective `name`: noted, then blocked while `stuck_collective` is set, else
    /// the configured result.
    fn collective(&self, name: &'static str) -> c_int {
        self.note(name);
        if self.stuck_collective.load(Ordering::SeqCst) {
            return self.block_until_revoked();
        }
        self.collective_result.load(Ordering::SeqCst)
    }

    /// The split in progress on it ends: NCCL's thread writes the child, which is
    /// ready from then on.
    fn end_split(&self) {
        if let Some((out, child)) = self.pending_split.lock().take() {
            fake(child as sys::ncclComm_t)
                .ready
                .store(true, Ordering::SeqCst);
            // SAFETY: `out` is the split's out-pointer, which the caller keeps alive
            // until the parent's poll says the split is done or the parent's abort
            // returned (see `ffi::Starting`).
            unsafe {
                std::ptr::write_volatile(out as *mut sys::ncclComm_t, child as sys::ncclComm_t)
            };
        }
    }

    fn interrupt(&self, flag: &AtomicBool) {
        let _g = self.wake_lock.lock();
        flag.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    /// Block like a call whose peer never comes: until a revoke that ends after the
    /// call started, or an abort (the fake's own bound: 30 s). With `late_register`,
    /// the call reaches NCCL only after the first revoke ended.
    fn block_until_revoked(&self) -> c_int {
        let mut g = self.wake_lock.lock();
        let until = Deadline::after(Duration::from_secs(30));
        let ended = |epoch: Option<u64>| {
            let revokes = self.revokes.load(Ordering::SeqCst);
            self.aborted.load(Ordering::SeqCst)
                || epoch.is_some_and(|e| revokes != e)
                || (epoch.is_none() && revokes > 0)
        };
        if self.late_register.load(Ordering::SeqCst) {
            self.wake
                .wait_while_until(&mut g, |_| !ended(None), until.instant());
        }
        let epoch = self.revokes.load(Ordering::SeqCst);
        self.wake
            .wait_while_until(&mut g, |_| !ended(Some(epoch)), until.instant());
        self.register_ended_by_abort
            .store(self.aborted.load(Ordering::SeqCst), Ordering::SeqCst);
        INTERNAL_ERROR
    }

    /// The calls made on it so far.
    pub(super) fn calls(&self) -> Vec<Call> {
        self.log.lock().iter().map(|(call, _)| *call).collect()
    }

    /// The names of the calls made on it so far, each with its stamp: calls on
    /// different communicators are ordered by their stamps.
    pub(super) fn stamped(&self) -> Vec<(&'static str, u64)> {
        self.log
            .lock()
            .iter()
            .map(|((name, _), t)| (*name, *t))
            .collect()
    }

    /// The names of the calls made on it by `thread`.
    pub(super) fn names_on(&self, thread: ThreadId) -> Vec<&'static str> {
        self.calls()
            .into_iter()
            .filter(|(_, t)| *t == thread)
            .map(|(n, _)| n)
            .collect()
    }

    /// Forget the calls so far.
    pub(super) fn clear(&self) {
        self.log.lock().clear();
    }
}

/// The fake behind a communicator handle made by the fake.
pub(super) fn comm(raw: RawComm) -> &'static FakeComm {
    // SAFETY: every handle reaching the fake was made by `FakeComm::make` and is never
    // freed (fake communicators are leaked, as an aborted NCCL communicator's memory is
    // nobody's business).
    unsafe { &*raw.0.cast::<FakeComm>() }
}

fn fake(c: sys::ncclComm_t) -> &'static FakeComm {
    comm(RawComm(c))
}

const SUCCESS: c_int = 0;
const INTERNAL_ERROR: c_int = 3;

unsafe extern "C" fn get_unique_id(id: *mut sys::ncclUniqueId) -> c_int {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { (*id).internal = [0; 128] };
    SUCCESS
}

unsafe extern "C" fn init_rank_config(
    out: *mut sys::ncclComm_t,
    _n: c_int,
    _id: sys::ncclUniqueId,
    _rank: c_int,
    config: *mut sys::ncclConfig_t,
) -> c_int {
    // SAFETY: the caller passes valid pointers.
    let blocking = unsafe { (*config).blocking } != 0;
    // SAFETY: as above.
    unsafe { *out = FakeComm::make(blocking, true) };
    SUCCESS
}

unsafe extern "C" fn split(
    parent: sys::ncclComm_t,
    _color: c_int,
    _key: c_int,
    out: *mut sys::ncclComm_t,
    config: *mut sys::ncclConfig_t,
) -> c_int {
    let p = fake(parent);
    p.note("ncclCommSplit");
    // SAFETY: the caller passes valid pointers.
    let blocking = unsafe { (*config).blocking } != 0;
    let child = FakeComm::make(blocking, p.blocking);
    *p.last_child.lock() = Some(child as usize);
    if p.blocking {
        // SAFETY: as above.
        unsafe { *out = child };
        return SUCCESS;
    }
    // A non-blocking parent runs the split in the background and writes the child
    // when it ends (here: at the parent's next poll, or its abort). Real NCCL (2.28.3)
    // answers "in progress" for a non-blocking child and "success" at once for a
    // blocking one. Its thread may write the child before that job ended.
    if p.early_split_write.load(Ordering::SeqCst) {
        // SAFETY: as above.
        unsafe { *out = child };
    }
    *p.pending_split.lock() = Some((out as usize, child as usize));
    if blocking { SUCCESS } else { ffi::IN_PROGRESS }
}

/// Aborts that wait for each other.
#[derive(Debug, Default)]
pub(super) struct Rendezvous {
    need: usize,
    arrived: Mutex<usize>,
    cv: Condvar,
}

impl Rendezvous {
    pub(super) fn new(need: usize) -> Arc<Self> {
        Arc::new(Rendezvous {
            need,
            ..Rendezvous::default()
        })
    }

    fn meet(&self) {
        let mut arrived = self.arrived.lock();
        *arrived += 1;
        self.cv.notify_all();
        let until = Deadline::after(Duration::from_secs(2));
        self.cv
            .wait_while_until(&mut arrived, |a| *a < self.need, until.instant());
    }
}

unsafe extern "C" fn abort(c: sys::ncclComm_t) -> c_int {
    let f = fake(c);
    let rendezvous = f.abort_rendezvous.lock().clone();
    if let Some(r) = rendezvous {
        r.meet();
    }
    // Aborting a communicator being made ends its creation (NCCL's
    // `setCommAbortFlags`; a parent's abort ends its split's job).
    f.ready.store(true, Ordering::SeqCst);
    f.note("ncclCommAbort");
    f.interrupt(&f.aborted);
    f.end_split();
    SUCCESS
}

unsafe extern "C" fn get_async_error(c: sys::ncclComm_t, state: *mut c_int) -> c_int {
    let f = fake(c);
    f.note("ncclCommGetAsyncError");
    if f.stuck_split.load(Ordering::SeqCst) && f.pending_split.lock().is_some() {
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { *state = ffi::IN_PROGRESS };
        return SUCCESS;
    }
    f.end_split();
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *state = f.async_error.load(Ordering::SeqCst) };
    SUCCESS
}

unsafe extern "C" fn count(_c: sys::ncclComm_t, n: *mut c_int) -> c_int {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *n = 1 };
    SUCCESS
}

unsafe extern "C" fn zero(_c: sys::ncclComm_t, n: *mut c_int) -> c_int {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *n = 0 };
    SUCCESS
}

unsafe extern "C" fn error_string(_code: c_int) -> *const c_char {
    c"fake NCCL error".as_ptr()
}

unsafe extern "C" fn last_error(_c: sys::ncclComm_t) -> *const c_char {
    c"".as_ptr()
}

/// Fake device addresses: never dereferenced.
static NEXT_ADDRESS: AtomicU64 = AtomicU64::new(0x7f00_0000_0000);

/// The fake allocations not freed yet.
static LIVE: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

thread_local! {
    /// The last fake allocation of this thread.
    pub(super) static LAST_ALLOC: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Whether the fake allocation at `ptr` was not freed yet.
pub(super) fn live(ptr: u64) -> bool {
    LIVE.lock().contains(&ptr)
}

unsafe extern "C" fn mem_alloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    let at = NEXT_ADDRESS.fetch_add(size as u64, Ordering::SeqCst);
    LIVE.lock().insert(at);
    LAST_ALLOC.with(|l| l.set(at));
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *ptr = at as *mut c_void };
    SUCCESS
}

unsafe extern "C" fn mem_free(ptr: *mut c_void) -> c_int {
    if LIVE.lock().remove(&(ptr as u64)) {
        SUCCESS
    } else {
        INTERNAL_ERROR
    }
}

unsafe extern "C" fn window_register(
    c: sys::ncclComm_t,
    _ptr: *mut c_void,
    _size: usize,
    win: *mut sys::ncclWindow_t,
    _flags: c_int,
) -> c_int {
    let f = fake(c);
    f.note("ncclCommWindowRegister");
    if f.stuck_register.load(Ordering::SeqCst) {
        // Like a registration whose peer never comes: only a revoke or an abort ends
        // it (the test that sets this bounds the whole test by its own deadline).
        return f.block_until_revoked();
    }
    let window = if f.null_window.load(Ordering::SeqCst) {
        std::ptr::null_mut()
    } else {
        std::ptr::dangling_mut::<u8>().cast()
    };
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *win = window };
    SUCCESS
}

unsafe extern "C" fn window_deregister(c: sys::ncclComm_t, _win: sys::ncclWindow_t) -> c_int {
    fake(c).note("ncclCommWindowDeregister");
    SUCCESS
}

unsafe extern "C" fn all_gather(
    _send: *const c_void,
    _recv: *mut c_void,
    _n: usize,
    _dt: sys::ncclDataType_t,
    c: sys::ncclComm_t,
    _stream: sys::cudaStream_t,
) -> c_int {
    fake(c).collective("ncclAllGather")
}

/// `ncclReduceScatter` (`ALL` false) and `ncclAllReduce` (`ALL` true), which take the
/// same arguments.
unsafe extern "C" fn reduce<const ALL: bool>(
    _send: *const c_void,
    _recv: *mut c_void,
    _n: usize,
    _dt: sys::ncclDataType_t,
    _op: sys::ncclRedOp_t,
    c: sys::ncclComm_t,
    _stream: sys::cudaStream_t,
) -> c_int {
    fake(c).collective(if ALL {
        "ncclAllReduce"
    } else {
        "ncclReduceScatter"
    })
}

unsafe extern "C" fn revoke(c: sys::ncclComm_t, _flags: c_int) -> c_int {
    let f = fake(c);
    f.note("ncclCommRevoke");
    let _g = f.wake_lock.lock();
    f.revokes.fetch_add(1, Ordering::SeqCst);
    f.wake.notify_all();
    SUCCESS
}

/// One `ncclCommGrow` the fake saw: the calling thread, whether it had a parent, the
/// new size, whether it passed an id, the rank it passed.
pub(super) type GrowCall = (ThreadId, bool, c_int, bool, c_int);

/// Every `ncclCommGrow` so far.
pub(super) static GROWS: Mutex<Vec<GrowCall>> = Mutex::new(Vec::new());

unsafe extern "C" fn grow_unique_id(c: sys::ncclComm_t, id: *mut sys::ncclUniqueId) -> c_int {
    fake(c).note("ncclCommGetUniqueId");
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { (*id).internal = [7; 128] };
    SUCCESS
}

unsafe extern "C" fn grow(
    parent: sys::ncclComm_t,
    n: c_int,
    id: *const sys::ncclUniqueId,
    rank: c_int,
    out: *mut sys::ncclComm_t,
    config: *mut sys::ncclConfig_t,
) -> c_int {
    if !parent.is_null() {
        fake(parent).note("ncclCommGrow");
    }
    let call = (
        std::thread::current().id(),
        !parent.is_null(),
        n,
        !id.is_null(),
        rank,
    );
    GROWS.lock().push(call);
    // SAFETY: the caller passes valid pointers.
    let blocking = unsafe { (*config).blocking } != 0;
    // SAFETY: as above.
    unsafe { *out = FakeComm::make(blocking, true) };
    if blocking { SUCCESS } else { ffi::IN_PROGRESS }
}

fn table(with_revoke: bool, with_grow: bool) -> Syms {
    Syms {
        get_unique_id,
        init_rank_config,
        split,
        abort,
        get_async_error,
        count,
        user_rank: zero,
        cu_device: zero,
        error_string,
        last_error,
        mem_alloc,
        mem_free,
        window_register,
        window_deregister,
        all_gather,
        reduce_scatter: reduce::<false>,
        all_reduce: reduce::<true>,
        revoke: with_revoke.then_some(revoke as ffi::RevokeFn),
        grow: with_grow.then_some(ffi::GrowFns {
            unique_id: grow_unique_id,
            grow,
        }),
    }
}

/// The fake function table: NCCL 2.28.7 to 2.29.1 (`with_revoke`) or older.
pub(crate) fn syms(with_revoke: bool) -> &'static Syms {
    static NEW: std::sync::OnceLock<Syms> = std::sync::OnceLock::new();
    static OLD: std::sync::OnceLock<Syms> = std::sync::OnceLock::new();
    if with_revoke {
        NEW.get_or_init(|| table(true, false))
    } else {
        OLD.get_or_init(|| table(false, false))
    }
}

/// The fake function table of NCCL ≥ 2.29.2: `ncclCommGrow` too.
pub(crate) fn syms_with_grow() -> &'static Syms {
    static GROWING: std::sync::OnceLock<Syms> = std::sync::OnceLock::new();
    GROWING.get_or_init(|| table(true, true))
}

/// A fake stream: whether it is "capturing".
#[derive(Debug, Default)]
pub(super) struct FakeStream {
    pub(super) capturing: AtomicBool,
    /// `cuStreamIsCapturing` fails on it.
    pub(super) query_fails: AtomicBool,
    /// `cuEventRecord` fails on it.
    pub(super) record_fails: AtomicBool,
}

/// A fake event: complete unless told otherwise; its query blocks while `held` says.
#[derive(Debug, Clone, Default)]
pub(super) struct FakeEvent {
    pending: Arc<AtomicBool>,
    held: Option<Arc<Held>>,
}

/// A query held until released (a slow `cuEventQuery`).
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) querying: AtomicBool,
    released: Mutex<bool>,
    cv: Condvar,
}

impl Held {
    pub(super) fn release(&self) {
        *self.released.lock() = true;
        self.cv.notify_all();
    }
}

impl FakeEvent {
    /// An event whose query blocks until `held` is released (or 10 s).
    pub(super) fn held(held: Arc<Held>) -> Self {
        FakeEvent {
            pending: Arc::default(),
            held: Some(held),
        }
    }
}

impl Completion for FakeEvent {
    fn complete(&self) -> std::result::Result<bool, String> {
        if let Some(h) = &self.held {
            h.querying.store(true, Ordering::SeqCst);
            let mut released = h.released.lock();
            let until = Deadline::after(Duration::from_secs(10));
            h.cv.wait_while_until(&mut released, |r| !*r, until.instant());
        }
        Ok(!self.pending.load(Ordering::SeqCst))
    }
}

/// A fake device, logging its calls.
#[derive(Default)]
pub(super) struct FakeDevice {
    log: Mutex<Vec<Call>>,
}

impl FakeDevice {
    fn note(&self, name: &'static str) {
        self.log.lock().push((name, std::thread::current().id()));
    }

    /// The names of the calls `thread` made.
    pub(super) fn names_on(&self, thread: ThreadId) -> Vec<&'static str> {
        (self.log.lock().iter())
            .filter(|(_, t)| *t == thread)
            .map(|(n, _)| *n)
            .collect()
    }

    /// Forget the calls so far.
    pub(super) fn clear(&self) {
        self.log.lock().clear();
    }
}

/// A fake CUDA failure of `op` while `flag` is set.
fn fails_if(flag: &AtomicBool, op: &'static str) -> Result<()> {
    if flag.load(Ordering::SeqCst) {
        return Err(crate::error::Error::Cuda {
            op,
            code: 700,
            message: "a fake failure".into(),
        });
    }
    Ok(())
}

impl Device for FakeDevice {
    type Stream = FakeStream;
    type Event = FakeEvent;

    fn raw_stream(&self, _stream: &FakeStream) -> sys::cudaStream_t {
        std::ptr::null_mut()
    }

    fn capturing(&self, stream: &FakeStream) -> Result<bool> {
        self.note("cuStreamIsCapturing");
        fails_if(&stream.query_fails, "cuStreamIsCapturing")?;
        Ok(stream.capturing.load(Ordering::SeqCst))
    }

    fn record(&self, stream: &FakeStream, spare: Option<FakeEvent>) -> Result<FakeEvent> {
        self.note("cuEventRecord");
        fails_if(&stream.record_fails, "cuEventRecord")?;
        Ok(spare.unwrap_or_default())
    }

    fn wait_idle(&self, _stream: &FakeStream, _deadline: Deadline) -> Result<bool> {
        self.note("wait idle");
        Ok(true)
    }

    fn binder(&self) -> Binder {
        Arc::new(|| {})
    }
}

/// A rank of one as the builder makes it, on the fake NCCL: a non-blocking control
/// communicator from a unique id, and `infos`' data communicators split off it
/// (`blocking` as configured), with no watchdog thread yet.
pub(super) fn shared(
    with_revoke: bool,
    infos: &[CommInfo],
    config: NcclConfig,
) -> Result<Arc<Shared<FakeDevice>>> {
    shared_with(with_revoke, infos, config, Health::default())
}

/// [`shared`], with `health` (say, [`Health::watching`] an exchange).
pub(super) fn shared_with(
    with_revoke: bool,
    infos: &[CommInfo],
    config: NcclConfig,
    health: Health,
) -> Result<Arc<Shared<FakeDevice>>> {
    let nccl = syms(with_revoke);
    let deadline = Deadline::after(Duration::from_secs(10));
    let id = ffi::unique_id(nccl)?;
    let control = finish_creation(
        nccl,
        ffi::comm_init(nccl, 1, &id, 0),
        "ncclCommInitRankConfig",
        false,
        deadline,
        None,
        &|| None,
    )?;
    let blocking = config.data_blocking;
    let comms = infos
        .iter()
        .map(|info| {
            // SAFETY: the fake control communicator, used by this thread only.
            let starting =
                unsafe { ffi::comm_split(nccl, control.raw, 0, info.cta_policy, blocking) };
            finish_creation(
                nccl,
                starting,
                "ncclCommSplit",
                blocking,
                deadline,
                Some(&control),
                &|| None,
            )
        })
        .collect::<Result<Vec<Comm>>>()?;
    Ok(Arc::new(Shared {
        rank: 0,
        world: 1,
        device: FakeDevice::default(),
        nccl,
        control: Some(control),
        comms,
        health,
        watch: Mutex::default(),
        config,
    }))
}

#[cfg(test)]
mod tests;
