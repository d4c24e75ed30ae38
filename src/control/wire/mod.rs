//! The store's wire protocol.
//!
//! A connection starts with a 12-byte *preface* from each side: the magic
//! `b"SYMMPOOL"`, the protocol version (`u16`, little-endian) and two reserved zero
//! bytes. Then each side sends *frames*: a `u32` little-endian body length followed by
//! the body, a [`postcard`]-encoded [`ToServer`] or [`ToClient`]. A length above the
//! receiver's limit is refused before anything is allocated for it, and buffers only
//! grow as bytes actually arrive. The client's first frame is [`ToServer::Hello`]
//! (job token, job identity, rank, world size, who the process is, and whether it is a
//! newcomer that waits to join the group); the server answers [`ToClient::Welcome`] or
//! [`ToClient::Reject`] (with the store's job identity and, where it matters, who holds
//! the rank asked for).

mod frames;
#[cfg(test)]
#[path = "../../../tests/unit/control/wire.rs"]
mod tests;

pub use frames::fuzz_frames;
pub(crate) use frames::{FrameReader, FrameResult, ReadError, SharedStream};

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

/// The first bytes of every connection, both ways.
pub(crate) const MAGIC: [u8; 8] = *b"SYMMPOOL";
/// The protocol version; a peer speaking another is refused. 2: the hello names the job
/// and the process, a refusal says why; 3: [`ToClient::Waiting`]; 4: the survivors of a
/// loss shrink the group ([`ToServer::Shrink`], [`ToClient::Regrouped`], then `Shrunk`); 5: an ask to
/// shrink that timed out is withdrawn ([`ToServer::Withdraw`]), and a round's
/// contribution and abandonment name their group's epoch; 6: the withdrawal is confirmed
/// with the ranks that had not asked ([`ToClient::Withdrawn`]); 7: a failed shrink says
/// whether to ask again; 8: a rank declared lost is told so before its connection
/// closes ([`ToClient::Expelled`]), and a loss is told even where a timeout broke the
/// group first (a second [`ToClient::Broken`], of cause [`Cause::Lost`]); 9: a newcomer
/// joins a group that grows ([`ToServer::Hello`]'s `joining`, [`ToServer::Grow`],
/// [`ToClient::NotGrown`]; [`ToClient::Regrouped`] names a shrunk or grown group).
pub(crate) const VERSION: u16 = 9;
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

/// The preface and `msg`'s frame, for one write: a connection's first bytes.
pub(crate) fn with_preface<T: Serialize>(msg: &T) -> Vec<u8> {
    [&preface()[..], &encode(msg)].concat()
}

/// Check a peer's preface; `Err` says what is wrong.
pub(crate) fn check_preface(p: &[u8]) -> Result<(), String> {
    if p.len() < PREFACE_BYTES || p[..8] != MAGIC {
        let shown = String::from_utf8_lossy(&p[..p.len().min(8)]);
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
#[derive(Debug, PartialEq, Serialize, Deserialize)]
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
        /// A newcomer (`SYMMPOOL_JOIN=1`) for a job rank the group went on without: it
        /// waits to join the group when its ranks grow it ([`ToServer::Grow`]).
        joining: bool,
    },
    /// This rank's payload for a round of the group of `epoch` (one that is over is
    /// ignored: the rank was told the group shrank).
    Contribute {
        epoch: u64,
        channel: u64,
        round: u64,
        op: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    /// This rank gave up waiting for a round of the group of `epoch`: break the group
    /// (ignored once that group is over).
    Abandon {
        epoch: u64,
        channel: u64,
        round: u64,
        op: String,
    },
    /// Liveness.
    Heartbeat,
    /// Orderly goodbye.
    Bye,
    /// This rank asks to go on without the lost ranks: the group of `epoch` (0 at
    /// start, one more per shrink) becomes the ranks still connected, once every one
    /// of them has asked.
    Shrink { epoch: u64 },
    /// This rank's ask to shrink the group of `epoch` timed out: it no longer counts
    /// (the others' asks must not shrink the group with a rank that gave up). The
    /// answer is [`ToClient::Withdrawn`] (or [`ToClient::NotGrown`]), or nothing where
    /// that group is over (the rank was sent [`ToClient::Regrouped`] first). Also for an
    /// ask to grow.
    Withdraw { epoch: u64 },
    /// This rank asks to grow the group of `epoch` by the newcomers waiting to join it,
    /// once every connected rank of it has asked; with `wait` false on some ask and no
    /// newcomer then, the answer is [`ToClient::NotGrown`].
    Grow { epoch: u64, wait: bool },
}

/// Why a group broke.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum Cause {
    /// The rank timed out; these ranks had not contributed to its round.
    Timeout { missing: Vec<u32> },
    /// The rank was lost.
    Lost { detail: String },
}

/// A broken group: who, in what, why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Broken {
    pub(crate) rank: u32,
    pub(crate) op: String,
    pub(crate) cause: Cause,
}

impl Broken {
    /// `rank` was lost, as `detail` says.
    pub(crate) fn lost(rank: u32, detail: String) -> Broken {
        Broken {
            rank,
            op: String::new(),
            cause: Cause::Lost { detail },
        }
    }

    /// `rank` gave up waiting in `op` for the ranks `missing`.
    pub(crate) fn timeout(rank: u32, op: String, missing: Vec<u32>) -> Broken {
        Broken {
            rank,
            op,
            cause: Cause::Timeout { missing },
        }
    }
}

/// A process that joined (or asked to join) the store: where, which, when.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
    let (s, milli) = (ms_of_day / 1000, ms_of_day % 1000);
    let (hour, min, sec) = (s / 3600, s / 60 % 60, s % 60);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{min:02}:{sec:02}.{milli:03} UTC")
}

/// Why a handshake was refused, in a form the client acts on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
#[derive(Debug, PartialEq, Serialize, Deserialize)]
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
        /// As postcard byte strings (a length, then the bytes copied at once), not as
        /// sequences of `u8` serialised one by one: the same bytes on the wire, written
        /// and read several times faster (a round's result is encoded once and decoded
        /// by every rank).
        payloads: Vec<ByteBuf>,
    },
    /// The group is broken for good. Sent once with the first cause; where that was a
    /// timeout, once more with the first loss that follows ([`Cause::Lost`]), which
    /// explains the timeout.
    Broken(Broken),
    /// Liveness.
    Heartbeat,
    /// A round that has waited `StoreConfig::wait_warning_interval` (again) for the
    /// ranks `missing`, which have not contributed; sent to the ranks that have, which
    /// log it.
    Waiting {
        channel: u64,
        round: u64,
        missing: Vec<u32>,
    },
    /// Every connected rank asked to shrink or grow: the group of `epoch` is `group`
    /// (job ranks, ascending; a rank's place in the list is its rank). Rounds start
    /// again from 1 on every channel. Sent to a newcomer too: its admission.
    Regrouped { epoch: u64, group: Vec<u32> },
    /// This rank's request to shrink (or grow) failed: a rank was lost while the
    /// survivors asked (`retry`), it asked for an epoch that is over, or the others
    /// asked for the other.
    ShrinkFailed { reason: String, retry: bool },
    /// This rank's ask to shrink no longer counts ([`ToServer::Withdraw`]); `missing`
    /// are the ranks of the group (places in its list) still connected that had not
    /// asked.
    Withdrawn { missing: Vec<u32> },
    /// The store declared this rank lost (`reason`: it sent nothing for longer than the
    /// heartbeat timeout) and closes its connection: the others go on without it. The
    /// last frame before the close, if it fits in the socket's buffer at once.
    Expelled { reason: String },
    /// Every rank asked to grow, some without waiting (or one gave up waiting), and no
    /// newcomer waits: the group stays as it is.
    NotGrown,
}

/// Encode `msg` as one frame (length prefix and body), ready for a single write.
pub(crate) fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // Serialising plain enums of integers, strings and byte vectors cannot fail.
    let mut out = postcard::to_extend(msg, vec![0u8; 4]).unwrap_or_else(|_| vec![0u8; 4]);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decode a frame body.
pub(crate) fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, String> {
    postcard::from_bytes(body)
        .map_err(|e| format!("undecodable frame of {} bytes: {e}", body.len()))
}

/// Compare two secrets in time that depends only on their lengths.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let at = |s: &[u8], i: usize| s.get(i).copied().unwrap_or(0);
    let diff = (0..a.len().max(b.len())).fold(0, |d, i| d | (at(a, i) ^ at(b, i)));
    diff == 0 && a.len() == b.len()
}
