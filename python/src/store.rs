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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use symmpool::control::{JobEnd, KvConfig, KvExchange, KvStore, StoreConfig};
use symmpool::{ChannelId, Deadline, Error, Exchange, Result};

/// A Python store object, called with the GIL held (acquired per call: the exchange
/// runs with the GIL released).
///
/// Each call runs on a client of the store that no other call is using at that moment:
/// a clone of the store (`Store.clone()`, a connection of its own in c10d's
/// `TCPStore`), kept for later calls once it is done. A c10d client runs one operation
/// at a time: a rank's blocking `wait` on a shared client would hold up its other
/// threads' calls (the async check's thread waiting for a round while the caller's
/// thread posts its key for another) and torch's own calls on the default store until
/// the wait ends. A store without `clone` (or whose `clone` fails) is called as it is,
/// by every call: it must serve concurrent calls itself.
#[derive(Debug)]
pub(crate) struct PyStore {
    store: Py<PyAny>,
    /// Clones of `store` not in use (at most as many as calls ever ran at once).
    idle: Mutex<Vec<Py<PyAny>>>,
    /// Whether `store` is cloned per call (it has `clone`, and no `clone` failed yet).
    clones: AtomicBool,
    /// Clones made so far.
    made: Arc<AtomicUsize>,
}

impl PyStore {
    fn new(py: Python<'_>, store: Py<PyAny>) -> PyResult<Self> {
        let clones = store.bind(py).hasattr("clone")?;
        Ok(PyStore {
            store,
            idle: Mutex::new(Vec::new()),
            clones: AtomicBool::new(clones),
            made: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Run `f` with the GIL on a client of the store that no other call is using (see
    /// the type's documentation); a failure is the crate's transport error of `op`.
    fn call<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        Python::with_gil(|py| {
            let client = self.take(py);
            let out = match &client {
                Some(c) => f(py, c.bind(py)),
                None => f(py, self.store.bind(py)),
            };
            if let Some(c) = client {
                self.idle.lock().push(c);
            }
            out
        })
        .map_err(|e| store_error(op, e))
    }

    /// An idle clone, or a new one; `None`: call the store itself.
    fn take(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        if let Some(c) = self.idle.lock().pop() {
            return Some(c);
        }
        if !self.clones.load(Ordering::Relaxed) {
            return None;
        }
        match self.store.call_method0(py, "clone") {
            Ok(c) => {
                self.made.fetch_add(1, Ordering::Relaxed);
                Some(c)
            }
            Err(_) => {
                // Not a store that clones (a Python subclass of c10d's Store without
                // it): every call uses the store itself from now on.
                self.clones.store(false, Ordering::Relaxed);
                None
            }
        }
    }
}

/// A Python exception raised by the store, as the crate's transport error.
fn store_error(op: &'static str, e: PyErr) -> Error {
    let detail = e.to_string();
    Error::Transport {
        op,
        detail: detail.clone(),
        source: std::io::Error::other(detail).into(),
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
        self.call("store.set", |py, store| {
            store.call_method1("set", (key, PyBytes::new(py, value)))?;
            Ok(())
        })
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.call("store.get", |_, store| {
            bytes_of(&store.call_method1("get", (key,))?)
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call("store.add", |_, store| {
            store.call_method1("add", (key, delta))?.extract::<i64>()
        })
    }

    /// One blocking `store.wait(keys, timeout)`: it returns as soon as every key
    /// exists (c10d's server answers the waiting client then), nothing polls.
    fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool> {
        self.call("store.wait", |py, store| {
            let list = PyList::new(py, keys)?;
            match store.call_method1("wait", (list, timedelta(py, timeout)?)) {
                Ok(_) => Ok(true),
                Err(e) if is_timeout(py, &e) => Ok(false),
                Err(e) => Err(e),
            }
        })
    }

    fn check(&self, keys: &[String]) -> Result<bool> {
        let has_check = Python::with_gil(|py| self.store.bind(py).hasattr("check"))
            .map_err(|e| store_error("store.check", e))?;
        if !has_check {
            return self.wait(keys, Duration::from_millis(1));
        }
        self.call("store.check", |py, store| {
            let list = PyList::new(py, keys)?;
            store.call_method1("check", (list,))?.extract()
        })
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call("store.delete_key", |_, store| {
            if store.hasattr("delete_key")? {
                store.call_method1("delete_key", (key,))?;
            }
            Ok(())
        })
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
/// Round `r` of channel `c` on rank `k` is the key `PREFIX/c/r/k`. A rank sets its key,
/// then waits for the round's keys with the store's own blocking `wait(keys,
/// timeout)`, which returns as soon as every key exists: one wait up to the call's
/// deadline (`poll_s=None`, the default; a wait is cut where the crate logs its
/// warning naming the missing ranks, every 30 s), or waits of at most `poll_s`
/// seconds, between which the rank looks whether another broke the group. Each call
/// runs on a client of the store of its own (`store.clone()`), so that one thread's
/// wait never holds up another's call. A rank that waits past its deadline fails with
/// a timeout and breaks the group (the key `PREFIX/broken`): every other rank fails
/// at its next round, or when its own wait ends (within `poll_s` where it is set, by
/// its own deadline otherwise). A rank that dies is noticed only through deadlines
/// (the store has no heartbeat): the survivors fail when their calls' timeouts pass
/// (the pool's `timeout_s`, 60 s by default).
#[pyclass(frozen, module = "symmpool._ext")]
pub struct StoreExchange {
    kv: Arc<KvExchange<PyStore>>,
    channels: Channels,
    /// The store's clients made so far (its clones).
    clients: Arc<AtomicUsize>,
}

#[pymethods]
impl StoreExchange {
    /// `StoreExchange(store, rank, world_size, prefix="symmpool", poll_s=None)`.
    ///
    /// `store`: torch's `c10d.Store` (or any object with `set`, `get`, `add`, `wait`,
    /// and optionally `check`, `delete_key`, `clone`). `poll_s`: `None` (each round's
    /// keys waited for in one blocking `store.wait` up to the deadline) or the longest
    /// single wait in seconds (> 0).
    #[new]
    #[pyo3(signature = (store, rank, world_size, prefix = "symmpool".to_string(), poll_s = None))]
    fn new(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        prefix: String,
        poll_s: Option<f64>,
    ) -> PyResult<Self> {
        let poll = match poll_s {
            None => Duration::MAX,
            Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
            Some(s) => {
                return Err(PyValueError::new_err(format!(
                    "poll_s must be a positive number of seconds, or None (one wait up to the deadline), not {s}"
                )));
            }
        };
        let config = KvConfig::new(prefix).with_poll(poll);
        let store = PyStore::new(py, store)?;
        let clients = store.made.clone();
        let kv = Arc::new(KvExchange::new(store, rank, world_size, config).map_err(to_py)?);
        Ok(StoreExchange {
            channels: Channels::new(kv.clone()),
            kv,
            clients,
        })
    }

    /// The longest single wait on the store, in seconds (`None`: up to the deadline).
    #[getter]
    fn poll_s(&self) -> Option<f64> {
        let poll = self.kv.config().poll;
        (poll != Duration::MAX).then_some(poll.as_secs_f64())
    }

    /// How many clients of the store this exchange has made (`store.clone()`): at most
    /// as many as its calls that ever ran at once; 0 for a store without `clone`.
    #[getter]
    fn store_clients(&self) -> usize {
        self.clients.load(Ordering::Relaxed)
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
///
/// With `SYMMPOOL_JOIN=1` (and the store outside the ranks, `SYMMPOOL_STORE_EXTERNAL=1`)
/// the process is a newcomer that replaces the lost job rank `RANK`: `from_env()`
/// waits until the group's ranks grow (`Pool.grow()`) and returns its place in the
/// grown group (`newcomer` is then `True`, and the pools made over it join the
/// group: `Pool.shm`).
#[pyclass(frozen, module = "symmpool._ext")]
pub struct TcpStoreExchange {
    exchange: Arc<symmpool::StoreExchange>,
    channels: Channels,
}

/// The crate's store exchange from the launcher's environment (with `SYMMPOOL_JOIN=1`
/// a newcomer's: it returned once the group's ranks grew the group with it).
pub(crate) fn store_from_env() -> Result<symmpool::StoreExchange> {
    symmpool::StoreExchange::connect(StoreConfig::from_env()?)
}

#[pymethods]
impl TcpStoreExchange {
    /// Join the store from the launcher's environment (rank 0 hosts it) and wait until
    /// every rank has joined, within the start-up timeout (`SYMMPOOL_STARTUP_TIMEOUT_MS`,
    /// see the crate's `StoreConfig`). Collective: every rank of the job calls it.
    ///
    /// With `SYMMPOOL_JOIN=1`, a newcomer: it waits (up to the same start-up timeout)
    /// until the group's ranks grow the group with it, and takes the lost job rank's
    /// place (`rank`).
    ///
    /// Raises `ConfigurationError` for a missing or invalid launcher variable, or a
    /// store of another job on the port; `SymmpoolTimeoutError` naming the ranks that
    /// never joined (on a newcomer: no grow took it in).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<TcpStoreExchange> {
        let exchange = Arc::new(py.allow_threads(store_from_env).map_err(to_py)?);
        Ok(TcpStoreExchange {
            channels: Channels::new(exchange.clone()),
            exchange,
        })
    }

    /// Whether this process joined a grown group as a newcomer (`SYMMPOOL_JOIN=1`):
    /// the pools made over this exchange join the group's (`Pool.shm`; `pool.joined`).
    #[getter]
    fn newcomer(&self) -> bool {
        self.exchange.is_newcomer()
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
            "TcpStoreExchange(rank={}, world_size={}, newcomer={})",
            self.exchange.rank(),
            self.exchange.world_size(),
            if self.exchange.is_newcomer() {
                "True"
            } else {
                "False"
            }
        )
    }
}

/// The crate's TCP store in a process of its own (a launcher's host), so that no rank
/// hosts it and any rank, rank 0 included, can be lost while the survivors shrink and
/// go on; the ranks run with `SYMMPOOL_STORE_EXTERNAL=1`. `python -m symmpool.store`
/// runs one.
#[pyclass(frozen, module = "symmpool._ext")]
pub struct StoreServer {
    server: symmpool::control::StoreServer,
}

#[pymethods]
impl StoreServer {
    /// Listen on `ip` for a job of `world_size` ranks, with the settings its ranks read
    /// from the environment (the port `SYMMPOOL_STORE_PORT`, else `MASTER_PORT`; the
    /// token, job identity and heartbeats).
    ///
    /// Raises `ConfigurationError` for an invalid setting, `TransportError` if the
    /// address cannot be bound.
    #[new]
    #[pyo3(signature = (world_size, ip = "0.0.0.0"))]
    fn new(world_size: usize, ip: &str) -> PyResult<StoreServer> {
        let server = symmpool::control::StoreServer::bind_from_env(world_size, ip);
        Ok(StoreServer {
            server: server.map_err(to_py)?,
        })
    }

    /// The address listened on, `"host:port"`.
    #[getter]
    fn address(&self) -> String {
        self.server.local_addr().to_string()
    }

    /// Wait until every rank has joined and then left (ended or lost), or `timeout_s`
    /// seconds, or the ranks' start-up timeout without every rank joined: `"ended"`,
    /// `"deadline"` or `"not_assembled"`. Python's signals (Ctrl-C) are checked every
    /// 0.2 s.
    fn wait_until_done(&self, py: Python<'_>, timeout_s: f64) -> PyResult<&'static str> {
        let deadline = symmpool::Deadline::after(seconds("timeout_s", Some(timeout_s))?);
        loop {
            let slice = deadline.min(symmpool::Deadline::after(Duration::from_millis(200)));
            match py.allow_threads(|| self.server.wait_until_done(slice)) {
                JobEnd::Ended => return Ok("ended"),
                JobEnd::NotAssembled => return Ok("not_assembled"),
                _ if deadline.expired() => return Ok("deadline"),
                _ => py.check_signals()?,
            }
        }
    }

    /// Rounds the ranks completed through the store.
    #[getter]
    fn rounds_completed(&self) -> u64 {
        self.server.stats().rounds_completed
    }

    /// Ranks that joined and then left or were lost.
    #[getter]
    fn ranks_departed(&self) -> u64 {
        self.server.stats().ranks_departed
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
