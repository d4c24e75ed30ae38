//! `symmpool._ext.Pool` and `Buffer`: one rank's pool, its allocations (DLPack tensors,
//! buffer handles), its collectives and its statistics.

use crate::dtype::DType;
use crate::errors::{seconds, to_py};
use crate::store::{AnyExchange, StoreExchange};
use crate::{dlpack, live};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Arc;
use symmpool::backend::CommRole;
use symmpool::backend::nccl::{CUstream, ncclComm_t};
use symmpool::backend::shm::{ShmBackend, ShmConfig};
use symmpool::coll::{CollectiveReport, path_name};
use symmpool::observe::{PoolSnapshot, StatValue, render_ranks, render_svg};
use symmpool::{
    Backend, Coll, CollectiveCalls, Exchange, HostBackend, HostConfig, NcclBackend, NcclConfig,
    PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool, bf16, f16,
};

/// NCCL's `NCCL_CTA_POLICY_ZERO`.
const CTA_POLICY_ZERO: i32 = 2;

/// A pool and what the bindings need beside it.
#[derive(Debug)]
pub(crate) struct Handle {
    pub(crate) pool: SymmPool,
    /// The collectives on the pool's buffers.
    coll: Coll,
    /// The stream of every call on a host pool.
    host: Stream,
}

impl Handle {
    fn new(pool: SymmPool, coll: Coll) -> Arc<Self> {
        Arc::new(Handle {
            pool,
            coll,
            host: Stream::host(),
        })
    }

    /// The CUDA device of an NCCL pool.
    pub(crate) fn device(&self) -> Option<usize> {
        self.pool
            .backend()
            .downcast_ref::<NcclBackend>()
            .map(NcclBackend::device)
    }

    /// The pool's stream for a raw `cudaStream_t` (ignored on a host pool).
    ///
    /// # Safety
    /// On an NCCL pool, `raw` is a live stream of the pool's device, in its primary
    /// context, that stays alive as long as the pool (PyTorch's pooled streams and the
    /// legacy default stream, 0, do).
    pub(crate) unsafe fn stream(&self, raw: usize) -> symmpool::Result<Stream> {
        if self.device().is_none() {
            return Ok(self.host.clone());
        }
        // SAFETY: the caller's contract.
        unsafe { Stream::from_raw_cuda(self.pool.backend(), raw as CUstream) }
    }
}

fn pool_config(name: &str, timeout_s: Option<f64>) -> PyResult<PoolConfig> {
    let mut config = PoolConfig::default().with_timeout(seconds("timeout_s", timeout_s)?);
    config.name = name.to_owned();
    Ok(config)
}

fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    Ok(match op {
        "sum" => ReduceOp::Sum,
        "avg" => ReduceOp::Avg,
        "prod" => ReduceOp::Prod,
        "max" => ReduceOp::Max,
        "min" => ReduceOp::Min,
        _ => return Err(PyValueError::new_err(format!("unknown reduction {op:?}"))),
    })
}

/// Run an in-place reduce-scatter of `dtype` elements on `buf`.
fn reduce_scatter(
    coll: &Coll,
    buf: &SymmBuffer,
    dtype: DType,
    op: ReduceOp,
    stream: &Stream,
) -> symmpool::Result<CollectiveReport> {
    match dtype {
        DType::F32 => coll.reduce_scatter_in_place::<f32>(buf, op, stream),
        DType::BF16 => coll.reduce_scatter_in_place::<bf16>(buf, op, stream),
        DType::F16 => coll.reduce_scatter_in_place::<f16>(buf, op, stream),
        DType::U8 => coll.reduce_scatter_in_place::<u8>(buf, op, stream),
    }
}

/// Run a reduce-scatter of `dtype` elements from `input` into `output` (its shard).
fn reduce_scatter_into(
    coll: &Coll,
    input: &SymmBuffer,
    output: &SymmBuffer,
    dtype: DType,
    op: ReduceOp,
    stream: &Stream,
) -> symmpool::Result<CollectiveReport> {
    match dtype {
        DType::F32 => coll.reduce_scatter::<f32>(input, output, op, stream),
        DType::BF16 => coll.reduce_scatter::<bf16>(input, output, op, stream),
        DType::F16 => coll.reduce_scatter::<f16>(input, output, op, stream),
        DType::U8 => coll.reduce_scatter::<u8>(input, output, op, stream),
    }
}

/// One rank's symmetric-memory pool.
///
/// Make it with `Pool.nccl_adopt` (communicators split off a process group's), with
/// `Pool.nccl_wrap` (windows registered on the process group's communicator itself,
/// for the pluggable allocator) or, without a GPU, `Pool.shm` (one process per rank,
/// shared memory) or `Pool.host_group` (ranks as threads). `symmpool.from_group` in
/// the Python package does the set-up from a `torch.distributed` group.
///
/// Timeouts (`timeout_s`, …) are seconds; `None` or infinity waits without a
/// deadline, a negative number is a `ValueError`. Failures raise the classes of
/// `symmpool.errors` (`UsageError`, `DivergenceError`, `SymmpoolTimeoutError`,
/// `PeerLostError`, `OutOfMemoryError`, `ConfigurationError`, all `SymmpoolError`).
#[pyclass(frozen, module = "symmpool._ext")]
pub struct Pool {
    pub(crate) handle: GilFree<Arc<Handle>>,
}

/// A value dropped without the GIL. Python drops its objects holding the GIL, and a
/// pool's last handle joins its check thread, which may be inside a Python store's
/// call waiting for the GIL: dropped with it held, both would wait until the
/// exchange's timeout.
pub(crate) struct GilFree<T: Send>(Option<T>);

impl<T: Send> GilFree<T> {
    pub(crate) fn new(value: T) -> Self {
        GilFree(Some(value))
    }
}

impl<T: Send> std::ops::Deref for GilFree<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().expect("present until dropped")
    }
}

impl<T: Send> Drop for GilFree<T> {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            Python::with_gil(|py| py.allow_threads(move || drop(value)));
        }
    }
}

#[pymethods]
impl Pool {
    /// One pool per rank of a host world (ranks as threads, host memory): for tests
    /// without a GPU. With `exchanges` (one `StoreExchange` per rank), the agreement runs
    /// over those instead of in memory.
    #[staticmethod]
    #[pyo3(signature = (world_size, name = "symmpool", timeout_s = 60.0, exchanges = None))]
    fn host_group(
        py: Python<'_>,
        world_size: usize,
        name: &str,
        timeout_s: Option<f64>,
        exchanges: Option<Vec<Py<StoreExchange>>>,
    ) -> PyResult<Vec<Pool>> {
        let config = pool_config(name, timeout_s)?;
        let host = HostConfig::new(world_size).with_timeout(config.timeout);
        let mut backends = HostBackend::world(host).map_err(to_py)?;
        if let Some(exchanges) = exchanges {
            if exchanges.len() != world_size {
                return Err(PyValueError::new_err("one exchange per rank"));
            }
            backends = backends
                .into_iter()
                .zip(exchanges)
                .map(|(b, ex)| {
                    let ex = ex.get().exchange();
                    b.with_exchange(|_| ex)
                })
                .collect::<symmpool::Result<Vec<Backend>>>()
                .map_err(to_py)?;
        }
        let (pools, colls) = py
            .allow_threads(|| {
                let pools = SymmPool::group(backends, &config)?;
                let colls = Coll::group(&pools)?;
                Ok((pools, colls))
            })
            .map_err(to_py)?;
        Ok(pools
            .into_iter()
            .zip(colls)
            .map(|(p, c)| Pool {
                handle: GilFree::new(Handle::new(p, c)),
            })
            .collect())
    }

    /// This process's pool of a world of processes on one machine (one rank per
    /// process, started by torchrun, `python -m symmpool.launch`, `srun` or `mpirun`),
    /// on the shared-memory backend: segments in shared memory that every rank maps,
    /// collectives that read the peers' memory, no GPU. Collective: every rank calls it
    /// at the same point.
    ///
    /// `exchange`: what the ranks agree over, a `TcpStoreExchange` or a
    /// `StoreExchange` (over torch's store, for example); by default
    /// `TcpStoreExchange.from_env()`, the crate's own store from the launcher's
    /// variables. `timeout_s`: how long a pool call or a collective waits for the
    /// other ranks (`None`: no deadline). `symmetric=False`: registrations give no
    /// windows (like an NCCL communicator without symmetric support: collectives take
    /// the plain path). `max_reserved_bytes`: this rank's shared-memory limit (16 GiB
    /// by default; pages are backed only when written).
    #[staticmethod]
    #[pyo3(signature = (exchange = None, name = "symmpool", timeout_s = 60.0, symmetric = true,
        max_reserved_bytes = None))]
    fn shm(
        py: Python<'_>,
        exchange: Option<AnyExchange<'_>>,
        name: &str,
        timeout_s: Option<f64>,
        symmetric: bool,
        max_reserved_bytes: Option<u64>,
    ) -> PyResult<Pool> {
        let config = pool_config(name, timeout_s)?;
        let ex = match exchange {
            Some(ex) => ex.exchange(),
            None => {
                let tcp: Arc<dyn Exchange> = Arc::new(
                    py.allow_threads(symmpool::StoreExchange::from_env)
                        .map_err(to_py)?,
                );
                tcp
            }
        };
        let mut shm = ShmConfig::default()
            .with_timeout(config.timeout)
            .with_symmetric(symmetric);
        if let Some(bytes) = max_reserved_bytes {
            shm = shm.with_max_reserved_bytes(bytes);
        }
        let (pool, coll) = py
            .allow_threads(move || {
                let backend = ShmBackend::join(ex, shm)?;
                let pool = SymmPool::new(backend, config)?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll))
            })
            .map_err(to_py)?;
        Ok(Pool {
            handle: GilFree::new(Handle::new(pool, coll)),
        })
    }

    /// Adopt a process group's communicator (`ncclComm_t` from `_comm_ptr()`): the crate
    /// splits its own non-blocking communicators off it (symmetric kernels; copy engine,
    /// NCCL ≥ 2.28; plain ring) and makes a pool over them. Collective over the group.
    ///
    /// The communicator must be a live one of the NCCL loaded in this process, on
    /// `device`, with no other NCCL call on it until this returns. `exchange`: what
    /// the ranks agree over (a `StoreExchange` over torch's store, or a
    /// `TcpStoreExchange`).
    #[staticmethod]
    #[pyo3(signature = (comm_ptr, device, exchange, name = "symmpool", copy_engine = true,
        plain = true, timeout_s = 60.0, setup_timeout_s = 600.0, call_timeout_s = 60.0,
        watchdog_timeout_s = 600.0))]
    #[allow(clippy::too_many_arguments)]
    fn nccl_adopt(
        py: Python<'_>,
        comm_ptr: usize,
        device: usize,
        exchange: AnyExchange<'_>,
        name: &str,
        copy_engine: bool,
        plain: bool,
        timeout_s: Option<f64>,
        setup_timeout_s: Option<f64>,
        call_timeout_s: Option<f64>,
        watchdog_timeout_s: Option<f64>,
    ) -> PyResult<Pool> {
        if comm_ptr == 0 {
            return Err(PyValueError::new_err(
                "the communicator pointer is 0 (no communicator yet, or the current CUDA device is wrong)",
            ));
        }
        let config = pool_config(name, timeout_s)?;
        let nccl = NcclConfig::default()
            .with_communicators(copy_engine, plain)
            .with_setup_timeout(seconds("setup_timeout_s", setup_timeout_s)?)
            .with_call_timeout(seconds("call_timeout_s", call_timeout_s)?)
            .with_watchdog(seconds("watchdog_timeout_s", watchdog_timeout_s)?);
        let ex = exchange.exchange();
        let pool = py
            .allow_threads(move || {
                // SAFETY: the Python caller hands a live communicator of this process's
                // NCCL on `device` (checked by the crate against the exchange and the
                // device), and issues no NCCL call on it until this returns (it waits
                // here).
                let backend =
                    unsafe { NcclBackend::adopt(comm_ptr as ncclComm_t, device, ex, nccl) }?;
                let pool = SymmPool::new(backend, config)?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll))
            })
            .map_err(to_py)?;
        Ok(Pool {
            handle: GilFree::new(Handle::new(pool.0, pool.1)),
        })
    }

    /// A pool whose segments are registered as windows on the process group's
    /// communicator itself (no split): PyTorch's own collectives on that group then find
    /// the windows. The communicator is PyTorch's (usually blocking: no deadline bounds
    /// a registration on it); window registration happens inside allocations, on the
    /// allocating thread, which must be the thread issuing the group's collectives.
    /// `cta_policy` is the group's `NCCLConfig.cta_policy` (2, ZERO: copy-engine
    /// all-gather). Collective over the group.
    #[staticmethod]
    #[pyo3(signature = (comm_ptr, device, exchange, name = "symmpool", cta_policy = 0,
        timeout_s = 60.0))]
    fn nccl_wrap(
        py: Python<'_>,
        comm_ptr: usize,
        device: usize,
        exchange: AnyExchange<'_>,
        name: &str,
        cta_policy: i32,
        timeout_s: Option<f64>,
    ) -> PyResult<Pool> {
        if comm_ptr == 0 {
            return Err(PyValueError::new_err(
                "the communicator pointer is 0 (no communicator yet, or the current CUDA device is wrong)",
            ));
        }
        let config = pool_config(name, timeout_s)?;
        let role = if cta_policy == CTA_POLICY_ZERO {
            CommRole::CopyEngine
        } else {
            CommRole::Symmetric
        };
        let ex = exchange.exchange();
        let pool = py
            .allow_threads(move || {
                // SAFETY: the Python caller hands a live communicator of this process's
                // NCCL on `device`, which outlives the pool (PyTorch's process group is
                // destroyed after the pool), created with `cta_policy`; NCCL calls on it
                // are serialised with PyTorch's by running on the thread that issues
                // the group's collectives (documented above).
                let backend = unsafe {
                    NcclBackend::from_raw(
                        device,
                        vec![(comm_ptr as ncclComm_t, role, cta_policy)],
                        ex,
                        NcclConfig::default(),
                    )
                }?;
                let pool = SymmPool::new(backend, config)?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll))
            })
            .map_err(to_py)?;
        Ok(Pool {
            handle: GilFree::new(Handle::new(pool.0, pool.1)),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.handle.pool.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.handle.pool.world_size()
    }

    /// The pool's name.
    #[getter]
    fn name(&self) -> String {
        self.handle.pool.config().name.clone()
    }

    /// The CUDA device (None for a host or shared-memory pool).
    #[getter]
    fn device(&self) -> Option<usize> {
        self.handle.device()
    }

    /// Allocate `nbytes` on the raw CUDA stream `stream` (ignored on a host or
    /// shared-memory pool) and return a `Buffer`. Collective when the pool grows.
    #[pyo3(signature = (nbytes, stream = 0))]
    fn alloc(&self, py: Python<'_>, nbytes: u64, stream: usize) -> PyResult<Buffer> {
        let handle = self.handle.clone();
        let buf = py
            .allow_threads(move || {
                // SAFETY: the Python caller passes a stream of the pool's device that
                // outlives the pool (documented on `symmpool.Pool`).
                let s = unsafe { handle.stream(stream) }?;
                handle.pool.alloc(nbytes, &s)
            })
            .map_err(to_py)?;
        Ok(Buffer {
            buf: Mutex::new(Some(Arc::new(buf))),
            coll: GilFree::new(self.handle.coll.clone()),
        })
    }

    /// Allocate `nbytes` on the raw CUDA stream `stream` and return a DLPack capsule of
    /// a one-dimensional `uint8` CUDA tensor over the buffer; the block returns to the
    /// pool when the tensor dies. NCCL pools only. Collective when the pool grows.
    #[pyo3(signature = (nbytes, stream = 0))]
    fn alloc_dlpack(&self, py: Python<'_>, nbytes: u64, stream: usize) -> PyResult<PyObject> {
        let device = self
            .handle
            .device()
            .ok_or_else(|| PyRuntimeError::new_err("DLPack tensors need an NCCL (GPU) pool"))?;
        let handle = self.handle.clone();
        let ptr = py
            .allow_threads(move || {
                // SAFETY: as in `alloc`.
                let s = unsafe { handle.stream(stream) }?;
                live::insert(handle.pool.alloc(nbytes, &s)?)
            })
            .map_err(to_py)?;
        dlpack::capsule(py, ptr, nbytes, device)
    }

    /// In-place all-gather (FSDP layout) of the `nbytes` at device address `ptr`, which
    /// must be a whole buffer of this pool (a tensor from `alloc_dlpack`), on the raw
    /// stream `stream`. Returns the path taken. Collective.
    #[pyo3(signature = (ptr, nbytes, stream = 0))]
    fn all_gather_at(
        &self,
        py: Python<'_>,
        ptr: u64,
        nbytes: u64,
        stream: usize,
    ) -> PyResult<&'static str> {
        let buf = self.buffer_at(ptr, nbytes)?;
        let handle = self.handle.clone();
        let report = py
            .allow_threads(move || {
                // SAFETY: as in `alloc`.
                let s = unsafe { handle.stream(stream) }?;
                handle.coll.all_gather_in_place::<u8>(&buf, &s)
            })
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// In-place reduce-scatter of the buffer at `ptr` (`dtype`: float32, bfloat16,
    /// float16 or uint8, as a string such as `"bf16"` or a torch dtype such as
    /// `torch.bfloat16`; `op`: sum, avg, prod, max, min): afterwards this rank's chunk
    /// holds the reduction. Returns the path taken. Collective.
    #[pyo3(signature = (ptr, nbytes, dtype, op = "sum", stream = 0))]
    fn reduce_scatter_at(
        &self,
        py: Python<'_>,
        ptr: u64,
        nbytes: u64,
        dtype: DType,
        op: &str,
        stream: usize,
    ) -> PyResult<&'static str> {
        let buf = self.buffer_at(ptr, nbytes)?;
        let op = reduce_op(op)?;
        let handle = self.handle.clone();
        let report = py
            .allow_threads(move || {
                // SAFETY: as in `alloc`.
                let s = unsafe { handle.stream(stream) }?;
                reduce_scatter(&handle.coll, &buf, dtype, op, &s)
            })
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// Reduce-scatter of the buffer at `in_ptr` (`in_nbytes`) into the buffer at
    /// `out_ptr` (`out_nbytes` = `in_nbytes` / world size), both whole buffers of this
    /// pool (tensors from `alloc_dlpack`), on the raw stream `stream` (`dtype` and
    /// `op` as for `reduce_scatter_at`): FSDP2's
    /// reduce-scatter, whose output FSDP2 also allocates from the comm object. One call,
    /// no copy; the path is chosen per size. Returns the path taken. Collective.
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, dtype, op = "sum", stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_into(
        &self,
        py: Python<'_>,
        in_ptr: u64,
        in_nbytes: u64,
        out_ptr: u64,
        out_nbytes: u64,
        dtype: DType,
        op: &str,
        stream: usize,
    ) -> PyResult<&'static str> {
        let input = self.buffer_at(in_ptr, in_nbytes)?;
        let output = self.buffer_at(out_ptr, out_nbytes)?;
        let op = reduce_op(op)?;
        let handle = self.handle.clone();
        let report = py
            .allow_threads(move || {
                // SAFETY: as in `alloc`.
                let s = unsafe { handle.stream(stream) }?;
                reduce_scatter_into(&handle.coll, &input, &output, dtype, op, &s)
            })
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// The flat statistics (PyTorch's key names where they mean the same), as a dict.
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The pool's lock is taken without the GIL: a growth on another thread may hold
        // it while its exchange (a torch store) waits for the GIL.
        let handle = self.handle.clone();
        let stats = py.allow_threads(move || handle.coll.memory_stats());
        let dict = PyDict::new(py);
        for (k, v) in stats {
            match v {
                StatValue::Count(n) => dict.set_item(k, n)?,
                StatValue::Real(x) => dict.set_item(k, x)?,
            }
        }
        Ok(dict)
    }

    /// Every segment, window and block, as a JSON string.
    fn memory_snapshot_json(&self, py: Python<'_>) -> PyResult<String> {
        let handle = self.handle.clone();
        let snap = py.allow_threads(move || handle.pool.memory_snapshot());
        serde_json::to_string(&snap).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Every segment, window and block, as a dict (`as_json=True`: a JSON string).
    #[pyo3(signature = (as_json = false))]
    fn memory_snapshot(&self, py: Python<'_>, as_json: bool) -> PyResult<PyObject> {
        let text = self.memory_snapshot_json(py)?;
        if as_json {
            return Ok(text.into_pyobject(py)?.into_any().unbind());
        }
        Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
    }

    /// Record every allocation, free and segment event of this pool in a ring of the
    /// last `max_entries` (PyTorch's `torch.cuda.memory._record_memory_history`);
    /// 0 stops recording and drops the history. Local.
    fn record_memory_history(&self, py: Python<'_>, max_entries: usize) {
        let handle = self.handle.clone();
        py.allow_threads(move || handle.pool.record_memory_history(max_entries));
    }

    /// This rank's segments, blocks and recorded history as the dictionary
    /// `torch.cuda.memory._snapshot()` returns (`segments`, `device_traces`), for
    /// PyTorch's memory_viz: pickle it (`Pool.dump_snapshot`). No stack frames. Local.
    fn torch_memory_snapshot(&self, py: Python<'_>) -> PyResult<PyObject> {
        let device = self.handle.device().unwrap_or(0) as u64;
        let handle = self.handle.clone();
        let snap = py.allow_threads(move || handle.pool.torch_memory_snapshot(device));
        let text =
            serde_json::to_string(&snap).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
    }

    /// Write [`torch_memory_snapshot`](Self::torch_memory_snapshot) to `path` as a
    /// pickle, the file PyTorch's memory_viz (`pytorch.org/memory_viz`,
    /// `python -m torch.cuda._memory_viz trace_plot FILE`) opens. Local.
    fn dump_snapshot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let snap = self.torch_memory_snapshot(py)?;
        let file = py.import("builtins")?.call_method1("open", (path, "wb"))?;
        let dumped = py.import("pickle")?.call_method1("dump", (snap, &file));
        file.call_method0("close")?;
        dumped.map(|_| ())
    }

    /// The memory map as an SVG picture.
    fn memory_map_svg(&self, py: Python<'_>) -> String {
        let handle = self.handle.clone();
        py.allow_threads(move || render_svg(&handle.pool.memory_snapshot()))
    }

    /// Release the free segments (collective). Returns the bytes released.
    fn trim(&self, py: Python<'_>) -> PyResult<u64> {
        let handle = self.handle.clone();
        py.allow_threads(move || handle.pool.trim()).map_err(to_py)
    }

    /// Close the pool (collective): every buffer must be gone on every rank
    /// (otherwise a `UsageError` naming the ranks that hold some, and nothing is
    /// released).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.clone();
        py.allow_threads(move || handle.pool.close()).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Pool(name={:?}, rank={}, world_size={}, device={:?})",
            self.handle.pool.config().name,
            self.handle.pool.rank(),
            self.handle.pool.world_size(),
            self.handle.device()
        )
    }
}

impl Pool {
    /// The live buffer of this pool at `ptr`, `nbytes` long.
    fn buffer_at(&self, ptr: u64, nbytes: u64) -> PyResult<Arc<SymmBuffer>> {
        let buf = live::get(ptr).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{ptr:#x} is not the start of a symmpool buffer (allocate it with the pool)"
            ))
        })?;
        if !buf.pool().same_pool(&self.handle.pool) {
            return Err(PyValueError::new_err("the buffer belongs to another pool"));
        }
        if buf.len_bytes() != nbytes {
            return Err(PyValueError::new_err(format!(
                "the buffer has {} bytes, the tensor {nbytes}",
                buf.len_bytes()
            )));
        }
        Ok(buf)
    }
}

/// Draw several ranks' snapshots (JSON strings from `memory_snapshot_json`) side by
/// side, blocks placed differently outlined in red.
#[pyfunction]
pub(crate) fn render_ranks_svg(snapshots: Vec<String>) -> PyResult<String> {
    let snaps = snapshots
        .iter()
        .map(|s| serde_json::from_str::<PoolSnapshot>(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PyValueError::new_err(format!("not a snapshot: {e}")))?;
    Ok(render_ranks(&snaps))
}

/// A pool buffer held from Python (host pools in tests; any pool). Dropping it, or
/// `free()`, returns the block to the pool.
#[pyclass(frozen, module = "symmpool._ext")]
pub struct Buffer {
    buf: Mutex<Option<Arc<SymmBuffer>>>,
    /// The collectives of the buffer's pool.
    coll: GilFree<Coll>,
}

impl Buffer {
    fn get(&self) -> PyResult<Arc<SymmBuffer>> {
        self.buf
            .lock()
            .clone()
            .ok_or_else(|| PyValueError::new_err("the buffer was freed"))
    }
}

#[pymethods]
impl Buffer {
    /// Bytes requested.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        Ok(self.get()?.len_bytes())
    }

    /// The segment it lies in.
    #[getter]
    fn segment(&self) -> PyResult<u64> {
        Ok(self.get()?.segment().0.into())
    }

    /// Its offset in the segment (the same on every rank).
    #[getter]
    fn offset(&self) -> PyResult<u64> {
        Ok(self.get()?.offset_bytes())
    }

    /// Its device address (None on a host pool).
    #[getter]
    fn device_ptr(&self) -> PyResult<Option<u64>> {
        Ok(self.get()?.device_ptr())
    }

    /// Copy `data` into the start of the buffer.
    fn write(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        let buf = self.get()?;
        py.allow_threads(move || buf.write::<u8>(&data))
            .map_err(to_py)
    }

    /// The buffer's bytes.
    fn read(&self, py: Python<'_>) -> PyResult<Vec<u8>> {
        let buf = self.get()?;
        py.allow_threads(move || buf.read::<u8>()).map_err(to_py)
    }

    /// In-place all-gather (collective): afterwards every rank's chunk holds that
    /// rank's chunk. Returns the path taken.
    fn all_gather(&self, py: Python<'_>) -> PyResult<&'static str> {
        let buf = self.get()?;
        let stream = buf.stream().clone();
        let coll = self.coll.clone();
        let report = py
            .allow_threads(move || coll.all_gather_in_place::<u8>(&buf, &stream))
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// In-place reduce-scatter (collective): the buffer holds `dtype` elements
    /// (float32, bfloat16, float16 or uint8, as a string or a torch dtype); afterwards
    /// this rank's chunk holds the reduction `op` (sum, avg, prod, max, min). Returns
    /// the path taken.
    #[pyo3(signature = (dtype, op = "sum"))]
    fn reduce_scatter(&self, py: Python<'_>, dtype: DType, op: &str) -> PyResult<&'static str> {
        let buf = self.get()?;
        let op = reduce_op(op)?;
        let stream = buf.stream().clone();
        let coll = self.coll.clone();
        let report = py
            .allow_threads(move || reduce_scatter(&coll, &buf, dtype, op, &stream))
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// Return the block to the pool now.
    fn free(&self) {
        self.buf.lock().take();
    }
}
