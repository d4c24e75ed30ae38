use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

impl<E: Completion> Watch<E> {
    /// Number of collectives not yet seen complete.
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Drop the completed collectives; `Some(cause)` if one is older than `timeout` and
    /// not complete, or the device failed. (The watchdog does the same in three steps,
    /// [`take`](Self::take), [`sweep`], [`restore`](Self::restore), so that the lock on
    /// the list is not held across the queries.)
    fn sweep(&mut self, now: Instant, timeout: Duration) -> Option<Cause> {
        let swept = sweep(self.take(), now, timeout);
        self.restore(swept.kept, swept.complete);
        swept.cause
    }
}

/// 0 pending, 1 complete, 2 failed.
#[derive(Debug, Clone)]
struct Fake(Arc<AtomicU8>);

impl Completion for Fake {
    fn complete(&self) -> std::result::Result<bool, String> {
        match self.0.load(Ordering::SeqCst) {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("CUDA_ERROR_ILLEGAL_ADDRESS".into()),
        }
    }
}

fn fake(state: u8) -> Fake {
    Fake(Arc::new(AtomicU8::new(state)))
}

#[test]
fn watchdog_expires_only_incomplete_old_collectives() {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(600);
    let mut w = Watch::default();
    let slow = fake(0);
    w.pending.push_back(Enqueued {
        op: "ncclAllGather",
        comm: 1,
        at: t0,
        done: slow.clone(),
    });
    w.pending.push_back(Enqueued {
        op: "ncclReduceScatter",
        comm: 2,
        at: t0,
        done: fake(1),
    });
    assert_eq!(w.sweep(t0 + Duration::from_secs(599), timeout), None);
    assert_eq!(w.len(), 1, "completed collectives are dropped");
    assert!(w.spare.pop().is_some(), "and their events kept for reuse");
    match w.sweep(t0 + Duration::from_secs(601), timeout) {
        Some(Cause::Watchdog { op, comm, waited }) => {
            assert_eq!((op, comm), ("ncclAllGather", 1));
            assert!(waited > timeout);
        }
        other => panic!("{other:?}"),
    }
    slow.0.store(1, Ordering::SeqCst);
    assert_eq!(w.sweep(t0 + Duration::from_secs(700), timeout), None);
    assert_eq!(w.len(), 0);
}

#[test]
fn a_failed_device_breaks_at_once() {
    let t0 = Instant::now();
    let mut w = Watch::default();
    w.pending.push_back(Enqueued {
        op: "ncclAllGather",
        comm: 0,
        at: t0,
        done: fake(2),
    });
    assert!(matches!(
        w.sweep(t0, Duration::from_secs(600)),
        Some(Cause::Failed(m)) if m.contains("ILLEGAL_ADDRESS")
    ));
}

#[test]
fn health_breaks_once_and_stays_broken() {
    let h = Health::default();
    assert!(h.check().is_ok() && !h.is_broken());
    let first = Cause::Timeout {
        op: "ncclCommWindowRegister",
        waited: Duration::from_secs(60),
    };
    assert!(h.break_with(first.clone()));
    assert!(
        !h.break_with(Cause::Failed("later".into())),
        "the first cause stays"
    );
    assert!(matches!(
        first.error(true),
        Error::NcclTimeout {
            op: "ncclCommWindowRegister",
            ..
        }
    ));
    for _ in 0..2 {
        match h.check() {
            Err(Error::NcclAborted { reason }) => {
                assert!(reason.contains("ncclCommWindowRegister"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    let w = Health::default();
    w.break_with(Cause::Watchdog {
        op: "ncclAllGather",
        comm: 0,
        waited: Duration::from_secs(601),
    });
    assert!(matches!(w.check(), Err(Error::NcclWatchdog { .. })));
}

#[test]
fn backoff_grows_and_respects_the_deadline() {
    let now = Instant::now();
    let mut b = Backoff::new(MAX_POLL_PAUSE);
    let far = now + Duration::from_secs(10);
    let pauses: Vec<_> = (0..12).map(|_| b.pause(now, far)).collect();
    assert_eq!(pauses[0], Duration::from_micros(20));
    assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
    assert_eq!(*pauses.last().unwrap(), MAX_POLL_PAUSE);
    assert_eq!(
        b.pause(now, now + Duration::from_micros(3)),
        Duration::from_micros(3)
    );
    assert_eq!(b.pause(now + Duration::from_secs(1), now), Duration::ZERO);
}

#[test]
fn poll_until_answers_or_gives_up_at_the_deadline() {
    let mut calls = 0;
    let answer = poll_until(Deadline::after(Duration::from_secs(10)), || {
        calls += 1;
        (calls == 3).then_some(calls)
    });
    assert_eq!(answer, Some(3));
    let mut tries = 0;
    let start = Instant::now();
    let none: Option<()> = poll_until(Deadline::after(Duration::from_millis(20)), || {
        tries += 1;
        None
    });
    assert!(none.is_none() && tries > 1);
    assert!(start.elapsed() >= Duration::from_millis(20));
    let mut once = 0;
    let expired: Option<()> = poll_until(Deadline::after(Duration::ZERO), || {
        once += 1;
        None
    });
    assert_eq!((expired, once), (None, 1), "the step runs at least once");
}

#[test]
fn the_applications_own_abort_is_no_error_in_the_log_and_a_failure_is() {
    // A shrink or grow aborts the communicators it replaces (`Cause::Aborted`): a job
    // that recovers prints no ERROR for it. A failure of the backend's own does.
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logged = |cause: Cause| {
        let lines = Lines::default();
        let out = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            assert!(Health::default().break_with(cause));
        });
        String::from_utf8(lines.0.lock().unwrap().clone()).unwrap()
    };
    let aborted = logged(Cause::Aborted("the group shrinks".into()));
    assert!(
        aborted.contains("INFO") && !aborted.contains("ERROR"),
        "{aborted}"
    );
    let failed = logged(Cause::Failed("CUDA_ERROR_ILLEGAL_ADDRESS".into()));
    assert!(failed.contains("ERROR"), "{failed}");
    // Either way the calls after it are refused as aborted.
    let h = Health::default();
    h.break_with(Cause::Aborted("the group grows".into()));
    assert!(matches!(h.check(), Err(Error::NcclAborted { reason }) if reason.contains("grows")));
}
