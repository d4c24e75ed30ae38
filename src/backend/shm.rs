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

use super::host::{HostStreams, bounds, reserve};
use super::{
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, DataMover, Refused, Region,
    Segment, SegmentMemory, SegmentProvider, Window,
};
use crate::control::{ChannelId, Exchange};
use crate::dtype;
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use memmap2::MmapRaw;
use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Settings of a shared-memory rank.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShmConfig {
    /// Whether registration yields windows (`false`: like an NCCL communicator
    /// without symmetric support, registration succeeds with no window).
    pub symmetric: bool,
    /// How long registration and collectives wait for the other ranks (default 60 s).
    pub timeout: Duration,
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
            timeout: Duration::from_secs(60),
            granularity_bytes: 2 << 20,
            max_reserved_bytes: 16 << 30,
            nccl_version: NcclVersion::new(2, 28, 3),
        }
    }
}

impl ShmConfig {
    /// Set the timeout of waits on other ranks.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set whether registration gives windows.
    pub fn with_symmetric(mut self, symmetric: bool) -> Self {
        self.symmetric = symmetric;
        self
    }

    /// Set the per-rank memory limit in bytes.
    pub fn with_max_reserved_bytes(mut self, bytes: u64) -> Self {
        self.max_reserved_bytes = bytes;
        self
    }
}

/// One segment: a memfd and this rank's mapping of it.
struct ShmMemory {
    file: File,
    map: MmapRaw,
    size_bytes: u64,
    reserved: Arc<AtomicU64>,
}

impl fmt::Debug for ShmMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmMemory")
            .field("fd", &self.file.as_raw_fd())
            .field("size_bytes", &self.size_bytes)
            .finish()
    }
}

impl Drop for ShmMemory {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.size_bytes, Ordering::Relaxed);
    }
}

impl SegmentMemory for ShmMemory {
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

/// A window: this rank's mappings of every peer's segment registered at the same
/// position (`None` at this rank's own index).
struct ShmWindow {
    peers: Vec<Option<MmapRaw>>,
}

fn memory_of(segment: &Segment) -> Result<&ShmMemory> {
    segment.memory::<ShmMemory>().ok_or(Error::Internal {
        what: "a segment of another backend reached the shared-memory backend".into(),
    })
}

fn shm_error(op: &'static str, detail: String, source: std::io::Error) -> Error {
    Error::SharedMemory { op, detail, source }
}

/// What every payload of a communicator's channel starts with, so that rounds of
/// different kinds never pass for each other.
mod kind {
    pub(super) const REGISTER: u64 = 0x5245_4749; // "REGI"
    pub(super) const POST: u64 = 0x504f_5354; // "POST"
    pub(super) const DATA: u64 = 0x4441_5441; // "DATA"
    pub(super) const DONE: u64 = 0x444f_4e45; // "DONE"
}

fn encode(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn decode(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

/// Bytes of control-plane payload per data round on the plain path.
const DATA_PIECE_BYTES: usize = 1 << 20;

/// One rank of a multi-process shared-memory world. Make it with
/// [`ShmBackend::join`]; it returns a [`Backend`].
pub struct ShmBackend {
    rank: usize,
    world: usize,
    config: ShmConfig,
    exchange: Arc<dyn Exchange>,
    /// Per communicator: the channel of its registrations and collectives, and the
    /// lock that keeps one call at a time on it on this rank.
    comms: Vec<(ChannelId, Mutex<()>)>,
    /// Registrations made per communicator (window ordinals).
    ordinals: Mutex<Vec<u64>>,
    reserved: Arc<AtomicU64>,
}

impl fmt::Debug for ShmBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ShmBackend {
    /// This process's rank of a shared-memory world over `exchange` (for example a
    /// [`StoreExchange`](crate::control::StoreExchange) from the launcher's
    /// environment). The world has the same three communicators as the NCCL backend.
    ///
    /// # Collective
    /// Every rank calls it at the same point (the ranks open the communicators'
    /// channels).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a granularity that is not a power of two; the
    /// errors of [`Exchange::open_channel`].
    pub fn join(exchange: Arc<dyn Exchange>, config: ShmConfig) -> Result<Backend> {
        let (rank, world) = (exchange.rank(), exchange.world_size());
        let infos = CommInfo::STANDARD.to_vec();
        let info = BackendInfo::new(
            BackendKind::Host,
            rank,
            world,
            config.nccl_version,
            config.granularity_bytes,
            infos.clone(),
        )?;
        let comms = (0..infos.len())
            .map(|c| {
                let ch = exchange.open_channel(&format!("shm:comm{c}"), super::SETUP_TIMEOUT)?;
                Ok((ch, Mutex::new(())))
            })
            .collect::<Result<Vec<_>>>()?;
        let parts = Arc::new(ShmBackend {
            rank,
            world,
            config,
            exchange: exchange.clone(),
            comms,
            ordinals: Mutex::new(vec![0; infos.len()]),
            reserved: Arc::new(AtomicU64::new(0)),
        });
        let streams = Arc::new(HostStreams::default());
        Backend::with_stream_ops(info, exchange, parts, streams)
    }

    fn comm(&self, c: usize) -> Result<&(ChannelId, Mutex<()>)> {
        self.comms.get(c).ok_or_else(|| Error::InvalidCollective {
            op: "shared-memory collective",
            detail: format!("no communicator {c}"),
        })
    }

    /// One round on communicator `c`'s channel.
    fn round(&self, c: usize, op: &'static str, words: &[u64]) -> Result<Vec<Vec<u64>>> {
        let (ch, _) = self.comm(c)?;
        let all = self
            .exchange
            .all_gather(*ch, op, &encode(words), self.config.timeout)?;
        Ok(all.iter().map(|b| decode(b)).collect())
    }

    /// A round of raw bytes (the plain path's data), tagged.
    fn data_round(&self, c: usize, op: &'static str, piece: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (ch, _) = self.comm(c)?;
        let mut payload = kind::DATA.to_le_bytes().to_vec();
        payload.extend_from_slice(piece);
        let all = self
            .exchange
            .all_gather(*ch, op, &payload, self.config.timeout)?;
        all.into_iter()
            .map(|mut p| {
                if p.len() < 8 || p[..8] != kind::DATA.to_le_bytes() {
                    return Err(Error::CollectiveMismatch {
                        op,
                        detail: "a peer is at another step of its calls on this communicator"
                            .into(),
                    });
                }
                p.drain(..8);
                Ok(p)
            })
            .collect()
    }

    /// Run one collective: compare the posts, move the data with `body`, barrier.
    fn collective(
        &self,
        args: &CollArgs<'_>,
        op: &'static str,
        reduce: bool,
        body: impl FnOnce(&[Vec<u64>]) -> Result<()>,
    ) -> Result<()> {
        let (_, serial) = self.comm(args.comm)?;
        let _serial = lock(serial);
        // The opening round: every rank is at this collective on this communicator
        // (the arguments are compared by the checked collectives of `coll`, the same
        // way on every backend; like NCCL, the backend itself does not).
        let posts = self.round(args.comm, op, &[kind::POST, u64::from(reduce)])?;
        let verdict = match posts.iter().position(|p| p.first() != Some(&kind::POST)) {
            Some(rank) => Err(Error::CollectiveMismatch {
                op,
                detail: format!("rank {rank} is at another step of its calls on this communicator"),
            }),
            None => body(&posts),
        };
        // Nobody returns (and reuses its input) before every rank is done with it.
        let done = self.round(args.comm, op, &[kind::DONE])?;
        if done.iter().any(|d| d.first() != Some(&kind::DONE)) {
            return Err(Error::CollectiveMismatch {
                op,
                detail: "a peer is at another step of its calls on this communicator".into(),
            });
        }
        verdict
    }

    /// `len` bytes of peer `peer`'s segment in `window`, at `offset`.
    fn peer_bytes(window: &Window, peer: usize, offset: u64, len: u64) -> Result<Vec<u8>> {
        let w = window.handle::<ShmWindow>().ok_or(Error::Internal {
            what: "a window of another backend reached the shared-memory backend".into(),
        })?;
        let Some(Some(map)) = w.peers.get(peer) else {
            return Err(Error::Internal {
                what: format!("window {} has no mapping of rank {peer}", window.ordinal()),
            });
        };
        let range = bounds(map.len() as u64, offset, len)?;
        let mut out = vec![0u8; range.len()];
        // SAFETY: `range` lies inside the peer's mapping (checked by `bounds`); the
        // mapping stays alive while `window` is borrowed; the peer writes only other
        // bytes of it until the collective's closing barrier (the posts agreed that
        // every rank reads the same, disjoint chunks), and `out` is a fresh buffer.
        let src = map.as_ptr().wrapping_add(range.start);
        // SAFETY: `src..src + range.len()` lies inside the peer's mapping (see above).
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), range.len()) };
        Ok(out)
    }
}

impl ShmBackend {
    /// Write `data` into peer `peer`'s segment in `window`, at `offset`.
    fn peer_write(window: &Window, peer: usize, offset: u64, data: &[u8]) -> Result<()> {
        let w = window.handle::<ShmWindow>().ok_or(Error::Internal {
            what: "a window of another backend reached the shared-memory backend".into(),
        })?;
        let Some(Some(map)) = w.peers.get(peer) else {
            return Err(Error::Internal {
                what: format!("window {} has no mapping of rank {peer}", window.ordinal()),
            });
        };
        let range = bounds(map.len() as u64, offset, data.len() as u64)?;
        let dst = map.as_mut_ptr().wrapping_add(range.start);
        // SAFETY: `dst..dst + data.len()` lies inside the peer's live mapping (checked
        // by `bounds`; the window is borrowed); during this collective only this rank
        // writes this chunk of the peer's output (the posts agreed on the offsets) and
        // the peer reads it only after the closing barrier.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }
}

/// This rank's mapping of a region's bytes.
fn local_ptr(region: &Region<'_>) -> Result<(*mut u8, std::ops::Range<usize>)> {
    let mem = memory_of(region.segment())?;
    let range = bounds(mem.size_bytes, region.offset_bytes(), region.len_bytes())?;
    Ok((mem.map.as_mut_ptr(), range))
}

fn read_local(region: &Region<'_>, out: &mut [u8]) -> Result<()> {
    let (ptr, range) = local_ptr(&region.sub(0, out.len() as u64)?)?;
    // SAFETY: `range` lies inside this rank's live mapping of the segment (the region
    // borrows the segment); peers only read this rank's memory during collectives,
    // which are ordered with this call by the pool's stream rules; `out` is distinct.
    let src = ptr.wrapping_add(range.start);
    // SAFETY: (as above) `src..src + out.len()` is inside the mapping.
    unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), range.len()) };
    Ok(())
}

fn write_local(region: &Region<'_>, data: &[u8]) -> Result<()> {
    let (ptr, range) = local_ptr(&region.sub(0, data.len() as u64)?)?;
    // SAFETY: as in `read_local`; the bytes written are this rank's own block (or the
    // chunk of a collective output that only this rank writes).
    let dst = ptr.wrapping_add(range.start);
    // SAFETY: (as above) `dst..dst + data.len()` is inside the mapping.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, range.len()) };
    Ok(())
}

impl SegmentProvider for ShmBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        reserve(&self.reserved, size_bytes, self.config.max_reserved_bytes)?;
        let undo = |e: Error| {
            self.reserved.fetch_sub(size_bytes, Ordering::Relaxed);
            e
        };
        let oom = |message: String| Error::DeviceOutOfMemory {
            segment_bytes: size_bytes,
            op: "memfd_create",
            code: 0,
            message,
        };
        let memfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create("symmpool-segment")
            .map_err(|e| undo(oom(e.to_string())))?;
        let file = memfd.into_file();
        file.set_len(size_bytes)
            .map_err(|e| undo(oom(format!("sizing the segment: {e}"))))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| undo(oom(format!("mapping: {e}"))))?;
        Ok(Segment::new(Box::new(ShmMemory {
            file,
            map,
            size_bytes,
            reserved: self.reserved.clone(),
        })))
    }

    unsafe fn register(&self, segment: &Segment, comm: usize) -> Result<Option<Window>> {
        let mem = memory_of(segment)?;
        let (_, serial) = self.comm(comm)?;
        let _serial = lock(serial);
        let mine = [
            kind::REGISTER,
            u64::from(std::process::id()),
            mem.file.as_raw_fd() as u64,
            mem.size_bytes,
        ];
        let all = self.round(comm, "window registration", &mine)?;
        let ordinal = {
            let mut o = lock(&self.ordinals);
            o[comm] += 1;
            o[comm]
        };
        if all.iter().any(|p| p.len() != 4 || p[0] != kind::REGISTER) {
            return Err(Error::CollectiveMismatch {
                op: "window registration",
                detail: "a peer is at another step of its calls on this communicator".into(),
            });
        }
        let sizes: Vec<u64> = all.iter().map(|p| p[3]).collect();
        if sizes.iter().any(|&s| s != mem.size_bytes) {
            return Err(Error::RegistrationMismatch { ordinal, sizes });
        }
        if !self.config.symmetric {
            return Ok(None);
        }
        let mut peers = Vec::with_capacity(self.world);
        for (r, p) in all.iter().enumerate() {
            if r == self.rank {
                peers.push(None);
                continue;
            }
            let path = format!("/proc/{}/fd/{}", p[1], p[2]);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    shm_error("opening a peer's segment", format!("rank {r}: {path}"), e)
                })?;
            let map = MmapRaw::map_raw(&file)
                .map_err(|e| shm_error("mapping a peer's segment", format!("rank {r}"), e))?;
            if map.len() as u64 != mem.size_bytes {
                return Err(Error::RegistrationMismatch { ordinal, sizes });
            }
            peers.push(Some(map));
        }
        Ok(Some(Window::new(
            comm,
            ordinal,
            Box::new(ShmWindow { peers }),
        )))
    }

    unsafe fn deregister(&self, window: Window) -> std::result::Result<(), Refused<Window>> {
        // Unmapping the peers' segments is local; their memory lives on until every
        // mapping and descriptor of it is gone.
        drop(window);
        Ok(())
    }

    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        drop(segment);
        Ok(())
    }
}

impl DataMover for ShmBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        write_local(&region, data)
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        if !stream.is_host() {
            return Err(Error::WrongStream);
        }
        read_local(&region, out)
    }

    fn time_ms(&self, _stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let start = Instant::now();
        f()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}

impl ShmBackend {
    /// Every rank's `len` bytes, moved through the control plane in pieces.
    fn gather_bytes(&self, c: usize, op: &'static str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut out: Vec<Vec<u8>> = vec![Vec::with_capacity(mine.len()); self.world];
        let pieces = mine.len().div_ceil(DATA_PIECE_BYTES).max(1);
        for k in 0..pieces {
            let lo = (k * DATA_PIECE_BYTES).min(mine.len());
            let hi = ((k + 1) * DATA_PIECE_BYTES).min(mine.len());
            let got = self.data_round(c, op, &mine[lo..hi])?;
            for (r, piece) in got.into_iter().enumerate() {
                if piece.len() != hi - lo {
                    return Err(Error::CollectiveMismatch {
                        op,
                        detail: format!(
                            "rank {r} sent {} bytes, expected {}",
                            piece.len(),
                            hi - lo
                        ),
                    });
                }
                out[r].extend_from_slice(&piece);
            }
        }
        Ok(out)
    }
}

impl Collectives for ShmBackend {
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let chunk = args.check_counts(OP, self.world, false)?;
        let me = self.rank as u64;
        self.collective(args, OP, false, |_| {
            let mut mine = vec![0u8; chunk as usize];
            read_local(&args.send, &mut mine)?;
            match args.windows.1 {
                Some(recv_window) => {
                    // Push this rank's chunk into every rank's output, at the local
                    // output offset (the symmetric path).
                    let at = args.recv.offset_bytes() + me * chunk;
                    for p in 0..self.world {
                        if p == self.rank {
                            write_local(&args.recv.sub(me * chunk, chunk)?, &mine)?;
                        } else {
                            Self::peer_write(recv_window, p, at, &mine)?;
                        }
                    }
                }
                None => {
                    let chunks = self.gather_bytes(args.comm, OP, &mine)?;
                    for (r, data) in chunks.iter().enumerate() {
                        write_local(&args.recv.sub(r as u64 * chunk, chunk)?, data)?;
                    }
                }
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let chunk = args.check_counts(OP, self.world, true)?;
        let me = self.rank as u64;
        self.collective(args, OP, true, |_| {
            let inputs: Vec<Vec<u8>> = match args.windows {
                (Some(send_window), _) => (0..self.world)
                    .map(|p| {
                        if p == self.rank {
                            let mut v = vec![0u8; chunk as usize];
                            read_local(&args.send.sub(me * chunk, chunk)?, &mut v)?;
                            Ok(v)
                        } else {
                            Self::peer_bytes(
                                send_window,
                                p,
                                args.send.offset_bytes() + me * chunk,
                                chunk,
                            )
                        }
                    })
                    .collect::<Result<_>>()?,
                _ => {
                    let whole = chunk * self.world as u64;
                    let mut mine = vec![0u8; whole as usize];
                    read_local(&args.send.sub(0, whole)?, &mut mine)?;
                    let lo = (me * chunk) as usize;
                    self.gather_bytes(args.comm, OP, &mine)?
                        .into_iter()
                        .map(|v| v[lo..lo + chunk as usize].to_vec())
                        .collect()
                }
            };
            let acc = dtype::reduce_ranks(args.dtype, args.op, inputs)?;
            write_local(&args.recv.sub(0, chunk)?, &acc)
        })
    }
}
