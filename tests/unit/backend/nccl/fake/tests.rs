//! The fake NCCL's tests: what the backend's communicator, gate, watchdog and warm-up
//! layers call, shown without a GPU.

use super::*;
use crate::backend::CommRole;
use crate::backend::nccl::build::Builder;
use crate::backend::nccl::comm::Bound;
use crate::backend::nccl::ffi::{CollCall, CollKind};
use crate::backend::nccl::health::{Cause, POLLS};
use crate::backend::nccl::setup::Placement;
use crate::backend::nccl::warmup::{WARM_LARGE_BYTES, WARM_SMALL_BYTES};
use crate::backend::nccl::warmup::{WarmCollective, WarmedPath};
use crate::backend::nccl::watchdog::Watchdog;
use crate::control::{ChannelId, Exchange, LocalExchange, LostPeer};
use crate::error::{Error, NcclVersion};
use std::time::Instant;

fn call(kind: CollKind) -> CollCall {
    CollCall {
        kind,
        send: 0x1000,
        recv: 0x2000,
        count: 16,
        dtype: sys::ncclDataType_t::ncclFloat32,
    }
}

const REDUCE: CollKind = CollKind::ReduceScatter(sys::ncclRedOp_t::ncclSum);

fn polls() -> u64 {
    POLLS.with(|p| p.get())
}

#[test]
fn data_communicators_are_blocking_and_split_through_the_control_one() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let control = s.control.as_ref().unwrap();
    assert!(!comm(control.raw).blocking && !control.blocking);
    for c in &s.comms {
        assert!(c.blocking && comm(c.raw).blocking, "config.blocking = 1");
    }
    let names: Vec<_> = comm(control.raw).calls().into_iter().map(|c| c.0).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "ncclCommSplit").count(),
        3,
        "{names:?}"
    );
    assert!(
        names.contains(&"ncclCommGetAsyncError"),
        "each split is polled through the non-blocking parent: {names:?}"
    );
    let nb = shared(
        true,
        &CommInfo::STANDARD,
        NcclConfig::default().with_data_blocking(false),
    )
    .unwrap();
    assert!(
        nb.comms
            .iter()
            .all(|c| !c.blocking && !comm(c.raw).blocking)
    );
}

/// A non-blocking control communicator of the fake, made as the builder makes it.
fn control() -> Comm {
    let nccl = syms(true);
    let id = ffi::unique_id(nccl).unwrap();
    let deadline = Deadline::after(Duration::from_secs(10));
    let starting = ffi::comm_init(nccl, 1, &id, 0);
    finish_creation(
        nccl,
        starting,
        "ncclCommInitRankConfig",
        false,
        deadline,
        None,
        &|| None,
    )
    .unwrap()
}

fn split_blocking(control: &Comm, deadline: Deadline) -> Result<Comm> {
    split_blocking_watched(control, deadline, &|| None)
}

/// As [`split_blocking`], ended early by the loss `lost` says.
fn split_blocking_watched(
    control: &Comm,
    deadline: Deadline,
    lost: &dyn Fn() -> Option<Error>,
) -> Result<Comm> {
    let nccl = syms(true);
    // SAFETY: the fake control communicator, used by this thread only.
    let starting =
        unsafe { ffi::comm_split(nccl, control.raw, 0, ffi::NCCL_CTA_POLICY_DEFAULT, true) };
    finish_creation(
        nccl,
        starting,
        "ncclCommSplit",
        true,
        deadline,
        Some(control),
        lost,
    )
}

#[test]
fn a_split_off_a_non_blocking_parent_is_read_only_once_the_parent_says_done() {
    let control = control();
    let parent = comm(control.raw);
    // NCCL's thread writes the child before `ncclCommSplit` returned `ncclSuccess`,
    // while its job still runs: the child must not be polled or used yet.
    parent.early_split_write.store(true, Ordering::SeqCst);
    let child = split_blocking(&control, Deadline::after(Duration::from_secs(10))).unwrap();
    let c = comm(child.raw);
    assert!(!c.used_unready.load(Ordering::SeqCst), "{:?}", c.calls());
    assert!(c.calls().is_empty(), "{:?}", c.calls());
    let names: Vec<_> = parent.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(
        names[names.len() - 2..],
        ["ncclCommSplit", "ncclCommGetAsyncError"],
        "the parent is polled: {names:?}"
    );
    assert_eq!(*parent.last_child.lock(), Some(child.raw.0 as usize));
}

#[test]
fn a_split_that_times_out_aborts_the_parent_then_the_child() {
    let control = control();
    let parent = comm(control.raw);
    parent.stuck_split.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = split_blocking(&control, Deadline::after(Duration::from_millis(50)));
    assert!(
        matches!(
            r,
            Err(Error::NcclTimeout {
                op: "ncclCommSplit",
                ..
            })
        ),
        "{:?}",
        r.err()
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(control.is_aborted());
    let names: Vec<_> = parent.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(names.last(), Some(&"ncclCommAbort"), "{names:?}");
    let child = comm(RawComm(
        parent.last_child.lock().expect("a child") as sys::ncclComm_t
    ));
    // Aborted once the parent's abort returned (the job then wrote it), and not
    // touched before.
    let deadline = Deadline::after(Duration::from_secs(10));
    let mut g = child.wake_lock.lock();
    child.wake.wait_while_until(
        &mut g,
        |_| !child.aborted.load(Ordering::SeqCst),
        deadline.instant(),
    );
    drop(g);
    let names: Vec<_> = child.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(names, vec!["ncclCommAbort"]);
    assert!(!child.used_unready.load(Ordering::SeqCst));
}

#[test]
fn a_creation_waiting_on_a_lost_peer_ends_with_the_loss_not_at_its_deadline() {
    // A shrink's set-up: a survivor lost while NCCL makes the new communicators never
    // comes; the exchange's verdict ends the wait, long before the deadline.
    let control = control();
    let parent = comm(control.raw);
    parent.stuck_split.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let lost = || {
        Some(Error::PeerLost {
            rank: 2,
            op: "shrink",
            detail: "frozen".into(),
        })
    };
    let r = split_blocking_watched(&control, Deadline::after(Duration::from_secs(600)), &lost);
    assert!(
        matches!(r, Err(Error::PeerLost { rank: 2, .. })),
        "{:?}",
        r.err()
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // As after a timeout: the parent is aborted, which ends NCCL's job.
    assert!(control.is_aborted());
}

#[test]
fn a_collective_on_a_data_communicator_is_the_enqueue_and_the_event_record() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let me = std::thread::current().id();
    let stream = FakeStream::default();
    for (c, kind, name) in [
        (0, CollKind::AllGather, "ncclAllGather"),
        (0, REDUCE, "ncclReduceScatter"),
        (1, CollKind::AllGather, "ncclAllGather"),
        (2, REDUCE, "ncclReduceScatter"),
    ] {
        let f = comm(s.comms[c].raw);
        f.clear();
        s.device.clear();
        let before = polls();
        // SAFETY: the fake never touches the addresses.
        unsafe { s.collective(c, &call(kind), &stream, Bound::Watchdog) }.unwrap();
        // The NCCL call, inline on this thread, and nothing else on the
        // communicator (no ncclCommGetAsyncError) from any thread.
        assert_eq!(f.names_on(me), vec![name]);
        assert_eq!(f.calls().len(), 1, "{:?}", f.calls());
        // The completion event (after the capture query), on this thread.
        assert_eq!(
            s.device.names_on(me),
            vec!["cuStreamIsCapturing", "cuEventRecord"]
        );
        assert_eq!(polls(), before, "no polling loop, so no sleep");
    }
    // The same call on a non-blocking data communicator is polled.
    let nb = shared(
        true,
        &CommInfo::STANDARD,
        NcclConfig::default().with_data_blocking(false),
    )
    .unwrap();
    let f = comm(nb.comms[0].raw);
    f.clear();
    let before = polls();
    // SAFETY: as above.
    unsafe { nb.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) }.unwrap();
    assert_eq!(
        f.names_on(me),
        vec!["ncclAllGather", "ncclCommGetAsyncError"]
    );
    assert_eq!(polls(), before + 1);
}

#[test]
fn a_collective_under_capture_takes_the_same_nccl_calls_and_records_no_event() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let me = std::thread::current().id();
    let stream = FakeStream::default();
    let mut seen = Vec::new();
    for capturing in [false, true] {
        stream.capturing.store(capturing, Ordering::SeqCst);
        let f = comm(s.comms[0].raw);
        f.clear();
        s.device.clear();
        s.watch.lock().clear();
        // SAFETY: the fake never touches the addresses.
        unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) }.unwrap();
        // SAFETY: as above.
        unsafe { s.collective(0, &call(REDUCE), &stream, Bound::Watchdog) }.unwrap();
        seen.push(f.names_on(me));
        let device = s.device.names_on(me);
        if capturing {
            assert_eq!(device, vec!["cuStreamIsCapturing"; 2]);
        } else {
            assert_eq!(device.iter().filter(|n| **n == "cuEventRecord").count(), 2);
        }
    }
    assert_eq!(seen[0], seen[1]);
    assert_eq!(seen[0], vec!["ncclAllGather", "ncclReduceScatter"]);
}

#[test]
fn a_bad_communicator_index_is_named() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let stream = FakeStream::default();
    // SAFETY: the fake never touches the addresses.
    let r = unsafe { s.collective(7, &call(CollKind::AllGather), &stream, Bound::Watchdog) };
    match r {
        Err(Error::InvalidCollective { op, detail }) => {
            assert_eq!(op, "ncclAllGather");
            assert!(
                detail.contains("index 7") && detail.contains('3'),
                "{detail}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_collective_never_waits_behind_the_watchdogs_event_queries() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let held = Arc::new(Held::default());
    s.watch
        .lock()
        .pending
        .push_back(crate::backend::nccl::health::Enqueued {
            op: "ncclAllGather",
            comm: 0,
            at: Instant::now(),
            done: FakeEvent::held(held.clone()),
        });
    let ticking = {
        let s = s.clone();
        std::thread::spawn(move || s.tick())
    };
    let deadline = Deadline::after(Duration::from_secs(5));
    while !held.querying.load(Ordering::SeqCst) && !deadline.expired() {
        std::thread::yield_now();
    }
    assert!(held.querying.load(Ordering::SeqCst));
    // The watchdog is inside a query: a collective still records its event.
    let (tx, rx) = std::sync::mpsc::channel();
    let caller = {
        let s = s.clone();
        std::thread::spawn(move || {
            let stream = FakeStream::default();
            // SAFETY: the fake never touches the addresses.
            let r =
                unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) };
            let _ = tx.send(r.is_ok());
        })
    };
    let done = rx.recv_timeout(Duration::from_secs(5));
    held.release();
    ticking.join().unwrap();
    caller.join().unwrap();
    assert_eq!(done, Ok(true), "the collective waited behind the query");
    assert_eq!(
        s.watch.lock().len(),
        1,
        "the queried event was complete; the one pushed meanwhile is kept"
    );
}

#[test]
fn an_unwatched_collective_stuck_inside_nccl_is_bounded_by_the_call_timeout() {
    let (s, _watchdog, call_timeout) = watched(true);
    let stream = FakeStream::default();
    // Under capture no event is recorded: the gate carries the deadline.
    stream.capturing.store(true, Ordering::SeqCst);
    comm(s.comms[0].raw)
        .stuck_collective
        .store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    // SAFETY: the fake never touches the addresses.
    let r = unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) };
    let took = t0.elapsed();
    assert!(
        matches!(
            r,
            Err(Error::NcclTimeout {
                op: "ncclAllGather",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(took < call_timeout + Duration::from_secs(1), "{took:?}");
    aborted(&s);
}

#[test]
fn a_failed_set_up_aborts_its_communicators_together() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let fakes: Vec<&FakeComm> = s.all_comms().map(|c| comm(c.raw)).collect();
    // Each abort returns only once all four run at once (or after 2 s each).
    let r = Rendezvous::new(fakes.len());
    for f in &fakes {
        *f.abort_rendezvous.lock() = Some(r.clone());
    }
    let t0 = Instant::now();
    drop(Arc::try_unwrap(s).ok().expect("one owner"));
    let took = t0.elapsed();
    for f in &fakes {
        assert!(f.aborted.load(Ordering::SeqCst));
    }
    assert!(
        took < Duration::from_secs(1),
        "aborted one after another: {took:?}"
    );
}

/// A backend of the standard communicators with a 300 ms call timeout, watched every
/// 10 ms: the backend, its watchdog and the call timeout.
fn watched(with_revoke: bool) -> (Arc<Shared<FakeDevice>>, Watchdog, Duration) {
    let call_timeout = Duration::from_millis(300);
    let config = NcclConfig::default()
        .with_call_timeout(call_timeout)
        .with_watchdog_interval(Duration::from_millis(10));
    let s = shared(with_revoke, &CommInfo::STANDARD, config).unwrap();
    let watchdog = Watchdog::spawn(&s).unwrap();
    (s, watchdog, call_timeout)
}

/// Wait (boundedly) until every communicator of `s` was aborted and its abort
/// returned.
fn aborted(s: &Shared<FakeDevice>) {
    let deadline = Deadline::after(Duration::from_secs(10));
    for c in s.all_comms() {
        assert_eq!(c.aborted_by(deadline), Some(true));
    }
}

fn stuck_registration(with_revoke: bool) -> (Vec<&'static str>, Duration, Result<()>) {
    stuck_registration_of(with_revoke, false).0
}

/// A registration stuck until revoked or aborted (reaching NCCL only after the first
/// revoke when `late`); what the communicator saw, how long the call took, its
/// result, and whether the abort ended it.
fn stuck_registration_of(
    with_revoke: bool,
    late: bool,
) -> ((Vec<&'static str>, Duration, Result<()>), bool) {
    let (s, _watchdog, call_timeout) = watched(with_revoke);
    let f = comm(s.comms[0].raw);
    f.stuck_register.store(true, Ordering::SeqCst);
    f.late_register.store(late, Ordering::SeqCst);
    let t0 = Instant::now();
    // SAFETY: the fake never touches the memory.
    let r = unsafe { s.register(0, 0x1000, 2 << 20, s.call_deadline()) }.map(|_| ());
    let took = t0.elapsed();
    aborted(&s);
    assert!(took >= call_timeout, "{took:?}");
    let names = f.calls().into_iter().map(|c| c.0).collect();
    let by_abort = f.register_ended_by_abort.load(Ordering::SeqCst);
    ((names, took, r), by_abort)
}

#[test]
fn a_thread_that_reaches_nccl_after_the_first_revoke_is_revoked_again() {
    let ((names, took, r), by_abort) = stuck_registration_of(true, true);
    assert!(matches!(r, Err(Error::NcclTimeout { .. })), "{r:?}");
    assert!(!by_abort, "revoked out before the abort: {names:?}");
    let revokes = names.iter().filter(|n| **n == "ncclCommRevoke").count();
    assert!(revokes >= 2, "{names:?}");
    assert!(
        took < Duration::from_millis(300) + Duration::from_secs(1),
        "{took:?}"
    );
}

#[test]
fn a_registration_stuck_past_its_deadline_is_revoked_then_aborted() {
    let (names, took, r) = stuck_registration(true);
    assert!(
        matches!(
            r,
            Err(Error::NcclTimeout {
                op: "ncclCommWindowRegister",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        took < Duration::from_millis(300) + Duration::from_secs(1),
        "{took:?}"
    );
    let at = |n| names.iter().position(|x| *x == n);
    let (revoke, abort) = (at("ncclCommRevoke"), at("ncclCommAbort"));
    assert!(revoke.is_some() && abort.is_some(), "{names:?}");
    assert!(revoke < abort, "revoked, then aborted: {names:?}");
}

#[test]
fn without_revoke_the_watchdog_aborts_directly() {
    let (names, took, r) = stuck_registration(false);
    assert!(matches!(r, Err(Error::NcclTimeout { .. })), "{r:?}");
    assert!(
        took < Duration::from_millis(300) + Duration::from_secs(1),
        "{took:?}"
    );
    assert!(!names.contains(&"ncclCommRevoke"), "{names:?}");
    assert!(names.contains(&"ncclCommAbort"), "{names:?}");
}

#[test]
fn after_an_abort_no_window_is_deregistered() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    // SAFETY: the fake never touches the memory.
    let w = unsafe { s.register(0, 0x1000, 2 << 20, s.call_deadline()) }
        .unwrap()
        .expect("a window");
    let _ = s.fail(Cause::Failed("a test breaks it".into()));
    aborted(&s);
    // SAFETY: registered on communicator 0 above.
    assert!(unsafe { s.deregister(0, w, s.call_deadline()) }.is_ok());
    let names: Vec<_> = comm(s.comms[0].raw)
        .calls()
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert!(!names.contains(&"ncclCommWindowDeregister"), "{names:?}");
    assert!(names.contains(&"ncclCommAbort"));
    assert!(
        s.may_free().is_ok(),
        "the aborts returned: segments may be freed"
    );
    // A broken backend starts no call at all.
    // SAFETY: the fake never touches the memory.
    assert!(unsafe { s.register(0, 0x1000, 2 << 20, s.call_deadline()) }.is_err());
}

/// What the path policy (`coll`) can choose on a communicator of `role`: the copy
/// engine runs all-gathers on the copy-engine communicator; the symmetric kernels
/// all-gather, reduce-scatter and all-reduce on the symmetric one; the plain
/// kernels the same three on the plain one.
fn policy_can_choose(role: CommRole) -> Vec<WarmCollective> {
    match role {
        CommRole::CopyEngine => vec![WarmCollective::AllGather],
        CommRole::Symmetric | CommRole::Plain => vec![
            WarmCollective::AllGather,
            WarmCollective::ReduceScatter,
            WarmCollective::AllReduce,
        ],
    }
}

#[test]
fn the_warm_up_covers_every_path_the_policy_can_choose() {
    let infos = CommInfo::STANDARD;
    let s = shared(true, &infos, NcclConfig::default()).unwrap();
    let _watchdog = Watchdog::spawn(&s).unwrap();
    let stream = FakeStream::default();
    let deadline = Deadline::after(Duration::from_secs(10));
    let warmed = s.warm_up(&infos, &stream, 2 << 20, deadline).unwrap();
    let segment = LAST_ALLOC.with(std::cell::Cell::get);
    assert!(!live(segment), "the warm-up's segment is freed");
    let sizes = [WARM_SMALL_BYTES, WARM_LARGE_BYTES];
    const { assert!(WARM_LARGE_BYTES >= 4 << 20) };
    let expected: BTreeSet<_> = infos
        .iter()
        .enumerate()
        .flat_map(|(c, info)| {
            policy_can_choose(info.role)
                .into_iter()
                .flat_map(move |w| sizes.map(|b| (c, format!("{w:?}"), b)))
        })
        .collect();
    let got: BTreeSet<_> = warmed
        .iter()
        .map(|w: &WarmedPath| {
            assert_eq!(infos[w.comm].role, w.role);
            (w.comm, format!("{:?}", w.collective), w.bytes_per_rank)
        })
        .collect();
    assert_eq!(got, expected);
    assert_eq!(warmed.len(), expected.len(), "each once");
    let names = |c: usize| -> Vec<&'static str> {
        comm(s.comms[c].raw)
            .calls()
            .into_iter()
            .map(|c| c.0)
            .collect()
    };
    for (c, info) in infos.iter().enumerate() {
        let mut want: Vec<&str> = Vec::new();
        if info.registers {
            want.push("ncclCommWindowRegister");
        }
        for _ in sizes {
            want.extend(policy_can_choose(info.role).iter().map(|w| match w {
                WarmCollective::AllGather => "ncclAllGather",
                WarmCollective::ReduceScatter => "ncclReduceScatter",
                WarmCollective::AllReduce => "ncclAllReduce",
            }));
        }
        if info.registers {
            want.push("ncclCommWindowDeregister");
        }
        assert_eq!(names(c), want, "communicator {c} ({:?})", info.role);
    }
    assert!(s.health.check().is_ok());
}

#[test]
fn a_failed_warm_up_releases_its_windows_and_segment() {
    let infos = CommInfo::STANDARD;
    let s = shared(true, &infos, NcclConfig::default()).unwrap();
    let _watchdog = Watchdog::spawn(&s).unwrap();
    let plain = infos.iter().position(|i| !i.registers).unwrap();
    // ncclInvalidArgument: the call fails, the backend does not break.
    comm(s.comms[plain].raw)
        .collective_result
        .store(4, Ordering::SeqCst);
    let stream = FakeStream::default();
    let deadline = Deadline::after(Duration::from_secs(10));
    let r = s.warm_up(&infos, &stream, 2 << 20, deadline);
    assert!(matches!(r, Err(Error::Nccl { code: 4, .. })), "{r:?}");
    assert!(s.health.check().is_ok());
    assert!(
        !live(LAST_ALLOC.with(std::cell::Cell::get)),
        "segment freed"
    );
    for (c, info) in infos.iter().enumerate().filter(|(_, i)| i.registers) {
        let names: Vec<_> = comm(s.comms[c].raw)
            .calls()
            .into_iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(
            names.last(),
            Some(&"ncclCommWindowDeregister"),
            "{c} {info:?}"
        );
    }
}

#[test]
fn a_failed_device_call_around_an_enqueue_never_runs_the_collective_twice() {
    let s = shared(true, &CommInfo::STANDARD, NcclConfig::default()).unwrap();
    let stream = FakeStream::default();
    let f = comm(s.comms[0].raw);
    let gathers = |f: &FakeComm| f.calls().iter().filter(|c| c.0 == "ncclAllGather").count();
    let gather = || {
        // SAFETY: the fake never touches the addresses.
        unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) }
    };
    // Before the enqueue (the capture query): the call fails, nothing is enqueued,
    // the backend stays usable.
    stream.query_fails.store(true, Ordering::SeqCst);
    let r = gather();
    assert!(matches!(r, Err(Error::Cuda { .. })), "{r:?}");
    assert_eq!(gathers(f), 0, "nothing enqueued: {:?}", f.calls());
    assert!(!s.health.is_broken());
    stream.query_fails.store(false, Ordering::SeqCst);
    // After it (the completion event): the collective is enqueued but unwatched, so
    // the backend breaks and aborts every communicator; a retry is refused before it
    // reaches NCCL. (The aborts run on their own threads: count only the collective.)
    stream.record_fails.store(true, Ordering::SeqCst);
    let message = gather().unwrap_err().to_string();
    assert!(message.contains("enqueued"), "{message}");
    assert_eq!(gathers(f), 1, "enqueued once");
    assert!(s.health.is_broken());
    assert!(s.comms.iter().all(|c| c.is_aborted()));
    stream.record_fails.store(false, Ordering::SeqCst);
    assert!(gather().is_err());
    assert_eq!(gathers(f), 1, "never twice");
}

#[test]
fn a_null_window_is_no_window_and_the_communicator_stays_usable() {
    // NCCL 2.29+ under NCCL_HOSTID answers a registration with a NULL window: the
    // segment is not registered there (the pool then takes the plain path), nothing is
    // to deregister, and the backend is not broken. On a blocking communicator and on
    // a non-blocking one (whose slot is read once NCCL says the call is done).
    for blocking in [true, false] {
        let config = NcclConfig::default().with_data_blocking(blocking);
        let s = shared(true, &CommInfo::STANDARD, config).unwrap();
        let f = comm(s.comms[0].raw);
        f.null_window.store(true, Ordering::SeqCst);
        for _ in 0..2 {
            // SAFETY: the fake never touches the memory.
            let w = unsafe { s.register(0, 0x1000, 2 << 20, s.call_deadline()) };
            assert!(matches!(w, Ok(None)), "blocking {blocking}: {w:?}");
        }
        assert!(s.health.check().is_ok());
        let stream = FakeStream::default();
        // SAFETY: the fake never touches the addresses.
        unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) }.unwrap();
        let names: Vec<_> = f.calls().into_iter().map(|c| c.0).collect();
        assert_eq!(
            names
                .iter()
                .filter(|n| **n == "ncclCommWindowRegister")
                .count(),
            2,
            "{names:?}"
        );
        assert!(!names.contains(&"ncclCommWindowDeregister"), "{names:?}");
    }
}

/// An exchange whose only use is its word on lost peers (set by the test), kept
/// back from the first `hidden` questions (a verdict that comes late).
#[derive(Debug, Default)]
struct Verdict(Mutex<Option<LostPeer>>, std::sync::atomic::AtomicUsize);

impl Verdict {
    fn lose(&self, rank: usize, detail: &str, left: bool) {
        *self.0.lock() = Some(LostPeer {
            rank,
            detail: detail.into(),
            left,
            this_rank: false,
        });
    }
}

impl Exchange for Verdict {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_gather(
        &self,
        _channel: ChannelId,
        op: &'static str,
        _payload: &[u8],
        _deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        Err(Error::Internal {
            what: format!("{op}: this test exchange runs no rounds"),
        })
    }
    fn open_channel(&self, _name: &str, _deadline: Deadline) -> Result<ChannelId> {
        Err(Error::Internal {
            what: "this test exchange opens no channels".into(),
        })
    }
    fn lost_peer(&self) -> Option<LostPeer> {
        let hidden = &self.1;
        if hidden.load(Ordering::SeqCst) > 0 {
            hidden.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        self.0.lock().clone()
    }
}

/// A backend of the standard communicators watched every 10 ms, with a 60 s call
/// timeout (far beyond the test's bounds), naming lost peers as `verdict` says.
fn watching(
    with_revoke: bool,
    verdict: &Arc<Verdict>,
) -> (Arc<Shared<FakeDevice>>, Watchdog, Arc<dyn Exchange>) {
    let exchange: Arc<dyn Exchange> = verdict.clone();
    let config = NcclConfig::default()
        .with_call_timeout(Duration::from_secs(60))
        .with_watchdog_interval(Duration::from_millis(10));
    let health = Health::watching(&exchange);
    let s = shared_with(with_revoke, &CommInfo::STANDARD, config, health).unwrap();
    let watchdog = Watchdog::spawn(&s).unwrap();
    (s, watchdog, exchange)
}

/// Wait (boundedly) until a thread is inside NCCL on data communicator `c`.
fn until_inside(s: &Shared<FakeDevice>, c: usize) {
    let deadline = Deadline::after(Duration::from_secs(10));
    while s.comms[c].inside().is_none() && !deadline.expired() {
        std::thread::yield_now();
    }
    assert!(s.comms[c].inside().is_some(), "never inside NCCL");
}

#[test]
fn a_call_blocked_on_a_lost_peer_ends_with_peer_lost_within_an_interval() {
    // The frozen peer of the issue: the exchange declares rank 1 lost (no heartbeat)
    // while this rank is blocked inside NCCL (an enqueue behind stuck work, or a
    // registration waiting for the peer); the watchdog revokes and aborts, and the
    // call returns `PeerLost` naming rank 1, within the interval plus the time a
    // thread is given to leave NCCL, far from the watchdog and call timeouts. With
    // and without `ncclCommRevoke`.
    for with_revoke in [true, false] {
        for op in ["ncclAllGather", "ncclCommWindowRegister"] {
            let verdict = Arc::new(Verdict::default());
            let (s, _watchdog, _exchange) = watching(with_revoke, &verdict);
            let f = comm(s.comms[0].raw);
            let collective = op == "ncclAllGather";
            if collective {
                f.stuck_collective.store(true, Ordering::SeqCst);
            } else {
                f.stuck_register.store(true, Ordering::SeqCst);
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let caller = {
                let s = s.clone();
                std::thread::spawn(move || {
                    let stream = FakeStream::default();
                    let r = if collective {
                        // SAFETY: the fake never touches the addresses.
                        unsafe {
                            s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog)
                        }
                    } else {
                        // SAFETY: as above.
                        unsafe { s.register(0, 0x1000, 2 << 20, s.call_deadline()) }.map(|_| ())
                    };
                    let _ = tx.send((r, Instant::now()));
                })
            };
            until_inside(&s, 0);
            let lost_at = Instant::now();
            verdict.lose(
                1,
                "no heartbeat for 5.1s (frozen or stopped, e.g. SIGSTOP)",
                false,
            );
            let (r, returned) = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("the blocked call returned");
            caller.join().unwrap();
            let took = returned.duration_since(lost_at);
            match &r {
                Err(Error::PeerLost {
                    rank: 1,
                    op: o,
                    detail,
                }) => {
                    assert_eq!(*o, op);
                    assert!(detail.contains("no heartbeat"), "{detail}");
                }
                other => panic!("{with_revoke} {op}: {other:?}"),
            }
            // Interval (10 ms) + at most LEAVE_WAIT (0.5 s), with slack for a busy
            // machine; the call timeout is 60 s and the watchdog timeout 10 min.
            assert!(
                took < Duration::from_secs(3),
                "{with_revoke} {op}: {took:?}"
            );
            aborted(&s);
            let names: Vec<_> = f.calls().into_iter().map(|c| c.0).collect();
            assert_eq!(names.contains(&"ncclCommRevoke"), with_revoke, "{names:?}");
            // Every later call names the lost rank too.
            let stream = FakeStream::default();
            // SAFETY: as above.
            let again = unsafe { s.collective(1, &call(REDUCE), &stream, Bound::Watchdog) };
            assert!(
                matches!(again, Err(Error::PeerLost { rank: 1, .. })),
                "{again:?}"
            );
        }
    }
}

#[test]
fn a_peer_that_left_breaks_the_backend_only_with_work_in_flight() {
    let verdict = Arc::new(Verdict::default());
    let exchange: Arc<dyn Exchange> = verdict.clone();
    let health = Health::watching(&exchange);
    let s = shared_with(true, &CommInfo::STANDARD, NcclConfig::default(), health).unwrap();
    // Nothing lost: the watchdog's look changes nothing.
    s.tick();
    assert!(s.health.check().is_ok());
    // Rank 1 finished and closed its exchange: with nothing in flight here, the end
    // of a job, not a failure.
    verdict.lose(1, "it closed its exchange (it finished)", true);
    s.tick();
    assert!(s.health.check().is_ok(), "{:?}", s.health.check());
    // A collective not complete on the device may wait for it: broken, naming it.
    let pending = FakeEvent::default();
    pending.pending.store(true, Ordering::SeqCst);
    s.watch
        .lock()
        .pending
        .push_back(crate::backend::nccl::health::Enqueued {
            op: "ncclAllGather",
            comm: 0,
            at: Instant::now(),
            done: pending,
        });
    s.tick();
    match s.health.check() {
        Err(Error::PeerLost {
            rank: 1, detail, ..
        }) => assert!(detail.contains("closed")),
        other => panic!("{other:?}"),
    }
    aborted(&s);
}

#[test]
fn a_backend_broken_by_nccls_error_names_the_lost_peer_behind_it() {
    let verdict = Arc::new(Verdict::default());
    let exchange: Arc<dyn Exchange> = verdict.clone();
    let health = Health::watching(&exchange);
    let s = shared_with(true, &CommInfo::STANDARD, NcclConfig::default(), health).unwrap();
    let stream = FakeStream::default();
    let gather = |c: usize| {
        // SAFETY: the fake never touches the addresses.
        unsafe { s.collective(c, &call(CollKind::AllGather), &stream, Bound::Watchdog) }
    };
    // The peer's death reaches NCCL (an internal error from the call) and the
    // exchange: the call reports the lost rank, with NCCL's error in the detail.
    comm(s.comms[0].raw)
        .collective_result
        .store(3, Ordering::SeqCst);
    verdict.lose(
        0,
        "the connection to the store server closed (rank 0 was killed)",
        false,
    );
    match gather(0) {
        Err(Error::PeerLost {
            rank: 0,
            op,
            detail,
        }) => {
            assert_eq!(op, "ncclAllGather");
            assert!(detail.contains("fake NCCL error"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    assert!(s.health.is_broken());
    assert!(matches!(gather(1), Err(Error::PeerLost { rank: 0, .. })));
    aborted(&s);
    // Without a lost peer the same failure is NCCL's error, as before (after the
    // bounded wait for the exchange's word).
    let verdict = Arc::new(Verdict::default());
    let exchange: Arc<dyn Exchange> = verdict.clone();
    let health = Health::watching(&exchange);
    let s = shared_with(true, &CommInfo::STANDARD, NcclConfig::default(), health).unwrap();
    comm(s.comms[0].raw)
        .collective_result
        .store(3, Ordering::SeqCst);
    let t0 = Instant::now();
    // SAFETY: as above.
    let r = unsafe { s.collective(0, &call(CollKind::AllGather), &stream, Bound::Watchdog) };
    assert!(matches!(r, Err(Error::Nccl { code: 3, .. })), "{r:?}");
    assert!(t0.elapsed() >= crate::backend::nccl::health::PEER_VERDICT_WAIT);
    // A verdict that comes later still names the rank on every later call.
    verdict.lose(1, "no heartbeat", false);
    assert!(matches!(
        s.health.check(),
        Err(Error::PeerLost { rank: 1, .. })
    ));
    aborted(&s);
}

#[test]
fn an_asynchronous_error_that_beats_the_verdict_is_blamed_on_the_lost_peer() {
    // Seen on one H200: a killed peer's closed socket reached NCCL (an asynchronous
    // error) 26 ms before the store declared it lost. The watchdog waits (boundedly)
    // for the verdict, and the backend breaks naming the rank, not NCCL's error.
    let verdict = Arc::new(Verdict::default());
    let exchange: Arc<dyn Exchange> = verdict.clone();
    let health = Health::watching(&exchange);
    let s = shared_with(true, &CommInfo::STANDARD, NcclConfig::default(), health).unwrap();
    // ncclRemoteError: "remote process exited or there was a network error".
    comm(s.comms[0].raw).async_error.store(6, Ordering::SeqCst);
    verdict.lose(1, "its connection failed: Connection reset by peer", false);
    // Kept from the watchdog's first look and the first poll after NCCL's error.
    verdict.1.store(2, Ordering::SeqCst);
    s.tick();
    match s.health.cause() {
        Some(Cause::PeerLost { rank: 1, detail }) => {
            assert!(detail.contains("asynchronous error"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.health.check(),
        Err(Error::PeerLost { rank: 1, .. })
    ));
    aborted(&s);
}

#[test]
fn a_shrink_aborts_the_old_set_then_makes_a_new_one_over_the_shrunk_exchange() {
    // One rank of one (the fake's world): its exchange shrinks into a group of the
    // same size, which is all a shrink needs here. With and without `ncclCommRevoke`,
    // and with `ncclCommGrow` (which a shrink does not use).
    for (with_revoke, nccl) in [
        (true, syms(true)),
        (false, syms(false)),
        (true, syms_with_grow()),
    ] {
        let old: Arc<dyn Exchange> = Arc::new(LocalExchange::group(1).remove(0));
        let health = Health::watching(&old);
        let config = NcclConfig::default();
        let s = shared_with(with_revoke, &CommInfo::STANDARD, config, health).unwrap();
        // A window on each communicator that registers, as the old pool holds them.
        let windows: Vec<_> = (0..2)
            .map(|c| {
                // SAFETY: the fake never touches the address.
                let w = unsafe { s.register(c, 0x1000, 2 << 20, s.call_deadline()) };
                (c, w.unwrap().expect("a window"))
            })
            .collect();
        let old_comms: Vec<&FakeComm> = s.all_comms().map(|c| comm(c.raw)).collect();
        old_comms.iter().for_each(|f| f.clear());
        let next = old
            .shrink(Deadline::after(Duration::from_secs(10)))
            .unwrap();
        let b = Builder {
            watch: None,
            version: NcclVersion::new(2, 28, 9),
            nccl,
            config,
            deadline: Deadline::after(Duration::from_secs(10)),
        };
        let (control, comms, placement) = b.survivors(&s, next.as_ref(), &[7; 16], false).unwrap();
        // The old pool's windows go with their communicators: nothing is called.
        for (c, w) in windows {
            // SAFETY: registered on `c` above; no work uses it.
            assert!(unsafe { s.deregister(c, w, s.call_deadline()) }.is_ok());
        }
        // Every old communicator was aborted, a blocking data one revoked first where
        // NCCL can; no window was deregistered on any of them.
        let revoke_first: &[&str] = match with_revoke {
            true => &["ncclCommRevoke", "ncclCommAbort"],
            false => &["ncclCommAbort"],
        };
        let (data, control_old) = old_comms.split_at(s.comms.len());
        for f in data {
            let names: Vec<_> = f.stamped().into_iter().map(|(n, _)| n).collect();
            assert_eq!(names, revoke_first, "with_revoke: {with_revoke}");
        }
        let names: Vec<_> = control_old[0]
            .stamped()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["ncclCommAbort"]);
        // The new set: a control communicator of its own, the data ones split off it
        // after every old abort returned.
        let last_abort = (old_comms.iter().flat_map(|f| f.stamped()))
            .map(|(_, t)| t)
            .max()
            .unwrap();
        let new_control = comm(control.raw);
        let made: Vec<_> = new_control.stamped();
        let splits = made.iter().filter(|(n, _)| *n == "ncclCommSplit").count();
        assert_eq!(splits, comms.len());
        assert!(made.iter().all(|(_, t)| *t > last_abort), "{made:?}");
        assert_eq!(comms.len(), s.comms.len());
        for (new, old) in comms.iter().map(|(_, c)| c).zip(&s.comms) {
            assert!(!new.is_aborted());
            assert_ne!(new.raw.0, old.raw.0);
        }
        assert_eq!(placement, Placement::ONE_NODE, "one rank, one GPU");
        // The set-up round went over the shrunk exchange (its first channel); the old
        // exchange refuses every call.
        let after = next.open_channel("after", Deadline::after(Duration::from_secs(10)));
        assert_eq!(after.unwrap().ordinal(), 2);
        let refused = old.all_gather(ChannelId::CONTROL, "t", &[], Deadline::never());
        assert!(matches!(refused, Err(Error::Shrunk { .. })), "{refused:?}");
    }
}

/// One side of a grow: its (rank, world size) in the grown group and its new set.
type Grown = Result<((usize, usize), (Comm, Vec<(CommInfo, Comm)>, Placement))>;

/// A survivor alone (the fake's world, its old set made with `prepare` applied) grows
/// with a newcomer on another thread, through `nccl`'s table: the old set, the
/// survivor's side, the newcomer's side, and the newcomer's thread.
fn grow_with_a_newcomer(
    nccl: &'static Syms,
    prepare: impl FnOnce(&Shared<FakeDevice>),
) -> (Arc<Shared<FakeDevice>>, Grown, Grown, std::thread::ThreadId) {
    let survivor = Arc::new(LocalExchange::group(1).remove(0));
    let newcomer = survivor.newcomer();
    let old: Arc<dyn Exchange> = survivor.clone();
    let config = NcclConfig::default();
    let s = shared_with(true, &CommInfo::STANDARD, config, Health::watching(&old)).unwrap();
    prepare(&s);
    let builder = || Builder {
        watch: None,
        version: NcclVersion::new(2, 28, 9),
        nccl,
        config,
        deadline: Deadline::after(Duration::from_secs(20)),
    };
    let deadline = Deadline::after(Duration::from_secs(20));
    let (member, (joined, thread)) = std::thread::scope(|t| {
        let joined = t.spawn(|| {
            let ex = newcomer.join(deadline).unwrap();
            assert!(ex.is_newcomer());
            let made = builder().communicators(ex.as_ref(), &[8; 16], None);
            (
                made.map(|m| ((ex.rank(), ex.world_size()), m)),
                std::thread::current().id(),
            )
        });
        let next = old
            .grow(true, deadline)
            .unwrap()
            .expect("the newcomer waits");
        assert!(!next.is_newcomer());
        let made = builder().survivors(&s, next.as_ref(), &[7; 16], true);
        (
            made.map(|m| ((next.rank(), next.world_size()), m)),
            joined.join().unwrap(),
        )
    });
    (s, member, joined, thread)
}

#[test]
fn a_grow_makes_a_new_set_with_the_newcomer_or_grows_the_control_communicator_where_nccl_can() {
    // Before NCCL 2.29.2 the survivor's old set is aborted and a new one made over the
    // grown exchange, in the same rounds as the newcomer's own set-up (`from_env`'s).
    // With `ncclCommGrow` the survivor, root of its control communicator, makes the
    // grow's id before the set-up round and grows the control communicator with it;
    // the newcomer grows with no parent, the id and the rank after the members'; the
    // old set is aborted only after the grow.
    for nccl in [syms(true), syms_with_grow()] {
        let clear = |s: &Shared<FakeDevice>| s.all_comms().for_each(|c| comm(c.raw).clear());
        let (s, grown, joined, thread) = grow_with_a_newcomer(nccl, clear);
        let ((at, (_, comms, placement)), (their_at, (_, their_comms, their_placement))) =
            (grown.unwrap(), joined.unwrap());
        assert_eq!((at, their_at), ((0, 2), (1, 2)));
        let old_comms: Vec<&FakeComm> = s.all_comms().map(|c| comm(c.raw)).collect();
        let control_old: Vec<_> = (old_comms[s.comms.len()].stamped().into_iter())
            .map(|(n, _)| n)
            .collect();
        let grows: Vec<_> = (GROWS.lock().iter())
            .filter(|g| [std::thread::current().id(), thread].contains(&g.0))
            .map(|g| (g.1, g.2, g.3, g.4))
            .collect();
        if nccl.grow.is_some() {
            assert_eq!(
                control_old,
                ["ncclCommGetUniqueId", "ncclCommGrow", "ncclCommAbort"]
            );
            // The survivor (root, keeps its rank: -1), the newcomer (rank 1 of 2).
            assert_eq!(grows.len(), 2, "{grows:?}");
            assert!(grows.contains(&(true, 2, true, -1)), "{grows:?}");
            assert!(grows.contains(&(false, 2, true, 1)), "{grows:?}");
        } else {
            assert_eq!(control_old, ["ncclCommAbort"]);
            assert!(grows.is_empty(), "{grows:?}");
        }
        let aborted = |f: &&FakeComm| f.stamped().iter().any(|(n, _)| *n == "ncclCommAbort");
        assert!(old_comms.iter().all(aborted));
        assert_eq!(comms.len(), s.comms.len());
        assert_eq!(their_comms.len(), comms.len());
        assert!((comms.iter().chain(&their_comms)).all(|(_, c)| !c.is_aborted()));
        assert_eq!(
            placement, their_placement,
            "both ranks agreed where they run"
        );
    }
}

#[test]
fn a_grow_over_an_aborted_control_communicator_fails_on_every_rank_at_once() {
    // The old backend broke without a lost peer (its communicators aborted): before
    // NCCL 2.29.2 the grow makes a new set; with `ncclCommGrow` the member cannot grow
    // its control communicator, makes a new set, and the set-up round refuses the mix
    // on both ranks, without waiting for a timeout.
    for nccl in [syms(true), syms_with_grow()] {
        let started = Instant::now();
        let fail = |s: &Shared<FakeDevice>| drop(s.fail(Cause::Failed("a timeout".into())));
        let (_, member, joined, _) = grow_with_a_newcomer(nccl, fail);
        if nccl.grow.is_some() {
            for out in [member.map(|_| ()), joined.map(|_| ())] {
                assert!(matches!(out, Err(Error::Protocol { .. })), "{out:?}");
            }
            assert!(started.elapsed() < Duration::from_secs(10));
        } else {
            assert!(member.is_ok() && joined.is_ok());
        }
    }
}
