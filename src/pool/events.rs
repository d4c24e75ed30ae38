//! The events the pool emits through `tracing` (the names and fields are listed in
//! [`observe`](crate::observe)).

use crate::backend::CommRole;
use crate::error::{Error, ErrorKind};
use crate::pool::SymmPool;
use std::sync::atomic::Ordering::Relaxed;

/// The name of a communicator role in statistics keys and events: `symmetric`,
/// `copy_engine`, `plain`.
pub(crate) fn role_name(role: CommRole) -> &'static str {
    match role {
        CommRole::Symmetric => "symmetric",
        CommRole::CopyEngine => "copy_engine",
        CommRole::Plain => "plain",
    }
}

/// A public pool or collective call is about to return `error`: logged at `debug`,
/// since the caller decides what it deserves (a loss the survivors shrink past, a
/// usage error it catches, is no failure of the job).
#[cold]
#[inline(never)]
pub(crate) fn call_failed(pool: &SymmPool, op: &'static str, error: &Error) {
    // An allocation refused for want of memory: the pool's limit, the device, a peer.
    if op == "alloc" && error.kind() == ErrorKind::OutOfMemory {
        pool.inner.counters.ooms.fetch_add(1, Relaxed);
    }
    tracing::debug!(
        target: "symmpool",
        rank = pool.rank(),
        pool = %pool.config().name,
        op,
        error = %error,
        "symmpool call failed"
    );
}

/// A pool with memory left was dropped without `close()`: a warning through
/// `tracing` (or `log`), and on standard error when neither is set up.
#[cold]
pub(crate) fn dropped_without_close(
    rank: usize,
    pool: &str,
    segments: usize,
    bytes: u64,
    broken: Option<&str>,
) {
    // A broken pool cannot be closed: say why it is released locally, without advice.
    let message = match broken {
        Some(why) => format!("broken pool dropped ({why}): releasing its segments locally"),
        None => "POOL DROPPED WITHOUT close(): releasing its segments locally, without \
                 agreement (call SymmPool::close on every rank before dropping the pool)"
            .to_owned(),
    };
    tracing::warn!(target: "symmpool::pool", rank, pool, segments, bytes, "{message}");
    // A program that set up `tracing` or `log` chose what it sees; one that set up
    // neither would see nothing.
    if !tracing::dispatcher::has_been_set() && log::max_level() < log::LevelFilter::Warn {
        eprintln!(
            "symmpool: rank {rank}: pool {pool:?}: {message} ({segments} segments, {bytes} bytes)"
        );
    }
}
