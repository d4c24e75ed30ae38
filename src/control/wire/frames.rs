//! The frame codec: reading length-prefixed frames from a socket with a read timeout,
//! keeping partial frames across timeouts, and writing them in one write each.

use super::{
    MAGIC, MAX_HANDSHAKE_FRAME_BYTES, PREFACE_BYTES, ToClient, ToServer, VERSION, check_preface,
    decode, encode,
};
use crate::deadline::Deadline;
use serde::{Deserialize, Serialize};
use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why reading a frame failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    /// The peer closed the connection (`partial`: in the middle of a frame).
    #[error("connection closed{}", if *.partial { " in the middle of a frame" } else { "" })]
    Eof { partial: bool },
    /// A length over the limit.
    #[error("frame length {len_bytes} bytes exceeds the limit of {max_bytes} bytes")]
    TooLarge { len_bytes: usize, max_bytes: usize },
    /// Any other I/O error.
    #[error("{0}")]
    Io(io::Error),
}

/// Reads frames from a socket that has a read timeout, keeping partial frames across
/// timeouts.
pub(crate) struct FrameReader<R> {
    /// The source.
    pub(crate) inner: R,
    pub(super) buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Largest frame body accepted.
    pub(crate) max_frame_bytes: usize,
    /// Bytes read so far: progress inside a large frame also shows the peer is alive.
    pub(crate) bytes_read: u64,
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

    /// Make room for `need` bytes from `start`, growing by at most doubling.
    fn room(&mut self, need: usize) {
        if self.start > 0 && self.buf.len() - self.start < need.max(self.buf.len() / 2) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // (Never less than its length: a buffer that holds `need` is not full.)
            self.buf
                .resize((self.buf.len() * 2).min(need.max(self.buf.len())), 0);
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
                    let partial = self.end > self.start;
                    return Err(ReadError::Eof { partial });
                }
                Ok(n) => {
                    self.end += n;
                    self.bytes_read += n as u64;
                    return Ok(true);
                }
                Err(e) if e.kind() == Interrupted => {}
                Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => return Ok(false),
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// The next `n` raw bytes (the preface), or `None` on a read timeout.
    pub(crate) fn raw(&mut self, n: usize) -> FrameResult {
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
    pub(crate) fn frame(&mut self) -> FrameResult {
        self.next_frame(&mut |r, b| r.read(b))
    }

    fn next_frame(
        &mut self,
        read: &mut impl FnMut(&mut R, &mut [u8]) -> io::Result<usize>,
    ) -> FrameResult {
        loop {
            let have = &self.buf[self.start..self.end];
            // The length prefix, then the body.
            let mut need = 4;
            if let Some(len) = have.first_chunk() {
                let len = u32::from_le_bytes(*len) as usize;
                if len > self.max_frame_bytes {
                    return Err(ReadError::TooLarge {
                        len_bytes: len,
                        max_bytes: self.max_frame_bytes,
                    });
                }
                need += len;
                if have.len() >= need {
                    let body = have[4..need].to_vec();
                    self.start += need;
                    if self.start == self.end {
                        (self.start, self.end) = (0, 0);
                    }
                    return Ok(Some(body));
                }
            }
            self.room(need);
            if !self.fill(read)? {
                return Ok(None);
            }
        }
    }
}

/// A frame's body, `None` on a read timeout, or why reading failed.
pub(crate) type FrameResult = Result<Option<Vec<u8>>, ReadError>;

/// One socket shared by a connection's reader, writer and closer: one descriptor per
/// connection (not a `try_clone` each), read and written through `&TcpStream`.
#[derive(Clone)]
pub(crate) struct SharedStream(pub(crate) Arc<TcpStream>);

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

impl SharedStream {
    /// Write one pre-encoded frame (or preface) in a single `write_all`.
    pub(crate) fn send(&self, bytes: &[u8]) -> io::Result<()> {
        (&*self.0).write_all(bytes)
    }
}

impl FrameReader<SharedStream> {
    /// The next frame's body: polled for up to `spin` first (waking a blocked thread
    /// costs tens of microseconds on an idle core; a round among ranks that arrive
    /// together is over sooner than that), then read blocking, up to the socket's read
    /// timeout (`None` then; a partial frame is kept); with `block` false, only polled
    /// (at least once). Polling reads with `MSG_DONTWAIT`, which leaves the socket's own
    /// blocking mode alone: other threads write to clones of it.
    pub(crate) fn spin_frame(&mut self, spin: Duration, block: bool) -> FrameResult {
        let until = Instant::now() + spin;
        while !spin.is_zero() || !block {
            let polled = self.next_frame(&mut |s, b| {
                rustix::net::recv(s.as_fd(), b, rustix::net::RecvFlags::DONTWAIT)
                    .map(|(n, _)| n)
                    .map_err(io::Error::from)
            })?;
            let over = Instant::now() >= until;
            if polled.is_some() || (over && !block) {
                return Ok(polled);
            } else if over {
                break;
            }
            // Let the thread this one waits for run, where cores are short.
            std::thread::yield_now();
        }
        self.frame()
    }

    /// Read with `f` (the preface, or a frame) until `deadline`: `None` when it passes.
    pub(crate) fn read_until(
        &mut self,
        deadline: Deadline,
        f: impl Fn(&mut Self) -> FrameResult,
    ) -> FrameResult {
        loop {
            let left = deadline.remaining();
            if left.is_zero() {
                return Ok(None);
            }
            self.inner
                .set_read_timeout(Some(left))
                .map_err(ReadError::Io)?;
            if let Some(v) = f(self)? {
                return Ok(Some(v));
            }
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
    let chunk = if mode & 0x10 != 0 {
        usize::MAX
    } else {
        usize::from(mode & 0x0f) + 1
    };
    let max_frame_bytes = if mode & 0x20 != 0 {
        MAX_HANDSHAKE_FRAME_BYTES
    } else {
        64
    };
    /// A peer that sends its bytes, at most `.1` a read.
    struct Peer<'a>(&'a [u8], usize);
    impl Read for Peer<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = out.len().min(self.1).min(self.0.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let mut reader = FrameReader::new(Peer(stream, chunk), max_frame_bytes);
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
            assert_eq!(frame[..4], (frame.len() as u32 - 4).to_le_bytes());
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
