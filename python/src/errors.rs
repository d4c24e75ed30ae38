//! Errors: the crate's errors as Python exceptions, and the last error kept for
//! `symmpool.last_error()` (PyTorch reports a failed pluggable `alloc` only as an
//! out-of-memory error).

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Mutex;
use std::time::Duration;

create_exception!(
    _ext,
    SymmpoolError,
    PyRuntimeError,
    "An error of the symmpool crate (divergence, timeout, NCCL, CUDA, ...)."
);

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Keep `message` as the last error.
pub(crate) fn remember(message: String) {
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
}

/// A crate error as a Python exception (and kept as the last error).
pub(crate) fn to_py(e: symmpool::Error) -> PyErr {
    let message = e.to_string();
    remember(message.clone());
    SymmpoolError::new_err(message)
}

/// Seconds (`None` or infinity: no deadline) as a duration.
pub(crate) fn dur(seconds: Option<f64>) -> Duration {
    match seconds {
        Some(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
        _ => Duration::MAX,
    }
}

/// The message of the last error an allocation or another call of this module failed
/// with, or `None`.
#[pyfunction]
pub(crate) fn last_error() -> Option<String> {
    LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Forget the last error.
#[pyfunction]
pub(crate) fn clear_error() {
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = None;
}
