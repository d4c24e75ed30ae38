//! The crate's agreement over a Python store object (PyTorch's `c10d.Store`, or any
//! object with `set`, `get`, `add` and `wait`): [`PyStore`] implements
//! [`symmpool::control::KvStore`], and [`StoreExchange`] is the Python handle of a
//! [`KvExchange`] over it.

use crate::errors::{dur, to_py};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use symmpool::control::{KvConfig, KvExchange, KvStore};
use symmpool::{ChannelId, Error, Exchange, Result};

/// A Python store object, called with the GIL held (acquired per call: the exchange
/// runs with the GIL released).
#[derive(Debug)]
pub(crate) struct PyStore {
    store: Py<PyAny>,
}

/// A Python exception raised by the store, as the crate's transport error.
fn store_error(op: &'static str, e: PyErr) -> Error {
    let detail = e.to_string();
    Error::Transport {
        op,
        detail: detail.clone(),
        source: std::io::Error::other(detail),
    }
}

/// Whether a store exception means "the wait timed out" (c10d raises
/// `DistStoreError: ... timeout ...`; test stores raise `TimeoutError`).
fn is_timeout(py: Python<'_>, e: &PyErr) -> bool {
    if e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py) {
        return true;
    }
    let text = e.to_string().to_lowercase();
    text.contains("timeout") || text.contains("timed out")
}

fn bytes_of(value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = value.downcast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = value.downcast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    value.extract::<Vec<u8>>()
}

fn timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    // Capped at 30 days: c10d converts to milliseconds.
    let secs = d.as_secs_f64().min(30.0 * 86400.0);
    py.import("datetime")?
        .getattr("timedelta")?
        .call1((0.0f64, secs))
}

impl KvStore for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Python::with_gil(|py| {
            self.store
                .call_method1(py, "set", (key, PyBytes::new(py, value)))
                .map(drop)
        })
        .map_err(|e| store_error("store.set", e))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        Python::with_gil(|py| bytes_of(self.store.call_method1(py, "get", (key,))?.bind(py)))
            .map_err(|e| store_error("store.get", e))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Python::with_gil(|py| {
            self.store
                .call_method1(py, "add", (key, delta))?
                .extract::<i64>(py)
        })
        .map_err(|e| store_error("store.add", e))
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool> {
        Python::with_gil(|py| {
            let list = PyList::new(py, keys)?;
            match self
                .store
                .call_method1(py, "wait", (list, timedelta(py, timeout)?))
            {
                Ok(_) => Ok(true),
                Err(e) if is_timeout(py, &e) => Ok(false),
                Err(e) => Err(e),
            }
        })
        .map_err(|e| store_error("store.wait", e))
    }

    fn check(&self, keys: &[String]) -> Result<bool> {
        let has_check = Python::with_gil(|py| self.store.bind(py).hasattr("check"))
            .map_err(|e| store_error("store.check", e))?;
        if !has_check {
            return self.wait(keys, Duration::from_millis(1));
        }
        Python::with_gil(|py| {
            let list = PyList::new(py, keys)?;
            self.store.call_method1(py, "check", (list,))?.extract(py)
        })
        .map_err(|e| store_error("store.check", e))
    }

    fn delete(&self, key: &str) -> Result<()> {
        Python::with_gil(|py| {
            let store = self.store.bind(py);
            if store.hasattr("delete_key")? {
                store.call_method1("delete_key", (key,))?;
            }
            Ok(())
        })
        .map_err(|e| store_error("store.delete_key", e))
    }
}

/// The crate's `Exchange` over a Python store: what the pool's agreement runs over.
///
/// Round `r` of channel `c` on rank `k` is the key `PREFIX/c/r/k`. A rank that waits
/// past its deadline breaks the group (the key `PREFIX/broken`); every other rank fails
/// within `poll_s` of that. A rank that dies is noticed only through deadlines: the
/// survivors fail when the first of them reaches its call's timeout (the pool's
/// `timeout_s`, 60 s by default), plus `poll_s`.
#[pyclass(frozen, module = "symmpool._ext")]
pub struct StoreExchange {
    pub(crate) inner: Arc<KvExchange<PyStore>>,
    channels: Mutex<HashMap<u64, ChannelId>>,
}

#[pymethods]
impl StoreExchange {
    /// `StoreExchange(store, rank, world_size, prefix="symmpool", poll_s=1.0)`.
    #[new]
    #[pyo3(signature = (store, rank, world_size, prefix = "symmpool".to_string(), poll_s = 1.0))]
    fn new(
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        prefix: String,
        poll_s: f64,
    ) -> PyResult<Self> {
        if !(poll_s.is_finite() && poll_s > 0.0) {
            return Err(PyValueError::new_err("poll_s must be a positive number"));
        }
        let config = KvConfig::new(prefix).with_poll(Duration::from_secs_f64(poll_s));
        let inner = KvExchange::new(PyStore { store }, rank, world_size, config).map_err(to_py)?;
        Ok(StoreExchange {
            inner: Arc::new(inner),
            channels: Mutex::new(HashMap::from([(0, ChannelId::CONTROL)])),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    /// The key prefix.
    #[getter]
    fn prefix(&self) -> String {
        self.inner.config().prefix.clone()
    }

    /// Open the next channel (collective: every rank, same order, same name); returns
    /// its ordinal (the control channel is 0).
    #[pyo3(signature = (name, timeout_s = None))]
    fn open_channel(&self, py: Python<'_>, name: &str, timeout_s: Option<f64>) -> PyResult<u64> {
        let inner = self.inner.clone();
        let name = name.to_owned();
        let ch = py
            .allow_threads(move || inner.open_channel(&name, dur(timeout_s)))
            .map_err(to_py)?;
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ch.ordinal(), ch);
        Ok(ch.ordinal())
    }

    /// One round on `channel`: every rank's payload, in rank order (collective).
    #[pyo3(signature = (channel, payload, timeout_s = None))]
    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        channel: u64,
        payload: Vec<u8>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let ch = *self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&channel)
            .ok_or_else(|| PyValueError::new_err(format!("channel {channel} is not open")))?;
        let inner = self.inner.clone();
        let all = py
            .allow_threads(move || inner.all_gather(ch, "python", &payload, dur(timeout_s)))
            .map_err(to_py)?;
        Ok(all.iter().map(|p| PyBytes::new(py, p)).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "StoreExchange(rank={}, world_size={}, prefix={:?})",
            self.inner.rank(),
            self.inner.world_size(),
            self.inner.config().prefix
        )
    }
}
