//! The crate's warnings and errors (its `tracing` events, forwarded to `log` when no
//! `tracing` subscriber is set) delivered to Python, instead of standard error:
//!
//! - the warning about a pool the caller held and dropped without `close()` (target
//!   `symmpool::pool`) as `warnings.warn(..., symmpool.SymmpoolWarning)`;
//! - everything else at warning level or above to the `logging` logger named after
//!   the target (`symmpool`, `symmpool.pool`, `symmpool.backend.nccl.comm`, …), except
//!   the crate's "symmpool call failed" event (of any of its targets), which the
//!   raised exception already says: the caller may catch it and carry on (a
//!   `UsageError` it expects, a loss it shrinks past), so it goes to its logger at
//!   `DEBUG`, never as a failure.
//!
//! A record is never delivered on the thread that emits it: that thread may hold a
//! lock of the pool, and running Python there (which may release and take the GIL)
//! could deadlock against a thread that holds the GIL and waits for that lock. Records
//! go to a bounded queue, which a thread of this module drains with the GIL, holding
//! no other lock; `flush_logs()` drains it on the calling thread. At interpreter exit
//! (an `atexit` hook) the thread stops, and later records (a pool dropped while the
//! interpreter shuts down) go to standard error, as the crate prints them without a
//! logger.

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use std::collections::VecDeque;
use std::sync::Once;
use std::time::Duration;

/// Records kept at most; older ones are dropped (and counted) beyond.
const QUEUE_LIMIT: usize = 1024;
/// How long a wait for records, or for another deliverer, lasts before looking again.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// One record to deliver.
#[derive(Debug)]
struct Record {
    level: log::Level,
    target: String,
    message: String,
}

/// The queue and the delivery's state.
#[derive(Debug)]
struct State {
    records: VecDeque<Record>,
    /// Records dropped because the queue was full, since the last delivery.
    dropped: u64,
    /// A thread is delivering (one at a time, so that `flush_logs()` returns only once
    /// every record queued before it has been delivered); the delivery thread claims
    /// it before it takes the GIL, so that the exit hook waits for it.
    delivering: bool,
    /// The interpreter is shutting down: nothing takes the GIL for records any more.
    stopped: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    records: VecDeque::new(),
    dropped: 0,
    delivering: false,
    stopped: false,
});
/// Signalled when a record is queued, a delivery ends or the exit hook runs.
static CHANGED: Condvar = Condvar::new();
static THREAD: Once = Once::new();

/// The `log` logger of the extension.
struct PyLogger;

impl log::Log for PyLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let r = Record {
            level: record.level(),
            target: record.target().to_owned(),
            // The advice in Python's words.
            message: crate::errors::in_python_words(&record.args().to_string()),
        };
        let mut st = STATE.lock();
        if st.stopped {
            drop(st);
            if !is_call_failed(&r) {
                eprintln!("symmpool {}: {}", r.level, r.message);
            }
            return;
        }
        if st.records.len() >= QUEUE_LIMIT {
            st.records.pop_front();
            st.dropped += 1;
        }
        st.records.push_back(r);
        drop(st);
        CHANGED.notify_all();
        THREAD.call_once(|| {
            // Without the thread, records wait for the next `flush_logs()`.
            let _ = std::thread::Builder::new()
                .name("symmpool-logs".into())
                .spawn(deliver_forever);
        });
    }

    fn flush(&self) {}
}

/// Whether `r` is the crate's event for a failed call (the exception says it), from
/// the crate's root target or one of its modules' (`symmpool::coll`).
fn is_call_failed(r: &Record) -> bool {
    let crate_target = r.target == "symmpool" || r.target.starts_with("symmpool::");
    crate_target && r.message.starts_with("symmpool call failed")
}

/// Whether `r` is the crate's warning about a pool dropped without `close()` (or a
/// broken one dropped): about a pool the caller holds, so a `SymmpoolWarning`. The
/// pool's other records (a shrink done, ...) go to `logging`.
fn is_pool_dropped(r: &Record) -> bool {
    r.level == log::Level::Warn
        && r.target == "symmpool::pool"
        && (r.message.starts_with("POOL DROPPED WITHOUT close()")
            || r.message.starts_with("broken pool dropped"))
}

/// Install the logger (once per process; a logger another library installed first
/// stays, and then this module delivers nothing) and the exit hook.
///
/// # Errors
/// Python's, registering the hook.
pub(crate) fn install(m: &Bound<'_, PyModule>) -> PyResult<()> {
    if log::set_logger(&PyLogger).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    let stop = wrap_pyfunction!(stop_logs, m)?;
    m.py().import("atexit")?.call_method1("register", (stop,))?;
    Ok(())
}

/// Wait (without the GIL: a deliverer may need it) until no one delivers, then claim
/// the delivery and take the queued records; `None` once stopped, for the thread.
fn claim(thread: bool) -> Option<(Vec<Record>, u64)> {
    let mut st = STATE.lock();
    while st.delivering || (thread && st.records.is_empty() && !st.stopped) {
        CHANGED.wait_for(&mut st, IDLE_WAIT);
    }
    if thread && st.stopped {
        return None;
    }
    st.delivering = true;
    Some((
        st.records.drain(..).collect(),
        std::mem::take(&mut st.dropped),
    ))
}

/// End a delivery.
fn release() {
    STATE.lock().delivering = false;
    CHANGED.notify_all();
}

/// The delivery thread: wait for records, deliver them with the GIL, until the exit
/// hook stops it.
fn deliver_forever() {
    loop {
        let Some((records, dropped)) = claim(true) else {
            return;
        };
        // SAFETY: `Py_IsInitialized` may be called at any time, with or without the GIL.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            Python::with_gil(|py| deliver(py, records, dropped));
        }
        release();
    }
}

/// Deliver every queued record on this thread (it holds the GIL).
fn deliver_queued(py: Python<'_>) {
    if let Some((records, dropped)) = py.allow_threads(|| claim(false)) {
        deliver(py, records, dropped);
        release();
    }
}

/// The exit hook: deliver what is queued, stop the delivery thread (waiting for a
/// delivery in progress); later records go to standard error.
#[pyfunction]
fn stop_logs(py: Python<'_>) {
    deliver_queued(py);
    py.allow_threads(|| {
        let mut st = STATE.lock();
        st.stopped = true;
        CHANGED.notify_all();
        while st.delivering {
            CHANGED.wait_for(&mut st, IDLE_WAIT);
        }
    });
}

/// Deliver `records` (see the module's documentation).
fn deliver(py: Python<'_>, records: Vec<Record>, dropped: u64) {
    if dropped > 0 {
        let r = Record {
            level: log::Level::Warn,
            target: "symmpool".into(),
            message: format!("{dropped} log records of symmpool were dropped (queue full)"),
        };
        if let Err(e) = deliver_one(py, &r) {
            e.write_unraisable(py, None);
        }
    }
    for r in &records {
        if let Err(e) = deliver_one(py, r) {
            // A warnings filter set to "error", a failing handler: Python reports it.
            e.write_unraisable(py, None);
        }
    }
}

fn deliver_one(py: Python<'_>, r: &Record) -> PyResult<()> {
    if is_pool_dropped(r) {
        let category = crate::errors::class(py, "SymmpoolWarning")?;
        py.import("warnings")?
            .call_method1("warn", (r.message.as_str(), category))?;
        return Ok(());
    }
    let level: u8 = match r.level {
        // The exception raised for the call says it already.
        _ if is_call_failed(r) => 10,
        log::Level::Error => 40,
        log::Level::Warn => 30,
        log::Level::Info => 20,
        log::Level::Debug | log::Level::Trace => 10,
    };
    let name = r.target.replace("::", ".");
    py.import("logging")?
        .call_method1("getLogger", (name,))?
        .call_method1("log", (level, "%s", r.message.as_str()))?;
    Ok(())
}

/// Deliver the crate's queued warnings and log records now, on this thread (they are
/// otherwise delivered by a thread of the extension within moments).
#[pyfunction]
pub(crate) fn flush_logs(py: Python<'_>) {
    deliver_queued(py);
}
