//! [`NcclConfig`]: which communicators a backend makes, on which device, and its deadlines.

use crate::backend::SETUP_TIMEOUT;
use std::time::Duration;

/// Which communicators an NCCL backend makes, on which device, and how long its NCCL
/// calls may wait on other ranks (see the [module](super) for the two kinds of
/// communicator and the table of waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclConfig {
    /// The CUDA device of this rank. `None` (the default): the launcher's local rank
    /// (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`), or device 0 when the
    /// process sees one GPU only. Ignored by [`NcclBackend::local_world`](super::NcclBackend::local_world).
    pub device: Option<usize>,
    /// Create the copy-engine communicator (ignored before NCCL 2.28).
    pub copy_engine: bool,
    /// Create the unregistered communicator for ring collectives.
    pub plain: bool,
    /// Split the data communicators off the control one as blocking communicators
    /// (default `true`); `false` makes them non-blocking, abortable at any point but ten
    /// times slower a call (see the [module](super), *Two kinds of communicator*).
    pub data_blocking: bool,
    /// Deadline of communicator creation (`ncclCommInitRankConfig`, `ncclCommSplit`)
    /// and of the exchange rounds of set-up (default [`SETUP_TIMEOUT`], 10 minutes: ranks
    /// of real jobs start minutes apart).
    pub setup_timeout: Duration,
    /// Deadline of every other NCCL call that can wait on peers: window registration and
    /// deregistration (the watchdog revokes and aborts a blocking one past it), and on
    /// non-blocking data communicators a collective's enqueue (default 60 s, the pool's
    /// default timeout: the pool has agreed with every rank just before it registers).
    pub call_timeout: Duration,
    /// How long an enqueued collective may take to complete on the device before the
    /// watchdog aborts the communicators (default 10 minutes, PyTorch's default).
    /// [`Duration::MAX`] turns the collective watch off (no events recorded; the thread
    /// still bounds registrations inside NCCL).
    pub watchdog_timeout: Duration,
    /// How often the watchdog looks (default 100 ms; never more often than every
    /// millisecond).
    pub watchdog_interval: Duration,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            device: None,
            copy_engine: true,
            plain: true,
            data_blocking: true,
            setup_timeout: SETUP_TIMEOUT,
            call_timeout: Duration::from_secs(60),
            watchdog_timeout: Duration::from_secs(600),
            watchdog_interval: Duration::from_millis(100),
        }
    }
}

impl NcclConfig {
    /// Use CUDA device `device` (an ordinal among the visible devices).
    pub fn with_device(mut self, device: usize) -> Self {
        self.device = Some(device);
        self
    }

    /// Choose the optional communicators.
    pub fn with_communicators(mut self, copy_engine: bool, plain: bool) -> Self {
        self.copy_engine = copy_engine;
        self.plain = plain;
        self
    }

    setters! {
        with_data_blocking(data_blocking: bool);
        with_setup_timeout(setup_timeout: Duration);
        with_call_timeout(call_timeout: Duration);
        with_watchdog(watchdog_timeout: Duration);
        with_watchdog_interval(watchdog_interval: Duration);
    }

    /// Whether the watchdog watches collectives (records their completion events).
    pub(crate) fn watchdog_enabled(&self) -> bool {
        self.watchdog_timeout != Duration::MAX
    }
}

/// The device a rank uses: the configured one, else the launcher's local rank, else 0
/// when only one device is visible (a launcher that sets `CUDA_VISIBLE_DEVICES` per
/// rank). A pure function, for tests.
pub(crate) fn pick_device(
    configured: Option<usize>,
    local_rank: Option<usize>,
    visible: usize,
) -> std::result::Result<usize, String> {
    let device = match (configured, local_rank) {
        (Some(d), _) => d,
        (None, Some(l)) if l < visible => l,
        (None, _) if visible == 1 => 0,
        (None, Some(l)) => {
            return Err(format!(
                "the local rank is {l} but only {visible} devices are visible (set NcclConfig::device)"
            ));
        }
        (None, None) => {
            return Err(
                "no local rank in the environment (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK) and several devices visible: set NcclConfig::device".into(),
            );
        }
    };
    if device >= visible {
        return Err(format!("device {device} not present ({visible} visible)"));
    }
    Ok(device)
}

/// The launcher's local rank, from the variables read through `get`.
pub(crate) fn local_rank(get: &dyn Fn(&str) -> Option<String>) -> Option<usize> {
    let vars = ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"];
    vars.into_iter()
        .find_map(get)
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl/config.rs"]
mod tests;
