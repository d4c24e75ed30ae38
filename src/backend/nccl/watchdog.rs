//! The watchdog: one thread per backend that looks every
//! [`NcclConfig::watchdog_interval`](super::NcclConfig::watchdog_interval) at the
//! collectives enqueued (their completion events), the threads inside NCCL (their
//! deadlines), the exchange's word on lost peers and every communicator's asynchronous
//! error, and breaks the backend on the first that fails (see the [module](super)'s
//! table of waits). It runs when the watchdog timeout is [`Duration::MAX`] too,
//! watching no collective then, only calls inside NCCL.

use super::comm::{Device, Shared};
use super::ffi;
use super::health::{self, Cause, Completion};
use crate::error::Result;
use cudarc::driver::CudaEvent;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

impl Completion for CudaEvent {
    fn complete(&self) -> std::result::Result<bool, String> {
        self.try_is_complete().map_err(|e| format!("{e:?}"))
    }
}

/// A backend's watchdog thread, stopped when this is stopped or dropped (the thread
/// also ends by itself once the backend's shared state is gone).
pub(super) struct Watchdog {
    /// Dropping it wakes the thread, which then ends.
    stop: Option<mpsc::Sender<()>>,
}

impl Watchdog {
    /// Start the watchdog of `shared`.
    ///
    /// # Errors
    /// When no thread can be started and a data communicator is blocking (nothing
    /// would then bound its calls): the backend breaks (its communicators are aborted)
    /// and its error is returned. With non-blocking data communicators only the log
    /// says so (their calls are polled under their own deadlines).
    pub(super) fn spawn<D: Device>(shared: &Arc<Shared<D>>) -> Result<Self> {
        let (stop, stopped) = mpsc::channel();
        let weak = Arc::downgrade(shared);
        let bind = shared.device.binder();
        let interval = (shared.config.watchdog_interval).max(Duration::from_millis(1));
        let spawned = std::thread::Builder::new()
            .name(format!("symmpool-watchdog-{}", shared.rank))
            .spawn(move || {
                bind();
                drop(bind);
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let Some(s) = weak.upgrade() else { break };
                    s.tick();
                }
            });
        if let Err(e) = spawned {
            if shared.comms.iter().any(|c| c.blocking) {
                return Err(shared.fail(Cause::Failed(format!(
                    "could not start the NCCL watchdog thread ({e}); calls on blocking communicators would be unbounded"
                ))));
            }
            tracing::error!(
                "symmpool: could not start the NCCL watchdog ({e}); collectives are not watched"
            );
        }
        Ok(Watchdog { stop: Some(stop) })
    }

    /// Stop the thread (it ends after the look in progress, if any).
    pub(super) fn stop(&mut self) {
        self.stop = None;
    }
}

impl<D: Device> Shared<D> {
    /// One look of the watchdog.
    pub(super) fn tick(&self) {
        if self.health.is_broken() {
            return;
        }
        let now = Instant::now();
        // The list is swapped out under its lock and queried outside it, so that a
        // collective recording its event never waits behind the queries.
        let pending = self.watch.lock().take();
        let swept = health::sweep(pending, now, self.config.watchdog_timeout);
        if let Some(cause) = swept.cause {
            let _ = self.fail(cause);
            return;
        }
        let in_flight = !swept.kept.is_empty();
        self.watch.lock().restore(swept.kept, swept.complete);
        // A lost peer (the exchange's verdict: its process ended, or its heartbeats
        // stopped) ends whatever may wait on it, before NCCL's own error (if any) is
        // looked at. A peer that closed its exchange itself only while this rank has
        // work that may need it: collectives not complete, or a thread inside NCCL.
        if let Some(loss) = self.health.lost_peer()
            && (!loss.left || in_flight || self.all_comms().any(|c| c.inside().is_some()))
        {
            let _ = self.fail(Cause::PeerLost {
                rank: loss.rank,
                detail: loss.detail,
            });
            return;
        }
        for c in self.all_comms().filter(|c| c.owned) {
            if let Some(inside) = c.inside()
                && let Some(deadline) = inside.deadline
                && deadline.instant() <= now
            {
                let _ = self.fail(Cause::Timeout {
                    op: inside.op,
                    waited: now.saturating_duration_since(inside.since),
                });
                return;
            }
            // A non-blocking communicator busy in a call is looked at next time (the
            // call joins NCCL's thread; its poll reads the same state).
            let _calls = if c.blocking {
                None
            } else {
                let Some(g) = c.calls.try_lock() else {
                    continue;
                };
                Some(g)
            };
            // SAFETY: `while_live` holds the gate, so the communicator is not aborted
            // (an abort is handed over only after marking it under the gate); a
            // non-blocking one is held by its calls lock, a blocking one only has its
            // state read.
            let result = c.while_live(|raw| unsafe {
                ffi::async_state(self.nccl, "an earlier NCCL call", raw)
            });
            if let Some(Err(e)) = result {
                // A peer's death may reach NCCL first: the verdict names it.
                let what = format!("NCCL reported an asynchronous error: {e}");
                let _ = self.fail(self.health.failure(what));
                return;
            }
        }
    }
}
