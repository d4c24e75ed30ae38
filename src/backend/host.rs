//! The host backend: N ranks as threads of one process, segments in host memory.
//!
//! It is not a mock. Registration is a real barrier among the ranks with NCCL's
//! ordering rule (windows pair by call order, sizes must match) and its caller's
//! deadline; collectives move and reduce real data between the ranks' segments, at
//! the offsets each rank passed (bounds checked), and end in a barrier. Like NCCL,
//! the backend does not compare the ranks' arguments: the checked collectives of
//! [`coll`](crate::coll) do, the same way on every backend. Host work is synchronous,
//! so streams are tags and fences are counters.
//!
//! A rank whose thread ends or panics drops its [`LocalExchange`]: the others' waits,
//! in the exchange and in the communicators, fail with [`Error::PeerLost`] at once, and
//! the survivors may shrink ([`Backend::shrink`]).

use super::{
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, DataMover, Region, Segment,
    SegmentMemory, SegmentProvider, StreamOps, Window,
};
use crate::control::{ChannelId, Exchange, LocalExchange, Rendezvous};
use crate::core::{Fence, StreamId};
use crate::deadline::Deadline;
use crate::dtype;
use crate::error::{Error, NcclVersion, Result, in_threads};
use crate::stream::Stream;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Settings of a host world.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HostConfig {
    /// Number of ranks (threads).
    pub world_size: usize,
    /// Whether registration yields symmetric windows. `false` behaves like an NCCL
    /// communicator without symmetric support: registration succeeds with a NULL
    /// window (no [`Window`]).
    pub symmetric: bool,
    /// Segment granularity in bytes (default 2 MiB, as `ncclMemAlloc` on H200).
    pub granularity_bytes: u64,
    /// Most host memory one rank may reserve, in bytes (default 64 GiB; pages are only
    /// touched when written).
    pub max_reserved_bytes: u64,
    /// The NCCL version whose rules the host backend reports (default 2.28.3, the GPU
    /// machine's).
    pub nccl_version: NcclVersion,
}

impl HostConfig {
    /// Defaults for `world_size` ranks.
    pub fn new(world_size: usize) -> Self {
        HostConfig {
            world_size,
            symmetric: true,
            granularity_bytes: 2 << 20,
            max_reserved_bytes: 64 << 30,
            nccl_version: NcclVersion::new(2, 28, 3),
        }
    }

    setters! {
        with_symmetric(symmetric: bool);
        with_max_reserved_bytes(max_reserved_bytes: u64);
        with_nccl_version(nccl_version: NcclVersion);
    }
}

/// Bytes of a rank's reserved-bytes counter, held by one segment's memory and given
/// back when it goes.
#[derive(Debug)]
pub(super) struct Reservation {
    counter: Arc<AtomicU64>,
    size_bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.size_bytes, Ordering::Relaxed);
    }
}

/// A segment's memory on the host backends (threads and processes): the backend's own
/// `memory` and the reservation it holds.
#[derive(Debug)]
pub(super) struct HostSegment<M> {
    pub(super) memory: M,
    pub(super) reservation: Reservation,
}

impl<M: fmt::Debug + Send + Sync + 'static> SegmentMemory for HostSegment<M> {
    fn size_bytes(&self) -> u64 {
        self.reservation.size_bytes
    }

    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

/// The `M` memory of a host-backend segment, or an error naming a segment from
/// another provider.
pub(super) fn memory_of<M>(segment: &Segment) -> Result<&M>
where
    HostSegment<M>: SegmentMemory,
{
    segment
        .memory::<HostSegment<M>>()
        .map(|s| &s.memory)
        .ok_or_else(|| Error::internal("a segment of another provider reached a host backend"))
}

/// One segment's bytes on the threads backend, shared with peers during collectives.
type HostMemory = Arc<Mutex<Box<[u8]>>>;

/// A rank's side of a collective, or of a copy: the memory of a region's segment and
/// the region's offset (the callers bound what they touch by the region's length).
type Side = (HostMemory, u64);

/// One rank's sides of a collective, as its peers read them.
#[derive(Clone)]
struct Post {
    send: Side,
    recv: Side,
    /// The calling pool ([`CollArgs::caller`]).
    caller: u64,
}

/// State shared by the ranks of one host world, per communicator.
struct HostComm {
    registrations: Arc<Rendezvous<u64, u64>>,
    collectives: Arc<Rendezvous<u64, Option<Post>>>,
}

impl HostComm {
    /// The standard communicators among the ranks of `group`, whose waits fail once a
    /// rank of the group is lost.
    fn standard(group: &LocalExchange) -> Vec<HostComm> {
        (CommInfo::STANDARD.map(|_| HostComm {
            registrations: group.rendezvous(),
            collectives: group.rendezvous(),
        }))
        .into()
    }

    /// The standard communicators of the ranks of `group` that opened `channel`
    /// together (split or shrunk): made by the first rank to ask.
    fn take(group: &LocalExchange, channel: ChannelId) -> Result<Arc<Vec<HostComm>>> {
        group.take_shared(channel.ordinal(), || HostComm::standard(group))
    }
}

/// The channel under which the ranks of a grown host world (newcomers included) find
/// their communicators.
const GROWN: &str = "backend:grow";

/// One rank of a host world: ranks are threads of one process, segments host memory.
/// Make a world with [`HostBackend::world`]; it returns [`Backend`]s.
pub struct HostBackend {
    rank: usize,
    config: HostConfig,
    comms: Arc<Vec<HostComm>>,
    /// The rank's exchange, whose ranks share the communicators.
    exchange: Arc<LocalExchange>,
    reserved: Arc<AtomicU64>,
    /// Per communicator: registration ordinal and collective round of this rank, held
    /// for the whole of each call so that two threads of the rank cannot interleave
    /// their rounds.
    calls: Vec<Mutex<(u64, u64)>>,
}

impl fmt::Debug for HostBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBackend")
            .field("rank", &self.rank)
            .field("world_size", &self.config.world_size)
            .field("symmetric", &self.config.symmetric)
            .finish()
    }
}

impl HostBackend {
    /// The ranks of a new host world, in rank order: hand one to each thread.
    ///
    /// The world has the same three communicators as the NCCL backend (symmetric,
    /// copy-engine, plain; see [`CommRole`](super::CommRole)) so path selection behaves the same.
    ///
    /// # Errors
    /// [`Error::Config`] for zero ranks or a granularity that is not a power of two.
    pub fn world(config: HostConfig) -> Result<Vec<Backend>> {
        if config.world_size == 0 {
            return Err(Error::config(
                "HostConfig::world_size",
                "0",
                "at least one rank",
            ));
        }
        let group = LocalExchange::group(config.world_size);
        let comms = Arc::new(HostComm::standard(&group[0]));
        // Making a backend is collective: one thread per rank.
        in_threads(group, "a host rank's set-up thread", |exchange| {
            Self::over(&config, Arc::new(exchange), comms.clone())
        })
    }

    /// The backend of `exchange`'s rank over `comms`, the communicators of its ranks,
    /// with `config` (its world size the exchange's).
    fn over(
        config: &HostConfig,
        exchange: Arc<LocalExchange>,
        comms: Arc<Vec<HostComm>>,
    ) -> Result<Backend> {
        let info = BackendInfo::new(
            BackendKind::Host,
            exchange.rank(),
            exchange.world_size(),
            config.nccl_version,
            config.granularity_bytes,
            CommInfo::STANDARD.to_vec(),
        )?;
        let parts = Self::parts(config, &exchange, comms, Arc::default());
        Backend::with_stream_ops(info, exchange, parts, Arc::new(HostStreams::default()))
    }

    /// A backend beside `backend`, this rank's over `exchange` (whose group's ranks
    /// `group` says): a new set of the standard communicators, found under `channel`,
    /// which the ranks open over `exchange` by `deadline`; the settings, memory limit
    /// and stream operations stay this rank's.
    fn beside(
        &self,
        backend: &Backend,
        exchange: Arc<dyn Exchange>,
        group: &Arc<LocalExchange>,
        channel: &str,
        deadline: Deadline,
    ) -> Result<Backend> {
        let comms = HostComm::take(group, exchange.open_channel(channel, deadline)?)?;
        let parts = Self::parts(&self.config, group, comms, self.reserved.clone());
        backend.with_parts(exchange, parts)
    }

    /// A newcomer that waits to join the host world of `backend` (or the world it
    /// shrank or grew into) when its ranks next [grow](Backend::grow) it: hand it to
    /// the newcomer's thread, which calls [`join`](Self::join).
    ///
    /// # Errors
    /// [`Error::Config`] for a backend not made by [`HostBackend`].
    pub fn newcomer(backend: &Backend) -> Result<crate::control::LocalNewcomer> {
        let host = backend.downcast_ref::<HostBackend>().ok_or_else(|| {
            let kind = format!("{:?}", backend.kind());
            Error::config(
                "HostBackend::newcomer",
                kind,
                "a backend made by HostBackend",
            )
        })?;
        Ok(host.exchange.newcomer())
    }

    /// A newcomer's rank of a host world: it waits until the world's ranks
    /// [grow](Backend::grow) it with `newcomer` (a [`LocalExchange::newcomer`] of one of
    /// theirs), then makes the grown world's communicators with them. `config`'s world
    /// size is the grown world's.
    ///
    /// # Collective
    /// With the ranks' `grow` (they open the channel `backend:grow`).
    ///
    /// # Errors
    /// As [`LocalNewcomer::join`](crate::control::LocalNewcomer::join); those of
    /// [`world`](Self::world) and of opening a channel.
    pub fn join(
        newcomer: crate::control::LocalNewcomer,
        config: HostConfig,
        deadline: Deadline,
    ) -> Result<Backend> {
        let exchange = newcomer.join(deadline)?;
        let comms = HostComm::take(&exchange, exchange.open_channel(GROWN, deadline)?)?;
        Self::over(&config, exchange, comms)
    }

    /// The parts of the rank of `group` over `comms`, the communicators of its ranks,
    /// with `config` (its world size `group`'s) and memory counted in `reserved`.
    fn parts(
        config: &HostConfig,
        group: &Arc<LocalExchange>,
        comms: Arc<Vec<HostComm>>,
        reserved: Arc<AtomicU64>,
    ) -> Arc<Self> {
        Arc::new(HostBackend {
            rank: group.rank(),
            config: HostConfig {
                world_size: group.world_size(),
                ..config.clone()
            },
            calls: comms.iter().map(|_| Mutex::default()).collect(),
            comms,
            exchange: group.clone(),
            reserved,
        })
    }

    fn comm(&self, c: usize) -> Result<&HostComm> {
        self.comms.get(c).ok_or_else(|| Error::InvalidCollective {
            op: "host collective",
            detail: format!("no communicator {c}"),
        })
    }

    /// Run one collective: post, check agreement, move data with `body` (given the
    /// round counter, for rounds of its own), barrier; every round waits until the
    /// call's deadline ([`CollArgs::deadline`]).
    fn collective(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        body: impl FnOnce(&[Post], &mut u64) -> Result<()>,
    ) -> Result<()> {
        let comm = self.comm(args.comm)?;
        let post = Post {
            send: side(&args.send)?,
            recv: side(&args.recv)?,
            caller: args.caller,
        };
        let mut calls = self.calls[args.comm].lock();
        let (n, deadline) = (&mut calls.1, args.deadline());
        let gathered = self.round(comm, n, op, Some(post), deadline)?;
        // A `None` is a peer's closing round paired with this post: the ranks are not
        // making the same calls on this communicator.
        let verdict = match gathered.into_iter().collect::<Option<Vec<Post>>>() {
            Some(posts) => {
                let callers: Vec<u64> = posts.iter().map(|p| p.caller).collect();
                super::callers_differ(op, &callers).and_then(|()| body(&posts, n))
            }
            None => Err(super::out_of_step(op, "a peer")),
        };
        // Second round: nobody returns (and reuses its input) before all are done.
        self.round(comm, n, op, None, deadline)?;
        verdict
    }

    /// The next round (after round `n`, which it counts) of collectives on `comm`, in
    /// which this rank posts `post`: every rank's post, in rank order.
    fn round(
        &self,
        comm: &HostComm,
        n: &mut u64,
        op: &'static str,
        post: Option<Post>,
        deadline: Deadline,
    ) -> Result<Vec<Option<Post>>> {
        *n += 1;
        (comm.collectives).gather(op, self.rank, *n, post, deadline, || false)
    }

    /// Reduce, in rank order, the `len` bytes `at` bytes into every rank's input into
    /// this rank's output; with `middle`, after a middle round, so that no rank
    /// overwrites its input (in place: its output) while a peer reads it.
    fn reduce(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        at: u64,
        len: u64,
        middle: bool,
    ) -> Result<()> {
        self.collective(args, op, |posts, n| {
            // Pull every rank's input, in rank order.
            let read = posts.iter().map(|p| read_side(&p.send, at, len));
            let reduced = (read.collect::<Result<Vec<_>>>())
                .and_then(|inputs| dtype::reduce_ranks(args.dtype, args.op, inputs));
            if middle
                && (self
                    .round(self.comm(args.comm)?, n, op, None, args.deadline())?
                    .iter())
                .any(Option::is_some)
            {
                return Err(super::out_of_step(op, "a peer"));
            }
            write_side(&posts[self.rank].recv, 0, &reduced?)
        })
    }
}

impl super::Regroup for HostBackend {
    /// [`Backend::split`] on the host backend: a new set of the standard
    /// communicators, shared by the ranks that split under the same channel; the
    /// memory limit and stream operations stay this rank's.
    fn split(&self, backend: &Backend, name: &str) -> Result<Backend> {
        let channel = format!("backend:split:{name}");
        let deadline = Deadline::after(super::SETUP_TIMEOUT);
        self.beside(
            backend,
            backend.exchange_handle(),
            &self.exchange,
            &channel,
            deadline,
        )
    }

    /// [`Backend::shrink`] and [`Backend::grow`] on the host backend, with `backend`'s
    /// exchange shrunk or grown (this rank's, or a wrapper of it): a new set of the
    /// standard communicators among the ranks of the new group, no registrations yet
    /// (as [`join`](HostBackend::join) makes them on a newcomer); the settings, memory
    /// limit and stream operations stay this rank's.
    ///
    /// # Collective
    /// Every rank of the new group, for its backends in the same order (the ranks open
    /// a channel of the new group, `backend:shrink` or `backend:grow`, under which they
    /// find the communicators).
    fn regroup(
        &self,
        backend: &Backend,
        exchange: Arc<dyn Exchange>,
        deadline: Deadline,
        grown: Option<bool>,
    ) -> Result<Backend> {
        let Some(wait) = grown else {
            let next = self.exchange.shrink(deadline)?;
            // The new group lost a rank between the two asks, and the second went past it.
            if let Some(lost) = exchange
                .lost_peer()
                .filter(|_| next.world_size() != exchange.world_size())
            {
                return Err(lost.error("shrink"));
            }
            return self.beside(backend, exchange, &next, "backend:shrink", deadline);
        };
        let next = (self.exchange.grow(wait, deadline)?)
            .ok_or_else(|| Error::internal("a grown exchange over a group that did not grow"))?;
        self.beside(backend, exchange, &next, GROWN, deadline)
    }
}

/// This rank's side of a collective, or of a copy, in `region`.
fn side(region: &Region<'_>) -> Result<Side> {
    let data = memory_of::<HostMemory>(region.segment())?.clone();
    Ok((data, region.offset_bytes()))
}

/// Run `f` on the `len` bytes `at` bytes into a rank's side.
fn on_side<R>(
    (seg, offset): &Side,
    at: u64,
    len: u64,
    f: impl FnOnce(&mut [u8]) -> R,
) -> Result<R> {
    let mut data = seg.lock();
    let range = bounds(data.len() as u64, offset.saturating_add(at), len)?;
    Ok(f(&mut data[range]))
}

/// The `len` bytes `at` bytes into a rank's side of a collective.
fn read_side(side: &Side, at: u64, len: u64) -> Result<Vec<u8>> {
    on_side(side, at, len, |b| b.to_vec())
}

/// Write `data` `at` bytes into a rank's side of a collective.
fn write_side(side: &Side, at: u64, data: &[u8]) -> Result<()> {
    on_side(side, at, data.len() as u64, |b| b.copy_from_slice(data))
}

/// Fail with [`Error::WrongStream`] unless `stream` is a host stream.
pub(super) fn host_stream(stream: &Stream) -> Result<()> {
    stream.is_host().then_some(()).ok_or(Error::WrongStream)
}

/// The bytes `offset..offset + len` of a segment of `seg_len` bytes, as an index range.
///
/// # Errors
/// [`Error::BadView`] if they leave the segment.
pub(super) fn bounds(seg_len: u64, offset: u64, len: u64) -> Result<std::ops::Range<usize>> {
    super::handles::within(offset, len, "segment", seg_len)?;
    Ok(offset as usize..(offset + len) as usize)
}

impl SegmentProvider for HostBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        let reservation = reserve(&self.reserved, size_bytes, self.config.max_reserved_bytes)?;
        // Zeroed by the allocator: large allocations come from the OS as untouched zero
        // pages, so reserving costs nothing until written.
        let zeroed = usize::try_from(size_bytes).map_err(drop);
        let Ok(data) = zeroed.and_then(bytemuck::allocation::try_zeroed_slice_box) else {
            return Err(Error::DeviceOutOfMemory {
                segment_bytes: size_bytes,
                op: "host allocation",
                code: 0,
                message: "the host allocator refused".into(),
            });
        };
        let memory: HostMemory = Arc::new(Mutex::new(data));
        Ok(Segment::new(Box::new(HostSegment {
            memory,
            reservation,
        })))
    }

    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> Result<Option<Window>> {
        memory_of::<HostMemory>(segment)?;
        let size = segment.size_bytes();
        let c = self.comm(comm)?;
        let mut calls = self.calls[comm].lock();
        calls.0 += 1;
        let ordinal = calls.0;
        let op = "window registration";
        let sizes = (c.registrations).gather(op, self.rank, ordinal, size, deadline, || false)?;
        if sizes.iter().any(|&s| s != size) {
            return Err(Error::RegistrationMismatch { ordinal, sizes });
        }
        let window = || Window::new(comm, ordinal, Box::new(()));
        Ok(self.config.symmetric.then(window))
    }

    // deregister and free: the defaults (dropping the handle releases the memory).
}

/// The streams of the host backends (threads and processes): streams are tags and
/// fences counters; host work is synchronous, so every fence is complete when it is
/// recorded.
#[derive(Debug, Default)]
pub(super) struct HostStreams {
    /// Latest fence per stream.
    fences: Mutex<BTreeMap<StreamId, Fence>>,
}

impl StreamOps for HostStreams {
    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream::host())
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        host_stream(stream)?;
        let mut f = self.fences.lock();
        let c = f.entry(stream.id()).or_insert(Fence(0));
        c.0 += 1;
        Ok(*c)
    }

    fn wait_fence(&self, stream: &Stream, _on: StreamId, _fence: Fence) -> Result<()> {
        // Host work is synchronous: every fence is complete when it is recorded.
        host_stream(stream)
    }

    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>> {
        Ok(self.fences.lock().get(&stream).copied())
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        host_stream(stream).map(|()| false)
    }

    fn drain(&self, _deadline: Deadline) -> Result<bool> {
        Ok(true)
    }
}

/// Take `size_bytes` from a rank's reserved-bytes `counter`, which may not pass
/// `limit`; the [`Reservation`] gives them back when it is dropped (with the segment's
/// memory, or at once if the allocation fails).
///
/// # Errors
/// [`Error::PoolLimit`]; nothing is taken then.
pub(super) fn reserve(
    counter: &Arc<AtomicU64>,
    size_bytes: u64,
    limit: u64,
) -> Result<Reservation> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
            r.checked_add(size_bytes).filter(|&t| t <= limit)
        })
        .map(|_| Reservation {
            counter: counter.clone(),
            size_bytes,
        })
        .map_err(|reserved| Error::PoolLimit {
            segment_bytes: size_bytes,
            would_reserve_bytes: reserved.saturating_add(size_bytes),
            max_reserved_bytes: limit,
        })
}

impl DataMover for HostBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        host_stream(stream)?;
        write_side(&side(&region.sub(0, data.len() as u64)?)?, 0, data)
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        host_stream(stream)?;
        let len = out.len() as u64;
        on_side(&side(&region.sub(0, len)?)?, 0, len, |b| {
            out.copy_from_slice(b)
        })
    }
}

impl Collectives for HostBackend {
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        let chunk = args.check_counts("all_gather", self.config.world_size, false)?;
        self.collective(args, "all_gather", |posts, _| {
            // Pull: read every rank's chunk, write it into this rank's output.
            for (r, p) in posts.iter().enumerate() {
                let data = read_side(&p.send, 0, chunk)?;
                write_side(&posts[self.rank].recv, r as u64 * chunk, &data)?;
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        let chunk = args.check_counts("reduce_scatter", self.config.world_size, true)?;
        self.reduce(
            args,
            "reduce_scatter",
            self.rank as u64 * chunk,
            chunk,
            false,
        )
    }

    fn abandon(&self, why: &'static str) {
        for comm in self.comms.iter() {
            comm.collectives.abandon(self.rank, why);
        }
    }

    fn all_reduce(&self, args: &CollArgs<'_>) -> Result<()> {
        let bytes = args.check_counts("all_reduce", 1, true)?;
        self.reduce(args, "all_reduce", 0, bytes, true)
    }
}
