//! [`StoreConfig`]: the settings of a [`StoreExchange`] and of the [`StoreServer`] that
//! rank 0 hosts, with their reading from the environment.

use super::env::{Launch, env_err, parse_var};
use super::wire::{FRAME_OVERHEAD_BYTES, MAX_HANDSHAKE_FRAME_BYTES, PER_PAYLOAD_OVERHEAD_BYTES};
#[cfg(doc)]
use super::{StoreExchange, StoreServer};
use crate::error::{Error, Result};
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

/// Settings of a [`StoreExchange`] (and of the [`StoreServer`] that rank 0 hosts).
#[derive(Clone)]
pub struct StoreConfig {
    /// Who this rank is and where the store is.
    pub launch: Launch,
    /// Whether this rank hosts the server (default: rank 0 does, unless
    /// `SYMMPOOL_STORE_EXTERNAL=1`: the store runs in a process of its own, at
    /// `MASTER_ADDR`/`MASTER_PORT`, and no rank hosts it, so that any rank, rank 0
    /// included, can be lost and the survivors shrink past it, and any be replaced
    /// ([`join`](Self::join)); see [`StoreServer::wait_until_done`]).
    pub host_server: bool,
    /// Whether this process is a newcomer (env `SYMMPOOL_JOIN`, `0` or `1`; default
    /// false): started for a job rank that the group has gone on without (its process
    /// was lost and the survivors shrank past it), to join the group when its ranks
    /// grow it ([`StoreExchange::grow`]). [`StoreExchange::connect`] then waits, until
    /// [`startup_timeout`](Self::startup_timeout), to be taken in, and its exchange is
    /// this rank's place in the grown group. A newcomer never hosts the server
    /// ([`host_server`](Self::host_server) must be false: for job rank 0, set
    /// `SYMMPOOL_STORE_EXTERNAL=1`, the store in a process of its own).
    pub join: bool,
    /// Where the hosted server listens (default: every interface, on
    /// `launch.master_port`).
    pub bind_addr: Option<SocketAddr>,
    /// Shared secret every rank must present (env `SYMMPOOL_TOKEN`); `None`: none.
    pub token: Option<String>,
    /// The job's identity, presented in every rank's handshake: a rank of another job
    /// is refused, on both sides, with [`Error::JobMismatch`] naming the two
    /// identities, so two jobs that reach one store never merge.
    ///
    /// [`from_env`](Self::from_env) takes it from, in this order: `SYMMPOOL_JOB_ID`;
    /// torchrun's `TORCHELASTIC_RUN_ID` with `TORCHELASTIC_RESTART_COUNT` (so a
    /// straggler of an earlier attempt is refused too; torchrun's default `none` is no
    /// identity); Open MPI's `OMPI_MCA_ess_base_jobid`, or Open MPI 5's PMIx namespace
    /// `PMIX_NAMESPACE`; slurm's `SLURM_JOB_ID` and `SLURM_STEP_ID`.
    ///
    /// `None` ([`new`](Self::new)'s default): ranks of any job whose handshake carries
    /// none either are accepted. The store still refuses a second claim of a rank
    /// ([`Error::RankTaken`], naming both processes), a different world size, and any
    /// client after every rank has joined; but a rank of another job on the same port
    /// that connects *before* this job's own rank takes its place (this job's rank is
    /// then refused, naming the holder). Where that matters set `SYMMPOOL_JOB_ID` (any
    /// string the ranks of one job share) or [`token`](Self::token).
    pub job_id: Option<String>,
    /// How long connecting, the handshake and the wait for every rank to join may take
    /// (ranks of real jobs start minutes apart; default 10 min). Connecting is retried
    /// until then. Env `SYMMPOOL_STARTUP_TIMEOUT_MS`.
    pub startup_timeout: Duration,
    /// How long the server waits for a new connection's handshake before closing it,
    /// and a rank for the server's verdict (default 5 s; a rank sends its handshake in
    /// one write on connecting). Env `SYMMPOOL_HANDSHAKE_TIMEOUT_MS`.
    pub handshake_timeout: Duration,
    /// Most handshakes the server runs at once (default 64; each holds a thread and a
    /// descriptor for at most [`handshake_timeout`](Self::handshake_timeout)); one
    /// beyond is refused as busy, and its rank retries until
    /// [`startup_timeout`](Self::startup_timeout). Env `SYMMPOOL_MAX_HANDSHAKES`.
    pub max_handshakes: usize,
    /// How often clients and server send heartbeats (default 1 s). Env
    /// `SYMMPOOL_HEARTBEAT_INTERVAL_MS`.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is declared lost (default 5 s). Env
    /// `SYMMPOOL_HEARTBEAT_TIMEOUT_MS`.
    pub heartbeat_timeout: Duration,
    /// Largest frame accepted after the handshake (default 16 MiB); bounds payloads,
    /// see [`max_payload_bytes`](Self::max_payload_bytes).
    pub max_frame_bytes: usize,
    /// How long the hosting rank's exchange, when dropped, waits for the other ranks
    /// to disconnect before stopping the server, so they can read the last results
    /// (default 10 s).
    pub linger: Duration,
    /// How long a thread waiting on the store (for a round's result, for the other
    /// ranks to join) polls its socket before each blocking read (default 50 µs, at
    /// most [`MAX_SPIN`](Self::MAX_SPIN); zero: block at once). Waking a blocked
    /// thread costs tens of microseconds, several times a round's own work when the
    /// ranks arrive together. Env `SYMMPOOL_SPIN_US`.
    pub spin: Duration,
    /// How long the hosting rank's server polls in each rank's thread: for a round's
    /// result after the rank contributed, and for its next frame before each blocking
    /// read (so up to twice this per round). `None` (default): [`spin`](Self::spin)
    /// where the ranks number at most half of the host's cores, else zero (polling
    /// threads would take the cores of the threads they wait for). At most
    /// [`MAX_SPIN`](Self::MAX_SPIN). Env `SYMMPOOL_SERVER_SPIN_US`.
    pub server_spin: Option<Duration>,
    /// How often a rank waiting for other ranks (to join at start-up, or to contribute
    /// to a round) logs a warning naming them (default
    /// [`WAIT_WARNING_INTERVAL`](super::WAIT_WARNING_INTERVAL), 30 s; not zero), and
    /// once more when they arrive. For rounds the hosting rank's server keeps the
    /// time, at its own setting, and tells the waiting ranks, which log it. Env
    /// `SYMMPOOL_WAIT_WARNING_MS`.
    pub wait_warning_interval: Duration,
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("launch", &self.launch)
            .field("host_server", &self.host_server)
            .field("join", &self.join)
            .field("bind_addr", &self.bind_addr)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("job_id", &self.job_id)
            .field("startup_timeout", &self.startup_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_handshakes", &self.max_handshakes)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("heartbeat_timeout", &self.heartbeat_timeout)
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("linger", &self.linger)
            .field("spin", &self.spin)
            .field("server_spin", &self.server_spin)
            .field("wait_warning_interval", &self.wait_warning_interval)
            .finish()
    }
}

impl StoreConfig {
    /// The largest [`spin`](Self::spin) and [`server_spin`](Self::server_spin)
    /// accepted: a rank's server thread does not read its socket while it polls for a
    /// result, so polling must stay far below the heartbeat interval.
    pub const MAX_SPIN: Duration = Duration::from_millis(1);

    /// Defaults for `launch` (see the fields).
    pub fn new(launch: Launch) -> StoreConfig {
        StoreConfig {
            host_server: launch.rank == 0,
            launch,
            join: false,
            bind_addr: None,
            token: None,
            job_id: None,
            startup_timeout: Duration::from_secs(600),
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 64,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            max_frame_bytes: 16 << 20,
            linger: Duration::from_secs(10),
            spin: Duration::from_micros(50),
            server_spin: None,
            wait_warning_interval: super::WAIT_WARNING_INTERVAL,
        }
    }

    /// From the process environment: [`Launch::from_env`], `SYMMPOOL_TOKEN`, the job
    /// identity (see [`job_id`](Self::job_id)), `SYMMPOOL_STORE_EXTERNAL` (see
    /// [`host_server`](Self::host_server)), `SYMMPOOL_JOIN` (see [`join`](Self::join))
    /// and the optional `SYMMPOOL_*_MS`,
    /// `SYMMPOOL_*SPIN_US` and `SYMMPOOL_MAX_HANDSHAKES` settings named on the fields.
    ///
    /// # Errors
    /// [`Error::LaunchEnv`] naming the variable that is missing or invalid.
    pub fn from_env() -> Result<StoreConfig> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`.
    ///
    /// # Errors
    /// [`Error::LaunchEnv`] naming the variable that is missing or invalid.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<StoreConfig> {
        let mut cfg = StoreConfig::new(Launch::from_vars(get)?);
        cfg.token = get("SYMMPOOL_TOKEN").filter(|t| !t.is_empty());
        cfg.job_id = job_id_from_vars(get);
        let flag = |name: &str| match parse_var::<u8>(get, name, "0 or 1")? {
            None | Some(0) => Ok(false),
            Some(1) => Ok(true),
            Some(n) => Err(env_err(name, format!("{n} is not 0 or 1"))),
        };
        cfg.host_server &= !flag("SYMMPOOL_STORE_EXTERNAL")?;
        cfg.join = flag("SYMMPOOL_JOIN")?;
        let spin = |name: &str| -> Result<Option<Duration>> {
            match parse_var(get, name, "a whole number of microseconds")? {
                Some(n) if Duration::from_micros(n) > Self::MAX_SPIN => Err(env_err(
                    name,
                    format!(
                        "{n} µs is more than the largest accepted, {} µs",
                        Self::MAX_SPIN.as_micros()
                    ),
                )),
                n => Ok(n.map(Duration::from_micros)),
            }
        };
        cfg.spin = spin("SYMMPOOL_SPIN_US")?.unwrap_or(cfg.spin);
        cfg.server_spin = spin("SYMMPOOL_SERVER_SPIN_US")?;
        for (name, slot) in [
            ("SYMMPOOL_STARTUP_TIMEOUT_MS", &mut cfg.startup_timeout),
            ("SYMMPOOL_HANDSHAKE_TIMEOUT_MS", &mut cfg.handshake_timeout),
            (
                "SYMMPOOL_HEARTBEAT_INTERVAL_MS",
                &mut cfg.heartbeat_interval,
            ),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", &mut cfg.heartbeat_timeout),
            ("SYMMPOOL_WAIT_WARNING_MS", &mut cfg.wait_warning_interval),
        ] {
            if let Some(n) = parse_var(get, name, "a whole number of milliseconds")? {
                *slot = Duration::from_millis(n);
            }
        }
        let handshakes = "a positive number of handshakes";
        let handshakes = parse_var::<NonZeroUsize>(get, "SYMMPOOL_MAX_HANDSHAKES", handshakes)?;
        cfg.max_handshakes = handshakes.map_or(cfg.max_handshakes, NonZeroUsize::get);
        Ok(cfg)
    }

    /// The largest payload one rank may contribute to a round: a round's result, all
    /// ranks' payloads, must fit in one frame.
    pub fn max_payload_bytes(&self) -> usize {
        (self.max_frame_bytes.saturating_sub(FRAME_OVERHEAD_BYTES) / self.launch.world_size.max(1))
            .saturating_sub(PER_PAYLOAD_OVERHEAD_BYTES)
    }

    /// The failure-detection bound (see [`control`](super)): the heartbeat timeout and
    /// interval, within which a rank hears of a loss from the store.
    pub(crate) fn detection_bound(&self) -> Duration {
        self.heartbeat_timeout + self.heartbeat_interval
    }

    pub(crate) fn check(&self) -> Result<()> {
        let frame_bytes = MAX_HANDSHAKE_FRAME_BYTES..=u32::MAX as usize;
        let problem = if self.heartbeat_interval.is_zero()
            || self.heartbeat_timeout <= self.heartbeat_interval
        {
            "heartbeat_timeout must exceed a non-zero heartbeat_interval"
        } else if !frame_bytes.contains(&self.max_frame_bytes) {
            "max_frame_bytes must be between 4 KiB and 4 GiB"
        } else if self.join && self.host_server {
            "a newcomer (join, SYMMPOOL_JOIN=1) cannot host the server (set SYMMPOOL_STORE_EXTERNAL=1)"
        } else if self.handshake_timeout.is_zero() {
            "handshake_timeout must not be zero"
        } else if self.max_handshakes == 0 {
            "max_handshakes must not be zero"
        } else if self.wait_warning_interval.is_zero() {
            "wait_warning_interval (SYMMPOOL_WAIT_WARNING_MS) must not be zero"
        } else if self.spin.max(self.server_spin.unwrap_or_default()) > Self::MAX_SPIN {
            &format!(
                "spin (SYMMPOOL_SPIN_US) and server_spin (SYMMPOOL_SERVER_SPIN_US) must be at most {} µs",
                Self::MAX_SPIN.as_micros()
            )
        } else {
            return Ok(());
        };
        Err(Error::InvalidConfig(format!("store: {problem}")))
    }
}

/// The job identity the launcher gives, read through `get` (see
/// [`StoreConfig::job_id`] for the variables and their order).
fn job_id_from_vars(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let set = |name: &str| {
        get(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    // torchrun without `--rdzv-id` (and without `--standalone`) sets "none".
    let torchrun = set("TORCHELASTIC_RUN_ID")
        .filter(|r| r != "none")
        .map(|run| {
            let attempt = set("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
            format!("torchrun:{run}/restart:{attempt}")
        });
    let slurm = |job| match set("SLURM_STEP_ID") {
        Some(step) => format!("slurm:{job}.{step}"),
        None => format!("slurm:{job}"),
    };
    (set("SYMMPOOL_JOB_ID").or(torchrun))
        .or_else(|| set("OMPI_MCA_ess_base_jobid").map(|job| format!("openmpi:{job}")))
        .or_else(|| set("PMIX_NAMESPACE").map(|ns| format!("pmix:{ns}")))
        .or_else(|| set("SLURM_JOB_ID").map(slurm))
}

#[cfg(test)]
#[path = "../../tests/unit/control/config.rs"]
mod tests;
