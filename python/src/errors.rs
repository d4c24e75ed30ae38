//! Errors: the crate's errors as the exceptions of `symmpool.errors` (a class per
//! kind of failure, with `rank`, `ranks` and `operation` attributes), the last error
//! kept for `symmpool.last_error()` (PyTorch reports a failed pluggable `alloc` only as
//! an out-of-memory error), and the checks of Python's timeout arguments.

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;
use std::time::Duration;
use symmpool::Error;

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Keep `message` as the last error.
pub(crate) fn remember(message: String) {
    *LAST_ERROR.lock() = Some(message);
}

/// The exception classes of `symmpool.errors`, by name (the module is Python, so that
/// a class can have two bases: `SymmpoolTimeoutError` is also a `TimeoutError`).
pub(crate) fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    static MODULE: GILOnceCell<Py<PyModule>> = GILOnceCell::new();
    let module = MODULE.get_or_try_init(py, || py.import("symmpool.errors").map(Bound::unbind))?;
    module
        .bind(py)
        .getattr(name)?
        .downcast_into()
        .map_err(Into::into)
}

/// What a Python caller learns from a crate error: the class, and the attributes.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Sorted {
    /// The class's name in `symmpool.errors`.
    pub(crate) class: &'static str,
    /// The peer rank the error is about.
    pub(crate) rank: Option<usize>,
    /// The ranks concerned.
    pub(crate) ranks: Vec<usize>,
    /// The operation that failed or was waited in.
    pub(crate) operation: Option<String>,
}

/// The class and attributes of `e` (see `symmpool.errors` for the classes).
pub(crate) fn sort(e: &Error) -> Sorted {
    let with = |class, rank, ranks, operation: Option<&str>| Sorted {
        class,
        rank,
        ranks,
        operation: operation.map(str::to_owned),
    };
    match e {
        Error::ZeroSize
        | Error::TooLarge { .. }
        | Error::BadAlignment { .. }
        | Error::ForeignBuffer { .. }
        | Error::DoubleFree { .. }
        | Error::WrongStream
        | Error::PoolClosed
        | Error::BadView(_)
        | Error::GraphCapture
        | Error::NoActivePool
        | Error::PayloadTooLarge { .. } => with("UsageError", None, vec![], None),
        // The failure's own class (a dead peer is still a PeerLostError); the message
        // names the shared communicators.
        Error::SharedCommunicators { error, .. } => sort(error),
        Error::BuffersAlive { live_per_rank, .. } => with(
            "UsageError",
            None,
            (0..live_per_rank.len())
                .filter(|&r| live_per_rank[r] > 0)
                .collect(),
            Some("close"),
        ),
        Error::InvalidCollective { op, .. } => with("UsageError", None, vec![], Some(op)),
        Error::Divergence(d) => with(
            "DivergenceError",
            None,
            d.calls.iter().map(|(r, _)| *r).collect(),
            Some(d.during),
        ),
        Error::CollectiveDivergence(d) => with(
            "DivergenceError",
            None,
            d.values.iter().map(|(r, _)| *r).collect(),
            Some(d.found_by),
        ),
        Error::CollectiveMismatch { op, .. } => with("DivergenceError", None, vec![], Some(op)),
        Error::ChannelMismatch { opened } => with(
            "DivergenceError",
            None,
            opened.iter().map(|(r, _, _)| *r).collect(),
            Some("open_channel"),
        ),
        Error::RegistrationOrder { order } => with(
            "DivergenceError",
            None,
            order.iter().map(|(r, _, _)| *r).collect(),
            Some("window registration"),
        ),
        Error::RegistrationMismatch { .. } => {
            with("DivergenceError", None, vec![], Some("window registration"))
        }
        Error::Timeout {
            op, missing_ranks, ..
        } => with(
            "SymmpoolTimeoutError",
            None,
            missing_ranks.clone(),
            Some(op),
        ),
        Error::GroupBroken { rank, op } => {
            with("SymmpoolTimeoutError", Some(*rank), vec![*rank], Some(op))
        }
        Error::NcclTimeout { op, .. } | Error::NcclWatchdog { op, .. } => {
            with("SymmpoolTimeoutError", None, vec![], Some(op))
        }
        Error::PeerLost { rank, op, .. } => {
            with("PeerLostError", Some(*rank), vec![*rank], Some(op))
        }
        Error::PoolLimit { .. } | Error::DeviceOutOfMemory { .. } => {
            with("OutOfMemoryError", None, vec![], Some("alloc"))
        }
        Error::PeerOutOfMemory { ranks, .. } => {
            with("OutOfMemoryError", None, ranks.clone(), Some("alloc"))
        }
        Error::Config { .. }
        | Error::InvalidConfig(_)
        | Error::LaunchEnv { .. }
        | Error::JobMismatch { .. }
        | Error::StoreRejected { .. }
        | Error::LibraryUnavailable { .. }
        | Error::NcclTooOld { .. }
        | Error::NoSymmetricSupport { .. } => with("ConfigurationError", None, vec![], None),
        Error::RankTaken { rank, .. } => with("ConfigurationError", Some(*rank), vec![*rank], None),
        Error::RegistrationBroken { rank, .. } => with(
            "SymmpoolError",
            Some(*rank),
            vec![*rank],
            Some("window registration"),
        ),
        Error::Nccl { op, .. } | Error::Cuda { op, .. } | Error::SharedMemory { op, .. } => {
            with("SymmpoolError", None, vec![], Some(op))
        }
        Error::Transport { op, .. } | Error::Protocol { op, .. } => {
            with("SymmpoolError", None, vec![], Some(op))
        }
        // A failure reported late is sorted as the failure itself.
        Error::Deferred { source, .. } => sort(source),
        _ => with("SymmpoolError", None, vec![], None),
    }
}

/// The message of `e`, with its advice said once: an error that wraps another (a
/// broken pool, a deferred failure) repeats the inner error's advice, which goes.
pub(crate) fn message(e: &Error) -> String {
    dedupe_advice(&e.to_string())
}

/// The advice the crate's messages end with (after `; ` or in parentheses).
const ADVICE: [&str; 4] = [
    "drop the pool and start again",
    "drop it and build a new one",
    "the pool is broken: drop it and build a new one",
    "drop the pools and the backend and restart",
];

/// `text` with every advice phrase of [`ADVICE`] after its first occurrence removed
/// (with the separator before it), and any phrase that occurs once kept.
fn dedupe_advice(text: &str) -> String {
    let mut out = text.to_owned();
    // The longer phrase first: it contains a shorter one.
    let mut phrases = ADVICE;
    phrases.sort_by_key(|p| std::cmp::Reverse(p.len()));
    // Where the phrase kept ends: later phrases are removed after it only, never
    // inside it (a shorter phrase is part of a longer one).
    let mut kept_end: Option<usize> = None;
    for phrase in phrases {
        let Some(first) = out.find(phrase) else {
            continue;
        };
        let from = *kept_end.get_or_insert(first + phrase.len());
        out = remove_all(&out, phrase, from);
    }
    out
}

/// Remove every occurrence of `phrase` at or after byte `from`, with the `; `, `: `
/// or ` (` before it and the `)` after it.
fn remove_all(text: &str, phrase: &str, from: usize) -> String {
    let (head, tail) = text.split_at(from);
    let mut tail = tail.to_owned();
    while let Some(at) = tail.find(phrase) {
        let mut start = at;
        let mut end = at + phrase.len();
        for sep in ["; ", ": ", " ("] {
            if tail[..start].ends_with(sep) {
                start -= sep.len();
                if sep == " (" && tail[end..].starts_with(')') {
                    end += 1;
                }
                break;
            }
        }
        tail.replace_range(start..end, "");
    }
    format!("{head}{tail}")
}

/// A crate error as the exception of its class (kept as the last error).
pub(crate) fn to_py(e: Error) -> PyErr {
    let text = message(&e);
    remember(text.clone());
    let sorted = sort(&e);
    Python::with_gil(|py| match raise(py, &sorted, text.clone()) {
        Ok(err) | Err(err) => err,
    })
}

fn raise(py: Python<'_>, sorted: &Sorted, text: String) -> Result<PyErr, PyErr> {
    let cls = class(py, sorted.class)?;
    let value = cls.call1((text,))?;
    value.setattr("rank", sorted.rank)?;
    value.setattr("ranks", sorted.ranks.clone())?;
    value.setattr("operation", sorted.operation.clone())?;
    Ok(PyErr::from_value(value))
}

/// Seconds as a duration: `None` or infinity is no deadline ([`Duration::MAX`]).
///
/// # Errors
/// `ValueError` for a negative or NaN number of seconds (`name` is the argument).
pub(crate) fn seconds(name: &str, seconds: Option<f64>) -> PyResult<Duration> {
    match seconds {
        None => Ok(Duration::MAX),
        Some(s) if s == f64::INFINITY => Ok(Duration::MAX),
        Some(s) if s >= 0.0 => Ok(Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)),
        Some(s) => Err(PyValueError::new_err(format!(
            "{name} must be a number of seconds >= 0, or None (no deadline), not {s}"
        ))),
    }
}

/// The message of the last error an allocation or another call of this module failed
/// with, or `None`.
#[pyfunction]
pub(crate) fn last_error() -> Option<String> {
    LAST_ERROR.lock().clone()
}

/// Forget the last error.
#[pyfunction]
pub(crate) fn clear_error() {
    *LAST_ERROR.lock() = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_is_said_once() {
        let inner = Error::GroupBroken { rank: 1, op: "x" };
        let broken = Error::PoolBroken {
            reason: inner.to_string(),
        };
        let text = message(&broken);
        assert_eq!(text.matches("drop").count(), 1, "{text}");
        assert!(text.contains("rank 1 timed out in x earlier"), "{text}");
        let plain = message(&inner);
        assert_eq!(plain, inner.to_string());
        // A shorter phrase inside the kept longer one stays: the advice is said once,
        // not dropped.
        let text = dedupe_advice(
            "diverged (the pool is broken: drop it and build a new one); drop it and build a new one",
        );
        assert_eq!(
            text.matches("drop it and build a new one").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("the pool is broken: drop it and build a new one"),
            "{text}"
        );
    }
}
