//! The watchdog: one thread per backend that looks every
//! [`NcclConfig::watchdog_interval`](super::NcclConfig::watchdog_interval) at the
//! collectives enqueued (a CUDA event recorded after each) and at every
//! communicator's asynchronous error, and breaks the backend (aborting its
//! communicators) on an expired collective, an NCCL error or a failed device. The
//! device-free bookkeeping ([`Watch`](super::health::Watch)) is tested without GPUs.

use super::comm::Shared;
use super::ffi;
use super::health::{Cause, Completion, Enqueued};
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

impl Completion for CudaEvent {
    fn complete(&self) -> std::result::Result<bool, String> {
        self.try_is_complete().map_err(|e| format!("{e:?}"))
    }
}

/// A backend's watchdog thread, stopped when this is stopped or dropped (the thread
/// also ends by itself once the backend's shared state is gone).
#[derive(Debug, Default)]
pub(super) struct Watchdog {
    /// Dropping it wakes the thread, which then ends.
    stop: Option<mpsc::Sender<()>>,
}

impl Watchdog {
    /// Start the watchdog of `shared`, unless its configuration turns it off (or no
    /// thread can be started: then collectives are not watched, and the log says so).
    pub(super) fn spawn(shared: &Arc<Shared>) -> Self {
        if !shared.config.watchdog_enabled() {
            return Watchdog::default();
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let weak: Weak<Shared> = Arc::downgrade(shared);
        let ctx = shared.ctx.clone();
        let interval = shared
            .config
            .watchdog_interval
            .max(Duration::from_millis(1));
        let spawned = std::thread::Builder::new()
            .name(format!("symmpool-watchdog-{}", shared.rank))
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                drop(ctx);
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    match weak.upgrade() {
                        Some(s) => s.tick(),
                        None => break,
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(
                "symmpool: could not start the NCCL watchdog ({e}); collectives are not watched"
            );
        }
        Watchdog { stop: Some(stop) }
    }

    /// Stop the thread (it ends after the look in progress, if any).
    pub(super) fn stop(&mut self) {
        self.stop = None;
    }
}

impl Shared {
    /// One look of the watchdog.
    fn tick(&self) {
        if self.health.is_broken() {
            return;
        }
        let cause = self
            .watch
            .lock()
            .sweep(Instant::now(), self.config.watchdog_timeout);
        if let Some(cause) = cause {
            let _ = self.fail(cause);
            return;
        }
        for c in self.comms.iter().filter(|c| c.owned) {
            // A communicator busy in a call is looked at next time.
            let Some(state) = c.state.try_lock() else {
                continue;
            };
            if state.aborted {
                continue;
            }
            // SAFETY: live (not aborted) and we hold its mutex.
            let result = unsafe { ffi::async_state("an earlier NCCL call", c.raw) };
            drop(state);
            if let Err(e) = result {
                let _ = self.fail(Cause::Failed(format!(
                    "NCCL reported an asynchronous error: {e}"
                )));
                return;
            }
        }
    }

    /// Record the event the watchdog waits for after a collective `op` on
    /// communicator `comm`, enqueued on `cs`.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda).
    pub(super) fn watch(
        &self,
        op: &'static str,
        comm: usize,
        cs: &Arc<CudaStream>,
    ) -> crate::Result<()> {
        let spare = self.watch.lock().spare();
        let event = match spare {
            Some(e) => e,
            None => self
                .ctx
                .new_event(None)
                .map_err(ffi::cuda("cuEventCreate"))?,
        };
        event.record(cs).map_err(ffi::cuda("cuEventRecord"))?;
        self.watch.lock().push(Enqueued {
            op,
            comm,
            at: Instant::now(),
            done: event,
        });
        Ok(())
    }
}
