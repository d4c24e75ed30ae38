//! The host backend: N ranks as threads of one process, segments in host memory.
//!
//! It is not a mock. Registration is a real barrier among the ranks with NCCL's
//! ordering rule (windows pair by call order, sizes must match) and a timeout;
//! collectives move and reduce real data between the ranks' segments, at the offsets
//! each rank passed (bounds checked), and end in a barrier. Like NCCL, the backend
//! does not compare the ranks' arguments: the checked collectives of
//! [`coll`](crate::coll) do, the same way on every backend. Host work is synchronous,
//! so streams are tags and fences are counters.

use super::rendezvous::Rendezvous;
use super::{
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, DataMover, Refused, Region,
    Segment, SegmentMemory, SegmentProvider, StreamOps, Window,
};
use crate::control::LocalExchange;
use crate::core::{Fence, StreamId};
use crate::dtype;
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// How long registration and collectives wait for the other ranks.
    pub timeout: Duration,
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
            timeout: Duration::from_secs(60),
            granularity_bytes: 2 << 20,
            max_reserved_bytes: 64 << 30,
            nccl_version: NcclVersion::new(2, 28, 3),
        }
    }

    /// Set whether registration gives symmetric windows.
    pub fn with_symmetric(mut self, symmetric: bool) -> Self {
        self.symmetric = symmetric;
        self
    }

    /// Set the timeout for waits on other ranks.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the per-rank memory limit in bytes.
    pub fn with_max_reserved_bytes(mut self, bytes: u64) -> Self {
        self.max_reserved_bytes = bytes;
        self
    }

    /// Set the NCCL version whose rules are reported.
    pub fn with_nccl_version(mut self, version: NcclVersion) -> Self {
        self.nccl_version = version;
        self
    }
}

/// One segment's bytes, shared with peers during collectives.
#[derive(Debug)]
struct HostMemory {
    data: Arc<Mutex<Box<[u8]>>>,
    size_bytes: u64,
    /// The rank's reserved-bytes counter, given back when the memory goes.
    reserved: Arc<AtomicU64>,
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.size_bytes, Ordering::Relaxed);
    }
}

impl SegmentMemory for HostMemory {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn device_ptr(&self) -> Option<u64> {
        None
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn lock_bytes(data: &Mutex<Box<[u8]>>) -> std::sync::MutexGuard<'_, Box<[u8]>> {
    data.lock().unwrap_or_else(|p| p.into_inner())
}

/// The host memory of a segment, or an error naming a segment from another provider.
fn memory_of(segment: &Segment) -> Result<&HostMemory> {
    segment.memory::<HostMemory>().ok_or(Error::Internal {
        what: "a segment of another backend reached the host backend".into(),
    })
}

/// Allocate `n` zeroed bytes, or `None` if the allocator refuses. Large allocations
/// come from the OS as untouched zero pages, so reserving costs nothing until written.
fn try_zeroed(n: usize) -> Option<Box<[u8]>> {
    if n == 0 {
        return Some(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    let slice = std::ptr::slice_from_raw_parts_mut(ptr, n);
    // SAFETY: `ptr` is a fresh, zero-initialised allocation of exactly `n` bytes made
    // with the layout of `[u8; n]` by the global allocator, which is the layout `Box<[u8]>`
    // frees with; ownership passes to the box.
    Some(unsafe { Box::from_raw(slice) })
}

type Side = (Arc<Mutex<Box<[u8]>>>, u64, u64);

/// One rank's sides of a collective, as its peers read them.
#[derive(Clone)]
struct Post {
    send: Side,
    recv: Side,
}

/// State shared by the ranks of one host world, per communicator.
struct HostComm {
    /// Held by one rank's calls on this communicator for the whole of each call, so
    /// that two threads of a rank cannot interleave their rounds.
    serial: Vec<Mutex<()>>,
    registrations: Rendezvous<u64>,
    collectives: Rendezvous<Option<Post>>,
}

/// One rank of a host world: ranks are threads of one process, segments host memory.
/// Make a world with [`HostBackend::world`]; it returns [`Backend`]s.
pub struct HostBackend {
    rank: usize,
    config: HostConfig,
    comms: Arc<Vec<HostComm>>,
    reserved: Arc<AtomicU64>,
    /// Per communicator: registration ordinal and collective round of this rank.
    counters: Mutex<Vec<(u64, u64)>>,
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
    /// [`Error::InvalidConfig`] for zero ranks or a granularity that is not a power of
    /// two.
    pub fn world(config: HostConfig) -> Result<Vec<Backend>> {
        if config.world_size == 0 {
            return Err(Error::InvalidConfig(
                "a world needs at least one rank".into(),
            ));
        }
        let infos = CommInfo::STANDARD.to_vec();
        let n = config.world_size;
        let comms = Arc::new(
            infos
                .iter()
                .map(|_| HostComm {
                    serial: (0..n).map(|_| Mutex::new(())).collect(),
                    registrations: Rendezvous::new(n),
                    collectives: Rendezvous::new(n),
                })
                .collect::<Vec<_>>(),
        );
        // Making a backend is collective: one thread per rank.
        std::thread::scope(|s| {
            let handles: Vec<_> = LocalExchange::group(n)
                .into_iter()
                .enumerate()
                .map(|(rank, exchange)| {
                    let (config, comms, infos) = (&config, &comms, &infos);
                    s.spawn(move || {
                        let info = BackendInfo::new(
                            BackendKind::Host,
                            rank,
                            n,
                            config.nccl_version,
                            config.granularity_bytes,
                            infos.clone(),
                        )?;
                        let parts = Arc::new(HostBackend {
                            rank,
                            config: config.clone(),
                            comms: comms.clone(),
                            reserved: Arc::new(AtomicU64::new(0)),
                            counters: Mutex::new(vec![(0, 0); infos.len()]),
                        });
                        let streams = Arc::new(HostStreams::default());
                        Backend::with_stream_ops(info, Arc::new(exchange), parts, streams)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Internal {
                            what: "a host rank's set-up thread panicked".into(),
                        })
                    })
                })
                .collect()
        })
    }

    fn comm(&self, comm: usize) -> Result<&HostComm> {
        self.comms
            .get(comm)
            .ok_or_else(|| Error::InvalidCollective {
                op: "host collective",
                detail: format!("no communicator {comm}"),
            })
    }

    fn next_round(&self, comm: usize, registration: bool) -> u64 {
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut c[comm];
        if registration {
            slot.0 += 1;
            slot.0
        } else {
            slot.1 += 1;
            slot.1
        }
    }

    /// Run one collective: post, check agreement, move data with `body`, barrier.
    fn collective(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        body: impl FnOnce(&[Post]) -> Result<()>,
    ) -> Result<()> {
        let comm = self.comm(args.comm)?;
        let side = |r: &super::Region<'_>| -> Result<Side> {
            Ok((
                memory_of(r.segment())?.data.clone(),
                r.offset_bytes(),
                r.len_bytes(),
            ))
        };
        let post = Post {
            send: side(&args.send)?,
            recv: side(&args.recv)?,
        };
        let _serial = comm.serial[self.rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let round = self.next_round(args.comm, false);
        let gathered =
            comm.collectives
                .gather(op, self.rank, round, Some(post), self.config.timeout)?;
        // A `None` is a peer's closing round paired with this post: the ranks are not
        // making the same calls on this communicator.
        let verdict = match gathered.into_iter().collect::<Option<Vec<Post>>>() {
            Some(posts) => body(&posts),
            None => Err(Error::CollectiveMismatch {
                op,
                detail: "a peer is at another step of its calls on this communicator".into(),
            }),
        };
        // Second round: nobody returns (and reuses its input) before all are done.
        let round = self.next_round(args.comm, false);
        comm.collectives
            .gather(op, self.rank, round, None, self.config.timeout)?;
        verdict
    }
}

fn read_region(seg: &Mutex<Box<[u8]>>, offset: u64, len: u64) -> Result<Vec<u8>> {
    let data = lock_bytes(seg);
    let range = bounds(data.len() as u64, offset, len)?;
    Ok(data[range].to_vec())
}

/// The bytes `offset..offset + len` of a segment of `seg_len` bytes, as an index range.
///
/// # Errors
/// [`Error::BadView`] if they leave the segment.
pub(super) fn bounds(seg_len: u64, offset: u64, len: u64) -> Result<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= seg_len => Ok(offset as usize..end as usize),
        _ => Err(Error::BadView(format!(
            "range {offset}+{len} outside a segment of {seg_len} bytes"
        ))),
    }
}

impl SegmentProvider for HostBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        reserve(&self.reserved, size_bytes, self.config.max_reserved_bytes)?;
        // From here the counter includes the segment; `HostMemory`'s drop gives it back.
        let oom = |message: &str| Error::DeviceOutOfMemory {
            segment_bytes: size_bytes,
            op: "host allocation",
            code: 0,
            message: message.into(),
        };
        let Some(data) = usize::try_from(size_bytes).ok().and_then(try_zeroed) else {
            self.reserved.fetch_sub(size_bytes, Ordering::Relaxed);
            return Err(oom("the host allocator refused"));
        };
        Ok(Segment::new(Box::new(HostMemory {
            data: Arc::new(Mutex::new(data)),
            size_bytes,
            reserved: self.reserved.clone(),
        })))
    }

    unsafe fn register(&self, segment: &Segment, comm: usize) -> Result<Option<Window>> {
        let size = memory_of(segment)?.size_bytes;
        let _serial = self.comm(comm)?.serial[self.rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let ordinal = self.next_round(comm, true);
        let sizes = self.comm(comm)?.registrations.gather(
            "window registration",
            self.rank,
            ordinal,
            size,
            self.config.timeout,
        )?;
        if sizes.iter().any(|&s| s != size) {
            return Err(Error::RegistrationMismatch { ordinal, sizes });
        }
        Ok(self
            .config
            .symmetric
            .then(|| Window::new(comm, ordinal, Box::new(()))))
    }

    unsafe fn deregister(&self, window: Window) -> std::result::Result<(), Refused<Window>> {
        drop(window);
        Ok(())
    }

    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        drop(segment);
        Ok(())
    }
}

/// The streams of the host backends (threads and processes): streams are tags and
/// fences counters; host work is synchronous, so every fence is complete when it is
/// recorded.
#[derive(Debug, Default)]
pub(super) struct HostStreams {
    /// Latest fence per stream.
    fences: Mutex<BTreeMap<StreamId, u64>>,
}

impl StreamOps for HostStreams {
    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream::host())
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        let mut f = self.fences.lock().unwrap_or_else(|p| p.into_inner());
        let c = f.entry(stream.id()).or_insert(0);
        *c += 1;
        Ok(Fence(*c))
    }

    fn wait_fence(&self, stream: &Stream, _on: StreamId, _fence: Fence) -> Result<()> {
        // Host work is synchronous: every fence is complete when it is recorded.
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        Ok(())
    }

    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>> {
        Ok(self
            .fences
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream)
            .map(|&f| Fence(f)))
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        Ok(false)
    }

    fn drain(&self, _deadline: Instant) -> Result<bool> {
        Ok(true)
    }
}

/// Take `size_bytes` from a rank's reserved-bytes `counter`, which may not pass
/// `limit`; the segment's memory gives them back when it goes.
///
/// # Errors
/// [`Error::PoolLimit`]; nothing is taken then.
pub(super) fn reserve(counter: &AtomicU64, size_bytes: u64, limit: u64) -> Result<()> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
            r.checked_add(size_bytes).filter(|&t| t <= limit)
        })
        .map(|_| ())
        .map_err(|reserved| Error::PoolLimit {
            segment_bytes: size_bytes,
            would_reserve_bytes: reserved.saturating_add(size_bytes),
            max_reserved_bytes: limit,
        })
}

impl DataMover for HostBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        let region = region.sub(0, data.len() as u64)?;
        let mem = memory_of(region.segment())?;
        let mut bytes = lock_bytes(&mem.data);
        let range = bounds(bytes.len() as u64, region.offset_bytes(), data.len() as u64)?;
        bytes[range].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        let region = region.sub(0, out.len() as u64)?;
        let mem = memory_of(region.segment())?;
        let bytes = lock_bytes(&mem.data);
        let range = bounds(bytes.len() as u64, region.offset_bytes(), out.len() as u64)?;
        out.copy_from_slice(&bytes[range]);
        Ok(())
    }

    fn time_ms(&self, _stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let start = Instant::now();
        f()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}

impl Collectives for HostBackend {
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        let chunk = args.check_counts("all_gather", self.config.world_size, false)?;
        self.collective(args, "all_gather", |posts| {
            // Pull: read every rank's chunk, write it into this rank's output.
            let (recv, recv_off, _) = &posts[self.rank].recv;
            for (r, p) in posts.iter().enumerate() {
                let data = read_region(&p.send.0, p.send.1, chunk)?;
                let mut out = lock_bytes(recv);
                let range = bounds(
                    out.len() as u64,
                    recv_off.saturating_add(r as u64 * chunk),
                    chunk,
                )?;
                out[range].copy_from_slice(&data);
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        let chunk = args.check_counts("reduce_scatter", self.config.world_size, true)?;
        let me = self.rank as u64;
        self.collective(args, "reduce_scatter", |posts| {
            // Pull: reduce this rank's chunk of every rank's input, in rank order.
            let inputs = posts
                .iter()
                .map(|p| read_region(&p.send.0, p.send.1.saturating_add(me * chunk), chunk))
                .collect::<Result<Vec<_>>>()?;
            let acc = dtype::reduce_ranks(args.dtype, args.op, inputs)?;
            let (recv, recv_off, _) = &posts[self.rank].recv;
            let mut out = lock_bytes(recv);
            let range = bounds(out.len() as u64, *recv_off, chunk)?;
            out[range].copy_from_slice(&acc);
            Ok(())
        })
    }
}
