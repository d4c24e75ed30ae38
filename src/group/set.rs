//! [`Group`]: one rank's communicator set as a value. The backend, the ledger the
//! ranks compare their records in, the channel and lock of window registrations, the
//! pools on the communicators and the claim of their collectives handle, and the
//! settings every pool over the communicators shares ([`GroupConfig`]).

use super::{CheckMode, Ledger, LedgerConfig};
use crate::backend::{Backend, Claim, HostBackend, HostConfig, SETUP_TIMEOUT};
use crate::control::ChannelId;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::{Mutex, MutexGuard};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::ThreadId;
use std::time::Duration;

/// The settings every pool of a [`Group`] shares: what the ranks wait for and how
/// they compare their calls.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupConfig {
    /// How long a wait on the other ranks (an agreement, a registration, a collective
    /// check, a drain at teardown, a shrink from start to end) may take (default 60 s).
    pub timeout: Duration,
    /// How the collectives of the group's pools are checked across ranks (default
    /// [`CheckMode::Async`]; [`from_env`](Self::from_env) reads it from
    /// `SYMMPOOL_CHECK`, and [`with_check`](GroupConfig::with_check) beats the
    /// environment, a bad value included). At world size 1
    /// the group runs as [`CheckMode::Off`]: no peer to compare with.
    pub check: CheckMode,
    /// Under [`CheckMode::Async`], how many collectives a rank may launch after one
    /// whose check has not yet come back (default 1; 0 counts as 1): the bound on the
    /// damage of a divergence ([`coll`](crate::coll), "Checked collectives"). Larger
    /// values let a rank's host run further ahead of its peers' records, at that cost
    /// in the bound.
    pub check_queue: usize,
    /// A `SYMMPOOL_CHECK` value that names no mode, read by `from_env()` and cleared
    /// by `with_check`: reported by `Group::new`.
    bad_check_env: Option<String>,
}

/// The environment variable that sets [`GroupConfig::check`]'s default.
const CHECK_ENV: &str = "SYMMPOOL_CHECK";

impl Default for GroupConfig {
    /// The defaults of the fields' documentation. Reads no environment variable (see
    /// [`from_env`](Self::from_env)).
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(60),
            check: CheckMode::default(),
            check_queue: 1,
            bad_check_env: None,
        }
    }
}

impl GroupConfig {
    /// The [defaults](Self::default), with the check mode from the `SYMMPOOL_CHECK`
    /// environment variable (`strict`, `async` or `off`, any case, blanks ignored)
    /// when it is set: what a program's entry point uses, so that the mode can be
    /// switched without touching the code (the crate's examples and the Python package
    /// do). A value that names no mode makes [`Group::new`] fail with
    /// [`Error::Config`] naming `SYMMPOOL_CHECK`, unless [`with_check`](Self::with_check)
    /// sets the mode.
    pub fn from_env() -> Self {
        let mut config = GroupConfig::default();
        let Some(value) = std::env::var_os(CHECK_ENV) else {
            return config;
        };
        let value = value.to_string_lossy().into_owned();
        match value.trim().to_ascii_lowercase().as_str() {
            "" => {}
            "strict" => config.check = CheckMode::Strict,
            "async" => config.check = CheckMode::Async,
            "off" => config.check = CheckMode::Off,
            _ => config.bad_check_env = Some(value),
        }
        config
    }

    setters! {
        with_timeout(timeout: Duration);
    }

    /// Set the collective [check](Self::check) mode (beats `SYMMPOOL_CHECK`).
    pub fn with_check(mut self, check: CheckMode) -> Self {
        self.check = check;
        self.bad_check_env = None;
        self
    }

    /// Set [`check_queue`](Self::check_queue) (at least 1).
    pub fn with_check_queue(mut self, records: usize) -> Self {
        self.check_queue = records.max(1);
        self
    }
}

/// A pool on the communicators: its name, and the thread of its latest collective
/// pool operation (none yet: `None`).
type PoolUser = (String, Option<ThreadId>);

/// The pools on a group's communicators, by channel ordinal: shared with its ledger,
/// whose divergence reports name them.
pub(crate) type Users = Arc<Mutex<BTreeMap<u64, PoolUser>>>;

/// One rank's communicator set: its [`Backend`] and what every pool over those
/// communicators shares. The ledger in which the ranks compare their pool calls and
/// collectives (one verdict: a divergence or a loss breaks the group, and every pool
/// on it), the agreement before each window registration (so that two pools on the
/// communicators never pair one's window with the other's), and the settings
/// ([`GroupConfig`]). Cheap to clone (a handle); pools keep their group alive.
///
/// A broken group stays broken: drop its pools and the group, and build a new one
/// (on a backend split off this one, [`split`](Self::split), or made anew).
///
/// ```
/// use symmpool::{Group, GroupConfig, HostBackend, HostConfig, PoolConfig, SymmPool};
///
/// let backends = HostBackend::world(HostConfig::new(2))?;
/// let groups = Group::world(backends, &GroupConfig::default())?;
/// let pools = SymmPool::world(&groups, &PoolConfig::default())?;
/// assert_eq!(pools[1].rank(), 1);
/// # Ok::<(), symmpool::Error>(())
/// ```
#[derive(Clone)]
pub struct Group {
    inner: Arc<GroupInner>,
}

/// In drop order: the ledger first (its drop waits for its thread's last round, on
/// the backend's exchange), the claim on the backend's communicators last.
struct GroupInner {
    ledger: Ledger,
    config: GroupConfig,
    /// The configuration's check mode, or [`CheckMode::Off`] at world size 1.
    mode: CheckMode,
    /// The channel on which pools agree before every window registration.
    registrations: ChannelId,
    /// Held from that agreement to the last registration of the segment, so that two
    /// pools of this rank cannot interleave their registrations.
    registering: Mutex<()>,
    /// The pools on the communicators, by pool channel ordinal (to name pools shared
    /// between threads when one fails).
    users: Users,
    /// See [`claim_collectives`](Group::claim_collectives).
    collectives_claimed: Arc<AtomicBool>,
    /// The group a [`shrink`](Group::shrink) or [`grow`](Group::grow) made of this one.
    shrunk: Mutex<Option<Group>>,
    backend: Backend,
    /// The group's hold on the backend's communicators.
    _claim: Claim,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Group {
    /// The communicator set of `backend`, with `config`: opens its registration and
    /// ledger channels on the backend's exchange (and, under [`CheckMode::Async`],
    /// starts the ledger's thread).
    ///
    /// One live group per communicator set: NCCL pairs windows and collectives by
    /// call order on each communicator, so two groups' pools over the same
    /// communicators could pair one's calls with the other's unseen. Pools that share
    /// communicators share their group; a pool used from another thread gets a group
    /// of its own ([`split`](Self::split)).
    ///
    /// # Collective
    /// Every rank makes its group over the same communicators at the same point, with
    /// the same check mode, waiting up to [`SETUP_TIMEOUT`] for late ranks (ranks of
    /// real jobs start minutes apart). With ranks as threads of one process, make
    /// them concurrently ([`Group::world`]).
    ///
    /// # Errors
    /// [`Error::Config`] if another live group holds `backend`'s communicators (a
    /// clone of it), or naming `SYMMPOOL_CHECK` if [`GroupConfig::from_env`] read a
    /// value that names no mode; [`Error::ChannelMismatch`] on every rank if the ranks
    /// set different check modes or make their groups at different points;
    /// [`Error::Timeout`] / [`Error::PeerLost`] if a rank does not come in time;
    /// [`Error::Internal`] if the ledger's thread cannot be started.
    pub fn new(backend: Backend, config: GroupConfig) -> Result<Group> {
        Self::open(backend, config, Deadline::after(SETUP_TIMEOUT))
    }

    /// As [`new`](Self::new), waiting for the other ranks until `deadline`.
    fn open(backend: Backend, config: GroupConfig, deadline: Deadline) -> Result<Group> {
        if let Some(v) = &config.bad_check_env {
            return Err(Error::config(
                CHECK_ENV,
                format!("{v:?}"),
                "strict, async or off (or unset: async)",
            ));
        }
        let Some(claim) = backend.claim_group() else {
            return Err(Error::config(
                "Group::new",
                "a backend another live group holds (while a pool or handle of it lives)",
                "one live group per communicator set: pools on them share it; Group::split",
            ));
        };
        // The group's channels and ledger (its thread started under `Async`).
        let exchange = backend.exchange_handle();
        let registrations = exchange.open_channel("group:registrations", deadline)?;
        // The check mode is part of the name: ranks that set it differently fail here.
        let name = format!("group:ledger:{}", config.check.name());
        let channel = exchange.open_channel(&name, deadline)?;
        let collectives = backend.collectives_handle();
        let users = Users::default();
        let ledger = Ledger::new(LedgerConfig {
            exchange,
            channel,
            timeout: config.timeout,
            capacity: config.check_queue,
            abandon: Box::new(move || collectives.abandon("a collective check that failed")),
            users: users.clone(),
        });
        let mode = match backend.world_size() {
            // One rank has nobody to compare with.
            1 => CheckMode::Off,
            _ => config.check,
        };
        if mode == CheckMode::Async {
            ledger.start()?;
        }
        Ok(Group {
            inner: Arc::new(GroupInner {
                backend,
                _claim: claim,
                config,
                mode,
                ledger,
                registrations,
                registering: Mutex::new(()),
                users,
                collectives_claimed: Arc::default(),
                shrunk: Mutex::new(None),
            }),
        })
    }

    /// One group per backend, for ranks that are threads of this process: made
    /// concurrently, in rank order.
    ///
    /// # Collective
    /// As [`new`](Self::new): every rank's backend is here.
    ///
    /// # Errors
    /// The first rank's error, as [`Group::new`].
    pub fn world(backends: Vec<Backend>, config: &GroupConfig) -> Result<Vec<Group>> {
        crate::error::in_threads(backends, "a group-making thread", |b| {
            Group::new(b, config.clone())
        })
    }

    /// The groups of a new host world of `world_size` ranks (threads), in rank order:
    /// the embedded default where there is no GPU.
    ///
    /// # Errors
    /// As [`HostBackend::world`] and [`Group::new`].
    pub fn host(world_size: usize, config: &GroupConfig) -> Result<Vec<Group>> {
        Self::world(HostBackend::world(HostConfig::new(world_size))?, config)
    }

    /// A group beside this one, with the same settings, over communicators of its own
    /// split off this group's ([`Backend::split`] under `name`): pools on it can be
    /// used from another thread than this group's pools (the FSDP pattern of a
    /// parameter pool on the all-gather stream's thread and a gradient pool on the
    /// reduce-scatter stream's).
    ///
    /// # Collective
    /// Every rank splits at the same point with the same `name`.
    ///
    /// # Errors
    /// As [`Backend::split`] and [`Group::new`].
    pub fn split(&self, name: &str) -> Result<Group> {
        let backend = self.inner.backend.split(name)?;
        Self::new(backend, self.inner.config.clone())
    }

    /// The group of this rank among the survivors of a loss: the backend shrunk
    /// ([`Backend::shrink`]) and a group over it with these settings, every wait ending
    /// by `deadline`. Asking again (another pool of the group) returns the same group,
    /// or, once that one lost a rank too or shrank in turn, that one's shrink (grown:
    /// [`Error::Shrunk`]).
    ///
    /// # Collective
    /// Every surviving rank calls it after the loss.
    ///
    /// # Errors
    /// As [`Backend::shrink`]; the errors of opening the new group's channels;
    /// [`Error::Timeout`] if another pool's shrink of this group holds it past
    /// `deadline`.
    pub(crate) fn shrink(&self, deadline: Deadline) -> Result<Group> {
        let mut shrunk = self.next("shrink", deadline)?;
        let Some(next) = shrunk.clone() else {
            let backend = self.inner.backend.shrink(deadline)?;
            let next = Self::open(backend, self.inner.config.clone(), deadline)?;
            return Ok(shrunk.insert(next).clone());
        };
        drop(shrunk);
        // Asked again after the survivors lost a rank too (a pool's shrink failed with
        // `PeerLost` on them), or after another pool went on past such a loss: go on
        // from there, or the survivors could never leave the group that lost it.
        let lost = next.inner.backend.exchange().lost_peer().is_some();
        if lost || next.next("shrink", deadline)?.is_some() {
            return next.shrink(deadline);
        }
        if next.world_size() > self.world_size() {
            return Err(Error::Shrunk {
                what: "this pool (another pool of its group grew it: grow this one too)",
            });
        }
        Ok(next)
    }

    /// The group of this rank grown by newcomers: the backend grown
    /// ([`Backend::grow`]) and a group over it with these settings, every wait ending
    /// by `deadline`; `None` when no newcomer waits. Asking again (another pool of the
    /// group) returns the same group (shrunk: [`Error::Shrunk`]).
    ///
    /// # Collective
    /// Every rank of the group calls it; the newcomers make their group over the
    /// backend they joined with ([`Group::new`]).
    ///
    /// # Errors
    /// As [`Backend::grow`]; the errors of opening the new group's channels;
    /// [`Error::Timeout`] if another pool's shrink or grow of this group holds it past
    /// `deadline`.
    pub(crate) fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Group>> {
        let mut next = self.next("grow", deadline)?;
        if let Some(n) = next.as_ref() {
            if n.world_size() <= self.world_size() {
                return Err(Error::Shrunk {
                    what: "this pool (another pool of its group shrank it: shrink this one too)",
                });
            }
        } else {
            let Some(backend) = self.inner.backend.grow(wait, deadline)? else {
                return Ok(None);
            };
            *next = Some(Self::open(backend, self.inner.config.clone(), deadline)?);
        }
        Ok(next.clone())
    }

    /// The group a shrink or grow made of this one, if any, under its lock (held by
    /// another pool's shrink or grow of this group, `op`, until `deadline` at most).
    fn next(&self, op: &'static str, deadline: Deadline) -> Result<MutexGuard<'_, Option<Group>>> {
        let started = std::time::Instant::now();
        (self.inner.shrunk.try_lock_until(deadline.instant()))
            .ok_or_else(|| Error::timeout_since(op, started, &[]))
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    /// The settings.
    pub fn config(&self) -> &GroupConfig {
        &self.inner.config
    }

    /// The deadline of a wait on the other ranks that starts now: the settings'
    /// timeout from now.
    pub(crate) fn deadline(&self) -> Deadline {
        Deadline::after(self.inner.config.timeout)
    }

    /// How collectives are checked: the configuration's mode, or [`CheckMode::Off`]
    /// at world size 1.
    pub fn check_mode(&self) -> CheckMode {
        self.inner.mode
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.backend.world_size()
    }

    /// Whether `other` is this group (a clone of it).
    pub fn same_group(&self, other: &Group) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The ledger.
    pub(crate) fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    /// The channel of the pre-registration agreement, and the lock that makes the
    /// agreement and the registrations that follow one step on this rank.
    pub(crate) fn registration_channel(&self) -> (ChannelId, MutexGuard<'_, ()>) {
        (self.inner.registrations, self.inner.registering.lock())
    }

    /// Note pool `pool` (its channel ordinal), named `name`, on these communicators:
    /// made (`used` false), or making a collective pool operation on this thread.
    pub(crate) fn note_user(&self, pool: u64, name: &str, used: bool) {
        let thread = used.then(|| std::thread::current().id());
        let mut users = self.inner.users.lock();
        let user = (users.entry(pool)).or_insert_with(|| (name.to_string(), None));
        user.1 = thread.or(user.1);
    }

    /// Forget pool `pool` (dropped).
    pub(crate) fn forget_user(&self, pool: u64) {
        self.inner.users.lock().remove(&pool);
    }

    /// The names of the other pools on these communicators whose latest collective
    /// pool operation ran on another thread than this one.
    pub(crate) fn users_on_other_threads(&self, pool: u64) -> Vec<String> {
        let me = std::thread::current().id();
        (self.inner.users.lock().iter())
            .filter(|(p, (_, thread))| **p != pool && thread.is_some_and(|t| t != me))
            .map(|(_, (name, _))| name.clone())
            .collect()
    }

    /// Claim these communicators for one collectives handle (`coll::Coll`, which numbers
    /// the collectives issued on each, see `Coll::new`): `None` while another handle
    /// holds them; released when the claim is dropped.
    pub(crate) fn claim_collectives(&self) -> Option<Claim> {
        Claim::take(&self.inner.collectives_claimed)
    }
}
