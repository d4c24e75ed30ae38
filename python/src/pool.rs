//! `symmpool._ext.Pool` and `Buffer`: one rank's pool, its allocations (DLPack tensors,
//! buffer handles), its collectives and its statistics.

use crate::dtype::DType;
use crate::errors::{seconds, to_py, usage};
use crate::render::{render_ranks, render_svg};
use crate::store::{AnyExchange, StoreExchange, store_from_env};
use crate::{dlpack, live};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};
use std::path::PathBuf;
use std::sync::Arc;
use symmpool::backend::CommRole;
use symmpool::backend::nccl::{CUstream, ncclComm_t};
use symmpool::backend::shm::{ShmBackend, ShmConfig};
use symmpool::coll::{CalibrateConfig, CollectiveReport, path_name};
use symmpool::observe::{PoolSnapshot, StatValue};
use symmpool::{
    Backend, CheckMode, Coll, CollectiveCalls, Error, Group, GroupConfig, HostBackend, HostConfig,
    NcclBackend, NcclConfig, PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool, bf16, f16,
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

/// The pool's group's settings and its own, from the constructors' arguments: `check` is `"strict"`,
/// `"async"`, `"off"` or `None` (the `SYMMPOOL_CHECK` variable, else async);
/// `check_queue` the async check's bound in records (`None`: the crate's default, 1);
/// `untagged_collectives` accepts collectives without `tag=` (by default they raise
/// `UsageError`).
fn pool_config(
    name: &str,
    timeout_s: Option<f64>,
    check: Option<&str>,
    check_queue: Option<usize>,
    untagged_collectives: bool,
) -> PyResult<(GroupConfig, PoolConfig)> {
    // The environment's `SYMMPOOL_CHECK` unless `check` is given.
    let mut config = GroupConfig::from_env().with_timeout(seconds("timeout_s", timeout_s)?);
    let pool =
        (PoolConfig::default().with_name(name)).with_untagged_collectives(untagged_collectives);
    if let Some(check) = check {
        config = config.with_check(check_mode(check)?);
    }
    if let Some(records) = check_queue {
        if records == 0 {
            return Err(PyValueError::new_err(
                "check_queue must be at least 1 record",
            ));
        }
        config = config.with_check_queue(records);
    }
    Ok((config, pool))
}

fn check_mode(name: &str) -> PyResult<CheckMode> {
    [CheckMode::Strict, CheckMode::Async, CheckMode::Off]
        .into_iter()
        .find(|m| m.name() == name)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "check must be \"strict\", \"async\", \"off\" or None, not {name:?}"
            ))
        })
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

/// A collective's tag as Python gives it: an `int` from 0 to 2**64 - 1 (0 is a tag
/// like any other); `None` (the argument's default) is an untagged call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tag(u64);

impl<'py> FromPyObject<'py> for Tag {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if !ob.is_instance_of::<PyInt>() || ob.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "tag must be an int (or None: untagged), not {}",
                ob.get_type().name()?
            )));
        }
        ob.extract::<u64>().map(Tag).map_err(|_| {
            PyValueError::new_err(format!("tag must be from 0 to 2**64 - 1, not {ob}"))
        })
    }
}

/// A byte count or address as Python gives it: an `int` from 0 to 2**64 - 1. Anything
/// else is a plain `ValueError` (a negative or too large int) or `TypeError` (not an
/// int), as the README promises for a bad argument (pyo3's own conversion would raise
/// `OverflowError` for -1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bytes(u64);

impl<'py> FromPyObject<'py> for Bytes {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if !ob.is_instance_of::<PyInt>() || ob.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "a byte count or address must be an int, not {}",
                ob.get_type().name()?
            )));
        }
        ob.extract::<u64>().map(Bytes).map_err(|_| {
            PyValueError::new_err(format!(
                "a byte count or address must be from 0 to 2**64 - 1, not {ob}"
            ))
        })
    }
}

/// A collective as the bindings call it: which one, on which buffers (`output`
/// `None`: in place), of which element type.
struct Call<'a> {
    op: Op,
    input: &'a SymmBuffer,
    output: Option<&'a SymmBuffer>,
    dtype: DType,
}

/// Which collective (with its reduction).
#[derive(Clone, Copy)]
enum Op {
    AllGather,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
}

impl Call<'_> {
    /// Run it on `stream`, carrying `tag` (`None`: untagged).
    fn run(
        &self,
        coll: &Coll,
        tag: Option<Tag>,
        stream: &Stream,
    ) -> symmpool::Result<CollectiveReport> {
        match tag {
            Some(Tag(tag)) => self.run_on(&coll.tagged(tag), stream),
            None => self.run_on(coll, stream),
        }
    }

    fn run_on<C: CollectiveCalls>(
        &self,
        c: &C,
        stream: &Stream,
    ) -> symmpool::Result<CollectiveReport> {
        match self.dtype {
            DType::F32 => self.typed::<C, f32>(c, stream),
            DType::BF16 => self.typed::<C, bf16>(c, stream),
            DType::F16 => self.typed::<C, f16>(c, stream),
            DType::U8 => self.typed::<C, u8>(c, stream),
        }
    }

    fn typed<C: CollectiveCalls, T: symmpool::Element>(
        &self,
        c: &C,
        stream: &Stream,
    ) -> symmpool::Result<CollectiveReport> {
        let input = self.input;
        match (self.op, self.output) {
            (Op::AllGather, None) => c.all_gather_in_place::<T>(input, stream),
            (Op::AllGather, Some(output)) => c.all_gather::<T>(input, output, stream),
            (Op::ReduceScatter(op), None) => c.reduce_scatter_in_place::<T>(input, op, stream),
            (Op::ReduceScatter(op), Some(output)) => {
                c.reduce_scatter::<T>(input, output, op, stream)
            }
            (Op::AllReduce(op), None) => c.all_reduce_in_place::<T>(input, op, stream),
            (Op::AllReduce(op), Some(output)) => c.all_reduce::<T>(input, output, op, stream),
        }
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
///
/// Collectives (`Buffer.all_gather`, `reduce_scatter`, `all_reduce`, and the
/// by-address `all_gather_at`, … for DLPack tensors) are checked across ranks as
/// `check` says (every constructor takes it): `"strict"` compares each call's record
/// before it runs (a mismatch is a `DivergenceError` on every rank and no data
/// moves); `"async"` (the default, or the `SYMMPOOL_CHECK` variable) compares them
/// off the calling thread (a mismatch is a `DivergenceError` from a later call on
/// every rank, at the latest `check_queue` + 1 collectives later, or from
/// `end_step()` / `wait_checks()`; the diverging calls may have moved data);
/// `"off"` checks nothing. Each collective takes `tag=`, an int that identifies the
/// call (a hash of the layer, say; 0 is a tag like any other): calls of the same shape
/// for different layers then differ in the field `"tag"`, so a rank that skips one is
/// caught at that call. A collective without `tag=` raises `UsageError` (nothing runs)
/// unless the pool was made with `untagged_collectives=True` (every constructor takes
/// it; every rank alike). `end_step()` marks a step boundary.
///
/// After a lost rank the survivors `shrink()` and go on; newcomers started with
/// `SYMMPOOL_JOIN=1` as the lost job ranks later join them when they `grow()`: a
/// newcomer's `Pool.shm()` joins the group's pool (`joined` is its `GrowReport`).
#[pyclass(frozen, module = "symmpool._ext")]
pub struct Pool {
    pub(crate) handle: GilFree<Arc<Handle>>,
    /// On a newcomer's pool, what its join did.
    joined: Option<GrowReport>,
}

/// A value dropped without the GIL. Python drops its objects holding the GIL, and a
/// pool's last handle joins its ledger's thread, which may be inside a Python store's
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
    #[pyo3(signature = (world_size, name = "symmpool", timeout_s = 60.0, exchanges = None,
        check = None, check_queue = None, untagged_collectives = false))]
    #[allow(clippy::too_many_arguments)]
    fn host_group(
        py: Python<'_>,
        world_size: usize,
        name: &str,
        timeout_s: Option<f64>,
        exchanges: Option<Vec<Py<StoreExchange>>>,
        check: Option<&str>,
        check_queue: Option<usize>,
        untagged_collectives: bool,
    ) -> PyResult<Vec<Pool>> {
        let (group_config, config) =
            pool_config(name, timeout_s, check, check_queue, untagged_collectives)?;
        let host = HostConfig::new(world_size);
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
                let pools = SymmPool::world(&Group::world(backends, &group_config)?, &config)?;
                let colls = Coll::world(&pools)?;
                Ok((pools, colls))
            })
            .map_err(to_py)?;
        Ok(pools
            .into_iter()
            .zip(colls)
            .map(|(p, c)| Pool::made(p, c, None))
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
    ///
    /// On a newcomer (`SYMMPOOL_JOIN=1` in the environment, the lost job rank's `RANK`,
    /// the store outside the ranks: a launcher restarting the same script), the
    /// exchange from the environment (or a `TcpStoreExchange` made so, `newcomer`
    /// `True`) waits until the group's ranks grow, and this joins their pool: the
    /// survivors' `grow()` of the pool of the same name, with their layout (segments
    /// of the same sizes, registered with theirs; every rank's next placement is
    /// identical). `pool.joined` is then the join's `GrowReport` (`None` on a pool
    /// made with the group): the newcomer loads its state (from the survivors, or a
    /// checkpoint) instead of starting afresh. A newcomer makes its pools in the
    /// order the survivors grow theirs, with the same names and settings.
    #[staticmethod]
    #[pyo3(signature = (exchange = None, name = "symmpool", timeout_s = 60.0, symmetric = true,
        max_reserved_bytes = None, check = None, check_queue = None, untagged_collectives = false))]
    #[allow(clippy::too_many_arguments)]
    fn shm(
        py: Python<'_>,
        exchange: Option<AnyExchange<'_>>,
        name: &str,
        timeout_s: Option<f64>,
        symmetric: bool,
        max_reserved_bytes: Option<u64>,
        check: Option<&str>,
        check_queue: Option<usize>,
        untagged_collectives: bool,
    ) -> PyResult<Pool> {
        let (group_config, config) =
            pool_config(name, timeout_s, check, check_queue, untagged_collectives)?;
        let ex = match exchange {
            Some(ex) => ex.exchange(),
            None => Arc::new(py.allow_threads(store_from_env).map_err(to_py)?),
        };
        let newcomer = ex.is_newcomer();
        let mut shm = ShmConfig::default().with_symmetric(symmetric);
        if let Some(bytes) = max_reserved_bytes {
            shm = shm.with_max_reserved_bytes(bytes);
        }
        let (pool, coll, joined) = py
            .allow_threads(move || {
                let group = Group::new(ShmBackend::join(ex, shm)?, group_config)?;
                let (pool, joined) = if newcomer {
                    let (pool, report) = SymmPool::join(&group, config)?;
                    (pool, Some(report))
                } else {
                    (SymmPool::new(&group, config)?, None)
                };
                let coll = Coll::new(&pool)?;
                Ok((pool, coll, joined))
            })
            .map_err(to_py)?;
        Ok(Pool::made(pool, coll, joined.map(GrowReport::from)))
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
        watchdog_timeout_s = 600.0, check = None, check_queue = None, untagged_collectives = false))]
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
        check: Option<&str>,
        check_queue: Option<usize>,
        untagged_collectives: bool,
    ) -> PyResult<Pool> {
        if comm_ptr == 0 {
            return Err(PyValueError::new_err(
                "the communicator pointer is 0 (no communicator yet, or the current CUDA device is wrong)",
            ));
        }
        not_a_newcomer(&exchange, "Pool.nccl_adopt")?;
        let (group_config, config) =
            pool_config(name, timeout_s, check, check_queue, untagged_collectives)?;
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
                let pool = SymmPool::new(&Group::new(backend, group_config)?, config)?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll))
            })
            .map_err(to_py)?;
        Ok(Pool::made(pool.0, pool.1, None))
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
        timeout_s = 60.0, check = None, check_queue = None, untagged_collectives = false))]
    #[allow(clippy::too_many_arguments)]
    fn nccl_wrap(
        py: Python<'_>,
        comm_ptr: usize,
        device: usize,
        exchange: AnyExchange<'_>,
        name: &str,
        cta_policy: i32,
        timeout_s: Option<f64>,
        check: Option<&str>,
        check_queue: Option<usize>,
        untagged_collectives: bool,
    ) -> PyResult<Pool> {
        if comm_ptr == 0 {
            return Err(PyValueError::new_err(
                "the communicator pointer is 0 (no communicator yet, or the current CUDA device is wrong)",
            ));
        }
        not_a_newcomer(&exchange, "Pool.nccl_wrap")?;
        let (group_config, config) =
            pool_config(name, timeout_s, check, check_queue, untagged_collectives)?;
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
                let pool = SymmPool::new(&Group::new(backend, group_config)?, config)?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll))
            })
            .map_err(to_py)?;
        Ok(Pool::made(pool.0, pool.1, None))
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
    fn alloc(&self, py: Python<'_>, nbytes: Bytes, stream: usize) -> PyResult<Buffer> {
        let Bytes(nbytes) = nbytes;
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
    fn alloc_dlpack(&self, py: Python<'_>, nbytes: Bytes, stream: usize) -> PyResult<PyObject> {
        let Bytes(nbytes) = nbytes;
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
    /// stream `stream`, carrying `tag` (an int; `None`: untagged, a `UsageError` unless
    /// the pool was made with `untagged_collectives=True`). Returns the path taken.
    /// Collective: every rank, same order, same size and tag.
    ///
    /// An address that is not the start of a live buffer of this pool, or a size that
    /// is not the buffer's, is a `ValueError` (the FSDP comm objects then hand the call
    /// to `torch.distributed`); a failure of the collective is the crate's exception.
    #[pyo3(signature = (ptr, nbytes, stream = 0, *, tag = None))]
    fn all_gather_at(
        &self,
        py: Python<'_>,
        ptr: Bytes,
        nbytes: Bytes,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let buf = self.buffer_at(ptr, nbytes)?;
        self.run_at(py, Op::AllGather, &buf, None, DType::U8, stream, tag)
    }

    /// In-place reduce-scatter of the buffer at `ptr` (`dtype`: float32, bfloat16,
    /// float16 or uint8, as a string such as `"bf16"` or a torch dtype such as
    /// `torch.bfloat16`; `op`: sum, avg, prod, max, min): afterwards this rank's chunk
    /// holds the reduction. `tag` as for `all_gather_at`. Returns the path taken.
    /// Collective.
    #[pyo3(signature = (ptr, nbytes, dtype, op = "sum", stream = 0, *, tag = None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_at(
        &self,
        py: Python<'_>,
        ptr: Bytes,
        nbytes: Bytes,
        dtype: DType,
        op: &str,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let buf = self.buffer_at(ptr, nbytes)?;
        let op = Op::ReduceScatter(reduce_op(op)?);
        self.run_at(py, op, &buf, None, dtype, stream, tag)
    }

    /// Reduce-scatter of the buffer at `in_ptr` (`in_nbytes`) into the buffer at
    /// `out_ptr` (`out_nbytes` = `in_nbytes` / world size), both whole buffers of this
    /// pool (tensors from `alloc_dlpack`), on the raw stream `stream` (`dtype`, `op`
    /// and `tag` as for `reduce_scatter_at`): FSDP2's reduce-scatter, whose output
    /// FSDP2 also allocates from the comm object. One call, no copy; the path is
    /// chosen per size. Returns the path taken. Collective.
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, dtype, op = "sum", stream = 0,
        *, tag = None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_into(
        &self,
        py: Python<'_>,
        in_ptr: Bytes,
        in_nbytes: Bytes,
        out_ptr: Bytes,
        out_nbytes: Bytes,
        dtype: DType,
        op: &str,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let input = self.buffer_at(in_ptr, in_nbytes)?;
        let output = self.buffer_at(out_ptr, out_nbytes)?;
        let op = Op::ReduceScatter(reduce_op(op)?);
        self.run_at(py, op, &input, Some(&output), dtype, stream, tag)
    }

    /// In-place all-reduce of the buffer at `ptr` (`nbytes`): afterwards it holds the
    /// reduction `op` over ranks (`dtype`, `op` and `tag` as for `reduce_scatter_at`).
    /// Returns the path taken. Collective.
    #[pyo3(signature = (ptr, nbytes, dtype, op = "sum", stream = 0, *, tag = None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_at(
        &self,
        py: Python<'_>,
        ptr: Bytes,
        nbytes: Bytes,
        dtype: DType,
        op: &str,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let buf = self.buffer_at(ptr, nbytes)?;
        let op = Op::AllReduce(reduce_op(op)?);
        self.run_at(py, op, &buf, None, dtype, stream, tag)
    }

    /// All-reduce of the buffer at `in_ptr` into the buffer at `out_ptr`, both
    /// `nbytes` long and whole buffers of this pool (`dtype`, `op` and `tag` as for
    /// `reduce_scatter_at`). Returns the path taken. Collective.
    #[pyo3(signature = (in_ptr, out_ptr, nbytes, dtype, op = "sum", stream = 0, *, tag = None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_into(
        &self,
        py: Python<'_>,
        in_ptr: Bytes,
        out_ptr: Bytes,
        nbytes: Bytes,
        dtype: DType,
        op: &str,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let input = self.buffer_at(in_ptr, nbytes)?;
        let output = self.buffer_at(out_ptr, nbytes)?;
        let op = Op::AllReduce(reduce_op(op)?);
        self.run_at(py, op, &input, Some(&output), dtype, stream, tag)
    }

    /// A step boundary: under the `"strict"` and `"async"` checks, the ranks compare
    /// where each is (per pool and communicator: the collectives issued, the pool's
    /// calls), then wait until every collective record is compared, so that a skipped
    /// or extra collective (tagged or not) or allocation fails here on every rank
    /// within one exchange round, as a `DivergenceError`. Nothing under `"off"` or at
    /// world size 1. Collective: every rank at the same point of its calls, once per
    /// step (the FSDP2 comm objects call it themselves, see `symmpool.fsdp`).
    fn end_step(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.clone();
        py.allow_threads(move || handle.coll.end_step())
            .map_err(to_py)
    }

    /// Wait until every collective record this rank posted has been compared with
    /// the peers' (under `"async"`; at once otherwise) and raise what the checks found
    /// (a `DivergenceError`, ...): before reading results that must be trusted.
    /// Collective in effect: the comparison needs the peers' records.
    fn wait_checks(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.clone();
        py.allow_threads(move || handle.coll.wait_checks())
            .map_err(to_py)
    }

    /// How the pool's collectives are checked across ranks: `"strict"`, `"async"` or
    /// `"off"` (`"off"` at world size 1, whatever the setting: no peer to compare with).
    #[getter]
    fn check(&self) -> &'static str {
        self.handle.coll.check_mode().name()
    }

    /// Whether the pool accepts collectives without `tag=` (made with
    /// `untagged_collectives=True`); otherwise they raise `UsageError`.
    #[getter]
    fn untagged_collectives(&self) -> bool {
        self.handle.pool.config().untagged_collectives
    }

    /// Whether this job should calibrate the automatic path choice (`calibrate()`):
    /// the crate's rule (`Coll::needs_calibration`): on NCCL with more than one rank,
    /// when ranks share a GPU or span several nodes (the default thresholds were
    /// measured with every rank on its own GPU of one node); never on the host and
    /// shared-memory backends. The same on every rank.
    #[getter]
    fn needs_calibration(&self) -> bool {
        self.handle.coll.needs_calibration()
    }

    /// Why calibration is needed (`"shared GPU"`, `"several nodes"`), or `None`.
    #[getter]
    fn calibration_reason(&self) -> Option<&'static str> {
        self.handle.coll.calibration_reason()
    }

    /// The automatic path choice in use, as one line (per collective, the path of
    /// each size range).
    #[getter]
    fn path_policy(&self) -> String {
        self.handle.coll.path_policy().to_string()
    }

    /// Measure every path of all-gather, reduce-scatter and all-reduce at
    /// `min_bytes`, the powers of two between and `max_bytes` per rank (`reps`
    /// repetitions, each of `bytes_per_rep` / size calls, 3 to 500; `None`: about 3
    /// calls at `max_bytes`, at most 8 at `min_bytes`), on the raw stream `stream`,
    /// in a temporary pool on this pool's communicators, and derive the automatic
    /// choice from rank 0's figures: the fastest path at each size. With `apply`
    /// (the default) the pool's collectives use it from the next call. Returns a
    /// dict: `policy` (the line, as `path_policy`), `ce_all_gather_min_bytes`,
    /// `plain_all_gather_bands`, `symmetric_reduce_scatter_bands`,
    /// `symmetric_all_reduce_bands` (inclusive `[lo, hi]` byte ranges),
    /// `min_bytes`, `max_bytes`, `ms` (the time it took) and `measurements` (rank
    /// 0's bus bandwidths in GB/s per size: `all_gather` `[symmetric, copy engine,
    /// plain]`, `reduce_scatter` and `all_reduce` `[symmetric, plain]`, `None`
    /// where the path did not run). Collective: every rank at the same point with
    /// the same arguments; every rank gets the same policy.
    #[pyo3(signature = (min_bytes = 64 << 10, max_bytes = 64 << 20, *, reps = 3,
        bytes_per_rep = None, stream = 0, apply = true))]
    #[allow(clippy::too_many_arguments)]
    fn calibrate(
        &self,
        py: Python<'_>,
        min_bytes: u64,
        max_bytes: u64,
        reps: usize,
        bytes_per_rep: Option<u64>,
        stream: usize,
        apply: bool,
    ) -> PyResult<PyObject> {
        let mut config = CalibrateConfig::quick(min_bytes, max_bytes).with_reps(reps);
        if let Some(bytes) = bytes_per_rep {
            config = config.with_bytes_per_rep(bytes);
        }
        let handle = self.handle.clone();
        let t0 = std::time::Instant::now();
        let calibration = py
            .allow_threads(move || {
                // SAFETY: the Python caller passes a stream of the pool's device that
                // outlives the pool (documented on `symmpool.Pool`).
                let s = unsafe { handle.stream(stream) }?;
                let calibration = handle.coll.calibrate(&s, &config)?;
                if apply {
                    handle.coll.set_path_policy(calibration.policy.clone());
                }
                Ok(calibration)
            })
            .map_err(to_py)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let p = &calibration.policy;
        let out = serde_json::json!({
            "policy": p.to_string(),
            "ce_all_gather_min_bytes": p.ce_all_gather_min_bytes,
            "plain_all_gather_bands": p.plain_all_gather_bands,
            "symmetric_reduce_scatter_bands": p.symmetric_reduce_scatter_bands,
            "symmetric_all_reduce_bands": p.symmetric_all_reduce_bands,
            "min_bytes": min_bytes,
            "max_bytes": max_bytes,
            "ms": ms,
            "measurements": calibration.measurements,
        });
        let text = out.to_string();
        let json = py.import("json")?;
        Ok(json.call_method1("loads", (text,))?.unbind())
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
        let snap = py.allow_threads(move || {
            let (snap, history) = handle.pool.memory_snapshot_with_history();
            crate::torch::torch_snapshot(&snap, &history, device)
        });
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

    /// Go on without the lost ranks, after a `PeerLostError` (or a broken pool whose
    /// message names a lost rank): returns `(pool, report)`, the survivors' pool (this
    /// rank numbered anew: `report.rank`, `report.world_size`) and a `ShrinkReport`.
    /// Collective: every survivor calls it, for each of its pools in the same order.
    ///
    /// The new pool keeps this pool's memory, blocks and call history (no
    /// reallocation: the segments are registered anew on the survivors'
    /// communicators), its settings (check mode, tags required, timeout) and its
    /// collectives run among the survivors. This pool is done: every call on it, and
    /// every collective on a buffer allocated from it, is a `UsageError` saying so
    /// (such a buffer's layout was made for the old world size; its data stays
    /// readable and writable: allocate anew from the new pool and copy). Buffers of
    /// this pool return their blocks to the new pool when freed; free them before
    /// the new pool's `close()`.
    ///
    /// Raises `ShrinkFailed` when the group cannot shrink: `retry` `True` (a second
    /// rank was lost while the survivors agreed: call it again, on every survivor) or
    /// `False` (the rank lost hosted the crate's store, rank 0; the store went on
    /// without this rank; the pool's exchange cannot shrink, such as one over torch's
    /// store: restart); `PeerLostError` when a survivor is lost while the new pool is
    /// set up (call it again); `SymmpoolTimeoutError` when a survivor does not ask in
    /// time; `DivergenceError` when the survivors' pools differ. On error this pool is
    /// left as it was (broken). A failure making the new pool's collectives (after a
    /// successful shrink) is raised as it is, and the new pool is dropped.
    fn shrink(&self, py: Python<'_>) -> PyResult<(Pool, ShrinkReport)> {
        let handle = self.handle.clone();
        let (pool, coll, report) = py
            .allow_threads(move || {
                let (pool, report) = handle.pool.shrink()?;
                let coll = Coll::new(&pool)?;
                Ok((pool, coll, report))
            })
            .map_err(to_py)?;
        Ok((Pool::made(pool, coll, None), ShrinkReport::from(report)))
    }

    /// Go on in this pool's group grown by the newcomers waiting to join it (processes
    /// started with `SYMMPOOL_JOIN=1` as lost job ranks, whose `Pool.shm()` joins):
    /// returns `(pool, report)`, the grown group's pool and a `GrowReport` (this rank
    /// numbered anew by job rank: `report.rank`, `report.world_size`, the newcomers'
    /// ranks `report.newcomers`), or `None` when no newcomer waits once every rank has
    /// asked and some rank asked with `wait=False` (ask again later: at a step's end,
    /// say). With `wait=True` on every rank, the ranks wait for a newcomer until the
    /// pool's timeout. Collective: every rank of the group calls it, for each of its
    /// pools in the same order; the newcomers make theirs in that order.
    ///
    /// The new pool keeps this pool's memory, blocks and settings; the newcomers get
    /// its layout, so every rank's next placement is identical. This pool is done, as
    /// after `shrink()`: every call on it, and every collective on a buffer allocated
    /// from it, is a `UsageError` (the data of its buffers stays readable and
    /// writable on this rank). Their blocks stay allocated in the new pool when they
    /// are freed (the newcomers hold them too, with no buffer): free old buffers
    /// before growing to have their memory back. Hand the newcomers their state (a
    /// file, a checkpoint, a collective of the new pool) and allocate anew for the new
    /// world size.
    ///
    /// Raises `PeerLostError` when the group lost a rank (before, or while the ranks
    /// ask): `shrink()` past it, then grow; `SymmpoolTimeoutError` when a rank does
    /// not ask, or a newcomer does not come, in time; `DivergenceError` when the
    /// ranks' pools differ (they made different pool calls); `OutOfMemoryError` when
    /// a newcomer cannot allocate the segments; `ConfigurationError` for a pool whose
    /// exchange cannot grow (one over torch's store: only the crate's store,
    /// `TcpStoreExchange`, and a host world can); `UsageError` on a pool already
    /// replaced or closed. On error this pool keeps its memory and state.
    #[pyo3(signature = (*, wait = false))]
    fn grow(&self, py: Python<'_>, wait: bool) -> PyResult<Option<(Pool, GrowReport)>> {
        let handle = self.handle.clone();
        let grown = py
            .allow_threads(move || {
                let Some((pool, report)) = handle.pool.grow(wait)? else {
                    return Ok(None);
                };
                let coll = Coll::new(&pool)?;
                Ok(Some((pool, coll, report)))
            })
            .map_err(to_py)?;
        Ok(grown
            .map(|(pool, coll, report)| (Pool::made(pool, coll, None), GrowReport::from(report))))
    }

    /// On a newcomer's pool (made over an exchange that joined a grown group,
    /// `SYMMPOOL_JOIN=1`), the `GrowReport` of its join (`old_world_size` 0, this
    /// rank among `newcomers`); `None` on a pool made with its group.
    #[getter]
    fn joined(&self) -> Option<GrowReport> {
        self.joined.clone()
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
    /// The Python pool of `pool` with its collectives `coll` (`joined`: a newcomer's
    /// join report).
    fn made(pool: SymmPool, coll: Coll, joined: Option<GrowReport>) -> Pool {
        Pool {
            handle: GilFree::new(Handle::new(pool, coll)),
            joined,
        }
    }

    /// Run `op` on the live buffers `input` (and `output`; `None`: in place) of this
    /// pool on the raw stream `stream`, carrying `tag`; the path taken.
    #[allow(clippy::too_many_arguments)]
    fn run_at(
        &self,
        py: Python<'_>,
        op: Op,
        input: &SymmBuffer,
        output: Option<&SymmBuffer>,
        dtype: DType,
        stream: usize,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let handle = &*self.handle;
        let call = Call {
            op,
            input,
            output,
            dtype,
        };
        let report = py
            .allow_threads(|| {
                // SAFETY: the Python caller passes a stream of the pool's device that
                // outlives the pool (documented on `symmpool.Pool`).
                let s = unsafe { handle.stream(stream) }?;
                call.run(&handle.coll, tag, &s)
            })
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }

    /// The live buffer of this pool at `ptr`, `nbytes` long.
    fn buffer_at(&self, ptr: Bytes, nbytes: Bytes) -> PyResult<Arc<SymmBuffer>> {
        let (Bytes(ptr), Bytes(nbytes)) = (ptr, nbytes);
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

/// What `Pool.shrink()` did on this rank (the crate's `ShrinkReport`).
#[pyclass(frozen, get_all, module = "symmpool._ext")]
#[derive(Debug, Clone)]
pub struct ShrinkReport {
    /// This rank before the shrink.
    old_rank: usize,
    /// This rank in the new group (the survivors numbered densely in their old order).
    rank: usize,
    /// The world size before the shrink.
    old_world_size: usize,
    /// The world size after.
    world_size: usize,
    /// The ranks of the old group that are gone (old numbering), ascending.
    lost_ranks: Vec<usize>,
    /// Segments kept, each registered anew once on each new communicator that registers.
    segments: usize,
    /// Window registrations made on the new communicators.
    registrations: u64,
    /// Buffers of the old pool still alive on this rank (readable and writable; no
    /// collective takes them).
    live_buffers: u64,
    /// Bytes of those buffers' blocks.
    live_bytes: u64,
    /// Blocks some survivors allocated after others had stopped (they learned of the
    /// loss a few calls apart): allocated on every rank until the pool is closed.
    pinned_blocks: u64,
    /// Seconds from the call to the new pool, ready (the collectives' set-up after it
    /// not included).
    took_s: f64,
}

impl From<symmpool::ShrinkReport> for ShrinkReport {
    fn from(r: symmpool::ShrinkReport) -> Self {
        ShrinkReport {
            old_rank: r.old_rank,
            rank: r.rank,
            old_world_size: r.old_world_size,
            world_size: r.world_size,
            lost_ranks: r.lost_ranks,
            segments: r.segments,
            registrations: r.registrations,
            live_buffers: r.live_buffers,
            live_bytes: r.live_bytes,
            pinned_blocks: r.pinned_blocks,
            took_s: r.took.as_secs_f64(),
        }
    }
}

#[pymethods]
impl ShrinkReport {
    fn __repr__(&self) -> String {
        format!(
            "ShrinkReport(rank {} of {} -> {} of {}, lost_ranks={:?}, segments={}, \
             registrations={}, live_buffers={}, live_bytes={}, pinned_blocks={}, took_s={:.3})",
            self.old_rank,
            self.old_world_size,
            self.rank,
            self.world_size,
            self.lost_ranks,
            self.segments,
            self.registrations,
            self.live_buffers,
            self.live_bytes,
            self.pinned_blocks,
            self.took_s
        )
    }
}

/// What `Pool.grow()` (on a rank of the group) or a newcomer's join (`Pool.joined`) did
/// on this rank (the crate's `GrowReport`).
#[pyclass(frozen, get_all, module = "symmpool._ext")]
#[derive(Debug, Clone)]
pub struct GrowReport {
    /// This rank in the grown group (the ranks numbered by job rank: a newcomer takes
    /// the place of the job rank it replaces).
    rank: usize,
    /// The world size before the grow (0 on a newcomer).
    old_world_size: usize,
    /// The world size after.
    world_size: usize,
    /// The newcomers' ranks in the grown group, ascending.
    newcomers: Vec<usize>,
    /// Segments of the pool, each registered once on each new communicator that
    /// registers.
    segments: usize,
    /// Window registrations made on the new communicators.
    registrations: u64,
    /// Blocks allocated before the grow (buffers of the old pool on the ranks that had
    /// it): they stay allocated in the new pool, on every rank.
    pinned_blocks: u64,
    /// Bytes of those blocks.
    pinned_bytes: u64,
    /// Seconds from the call to the new pool, ready (the collectives' set-up after it
    /// not included).
    took_s: f64,
}

impl From<symmpool::GrowReport> for GrowReport {
    fn from(r: symmpool::GrowReport) -> Self {
        GrowReport {
            rank: r.rank,
            old_world_size: r.old_world_size,
            world_size: r.world_size,
            newcomers: r.newcomers,
            segments: r.segments,
            registrations: r.registrations,
            pinned_blocks: r.pinned_blocks,
            pinned_bytes: r.pinned_bytes,
            took_s: r.took.as_secs_f64(),
        }
    }
}

#[pymethods]
impl GrowReport {
    fn __repr__(&self) -> String {
        format!(
            "GrowReport(rank={}, world_size {} -> {}, newcomers={:?}, segments={}, \
             registrations={}, pinned_blocks={}, pinned_bytes={}, took_s={:.3})",
            self.rank,
            self.old_world_size,
            self.world_size,
            self.newcomers,
            self.segments,
            self.registrations,
            self.pinned_blocks,
            self.pinned_bytes,
            self.took_s
        )
    }
}

/// Refuse a newcomer's exchange where the pool cannot join (the NCCL constructors take
/// a process group's communicator, which the grown group's ranks do not share).
fn not_a_newcomer(exchange: &AnyExchange<'_>, constructor: &str) -> PyResult<()> {
    if !exchange.exchange().is_newcomer() {
        return Ok(());
    }
    Err(to_py(Error::InvalidConfig(format!(
        "{constructor} over a newcomer's exchange (SYMMPOOL_JOIN=1): a newcomer joins a \
         grown group with Pool.shm(); an NCCL pool made from a process group's \
         communicator cannot join one"
    ))))
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
/// `free()`, returns the block to the pool; any use after `free()` (a second `free()`
/// too) is a `UsageError`.
#[pyclass(frozen, module = "symmpool._ext")]
pub struct Buffer {
    buf: Mutex<Option<Arc<SymmBuffer>>>,
    /// The collectives of the buffer's pool.
    coll: GilFree<Coll>,
}

impl Buffer {
    /// The buffer, or a `UsageError` once it was freed.
    fn buffer(&self) -> PyResult<Arc<SymmBuffer>> {
        self.buf.lock().clone().ok_or_else(|| {
            usage("the buffer was freed (Buffer.free()): allocate a new one with Pool.alloc")
        })
    }

    /// Run `op` on this buffer (`out`: into that one; `None`: in place) on the stream
    /// it was allocated on, carrying `tag`; the path taken.
    fn run(
        &self,
        py: Python<'_>,
        op: Op,
        dtype: DType,
        out: Option<&Bound<'_, Buffer>>,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let input = self.buffer()?;
        let output = out.map(|o| o.get().buffer()).transpose()?;
        let call = Call {
            op,
            input: &input,
            output: output.as_deref(),
            dtype,
        };
        let coll = &*self.coll;
        let report = py
            .allow_threads(|| call.run(coll, tag, input.stream()))
            .map_err(to_py)?;
        Ok(path_name(report.path))
    }
}

#[pymethods]
impl Buffer {
    /// Bytes requested.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        Ok(self.buffer()?.len_bytes())
    }

    /// The segment it lies in.
    #[getter]
    fn segment(&self) -> PyResult<u64> {
        Ok(self.buffer()?.segment().0.into())
    }

    /// Its offset in the segment (the same on every rank).
    #[getter]
    fn offset(&self) -> PyResult<u64> {
        Ok(self.buffer()?.offset_bytes())
    }

    /// Its device address (None on a host pool).
    #[getter]
    fn device_ptr(&self) -> PyResult<Option<u64>> {
        Ok(self.buffer()?.device_ptr())
    }

    /// Copy `data` (bytes) into the start of the buffer.
    fn write(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        let buf = self.buffer()?;
        py.allow_threads(move || buf.write::<u8>(&data))
            .map_err(to_py)
    }

    /// The buffer's bytes.
    fn read(&self, py: Python<'_>) -> PyResult<Vec<u8>> {
        let buf = self.buffer()?;
        py.allow_threads(move || buf.read::<u8>()).map_err(to_py)
    }

    /// All-gather, carrying `tag` (an int from 0 to 2**64 - 1; `None`: untagged, a
    /// `UsageError` unless the pool was made with `untagged_collectives=True`). In
    /// place by default: the buffer holds world equal chunks, this rank's at `rank`;
    /// afterwards every chunk holds its rank's. With `out` (a buffer of world times
    /// this one's bytes, of the same pool): this buffer lands at chunk `rank` of every
    /// rank's `out`. Returns the path taken. Collective: every rank, same order, same
    /// sizes and tag.
    #[pyo3(signature = (*, out = None, tag = None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        out: Option<Bound<'_, Buffer>>,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        self.run(py, Op::AllGather, DType::U8, out.as_ref(), tag)
    }

    /// Reduce-scatter of `dtype` elements (float32, bfloat16, float16 or uint8, as a
    /// string or a torch dtype) with the reduction `op` (sum, avg, prod, max, min),
    /// carrying `tag` (as for `all_gather`). In place by default: afterwards this
    /// rank's chunk (of world equal chunks) holds the reduction over ranks. With `out`
    /// (a buffer of this one's bytes / world, of the same pool): `out` gets it.
    /// Returns the path taken. Collective: every rank, same order, same sizes,
    /// operation and tag.
    #[pyo3(signature = (dtype, op = "sum", *, out = None, tag = None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        dtype: DType,
        op: &str,
        out: Option<Bound<'_, Buffer>>,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let op = Op::ReduceScatter(reduce_op(op)?);
        self.run(py, op, dtype, out.as_ref(), tag)
    }

    /// All-reduce of `dtype` elements with the reduction `op`, carrying `tag` (as for
    /// `reduce_scatter`). In place by default: afterwards the buffer holds the
    /// reduction over ranks. With `out` (a buffer of the same bytes, of the same
    /// pool): `out` gets it. Returns the path taken. Collective: every rank, same
    /// order, same sizes, operation and tag.
    #[pyo3(signature = (dtype, op = "sum", *, out = None, tag = None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        dtype: DType,
        op: &str,
        out: Option<Bound<'_, Buffer>>,
        tag: Option<Tag>,
    ) -> PyResult<&'static str> {
        let op = Op::AllReduce(reduce_op(op)?);
        self.run(py, op, dtype, out.as_ref(), tag)
    }

    /// Return the block to the pool now. Any use of the buffer afterwards, a second
    /// `free()` included, is a `UsageError` (nothing else happens).
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let buf = self.buf.lock().take();
        match buf {
            // The pool's lock is taken without the GIL (see `memory_stats`).
            Some(buf) => {
                py.allow_threads(move || drop(buf));
                Ok(())
            }
            None => Err(usage(
                "the buffer was already freed (Buffer.free() twice): free each buffer once",
            )),
        }
    }
}
