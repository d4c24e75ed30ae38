//! Errors: the crate's errors as the exceptions of `symmpool.errors` (the class of
//! the error's [`ErrorKind`], from that module's one table, with `rank`, `ranks`,
//! `operation` and, for a divergence, `field` and `values` attributes), the last error
//! kept for `symmpool.last_error()` (PyTorch reports a failed pluggable `alloc` only as
//! an out-of-memory error), and the checks of Python's timeout arguments.

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;
use std::time::Duration;
use symmpool::{Error, ErrorKind};

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Keep `message` as the last error.
pub(crate) fn remember(message: String) {
    *LAST_ERROR.lock() = Some(message);
}

/// The exception classes of `symmpool.errors`, by name (the module is Python, so that
/// a class can have two bases: `SymmpoolTimeoutError` is also a `TimeoutError`).
pub(crate) fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    errors_module(py)?
        .getattr(name)?
        .downcast_into()
        .map_err(Into::into)
}

fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static MODULE: GILOnceCell<Py<PyModule>> = GILOnceCell::new();
    let module = MODULE.get_or_try_init(py, || py.import("symmpool.errors").map(Bound::unbind))?;
    Ok(module.bind(py))
}

/// What a Python caller learns from a crate error beside its class (which
/// `symmpool.errors` picks from [`Error::kind`], in its one table): the attributes.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Details {
    /// The peer rank the error is about.
    pub(crate) rank: Option<usize>,
    /// The ranks concerned.
    pub(crate) ranks: Vec<usize>,
    /// The operation that failed or was waited in.
    pub(crate) operation: Option<String>,
    /// A divergence: what differs (a record's field, `"pool call"`, `"channel"`, …).
    pub(crate) field: Option<String>,
    /// A divergence: each rank's value of it, in rank order.
    pub(crate) values: Vec<(usize, String)>,
    /// A failed shrink ([`Error::ShrinkFailed`]): whether `shrink` again can succeed.
    /// Its exception is `symmpool.errors.ShrinkFailed`, whatever its kind.
    pub(crate) retry: Option<bool>,
}

/// The attributes of `e` (its class is its kind's: see `symmpool.errors.CLASSES`).
pub(crate) fn details(e: &Error) -> Details {
    let with = |rank, ranks, operation: Option<&str>| Details {
        rank,
        ranks,
        operation: operation.map(str::to_owned),
        ..Details::default()
    };
    // A divergence: every rank's value of what differs, and those ranks.
    let diverged = |operation: &str, field: &str, values: Vec<(usize, String)>| Details {
        ranks: values.iter().map(|(r, _)| *r).collect(),
        operation: Some(operation.to_owned()),
        field: Some(field.to_owned()),
        values,
        ..Details::default()
    };
    match e {
        // The failure's own attributes (a dead peer is still about that peer); the
        // message names the shared communicators.
        Error::SharedCommunicators { error, .. } => details(error),
        // A failure reported late is described as the failure itself.
        Error::Deferred { source, .. } => details(source),
        Error::BuffersAlive { live_per_rank, .. } => with(
            None,
            (0..live_per_rank.len())
                .filter(|&r| live_per_rank[r] > 0)
                .collect(),
            Some("close"),
        ),
        Error::InvalidCollective { op, .. } | Error::CollectiveMismatch { op, .. } => {
            with(None, vec![], Some(op))
        }
        Error::Divergence(d) => diverged(
            d.during,
            "pool call",
            (d.calls.iter())
                .map(|(r, call)| (*r, call.clone().unwrap_or_else(|| "(no such call)".into())))
                .collect(),
        ),
        Error::CollectiveDivergence(d) => diverged(d.found_by, d.field, d.values.clone()),
        Error::ChannelMismatch { opened } => diverged(
            "open_channel",
            "channel",
            (opened.iter())
                .map(|(r, ordinal, name)| (*r, format!("#{ordinal} {name:?}")))
                .collect(),
        ),
        Error::RegistrationOrder { order } => diverged(
            "window registration",
            "next registration",
            (order.iter())
                .map(|(r, pool, bytes)| (*r, format!("{pool}: a segment of {bytes} bytes")))
                .collect(),
        ),
        Error::RegistrationMismatch { sizes, .. } => diverged(
            "window registration",
            "segment bytes",
            sizes.iter().map(u64::to_string).enumerate().collect(),
        ),
        Error::Timeout {
            op, missing_ranks, ..
        } => with(None, missing_ranks.clone(), Some(op)),
        Error::GroupBroken { rank, op } | Error::PeerLost { rank, op, .. } => {
            with(Some(*rank), vec![*rank], Some(op))
        }
        Error::NcclTimeout { op, .. }
        | Error::NcclWatchdog { op, .. }
        | Error::Nccl { op, .. }
        | Error::Cuda { op, .. }
        | Error::SharedMemory { op, .. }
        | Error::Transport { op, .. }
        | Error::Protocol { op, .. } => with(None, vec![], Some(op)),
        Error::PoolLimit { .. } | Error::DeviceOutOfMemory { .. } => {
            with(None, vec![], Some("alloc"))
        }
        Error::PeerOutOfMemory { ranks, .. } => with(None, ranks.clone(), Some("alloc")),
        Error::RankTaken { rank, .. } => with(Some(*rank), vec![*rank], None),
        Error::RegistrationBroken { rank, .. } => {
            with(Some(*rank), vec![*rank], Some("window registration"))
        }
        Error::ShrinkFailed { retry, .. } => Details {
            operation: Some("shrink".to_owned()),
            retry: Some(*retry),
            ..Details::default()
        },
        _ => Details::default(),
    }
}

/// The message of `e`, with its advice said once (an error that wraps another, a
/// broken pool or a deferred failure, repeats the inner error's advice, which goes)
/// and in Python's words (the methods it names are the `Pool`'s).
pub(crate) fn message(e: &Error) -> String {
    in_python_words(&dedupe_advice(&e.to_string()))
}

/// The crate's names the messages use (its methods, the exchanges that can shrink and
/// grow), and the binding's for each.
const PYTHON_NAMES: [(&str, &str); 4] = [
    ("SymmPool::shrink", "Pool.shrink()"),
    ("SymmPool::grow", "Pool.grow()"),
    ("SymmPool::close", "Pool.close()"),
    (
        "a StoreExchange or a LocalExchange",
        "the crate's store (TcpStoreExchange) or a host world (Pool.host_group)",
    ),
];

/// `text` with the crate's method names of [`PYTHON_NAMES`] as Python calls them.
pub(crate) fn in_python_words(text: &str) -> String {
    let mut out = text.to_owned();
    for (rust, python) in PYTHON_NAMES {
        out = out.replace(rust, python);
    }
    out
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

/// A crate error as the exception of its kind's class (kept as the last error).
pub(crate) fn to_py(e: Error) -> PyErr {
    let text = message(&e);
    remember(text.clone());
    exception(e.kind(), text, &details(&e))
}

/// A `UsageError` (the class of [`ErrorKind::Usage`]) saying `text`, for a mistake the
/// bindings find themselves (a freed buffer).
pub(crate) fn usage(text: impl Into<String>) -> PyErr {
    let text = text.into();
    remember(text.clone());
    exception(ErrorKind::Usage, text, &Details::default())
}

/// The exception `symmpool.errors` makes for an error of `kind` (its one table of
/// classes by kind), with `details` as its attributes.
fn exception(kind: ErrorKind, text: String, details: &Details) -> PyErr {
    Python::with_gil(|py| {
        let made = errors_module(py).and_then(|m| {
            m.call_method1(
                "_from_crate",
                (
                    kind.name(),
                    text,
                    details.rank,
                    details.ranks.clone(),
                    details.operation.clone(),
                    details.field.clone(),
                    details.values.clone(),
                    details.retry,
                ),
            )
        });
        match made {
            Ok(value) => PyErr::from_value(value),
            Err(err) => err,
        }
    })
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
    use symmpool::{CollectiveDivergence, Divergence};

    #[test]
    fn divergences_name_every_rank_and_its_value() {
        let d = details(&Error::CollectiveDivergence(Box::new(
            CollectiveDivergence {
                pool: "p".into(),
                found_by: "async check",
                record: 3,
                field: "tag",
                values: vec![(0, "1 (0x1)".into()), (1, "2 (0x2)".into())],
            },
        )));
        assert_eq!(d.ranks, vec![0, 1]);
        assert_eq!(d.field.as_deref(), Some("tag"));
        assert_eq!(d.values[1], (1, "2 (0x2)".to_string()));
        assert_eq!(d.operation.as_deref(), Some("async check"));
        let d = details(&Error::Divergence(Box::new(Divergence {
            during: "grow",
            first_differing_call: Some(2),
            calls: vec![(0, Some("alloc 4096".into())), (1, None)],
            history_gone: None,
        })));
        assert_eq!(d.ranks, vec![0, 1]);
        assert_eq!(d.values[1].1, "(no such call)");
        // A failure reported late has the failure's attributes.
        let late = Error::Deferred {
            during: "free".into(),
            source: Box::new(Error::GroupBroken { rank: 2, op: "x" }),
        };
        let d = details(&late);
        assert_eq!((d.rank, d.ranks, d.field), (Some(2), vec![2], None));
        // A group broken by a timeout names no lost rank: restart, not shrink.
        assert_eq!(late.kind(), ErrorKind::Timeout);
    }

    #[test]
    fn a_failed_shrink_says_whether_to_ask_again() {
        for retry in [true, false] {
            let e = Error::ShrinkFailed {
                reason: "rank 2 was lost while the survivors agreed".into(),
                retry,
            };
            let d = details(&e);
            assert_eq!(d.retry, Some(retry));
            assert_eq!(d.operation.as_deref(), Some("shrink"));
        }
        assert_eq!(
            details(&Error::GroupBroken { rank: 1, op: "x" }).retry,
            None
        );
    }

    #[test]
    fn messages_name_the_python_methods() {
        let lost = Error::PeerLost {
            rank: 3,
            op: "all_gather",
            detail: "the process ended".into(),
        };
        let text = message(&lost);
        assert!(!text.contains("SymmPool::"), "{text}");
        // Whatever the crate's words around it, the advice names Python's method.
        if lost.to_string().contains("SymmPool::shrink") {
            assert!(text.contains("Pool.shrink()"), "{text}");
        }
        let shrunk = message(&Error::Shrunk { what: "the pool" });
        assert!(
            shrunk.contains("Pool.shrink()") && !shrunk.contains("SymmPool"),
            "{shrunk}"
        );
        // The crate's message names the grow beside the shrink.
        let rust = Error::Shrunk { what: "the pool" }.to_string();
        if rust.contains("SymmPool::grow") {
            assert!(shrunk.contains("Pool.grow()"), "{shrunk}");
        }
    }

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
