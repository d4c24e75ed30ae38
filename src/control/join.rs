//! Joining the store: connecting to the server (with retries while it cannot be
//! reached) and the handshake (preface, hello, the server's verdict).

use super::admission::{describe_io, out_of_descriptors};
use super::config::StoreConfig;
use super::waiting::{WaitWarnings, Who};
use super::wire::{
    self, FrameReader, FrameResult, MAX_HANDSHAKE_FRAME_BYTES, PREFACE_BYTES, Refusal,
    SharedStream, ToClient, ToServer,
};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// This host's name, for the store's messages about this process.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Connect to the store at `target` and complete the handshake, retrying while the
/// server cannot be reached or is busy (too many handshakes in flight), until
/// `deadline`. The connection's reader (its `inner` the socket, one descriptor).
///
/// # Errors
/// As [`StoreExchange::connect`](super::StoreExchange::connect).
pub(super) fn join_store(
    config: &StoreConfig,
    target: &str,
    deadline: Deadline,
    warnings: &mut WaitWarnings,
) -> Result<FrameReader<SharedStream>> {
    let launch = &config.launch;
    let job = config.job_id.clone().unwrap_or_default();
    let hello = wire::with_preface(&ToServer::Hello {
        token: config.token.clone().unwrap_or_default().into_bytes(),
        job: job.clone(),
        rank: launch.rank as u32,
        world_size: launch.world_size as u32,
        host: host_name(),
        pid: std::process::id(),
        joining: config.join,
    });
    let proto = |detail: String| Error::Protocol {
        op: "store handshake",
        detail,
    };
    let mut busy_delay = Duration::from_millis(5);
    loop {
        let stream = SharedStream(Arc::new(connect_retrying(
            config, target, deadline, warnings,
        )?));
        let _ = stream.set_nodelay(true);
        // Writes to a server that stops reading fail after a heartbeat timeout.
        stream
            .set_write_timeout(Some(config.heartbeat_timeout))
            .map_err(transport(
                "configuring the store connection",
                target.to_string(),
            ))?;
        // Handshake: preface and hello in one write; the server's preface and verdict.
        (stream.send(&hello))
            .map_err(transport("store handshake", format!("writing to {target}")))?;
        let mut reader = FrameReader::new(stream.clone(), MAX_HANDSHAKE_FRAME_BYTES);
        let hs_deadline = deadline.cap(config.handshake_timeout);
        let failed = |what: &str, got: FrameResult| {
            got.map_err(|e| proto(format!("reading the server's {what} from {target}: {e}")))?
                .ok_or_else(|| {
                    proto(format!(
                        "no {what} from {target} within the handshake timeout"
                    ))
                })
        };
        let preface = reader.read_until(hs_deadline, |r| r.raw(PREFACE_BYTES));
        let preface = failed("preface", preface)?;
        wire::check_preface(&preface).map_err(|why| proto(format!("{target}: {why}")))?;
        let verdict = failed("verdict", reader.read_until(hs_deadline, |r| r.frame()))?;
        let (reason, kind, store_job) = match wire::decode::<ToClient>(&verdict).map_err(proto)? {
            ToClient::Welcome => {
                reader.max_frame_bytes = config.max_frame_bytes;
                return Ok(reader);
            }
            ToClient::Reject { reason, kind, job } => (reason, kind, job),
            other => return Err(proto(format!("expected a welcome, got {other:?}"))),
        };
        return Err(match kind {
            Refusal::Busy if deadline.remaining() > busy_delay => {
                // Other handshakes hold the server's slots; they end within its
                // handshake timeout. (A newcomer is told so too while its job rank
                // is still in the group.) Past the deadline: the reason.
                tracing::debug!("symmpool store: {target} is busy ({reason}); retrying");
                thread::sleep(busy_delay);
                busy_delay = (busy_delay * 2).min(Duration::from_millis(500));
                continue;
            }
            Refusal::RankTaken {
                rank,
                holder,
                claimant,
            } => Error::RankTaken {
                rank: rank as usize,
                holder: holder.to_string(),
                claimant: claimant.to_string(),
            },
            _ if store_job != job => Error::JobMismatch { job, store_job },
            _ => Error::StoreRejected { reason },
        });
    }
}

/// Connect to `target`, retrying (with backoff up to 1 s) until `deadline`, with
/// `warnings` while the server cannot be reached.
fn connect_retrying(
    config: &StoreConfig,
    target: &str,
    deadline: Deadline,
    warnings: &mut WaitWarnings,
) -> Result<TcpStream> {
    let startup = config.startup_timeout;
    let who = Who(config.launch.rank, "store", target);
    let mut delay = Duration::from_millis(20);
    loop {
        let err = match target.to_socket_addrs() {
            Ok(addrs) => {
                let mut last = std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the address resolved to nothing",
                );
                for a in addrs {
                    let limit = (deadline.remaining())
                        .clamp(Duration::from_millis(1), Duration::from_secs(10));
                    match TcpStream::connect_timeout(&a, limit) {
                        Ok(s) => return Ok(s),
                        Err(e) if out_of_descriptors(&e) => {
                            // Not something waiting mends: say what it is at once.
                            let detail = format!("{target}: {}", describe_io(&e));
                            return Err(transport("connecting to the store", detail)(e));
                        }
                        Err(e) => last = e,
                    }
                }
                last
            }
            Err(e) => e,
        };
        let left = deadline.remaining();
        if left.is_zero() {
            let detail = format!(
                "{target} could not be reached within the start-up timeout of {startup:?}; is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?"
            );
            return Err(transport("connecting to the store", detail)(err));
        }
        if warnings.due() {
            warnings.warn(&who, "the store server (rank 0 hosts it)".into(), deadline);
        }
        thread::sleep(delay.min(left));
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// A [`Error::Transport`] for an I/O error of `op` (`detail`: where).
pub(super) fn transport(op: &'static str, detail: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Transport {
        op,
        detail,
        source: source.into(),
    }
}
