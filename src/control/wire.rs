//! The store's wire protocol.
//!
//! A connection starts with a 12-byte *preface* from each side: the magic
//! `b"SYMMPOOL"`, the protocol version (`u16`, little-endian) and two reserved zero
//! bytes. Then each side sends *frames*: a `u32` little-endian body length followed by
//! the body, a [`postcard`]-encoded [`ToServer`] or [`ToClient`]. A length above the
//! receiver's limit is refused before anything is allocated for it, and buffers only
//! grow as bytes actually arrive. The client's first frame is [`ToServer::Hello`]
//! (job token, job identity, rank, world size, and who the process is); the server
//! answers [`ToClient::Welcome`] or [`ToClient::Reject`] (with the store's job identity
//! and, where it matters, who holds the rank asked for).

use crate::deadline::Deadline;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The first bytes of every connection, both ways.
pub(crate) const MAGIC: [u8; 8] = *b"SYMMPOOL";
/// The protocol version; a peer speaking another is refused. Version 2: the hello
/// carries the job identity and the process (host, pid), a refusal says why in a form
/// the client can act on.
pub(crate) const VERSION: u16 = 2;
/// Length of the preface.
pub(crate) const PREFACE_BYTES: usize = 12;
/// Largest frame accepted before the handshake completes.
pub(crate) const MAX_HANDSHAKE_FRAME_BYTES: usize = 4096;
/// Bytes of a result frame that are not payload, per rank and in all (a bound, with
/// room to spare, on postcard's varints, tags and the op name).
pub(crate) const FRAME_OVERHEAD_BYTES: usize = 1024;
pub(crate) const PER_PAYLOAD_OVERHEAD_BYTES: usize = 16;

/// The preface this build sends.
pub(crate) fn preface() -> [u8; PREFACE_BYTES] {
    let mut p = [0u8; PREFACE_BYTES];
    p[..8].copy_from_slice(&MAGIC);
    p[8..10].copy_from_slice(&VERSION.to_le_bytes());
    p
}

/// Check a peer's preface; `Err` says what is wrong.
pub(crate) fn check_preface(p: &[u8]) -> Result<(), String> {
    if p.len() < PREFACE_BYTES || p[..8] != MAGIC {
        let shown = String::from_utf8_lossy(&p[..p.len().min(8)]).into_owned();
        return Err(format!(
            "wrong magic number {shown:?} (not a symmpool store client or server)"
        ));
    }
    let version = u16::from_le_bytes([p[8], p[9]]);
    if version != VERSION {
        return Err(format!(
            "protocol version {version}, this build speaks {VERSION} (run the same symmpool on every rank)"
        ));
    }
    Ok(())
}

/// Client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ToServer {
    /// The first frame: who this is.
    Hello {
        #[serde(with = "serde_bytes")]
        token: Vec<u8>,
        /// The job identity (empty: none known).
        job: String,
        rank: u32,
        world_size: u32,
        /// The process: host name and pid.
        host: String,
        pid: u32,
    },
    /// This rank's payload for a round.
    Contribute {
        channel: u64,
        round: u64,
        op: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    /// This rank gave up waiting for a round: break the group.
    Abandon {
        channel: u64,
        round: u64,
        op: String,
    },
    /// Liveness.
    Heartbeat,
    /// Orderly goodbye.
    Bye,
}

/// Why a group broke.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The rank timed out; these ranks had not contributed to its round.
    Timeout { missing: Vec<u32> },
    /// The rank was lost.
    Lost { detail: String },
}

/// A broken group: who, in what, why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Broken {
    pub(crate) rank: u32,
    pub(crate) op: String,
    pub(crate) cause: Cause,
}

/// A process that joined (or asked to join) the store: where, which, when.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Member {
    pub(crate) host: String,
    pub(crate) pid: u32,
    /// The peer address the server saw.
    pub(crate) addr: String,
    /// When the server accepted its hello, in milliseconds since the Unix epoch.
    pub(crate) at_unix_ms: u64,
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} on host {:?} (from {}, at {})",
            self.pid,
            self.host,
            self.addr,
            utc(self.at_unix_ms)
        )
    }
}

/// Milliseconds since the Unix epoch now.
pub(crate) fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `ms` since the Unix epoch as a UTC time, `2026-12-01 10:47:20.123 UTC`.
pub(crate) fn utc(ms: u64) -> String {
    let (days, ms_of_day) = (ms / 86_400_000, ms % 86_400_000);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let s = ms_of_day / 1000;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03} UTC",
        s / 3600,
        s / 60 % 60,
        s % 60,
        ms_of_day % 1000
    )
}

/// Why a handshake was refused, in a form the client acts on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Anything else; the reason says what.
    Other,
    /// Too many handshakes in flight: try again shortly.
    Busy,
    /// The client belongs to another job (the store's job identity is in the reject).
    OtherJob,
    /// The rank is held by another process.
    RankTaken {
        rank: u32,
        holder: Member,
        claimant: Member,
    },
}

/// Server to client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ToClient {
    /// Handshake accepted.
    Welcome,
    /// Handshake refused; the connection closes. `job`: the store's job identity.
    Reject {
        reason: String,
        kind: Refusal,
        job: String,
    },
    /// The ranks connected so far (sent while the group assembles).
    Joined { present: Vec<u32> },
    /// Every rank has connected.
    AllJoined,
    /// A round is complete.
    Result {
        channel: u64,
        round: u64,
        #[serde(with = "byte_lists")]
        payloads: Vec<Vec<u8>>,
    },
    /// The group is broken for good.
    Broken(Broken),
    /// Liveness.
    Heartbeat,
}

/// Byte vectors as postcard byte strings (a length, then the bytes copied at once), not
/// as sequences of `u8` serialised one by one: the same bytes on the wire, written and
/// read several times faster (a round's result is encoded once and decoded by every
/// rank).
mod byte_lists {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_bytes::{ByteBuf, Bytes};

    pub(super) fn serialize<S: Serializer>(lists: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(lists.iter().map(|l| Bytes::new(l)))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        let lists = Vec::<ByteBuf>::deserialize(d)?;
        Ok(lists.into_iter().map(ByteBuf::into_vec).collect())
    }
}

/// Encode `msg` as one frame (length prefix and body), ready for a single write.
pub(crate) fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    // Serialising plain enums of integers, strings and byte vectors cannot fail.
    out = match postcard::to_extend(msg, out) {
        Ok(v) => v,
        Err(_) => vec![0u8; 4],
    };
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decode a frame body.
pub(crate) fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, String> {
    postcard::from_bytes(body)
        .map_err(|e| format!("undecodable frame of {} bytes: {e}", body.len()))
}

/// Why reading a frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed the connection (`partial`: in the middle of a frame).
    Eof { partial: bool },
    /// A length over the limit.
    TooLarge { len_bytes: usize, max_bytes: usize },
    /// Any other I/O error.
    Io(io::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Eof { partial: false } => write!(f, "connection closed"),
            ReadError::Eof { partial: true } => {
                write!(f, "connection closed in the middle of a frame")
            }
            ReadError::TooLarge {
                len_bytes,
                max_bytes,
            } => write!(
                f,
                "frame length {len_bytes} bytes exceeds the limit of {max_bytes} bytes"
            ),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Reads frames from a socket that has a read timeout, keeping partial frames across
/// timeouts.
pub(crate) struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Largest frame body accepted.
    pub(crate) max_frame_bytes: usize,
    /// Bytes read so far: progress inside a large frame also shows the peer is alive.
    bytes_read: u64,
}

impl<R: Read> FrameReader<R> {
    pub(crate) fn new(inner: R, max_frame_bytes: usize) -> Self {
        FrameReader {
            inner,
            buf: vec![0u8; 4096],
            start: 0,
            end: 0,
            max_frame_bytes,
            bytes_read: 0,
        }
    }

    /// The reader's source.
    pub(crate) fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Bytes read from the peer so far (complete frames or not).
    pub(crate) fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Make room for `need` bytes from `start`, growing by at most doubling.
    fn room(&mut self, need: usize) {
        if self.start > 0 && self.buf.len() - self.start < need.max(self.buf.len() / 2) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            let grown = (self.buf.len() * 2).min(need.max(self.buf.len()));
            if grown > self.buf.len() {
                self.buf.resize(grown, 0);
            }
        }
    }

    /// Read more bytes with `read`. `Ok(false)`: the read timed out (or, not waiting,
    /// nothing had arrived).
    fn fill(
        &mut self,
        read: &mut impl FnMut(&mut R, &mut [u8]) -> io::Result<usize>,
    ) -> Result<bool, ReadError> {
        loop {
            match read(&mut self.inner, &mut self.buf[self.end..]) {
                Ok(0) => {
                    return Err(ReadError::Eof {
                        partial: self.end > self.start,
                    });
                }
                Ok(n) => {
                    self.end += n;
                    self.bytes_read += n as u64;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(false);
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// The next `n` raw bytes (the preface), or `None` on a read timeout.
    pub(crate) fn raw(&mut self, n: usize) -> Result<Option<Vec<u8>>, ReadError> {
        loop {
            if self.end - self.start >= n {
                let out = self.buf[self.start..self.start + n].to_vec();
                self.start += n;
                return Ok(Some(out));
            }
            self.room(n);
            if !self.fill(&mut |r, b| r.read(b))? {
                return Ok(None);
            }
        }
    }

    /// The next frame's body, or `None` on a read timeout (a partial frame is kept).
    pub(crate) fn frame(&mut self) -> Result<Option<Vec<u8>>, ReadError> {
        self.next_frame(&mut |r, b| r.read(b))
    }

    fn next_frame(
        &mut self,
        read: &mut impl FnMut(&mut R, &mut [u8]) -> io::Result<usize>,
    ) -> Result<Option<Vec<u8>>, ReadError> {
        loop {
            let have = self.end - self.start;
            if have >= 4 {
                let mut len = [0u8; 4];
                len.copy_from_slice(&self.buf[self.start..self.start + 4]);
                let len = u32::from_le_bytes(len) as usize;
                if len > self.max_frame_bytes {
                    return Err(ReadError::TooLarge {
                        len_bytes: len,
                        max_bytes: self.max_frame_bytes,
                    });
                }
                if have >= 4 + len {
                    let body = self.buf[self.start + 4..self.start + 4 + len].to_vec();
                    self.start += 4 + len;
                    if self.start == self.end {
                        self.start = 0;
                        self.end = 0;
                    }
                    return Ok(Some(body));
                }
                self.room(4 + len);
            } else {
                self.room(4);
            }
            if !self.fill(read)? {
                return Ok(None);
            }
        }
    }
}

/// One socket shared by a connection's reader, writer and closer: one descriptor per
/// connection (not a `try_clone` each), read and written through `&TcpStream`.
#[derive(Debug, Clone)]
pub(crate) struct SharedStream(pub(crate) Arc<TcpStream>);

impl SharedStream {
    pub(crate) fn new(stream: TcpStream) -> Self {
        SharedStream(Arc::new(stream))
    }
}

impl std::ops::Deref for SharedStream {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.0
    }
}

impl Read for SharedStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl Write for SharedStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self.0).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&*self.0).flush()
    }
}

impl AsFd for SharedStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl<R: Read + AsFd> FrameReader<R> {
    /// The next frame's body if its bytes are already here, else `None` at once (a
    /// partial frame is kept). Reads with `MSG_DONTWAIT`, which leaves the socket's
    /// own blocking mode alone: other threads write to clones of it.
    pub(crate) fn frame_now(&mut self) -> Result<Option<Vec<u8>>, ReadError> {
        self.next_frame(&mut |s, b| {
            rustix::net::recv(s.as_fd(), b, rustix::net::RecvFlags::DONTWAIT)
                .map(|(n, _)| n)
                .map_err(io::Error::from)
        })
    }

    /// Poll for the next frame for up to `spin`, then give up (`None`; the caller
    /// blocks instead). Waking a blocked thread costs tens of microseconds on an idle
    /// core; a round among ranks that arrive together is over sooner than that.
    pub(crate) fn spin_frame(&mut self, spin: Duration) -> Result<Option<Vec<u8>>, ReadError> {
        if spin.is_zero() {
            return Ok(None);
        }
        let until = Instant::now() + spin;
        loop {
            if let Some(body) = self.frame_now()? {
                return Ok(Some(body));
            }
            if Instant::now() >= until {
                return Ok(None);
            }
            // Let the thread this one waits for run, where cores are short.
            std::thread::yield_now();
        }
    }
}

/// Write one pre-encoded frame (or preface) in a single `write_all`.
pub(crate) fn send(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    w.write_all(bytes)
}

/// Compare two secrets in time that depends only on their lengths.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    diff == 0
}

/// Read until `deadline`: `None` when it passes.
pub(crate) fn read_until<T>(
    stream: &TcpStream,
    deadline: Deadline,
    mut f: impl FnMut() -> std::result::Result<Option<T>, ReadError>,
) -> std::result::Result<Option<T>, ReadError> {
    loop {
        let left = deadline.remaining();
        if left.is_zero() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left)).map_err(ReadError::Io)?;
        if let Some(v) = f()? {
            return Ok(Some(v));
        }
    }
}

/// Feed `data` to the store's decoders as a peer would send it, checking what they
/// promise; panics on a broken promise (for the fuzz target).
///
/// `data[0]` picks the read sizes (1 to 16 bytes a read, or everything at once) and
/// the frame limit; the rest is the byte stream: a preface, then frames, each decoded
/// as a [`ToServer`] and as a [`ToClient`]. Checked: no panic; a length over the limit
/// is refused before its buffer grows past it; every frame that decodes encodes back
/// to a frame that decodes to the same message; a preface is accepted exactly when
/// its magic and version are this build's.
#[doc(hidden)]
pub fn fuzz_frames(data: &[u8]) {
    let Some((&mode, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(mode & 0x0f) + 1;
    let all_at_once = mode & 0x10 != 0;
    let max_frame_bytes = if mode & 0x20 != 0 {
        MAX_HANDSHAKE_FRAME_BYTES
    } else {
        64
    };
    /// A peer that sends at most `chunk` bytes a read.
    struct Peer<'a> {
        bytes: &'a [u8],
        chunk: usize,
    }
    impl Read for Peer<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = out.len().min(self.chunk).min(self.bytes.len());
            out[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }
    let chunk = if all_at_once { usize::MAX } else { chunk };
    let mut reader = FrameReader::new(
        Peer {
            bytes: stream,
            chunk,
        },
        max_frame_bytes,
    );
    match reader.raw(PREFACE_BYTES) {
        Ok(Some(p)) => {
            let ok = p[..8] == MAGIC && p[8..10] == VERSION.to_le_bytes();
            assert_eq!(check_preface(&p).is_ok(), ok, "preface {p:?}");
        }
        Ok(None) => unreachable!("the peer never times out"),
        Err(_) => return,
    }
    fn round_trip<T>(body: &[u8])
    where
        T: Serialize + for<'a> Deserialize<'a> + PartialEq + std::fmt::Debug,
    {
        if let Ok(msg) = decode::<T>(body) {
            let frame = encode(&msg);
            let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
            assert_eq!(len, frame.len() - 4);
            assert_eq!(decode::<T>(&frame[4..]).as_ref(), Ok(&msg));
        }
    }
    loop {
        let before = reader.buf.len();
        match reader.frame() {
            Ok(Some(body)) => {
                assert!(body.len() <= max_frame_bytes);
                round_trip::<ToServer>(&body);
                round_trip::<ToClient>(&body);
            }
            Ok(None) => unreachable!("the peer never times out"),
            Err(ReadError::TooLarge { len_bytes, .. }) => {
                assert!(len_bytes > max_frame_bytes);
                assert!(reader.buf.len() <= before.max(4 + max_frame_bytes));
                return;
            }
            Err(ReadError::Eof { .. } | ReadError::Io(_)) => return,
        }
        assert!(reader.buf.len() <= 4096.max(4 + max_frame_bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte vectors written as byte strings are the bytes postcard writes for a
    /// sequence of `u8`: the frames on the wire did not change.
    #[test]
    fn byte_strings_keep_the_wire_format() {
        #[derive(Serialize)]
        enum PlainServer {
            _Hello,
            Contribute {
                channel: u64,
                round: u64,
                op: String,
                payload: Vec<u8>,
            },
        }
        #[derive(Serialize)]
        enum PlainClient {
            _Welcome,
            _Reject,
            _Joined,
            _AllJoined,
            Result {
                channel: u64,
                round: u64,
                payloads: Vec<Vec<u8>>,
            },
        }
        let payloads: Vec<Vec<u8>> = vec![vec![], (0..=255).collect(), vec![7; 300]];
        let ours = encode(&ToClient::Result {
            channel: 3,
            round: 1 << 40,
            payloads: payloads.clone(),
        });
        let plain = encode(&PlainClient::Result {
            channel: 3,
            round: 1 << 40,
            payloads: payloads.clone(),
        });
        assert_eq!(ours, plain);
        match decode::<ToClient>(&ours[4..]) {
            Ok(ToClient::Result { payloads: back, .. }) => assert_eq!(back, payloads),
            other => panic!("{other:?}"),
        }
        let contribute = |payload: Vec<u8>| ToServer::Contribute {
            channel: 1,
            round: 2,
            op: "op".into(),
            payload,
        };
        let ours = encode(&contribute(payloads[1].clone()));
        let plain = encode(&PlainServer::Contribute {
            channel: 1,
            round: 2,
            op: "op".into(),
            payload: payloads[1].clone(),
        });
        assert_eq!(ours, plain);
        assert!(matches!(
            decode::<ToServer>(&ours[4..]),
            Ok(ToServer::Contribute { payload, .. }) if payload == payloads[1]
        ));
    }

    #[test]
    fn frames_round_trip_across_short_reads() {
        let mut bytes = Vec::new();
        for i in 0..50u64 {
            bytes.extend(encode(&ToClient::Result {
                channel: i,
                round: i * 3,
                payloads: vec![vec![i as u8; (i * 37) as usize]; 3],
            }));
        }
        // A reader that returns at most 7 bytes at a time.
        struct Trickle(Vec<u8>, usize);
        impl Read for Trickle {
            fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
                let n = out.len().min(7).min(self.0.len() - self.1);
                out[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
                self.1 += n;
                Ok(n)
            }
        }
        let mut r = FrameReader::new(Trickle(bytes, 0), 1 << 20);
        for i in 0..50u64 {
            let body = r.frame().unwrap().unwrap();
            match decode::<ToClient>(&body).unwrap() {
                ToClient::Result {
                    channel,
                    round,
                    payloads,
                } => {
                    assert_eq!((channel, round), (i, i * 3));
                    assert_eq!(payloads, vec![vec![i as u8; (i * 37) as usize]; 3]);
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(r.frame(), Err(ReadError::Eof { partial: false })));
    }

    #[test]
    fn an_oversized_length_is_refused_before_allocating() {
        let mut r = FrameReader::new(&[0xff, 0xff, 0xff, 0x7f, 1, 2][..], 4096);
        assert!(matches!(
            r.frame(),
            Err(ReadError::TooLarge {
                max_bytes: 4096,
                ..
            })
        ));
        assert!(r.buf.len() <= 4096);
    }

    #[test]
    fn a_truncated_frame_is_a_partial_eof() {
        let mut r = FrameReader::new(&[10, 0, 0, 0, 1, 2][..], 4096);
        assert!(matches!(r.frame(), Err(ReadError::Eof { partial: true })));
    }

    #[test]
    fn garbage_does_not_decode_and_prefaces_are_checked() {
        assert!(decode::<ToServer>(&[0xff, 0xee, 0x01]).is_err());
        assert!(check_preface(&preface()).is_ok());
        assert!(
            check_preface(b"GET / HTTP/1.1")
                .unwrap_err()
                .contains("magic")
        );
        let mut p = preface();
        p[8] = 9;
        assert!(check_preface(&p).unwrap_err().contains("version 9"));
    }

    #[test]
    fn the_fuzz_entry_takes_frames_garbage_and_nothing() {
        fuzz_frames(&[]);
        fuzz_frames(&[3, 1, 2, 3]);
        let mut data = vec![0x22];
        data.extend(preface());
        data.extend(encode(&ToServer::Hello {
            token: b"t".to_vec(),
            job: "j".into(),
            rank: 1,
            world_size: 2,
            host: "h".into(),
            pid: 7,
        }));
        data.extend(encode(&ToClient::Reject {
            reason: "r".into(),
            kind: Refusal::RankTaken {
                rank: 1,
                holder: Member {
                    host: "a".into(),
                    pid: 1,
                    addr: "x".into(),
                    at_unix_ms: 1 << 40,
                },
                claimant: Member {
                    host: "b".into(),
                    pid: 2,
                    addr: "y".into(),
                    at_unix_ms: 0,
                },
            },
            job: "j".into(),
        }));
        data.extend(u32::MAX.to_le_bytes());
        fuzz_frames(&data);
        data[0] = 0x10;
        fuzz_frames(&data);
    }

    proptest::proptest! {
        /// The fuzz target's checks, on random inputs (with and without a valid
        /// preface) where cargo-fuzz is not at hand.
        #[test]
        fn the_frame_decoder_keeps_its_promises_on_random_bytes(
            mode: u8,
            valid_preface: bool,
            rest in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
        ) {
            let mut data = vec![mode];
            if valid_preface {
                data.extend(preface());
            }
            data.extend(rest);
            fuzz_frames(&data);
        }
    }

    #[test]
    fn times_print_as_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(utc(951_782_400_123), "2000-02-29 00:00:00.123 UTC");
        assert_eq!(utc(1_796_115_723_456), "2026-12-01 09:02:03.456 UTC");
    }

    #[test]
    fn tokens_compare_by_content() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"\0"));
        assert!(constant_time_eq(b"", b""));
    }
}
