//! The multi-process host backend: one rank per process (the shape of a real job),
//! segments in shared memory that every rank maps.
//!
//! It is the model of a symmetric heap, not a mock:
//! - a segment is an anonymous shared-memory file (`memfd_create`) mapped by its rank;
//!   it has no name, so nothing is left in `/dev/shm` whatever happens to the process
//!   (the kernel frees the memory when the last mapping and descriptor are gone);
//! - *registration* on a communicator is a round on the control plane in which every
//!   rank publishes its segment, then maps every peer's segment (through
//!   `/proc/<pid>/fd/<fd>`); the window is the set of those mappings, and windows pair
//!   across ranks by registration order, as NCCL's do;
//! - collectives on windows read peers' memory **at the local offset**, as NCCL's
//!   symmetric kernels and copy engines do inside a node; collectives without windows
//!   move the data through the control plane, as NCCL's ring moves it through its own
//!   buffers. Every collective starts with a round in which the ranks meet (their
//!   arguments are compared by the checked collectives of [`coll`](crate::coll), not
//!   here, as NCCL does not compare them either) and ends with a barrier, so no rank
//!   reuses its input early.
//!
//! Linux only (memfd and `/proc`). Host work is synchronous: streams are tags and
//! fences counters, as on the threads backend.

use super::host::{HostSegment, HostStreams, bounds, host_stream, memory_of, reserve};
use super::{
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, DataMover, Region, Segment,
    SegmentProvider, Window,
};
use crate::control::{ChannelId, Exchange, gather_records};
use crate::deadline::Deadline;
use crate::dtype;
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use memmap2::MmapRaw;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::copy_nonoverlapping;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// Settings of a shared-memory rank.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShmConfig {
    /// Whether registration yields windows (`false`: like an NCCL communicator
    /// without symmetric support, registration succeeds with no window).
    pub symmetric: bool,
    /// Segment granularity in bytes (default 2 MiB, as `ncclMemAlloc` on H200).
    pub granularity_bytes: u64,
    /// Most shared memory this rank may reserve, in bytes (default 16 GiB; pages are
    /// only backed when written).
    pub max_reserved_bytes: u64,
    /// The NCCL version whose rules the backend reports (default 2.28.3).
    pub nccl_version: NcclVersion,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            symmetric: true,
            granularity_bytes: 2 << 20,
            max_reserved_bytes: 16 << 30,
            nccl_version: NcclVersion::new(2, 28, 3),
        }
    }
}

impl ShmConfig {
    setters! {
        with_symmetric(symmetric: bool);
        with_max_reserved_bytes(max_reserved_bytes: u64);
    }
}

/// One segment: a memfd and this rank's mapping of it.
#[derive(Debug)]
struct ShmMemory {
    file: File,
    map: MmapRaw,
}

/// A window: this rank's mappings of every rank's segment registered at the same
/// position (its own too, mapped a second time), in rank order.
type ShmWindow = Vec<MmapRaw>;

/// This rank's mapping of rank `peer`'s segment in `window`.
fn peer_map(window: &Window, peer: usize) -> Result<&MmapRaw> {
    let w = window.handle::<ShmWindow>().ok_or_else(|| {
        Error::internal("a window of another backend reached the shared-memory backend")
    })?;
    w.get(peer).ok_or_else(|| {
        let ordinal = window.ordinal();
        Error::internal(format!("window {ordinal} has no mapping of rank {peer}"))
    })
}

fn shm_error(op: &'static str, detail: String, source: std::io::Error) -> Error {
    Error::SharedMemory {
        op,
        detail,
        source: source.into(),
    }
}

/// A rank's record in one round of a communicator's channel: the step of its calls
/// the rank is at, so that rounds of different kinds never pass for each other.
#[derive(Serialize, Deserialize)]
enum Step {
    /// A window registration: where the peers find the segment
    /// (`/proc/<pid>/fd/<fd>`), and its size.
    Register { pid: u32, fd: i32, size_bytes: u64 },
    /// The opening round of a collective, by pool `caller` ([`CollArgs::caller`]).
    Post { caller: u64 },
    /// A piece of a collective's data on the plain path.
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The closing barrier of a collective.
    Done,
    /// Every rank has read its peers' inputs (an all-reduce's middle barrier).
    Read,
}

/// A pick of [`at_step`]: what a record at the step of `$step` holds (`$what`), `None`
/// for a record at another step.
macro_rules! pick {
    ($step:pat => $what:expr) => {
        |s| match s {
            $step => Some($what),
            _ => None,
        }
    };
}

/// Every rank's record of a round as `pick` reads it, or [`Error::CollectiveMismatch`]
/// naming the first rank whose record `pick` refuses (at another step of its calls).
fn at_step<T>(
    op: &'static str,
    steps: Vec<Step>,
    pick: impl Fn(Step) -> Option<T>,
) -> Result<Vec<T>> {
    let each = |(rank, step)| {
        pick(step).ok_or_else(|| super::out_of_step(op, format_args!("rank {rank}")))
    };
    steps.into_iter().enumerate().map(each).collect()
}

/// Bytes of control-plane payload per data round on the plain path.
const DATA_PIECE_BYTES: usize = 1 << 20;

/// One rank of a multi-process shared-memory world. Make it with
/// [`ShmBackend::join`]; it returns a [`Backend`].
#[derive(Debug)]
pub struct ShmBackend {
    rank: usize,
    world: usize,
    config: ShmConfig,
    exchange: Arc<dyn Exchange>,
    /// The start of its communicators' channel names (`shm`, `shm:NAME` when split).
    prefix: String,
    /// Per communicator: the channel of its registrations and collectives, and the
    /// lock that keeps one call at a time on it on this rank, over the number of
    /// registrations made on it (window ordinals).
    comms: Vec<(ChannelId, Mutex<u64>)>,
    reserved: Arc<AtomicU64>,
}

impl ShmBackend {
    /// This process's rank of a shared-memory world over `exchange` (for example a
    /// [`StoreExchange`](crate::control::StoreExchange) from the launcher's
    /// environment). The world has the same three communicators as the NCCL backend.
    ///
    /// # Collective
    /// Every rank calls it at the same point (the ranks open the communicators' channels).
    ///
    /// # Errors
    /// [`Error::Config`] for a granularity that is not a power of two; the
    /// errors of [`Exchange::open_channel`].
    pub fn join(exchange: Arc<dyn Exchange>, config: ShmConfig) -> Result<Backend> {
        let info = BackendInfo::new(
            BackendKind::Host,
            exchange.rank(),
            exchange.world_size(),
            config.nccl_version,
            config.granularity_bytes,
            CommInfo::STANDARD.to_vec(),
        )?;
        let setup = Deadline::after(super::SETUP_TIMEOUT);
        let parts = Self::open(exchange.clone(), &config, "shm", Arc::default(), setup)?;
        Backend::with_stream_ops(info, exchange, parts, Arc::new(HostStreams::default()))
    }

    /// The parts of this process's rank of the world of `exchange`: the standard
    /// communicators on channels `PREFIX:comm0`, `PREFIX:comm1`, ... (opened by
    /// `deadline`), no registrations yet, memory counted in `reserved`.
    ///
    /// # Errors
    /// The errors of [`Exchange::open_channel`].
    fn open(
        exchange: Arc<dyn Exchange>,
        config: &ShmConfig,
        prefix: &str,
        reserved: Arc<AtomicU64>,
        deadline: Deadline,
    ) -> Result<Arc<Self>> {
        let comms = (0..CommInfo::STANDARD.len())
            .map(|c| {
                let ch = exchange.open_channel(&format!("{prefix}:comm{c}"), deadline)?;
                Ok((ch, Mutex::new(0)))
            })
            .collect::<Result<_>>()?;
        Ok(Arc::new(ShmBackend {
            rank: exchange.rank(),
            world: exchange.world_size(),
            config: config.clone(),
            exchange,
            prefix: prefix.into(),
            comms,
            reserved,
        }))
    }

    fn comm(&self, c: usize) -> Result<&(ChannelId, Mutex<u64>)> {
        self.comms.get(c).ok_or_else(|| Error::InvalidCollective {
            op: "shared-memory collective",
            detail: format!("no communicator {c}"),
        })
    }

    /// One round of `mine` on communicator `c`'s channel, by `deadline`: every rank's
    /// record, in rank order (as [`gather_records`]), as `pick` reads it ([`at_step`]).
    fn round<T>(
        &self,
        c: usize,
        op: &'static str,
        mine: &Step,
        deadline: Deadline,
        pick: impl Fn(Step) -> Option<T>,
    ) -> Result<Vec<T>> {
        let (ch, _) = self.comm(c)?;
        let all = gather_records(&*self.exchange, *ch, op, mine, deadline)?;
        at_step(op, all, pick)
    }

    /// Run one collective: the opening round, the data moved by `body`, the closing
    /// barrier; every round waits until the call's deadline ([`CollArgs::deadline`]).
    fn collective(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let (_, serial) = self.comm(args.comm)?;
        let _serial = serial.lock();
        // The opening round: every rank is at this collective on this communicator.
        let deadline = args.deadline();
        let post = Step::Post {
            caller: args.caller,
        };
        let posts = self.round(args.comm, op, &post, deadline, Some)?;
        let verdict = at_step(op, posts, pick!(Step::Post { caller } => caller))
            .and_then(|callers| super::callers_differ(op, &callers))
            .and_then(|()| body());
        // Nobody returns (and reuses its input) before every rank is done with it.
        self.round(
            args.comm,
            op,
            &Step::Done,
            deadline,
            pick!(Step::Done => ()),
        )?;
        verdict
    }

    /// Every rank's `len` bytes, moved through the control plane in pieces, waiting
    /// until `deadline`.
    fn gather_bytes(
        &self,
        c: usize,
        op: &'static str,
        mine: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let mut out: Vec<Vec<u8>> = vec![Vec::with_capacity(mine.len()); self.world];
        // One round at least: an empty payload is a round too.
        let empty = mine.is_empty().then_some(mine);
        for piece in mine.chunks(DATA_PIECE_BYTES).chain(empty) {
            let mine = Step::Data(piece.to_vec());
            let got = self.round(c, op, &mine, deadline, pick!(Step::Data(bytes) => bytes))?;
            for (r, theirs) in got.into_iter().enumerate() {
                let (sent, want) = (theirs.len(), piece.len());
                if sent != want {
                    let detail = format!("rank {r} sent {sent} bytes, expected {want}");
                    return Err(Error::CollectiveMismatch { op, detail });
                }
                out[r].extend_from_slice(&theirs);
            }
        }
        Ok(out)
    }

    /// Reduce, in rank order, the `len` bytes `at` bytes into every rank's input (of
    /// `whole` bytes) into this rank's output. With `middle` (an all-reduce), the reads
    /// through the peers' windows end with a middle round, so that no rank overwrites
    /// its input (in place: its output) while a peer reads it.
    fn reduce(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        at: u64,
        len: u64,
        whole: u64,
        middle: bool,
    ) -> Result<()> {
        self.collective(args, op, || {
            let inputs = match args.windows {
                (Some(send_window), _) => {
                    let at = args.send.offset_bytes() + at;
                    let read = (0..self.world)
                        .map(|p| peer_bytes(send_window, p, at, len))
                        .collect::<Result<Vec<_>>>();
                    if middle {
                        self.round(
                            args.comm,
                            op,
                            &Step::Read,
                            args.deadline(),
                            pick!(Step::Read => ()),
                        )?;
                    }
                    read?
                }
                // Through the control plane: every rank has read its input before it
                // posts it, so none is overwritten early.
                _ => {
                    let mut mine = vec![0u8; whole as usize];
                    read_local(&args.send.sub(0, whole)?, &mut mine)?;
                    let (lo, hi) = (at as usize, (at + len) as usize);
                    let all = self.gather_bytes(args.comm, op, &mine, args.deadline())?;
                    (all.into_iter())
                        .map(|mut v| {
                            v.truncate(hi);
                            v.drain(..lo);
                            v
                        })
                        .collect()
                }
            };
            let acc = dtype::reduce_ranks(args.dtype, args.op, inputs)?;
            write_local(&args.recv.sub(0, len)?, &acc)
        })
    }
}

impl super::Regroup for ShmBackend {
    /// [`Backend::split`] on the shared-memory backend: the same communicators on
    /// channels of their own (`shm:NAME:commC`), as on the host backend.
    fn split(&self, backend: &Backend, name: &str) -> Result<Backend> {
        let setup = Deadline::after(super::SETUP_TIMEOUT);
        let (ex, prefix) = (self.exchange.clone(), format!("shm:{name}"));
        let parts = Self::open(ex, &self.config, &prefix, self.reserved.clone(), setup)?;
        backend.with_parts(backend.exchange_handle(), parts)
    }

    /// [`Backend::shrink`] and [`Backend::grow`] on the shared-memory backend, with the
    /// new group's `exchange`: the same communicators on channels of the new group, no
    /// registrations yet.
    fn regroup(
        &self,
        backend: &Backend,
        exchange: Arc<dyn Exchange>,
        deadline: Deadline,
        _: Option<bool>,
    ) -> Result<Backend> {
        let reserved = self.reserved.clone();
        let parts = Self::open(
            exchange.clone(),
            &self.config,
            &self.prefix,
            reserved,
            deadline,
        )?;
        backend.with_parts(exchange, parts)
    }
}

/// The address of the `len` bytes at `offset` of `map` (this rank's mapping of a
/// segment, or of a peer's).
///
/// # Errors
/// [`Error::BadView`] if they leave the mapping.
fn addr(map: &MmapRaw, offset: u64, len: usize) -> Result<*mut u8> {
    let range = bounds(map.len() as u64, offset, len as u64)?;
    Ok(map.as_mut_ptr().wrapping_add(range.start))
}

/// The address of the first `len` bytes of `region`, in this rank's mapping of its
/// segment.
fn local(region: &Region<'_>, len: usize) -> Result<*mut u8> {
    let region = region.sub(0, len as u64)?;
    addr(
        &memory_of::<ShmMemory>(region.segment())?.map,
        region.offset_bytes(),
        len,
    )
}

/// `len` bytes of rank `peer`'s segment in `window`, at `offset`.
fn peer_bytes(window: &Window, peer: usize, offset: u64, len: u64) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len as usize];
    let src = addr(peer_map(window, peer)?, offset, out.len())?;
    // SAFETY: `src..src + len` lies inside this rank's live mapping of rank `peer`'s
    // segment (checked by `addr`; the window that holds it is borrowed), and `out` is
    // distinct memory. Rank `peer` (this one too) writes only other bytes of its
    // segment until the collective's closing barrier (the posts agreed that every rank
    // reads the same, disjoint chunks), or, in an all-reduce, none before the middle
    // barrier after these reads.
    unsafe { copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    Ok(out)
}

fn read_local(region: &Region<'_>, out: &mut [u8]) -> Result<()> {
    let src = local(region, out.len())?;
    // SAFETY: `src..src + out.len()` lies inside this rank's live mapping of the
    // region's segment (checked by `local`; the region borrows the segment), and `out`
    // is distinct memory. Peers read this rank's memory only during collectives, which
    // the pool's stream rules order with this call.
    unsafe { copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    Ok(())
}

fn write_local(region: &Region<'_>, data: &[u8]) -> Result<()> {
    let dst = local(region, data.len())?;
    // SAFETY: as in `read_local`; the bytes are this rank's own block, or the chunk of
    // a collective's output that only this rank writes.
    unsafe { copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    Ok(())
}

impl SegmentProvider for ShmBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        // Given back when the segment goes, or at once if making it fails.
        let reservation = reserve(&self.reserved, size_bytes, self.config.max_reserved_bytes)?;
        let oom = |message: String| Error::DeviceOutOfMemory {
            segment_bytes: size_bytes,
            op: "memfd_create",
            code: 0,
            message,
        };
        let memfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create("symmpool-segment")
            .map_err(|e| oom(e.to_string()))?;
        let file = memfd.into_file();
        file.set_len(size_bytes)
            .map_err(|e| oom(format!("sizing the segment: {e}")))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| oom(format!("mapping: {e}")))?;
        Ok(Segment::new(Box::new(HostSegment {
            memory: ShmMemory { file, map },
            reservation,
        })))
    }

    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> Result<Option<Window>> {
        const OP: &str = "window registration";
        let mem = memory_of::<ShmMemory>(segment)?;
        let size_bytes = segment.size_bytes();
        let (_, serial) = self.comm(comm)?;
        let mut ordinal = serial.lock();
        let mine = Step::Register {
            pid: std::process::id(),
            fd: mem.file.as_raw_fd(),
            size_bytes,
        };
        let all = self.round(comm, OP, &mine, deadline, Some)?;
        *ordinal += 1;
        let ordinal = *ordinal;
        let all = at_step(
            OP,
            all,
            pick!(Step::Register { pid, fd, size_bytes } => (pid, fd, size_bytes)),
        )?;
        let sizes: Vec<u64> = all.iter().map(|p| p.2).collect();
        if sizes.iter().any(|&s| s != size_bytes) {
            return Err(Error::RegistrationMismatch { ordinal, sizes });
        }
        if !self.config.symmetric {
            return Ok(None);
        }
        let mut peers = Vec::with_capacity(self.world);
        for (r, (pid, fd, _)) in all.iter().enumerate() {
            let path = format!("/proc/{pid}/fd/{fd}");
            let file = File::options()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    shm_error("opening a peer's segment", format!("rank {r}: {path}"), e)
                })?;
            let map = MmapRaw::map_raw(&file)
                .map_err(|e| shm_error("mapping a peer's segment", format!("rank {r}"), e))?;
            if map.len() as u64 != size_bytes {
                return Err(Error::RegistrationMismatch { ordinal, sizes });
            }
            peers.push(map);
        }
        Ok(Some(Window::new(comm, ordinal, Box::new(peers))))
    }

    // deregister and free: the defaults. Unmapping the peers' segments is local; their
    // memory lives on until every mapping and descriptor of it is gone.
}

impl DataMover for ShmBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        host_stream(stream).and_then(|()| write_local(&region, data))
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        host_stream(stream).and_then(|()| read_local(&region, out))
    }
}

impl Collectives for ShmBackend {
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let chunk = args.check_counts(OP, self.world, false)?;
        let me = self.rank as u64;
        self.collective(args, OP, || {
            let mut mine = vec![0u8; chunk as usize];
            read_local(&args.send, &mut mine)?;
            match args.windows.1 {
                Some(recv_window) => {
                    // Push this rank's chunk into every rank's output, at the local
                    // output offset (the symmetric path).
                    let at = args.recv.offset_bytes() + me * chunk;
                    for p in 0..self.world {
                        let dst = addr(peer_map(recv_window, p)?, at, mine.len())?;
                        // SAFETY: `dst..dst + chunk` lies inside this rank's live
                        // mapping of rank `p`'s output segment (checked by `addr`; the
                        // window is borrowed), and `mine` is distinct memory. During
                        // this collective only this rank writes this chunk of rank
                        // `p`'s output (the posts agreed on the offsets); `p` reads it
                        // after the closing barrier.
                        unsafe { copy_nonoverlapping(mine.as_ptr(), dst, mine.len()) };
                    }
                }
                None => {
                    let chunks = self.gather_bytes(args.comm, OP, &mine, args.deadline())?;
                    for (r, data) in chunks.iter().enumerate() {
                        write_local(&args.recv.sub(r as u64 * chunk, chunk)?, data)?;
                    }
                }
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        let chunk = args.check_counts("reduce_scatter", self.world, true)?;
        let whole = chunk * self.world as u64;
        self.reduce(
            args,
            "reduce_scatter",
            self.rank as u64 * chunk,
            chunk,
            whole,
            false,
        )
    }

    fn all_reduce(&self, args: &CollArgs<'_>) -> Result<()> {
        let bytes = args.check_counts("all_reduce", 1, true)?;
        self.reduce(args, "all_reduce", 0, bytes, bytes, true)
    }
}
