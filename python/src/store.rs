//! The exchanges the ranks agree over, from Python:
//!
//! - [`StoreExchange`]: the crate's agreement over a Python store object (PyTorch's
//!   `c10d.Store`, or any object with `set`, `get`, `add` and `wait`): [`PyStore`]
//!   implements [`symmpool::control::KvStore`], and a [`KvExchange`] runs over it;
//! - [`TcpStoreExchange`]: the crate's own TCP rendezvous store
//!   ([`symmpool::StoreExchange`]), which rank 0 hosts, from the launcher's
//!   environment (torchrun, `srun`, `mpirun`).

use crate::errors::{seconds, to_py};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use symmpool::control::{KvConfig, KvExchange, KvStore};
use symmpool::{ChannelId, Deadline, Error, Exchange, Result};

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

/// The channels a Python exchange handle has opened, by ordinal, and the exchange.
#[derive(Debug)]
struct Channels {
    exchange: Arc<dyn Exchange>,
    open: Mutex<HashMap<u64, ChannelId>>,
}

impl Channels {
    fn new(exchange: Arc<dyn Exchange>) -> Self {
        Channels {
            exchange,
            open: Mutex::new(HashMap::from([(0, ChannelId::CONTROL)])),
        }
    }

    fn open_channel(&self, py: Python<'_>, name: &str, timeout_s: Option<f64>) -> PyResult<u64> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let exchange = self.exchange.clone();
        let name = name.to_owned();
        let ch = py
            .allow_threads(move || exchange.open_channel(&name, Deadline::after(timeout)))
            .map_err(to_py)?;
        self.open.lock().insert(ch.ordinal(), ch);
        Ok(ch.ordinal())
    }

    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        channel: u64,
        payload: Vec<u8>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let ch = *self
            .open
            .lock()
            .get(&channel)
            .ok_or_else(|| PyValueError::new_err(format!("channel {channel} is not open")))?;
        let exchange = self.exchange.clone();
        let all = py
            .allow_threads(move || {
                exchange.all_gather(ch, "python", &payload, Deadline::after(timeout))
            })
            .map_err(to_py)?;
        Ok(all.iter().map(|p| PyBytes::new(py, p)).collect())
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
    kv: Arc<KvExchange<PyStore>>,
    channels: Channels,
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
        let kv =
            Arc::new(KvExchange::new(PyStore { store }, rank, world_size, config).map_err(to_py)?);
        Ok(StoreExchange {
            channels: Channels::new(kv.clone()),
            kv,
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.kv.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.kv.world_size()
    }

    /// The key prefix.
    #[getter]
    fn prefix(&self) -> String {
        self.kv.config().prefix.clone()
    }

    /// Open the next channel (collective: every rank, same order, same name); returns
    /// its ordinal (the control channel is 0). `timeout_s`: seconds to wait for the
    /// other ranks (`None`: no deadline).
    #[pyo3(signature = (name, timeout_s = None))]
    fn open_channel(&self, py: Python<'_>, name: &str, timeout_s: Option<f64>) -> PyResult<u64> {
        self.channels.open_channel(py, name, timeout_s)
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
        self.channels.all_gather(py, channel, payload, timeout_s)
    }

    fn __repr__(&self) -> String {
        format!(
            "StoreExchange(rank={}, world_size={}, prefix={:?})",
            self.kv.rank(),
            self.kv.world_size(),
            self.kv.config().prefix
        )
    }
}

/// The crate's own control plane for one process per rank: a small TCP rendezvous
/// store that rank 0 hosts and every rank connects to, with heartbeats, so that a
/// rank that dies or freezes is reported to the others as a `PeerLostError` within
/// seconds (whatever their own timeouts).
///
/// `TcpStoreExchange.from_env()` reads the launcher's variables: torchrun's `RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
/// (slurm's and Open MPI's too). The store listens on `MASTER_PORT`, or on
/// `MASTER_PORT + 1` under torchrun (whose agent serves PyTorch's store on
/// `MASTER_PORT`); `SYMMPOOL_STORE_PORT` overrides both. `SYMMPOOL_JOB_ID` (or
/// torchrun's run id) keeps two jobs on one port apart.
#[pyclass(frozen, module = "symmpool._ext")]
pub struct TcpStoreExchange {
    exchange: Arc<symmpool::StoreExchange>,
    channels: Channels,
}

#[pymethods]
impl TcpStoreExchange {
    /// Join the store from the launcher's environment (rank 0 hosts it) and wait until
    /// every rank has joined, within the start-up timeout (`SYMMPOOL_STARTUP_TIMEOUT_MS`,
    /// see the crate's `StoreConfig`). Collective: every rank of the job calls it.
    ///
    /// Raises `ConfigurationError` for a missing or invalid launcher variable, or a
    /// store of another job on the port; `SymmpoolTimeoutError` naming the ranks that
    /// never joined.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<TcpStoreExchange> {
        let exchange = Arc::new(
            py.allow_threads(symmpool::StoreExchange::from_env)
                .map_err(to_py)?,
        );
        Ok(TcpStoreExchange {
            channels: Channels::new(exchange.clone()),
            exchange,
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.exchange.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.exchange.world_size()
    }

    /// Open the next channel (collective: every rank, same order, same name); returns
    /// its ordinal (the control channel is 0). `timeout_s`: seconds to wait for the
    /// other ranks (`None`: no deadline).
    #[pyo3(signature = (name, timeout_s = None))]
    fn open_channel(&self, py: Python<'_>, name: &str, timeout_s: Option<f64>) -> PyResult<u64> {
        self.channels.open_channel(py, name, timeout_s)
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
        self.channels.all_gather(py, channel, payload, timeout_s)
    }

    fn __repr__(&self) -> String {
        format!(
            "TcpStoreExchange(rank={}, world_size={})",
            self.exchange.rank(),
            self.exchange.world_size()
        )
    }
}

/// Either exchange class, where a pool constructor takes one.
#[derive(FromPyObject)]
pub(crate) enum AnyExchange<'py> {
    /// Over a Python store.
    Store(PyRef<'py, StoreExchange>),
    /// Over the crate's TCP store.
    Tcp(PyRef<'py, TcpStoreExchange>),
}

impl StoreExchange {
    /// The exchange, to hand to a backend.
    pub(crate) fn exchange(&self) -> Arc<dyn Exchange> {
        self.channels.exchange.clone()
    }
}

impl AnyExchange<'_> {
    /// The exchange, to hand to a backend.
    pub(crate) fn exchange(&self) -> Arc<dyn Exchange> {
        match self {
            AnyExchange::Store(s) => s.channels.exchange.clone(),
            AnyExchange::Tcp(t) => t.channels.exchange.clone(),
        }
    }
}
