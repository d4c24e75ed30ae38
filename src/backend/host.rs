//! The host backend: N ranks as threads of one process, segments in host memory.
//!
//! It is not a mock. Registration is a real barrier among the ranks with NCCL's
//! ordering rule (windows pair by call order, sizes must match) and a timeout;
//! collectives move and reduce real data between the ranks' segments, check that
//! every rank passed the same arguments (and, on the symmetric path, the same
//! offsets), and end in a barrier. Host work is synchronous, so streams are tags and
//! fences are counters.

use super::{
    Backend, BackendKind, CollArgs, CommInfo, Region, Registration, SegmentKey, check_counts,
};
use crate::core::{Fence, StreamId};
use crate::dtype::{self, DType, ReduceOp};
use crate::error::{Error, NcclVersion, Result};
use crate::exchange::{Exchange, LocalExchange, Rendezvous};
use crate::stream::Stream;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Settings of a host world.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HostConfig {
    /// Number of ranks (threads).
    pub world_size: usize,
    /// Whether registration yields symmetric windows. `false` behaves like an NCCL
    /// communicator without symmetric support: registration succeeds with a NULL
    /// window ([`Registration::Unsupported`]).
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
struct HostSegment {
    data: Mutex<Box<[u8]>>,
}

impl HostSegment {
    fn lock(&self) -> std::sync::MutexGuard<'_, Box<[u8]>> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }
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

#[derive(Clone)]
struct Post {
    op: &'static str,
    send: (Arc<HostSegment>, u64, u64),
    recv: (Arc<HostSegment>, u64, u64),
    /// Position of the send and receive segments' windows on the communicator.
    send_window: Option<u64>,
    recv_window: Option<u64>,
    count: u64,
    dtype: DType,
    reduce: ReduceOp,
    symmetric: bool,
}

/// State shared by the ranks of one host world, per communicator.
struct HostComm {
    /// Held by one rank's calls on this communicator for the whole of each call, so
    /// that two threads of a rank cannot interleave their rounds.
    serial: Vec<Mutex<()>>,
    registrations: Rendezvous<u64>,
    collectives: Rendezvous<Option<Post>>,
}

/// One rank of a host world. Make a world with [`HostBackend::world`].
pub struct HostBackend {
    rank: usize,
    config: HostConfig,
    comms: Arc<Vec<HostComm>>,
    infos: Vec<CommInfo>,
    exchange: LocalExchange,
    segments: Mutex<BTreeMap<SegmentKey, Arc<HostSegment>>>,
    /// Per communicator: registration ordinal and collective round of this rank.
    counters: Mutex<Vec<(u64, u64)>>,
    /// (segment, communicator) -> registration and its position on the communicator
    /// (windows pair across ranks by that position).
    registered: Mutex<BTreeMap<(SegmentKey, usize), (Registration, u64)>>,
    fences: Mutex<BTreeMap<StreamId, u64>>,
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
    pub fn world(config: HostConfig) -> Result<Vec<HostBackend>> {
        if config.world_size == 0 {
            return Err(Error::InvalidConfig(
                "a world needs at least one rank".into(),
            ));
        }
        if !crate::core::is_pow2(config.granularity_bytes) {
            return Err(Error::InvalidConfig(
                "granularity_bytes must be a power of two".into(),
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
        Ok(LocalExchange::group(n)
            .into_iter()
            .enumerate()
            .map(|(rank, exchange)| HostBackend {
                rank,
                config: config.clone(),
                comms: comms.clone(),
                infos: infos.clone(),
                exchange,
                segments: Mutex::new(BTreeMap::new()),
                counters: Mutex::new(vec![(0, 0); infos.len()]),
                registered: Mutex::new(BTreeMap::new()),
                fences: Mutex::new(BTreeMap::new()),
            })
            .collect())
    }

    fn segment(&self, id: SegmentKey) -> Result<Arc<HostSegment>> {
        self.segments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or(Error::ForeignBuffer)
    }

    fn comm(&self, comm: usize) -> Result<&HostComm> {
        self.comms
            .get(comm)
            .ok_or_else(|| Error::InvalidConfig(format!("no communicator {comm}")))
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

    fn reserved_bytes(&self) -> u64 {
        self.segments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|s| s.lock().len() as u64)
            .sum()
    }

    /// Run one collective: post, check agreement, move data with `body`, barrier.
    fn collective(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        body: impl FnOnce(&[Post]) -> Result<()>,
    ) -> Result<()> {
        let comm = self.comm(args.comm)?;
        let window = |key: SegmentKey| {
            self.registered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&(key, args.comm))
                .map(|&(_, ordinal)| ordinal)
        };
        let post = Post {
            op,
            send_window: window(args.send.segment),
            recv_window: window(args.recv.segment),
            send: (
                self.segment(args.send.segment)?,
                args.send.offset_bytes,
                args.send.len_bytes,
            ),
            recv: (
                self.segment(args.recv.segment)?,
                args.recv.offset_bytes,
                args.recv.len_bytes,
            ),
            count: args.count,
            dtype: args.dtype,
            reduce: args.op,
            symmetric: args.symmetric,
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
            Some(posts) => check_posts(&posts).and_then(|()| body(&posts)),
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

/// All ranks must agree on the operation, counts, type and reduction; on the symmetric
/// path also on the offset of the buffer peers access (NCCL's kernels address peers at
/// the local offset and do not check it).
fn check_posts(posts: &[Post]) -> Result<()> {
    let first = &posts[0];
    for (rank, p) in posts.iter().enumerate() {
        let mismatch = |what: &str, a: String, b: String| Error::CollectiveMismatch {
            op: first.op,
            detail: format!("{what}: rank 0 has {a}, rank {rank} has {b}"),
        };
        if p.op != first.op {
            return Err(mismatch("operation", first.op.into(), p.op.into()));
        }
        if p.count != first.count {
            return Err(mismatch(
                "count",
                first.count.to_string(),
                p.count.to_string(),
            ));
        }
        if p.dtype != first.dtype || p.reduce != first.reduce {
            return Err(mismatch(
                "type or reduction",
                format!("{:?}/{:?}", first.dtype, first.reduce),
                format!("{:?}/{:?}", p.dtype, p.reduce),
            ));
        }
        // All-gather writes peers at the output offset, reduce-scatter reads them at the
        // input offset; the other side is local (so in-place calls are fine).
        // The peer-accessed side must be the same window (by registration order) at
        // the same offset on every rank.
        let (mine, theirs, what) = if first.op == "all_gather" {
            (
                (p.recv_window, p.recv.1),
                (first.recv_window, first.recv.1),
                "symmetric output (window, offset)",
            )
        } else {
            (
                (p.send_window, p.send.1),
                (first.send_window, first.send.1),
                "symmetric input (window, offset)",
            )
        };
        if first.symmetric && mine != theirs {
            return Err(mismatch(what, format!("{theirs:?}"), format!("{mine:?}")));
        }
    }
    Ok(())
}

fn read_region(seg: &HostSegment, offset: u64, len: u64) -> Result<Vec<u8>> {
    let data = seg.lock();
    let range = bounds(data.len(), offset, len)?;
    Ok(data[range].to_vec())
}

fn bounds(seg_len: usize, offset: u64, len: u64) -> Result<std::ops::Range<usize>> {
    let end = offset
        .checked_add(len)
        .filter(|&e| e <= seg_len as u64)
        .ok_or_else(|| {
            Error::BadView(format!(
                "range {offset}+{len} outside segment of {seg_len} bytes"
            ))
        })?;
    Ok(offset as usize..end as usize)
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.config.world_size
    }

    fn nccl_version(&self) -> NcclVersion {
        self.config.nccl_version
    }

    fn granularity_bytes(&self) -> u64 {
        self.config.granularity_bytes
    }

    fn communicators(&self) -> &[CommInfo] {
        &self.infos
    }

    fn exchange(&self) -> &dyn Exchange {
        &self.exchange
    }

    fn alloc_segment(&self, id: SegmentKey, size_bytes: u64) -> Result<()> {
        let reserved = self.reserved_bytes();
        let oom = |reason: String| Error::OutOfMemory {
            segment_bytes: size_bytes,
            reason,
        };
        if reserved.saturating_add(size_bytes) > self.config.max_reserved_bytes {
            return Err(oom(format!(
                "host backend limit of {} bytes per rank ({} reserved)",
                self.config.max_reserved_bytes, reserved
            )));
        }
        let n =
            usize::try_from(size_bytes).map_err(|_| oom("larger than the address space".into()))?;
        let data = try_zeroed(n).ok_or_else(|| oom("host allocation failed".into()))?;
        self.segments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id,
                Arc::new(HostSegment {
                    data: Mutex::new(data),
                }),
            );
        Ok(())
    }

    fn free_segment(&self, id: SegmentKey) -> Result<()> {
        self.segments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        Ok(())
    }

    fn register(&self, id: SegmentKey, comm: usize) -> Result<Registration> {
        let size = self.segment(id)?.lock().len() as u64;
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
        let reg = if self.config.symmetric {
            Registration::Symmetric
        } else {
            Registration::Unsupported
        };
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((id, comm), (reg, ordinal));
        Ok(reg)
    }

    fn deregister(&self, id: SegmentKey, comm: usize) -> Result<()> {
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(id, comm));
        Ok(())
    }

    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream::host())
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        let mut f = self.fences.lock().unwrap_or_else(|p| p.into_inner());
        let c = f.entry(stream.id()).or_insert(0);
        *c += 1;
        Ok(Fence(*c))
    }

    fn wait_fence(&self, _stream: &Stream, _on: StreamId, _fence: Fence) -> Result<()> {
        // Host work is synchronous: every fence is complete when it is recorded.
        Ok(())
    }

    fn is_capturing(&self, _stream: &Stream) -> Result<bool> {
        Ok(false)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn write(&self, region: Region, data: &[u8], _stream: &Stream) -> Result<()> {
        let seg = self.segment(region.segment)?;
        let mut bytes = seg.lock();
        let range = bounds(bytes.len(), region.offset_bytes, data.len() as u64)?;
        bytes[range].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, region: Region, out: &mut [u8], _stream: &Stream) -> Result<()> {
        let seg = self.segment(region.segment)?;
        let bytes = seg.lock();
        let range = bounds(bytes.len(), region.offset_bytes, out.len() as u64)?;
        out.copy_from_slice(&bytes[range]);
        Ok(())
    }

    fn device_ptr(&self, _region: Region) -> Option<u64> {
        None
    }

    fn time_ms(&self, _stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let start = std::time::Instant::now();
        f()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        check_counts("all_gather", args, self.config.world_size, false)?;
        let chunk = args.count * args.dtype.size_bytes(); // checked above
        self.collective(args, "all_gather", |posts| {
            // Pull: read every rank's chunk, write it into this rank's output.
            let (recv, recv_off, _) = &posts[self.rank].recv;
            for (r, p) in posts.iter().enumerate() {
                let data = read_region(&p.send.0, p.send.1, chunk)?;
                let mut out = recv.lock();
                let range = bounds(out.len(), recv_off.saturating_add(r as u64 * chunk), chunk)?;
                out[range].copy_from_slice(&data);
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        check_counts("reduce_scatter", args, self.config.world_size, true)?;
        let chunk = args.count * args.dtype.size_bytes(); // checked above
        let me = self.rank as u64;
        self.collective(args, "reduce_scatter", |posts| {
            // Pull: reduce this rank's chunk of every rank's input, in rank order.
            // Floating-point averages scale each input by 1/ranks first and then sum
            // (NCCL's pre-multiplied sum), so they do not overflow where the mean fits;
            // integer averages sum and then divide, as NCCL does.
            let premul = args.op == ReduceOp::Avg && args.dtype != DType::U8;
            let mut acc: Option<Vec<u8>> = None;
            for p in posts {
                let mut data = read_region(&p.send.0, p.send.1.saturating_add(me * chunk), chunk)?;
                if premul {
                    dtype::divide(args.dtype, &mut data, posts.len());
                }
                match &mut acc {
                    None => acc = Some(data),
                    Some(a) => dtype::reduce_into(args.dtype, args.op, a, &data),
                }
            }
            let mut acc = acc.expect("at least one rank");
            if args.op == ReduceOp::Avg && !premul {
                dtype::divide(args.dtype, &mut acc, posts.len());
            }
            let (recv, recv_off, _) = &posts[self.rank].recv;
            let mut out = recv.lock();
            let range = bounds(out.len(), *recv_off, chunk)?;
            out[range].copy_from_slice(&acc);
            Ok(())
        })
    }
}
