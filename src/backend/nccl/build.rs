//! Making a backend: every constructor goes through one [`Builder`] (NCCL and its
//! version, the set-up round of [`setup`], the control and data communicators, the
//! assembly with its watchdog and warm-up), under one deadline,
//! [`NcclConfig::setup_timeout`] from the public call.

use super::comm::{ABORT_WAIT, Comm, Device, Shared, abort_together, finish_creation};
use super::config::{self, NcclConfig};
use super::ffi::{self, RawComm, Syms};
use super::health::{Cause, Health};
use super::setup::{Placement, Role};
use super::watchdog::Watchdog;
use super::{NcclBackend, device_count, ncclComm_t, setup};
use crate::backend::{Backend, BackendInfo, BackendKind, CommInfo, CommRole};
use crate::control::{Exchange, LocalExchange, StoreExchange};
use crate::deadline::Deadline;
use crate::error::{Error, NcclVersion, Result};
use cudarc::driver::CudaContext;
use parking_lot::Mutex;
use std::sync::Arc;

/// The primary context of `device`, checked to exist first (cudarc panics without a
/// driver).
pub(super) fn context(device: usize) -> Result<Arc<CudaContext>> {
    let count = device_count()?;
    if device >= count {
        return Err(Error::config(
            "device",
            format!("{device} ({count} visible)"),
            "a visible device",
        ));
    }
    let ctx = CudaContext::new(device).map_err(ffi::cuda("cuDevicePrimaryCtxRetain"))?;
    ffi::bind(&ctx)?;
    Ok(ctx)
}

/// The UUID of the GPU of `ctx` (`cuDeviceGetUuid`), empty if the driver does not say:
/// the set-up round compares them to find ranks that share a GPU.
fn device_uuid(ctx: &CudaContext) -> Vec<u8> {
    ctx.uuid()
        .map(|u| u.bytes.iter().map(|&b| b as u8).collect())
        .unwrap_or_default()
}

/// `ncclGetVersion`'s code for a version.
fn version_code(v: NcclVersion) -> i32 {
    i32::try_from(v.major * 10000 + v.minor * 100 + v.patch).unwrap_or(i32::MAX)
}

/// The communicators a backend makes, for NCCL `version` and `config`.
fn roles_for(version: NcclVersion, config: &NcclConfig) -> Vec<CommInfo> {
    let mut roles = vec![CommInfo::SYMMETRIC];
    if config.copy_engine && version >= NcclVersion::COPY_ENGINE {
        roles.push(CommInfo::COPY_ENGINE);
    }
    if config.plain {
        roles.push(CommInfo::PLAIN);
    }
    roles
}

/// The CTA policy NCCL will apply: `NCCL_CTA_POLICY` in the environment overrides the
/// config (NCCL `init.cc`, "Comm config CTAPolicy reset to NCCL_CTA_POLICY").
fn effective_policy(requested: i32) -> i32 {
    match std::env::var("NCCL_CTA_POLICY").unwrap_or_default().trim() {
        "2" | "ZERO" => ffi::NCCL_CTA_POLICY_ZERO,
        "0" | "DEFAULT" => ffi::NCCL_CTA_POLICY_DEFAULT,
        "1" | "EFFICIENCY" => 1,
        _ => requested,
    }
}

/// The rank of a communicator found as `[rank, size, device]`, if it agrees with
/// `exchange` on rank and size and sits on `device`.
fn same_rank(
    [rank, world, dev]: [usize; 3],
    device: usize,
    exchange: &dyn Exchange,
) -> Result<usize> {
    if (rank, world) != (exchange.rank(), exchange.world_size()) || dev != device {
        return Err(Error::config(
            "communicator",
            format!(
                "rank {rank} of {world} on device {dev}; the exchange rank {} of {}, the device given {device}",
                exchange.rank(),
                exchange.world_size()
            ),
            "the exchange's rank and world size on the device given",
        ));
    }
    Ok(rank)
}

/// What every way of making a backend shares: the NCCL found, the configuration and
/// the set-up's deadline.
pub(super) struct Builder {
    pub(super) version: NcclVersion,
    pub(super) nccl: &'static Syms,
    pub(super) config: NcclConfig,
    pub(super) deadline: Deadline,
    /// The exchange whose lost-peer verdict ends a communicator's creation early (a
    /// shrink's: a survivor lost while the new set is made never comes).
    pub(super) watch: Option<Arc<dyn Exchange>>,
}

impl Builder {
    /// Load NCCL and check it has windows; the set-up's deadline starts now.
    fn new(config: NcclConfig) -> Result<Self> {
        Self::until(config, Deadline::after(config.setup_timeout), None)
    }

    /// As [`new`](Self::new), the set-up ending by `deadline`, or at once when
    /// `watch` (a shrink's exchange) has lost a peer.
    fn until(
        config: NcclConfig,
        deadline: Deadline,
        watch: Option<Arc<dyn Exchange>>,
    ) -> Result<Self> {
        let version = ffi::load()?;
        Ok(Builder {
            version,
            nccl: ffi::api()?,
            config,
            deadline,
            watch,
        })
    }

    /// The lost peer of the watched exchange, if any: what ends a creation early.
    fn lost(&self) -> Option<Error> {
        Some(
            self.watch
                .as_ref()?
                .lost_peer()?
                .error("making communicators"),
        )
    }

    /// [`finish_creation`] of `starting` (the call `op`) by the set-up's deadline, ended
    /// early by a lost peer of the watched exchange. A split is polled through its parent
    /// (as non-blocking: right for both kinds); `owner` is the parent when the crate made
    /// it (aborted on a timeout).
    fn finish(
        &self,
        starting: Result<ffi::Starting>,
        op: &'static str,
        blocking: bool,
        owner: Option<&Comm>,
    ) -> Result<Comm> {
        finish_creation(
            self.nccl,
            starting,
            op,
            blocking,
            self.deadline,
            owner,
            &|| self.lost(),
        )
    }

    /// The set-up round over `exchange` as `role` (`unique_id`: the control
    /// communicator's, sent by rank 0 of a new set or a grow's root), for this rank's
    /// GPU `device` (its UUID, [`device_uuid`]).
    fn agree(
        &self,
        exchange: &dyn Exchange,
        role: Role,
        unique_id: Option<[u8; 128]>,
        device: &[u8],
    ) -> Result<setup::Agreed> {
        let roles: Vec<_> = roles_for(self.version, &self.config)
            .iter()
            .map(|r| (r.role, r.cta_policy))
            .collect();
        let hello = setup::Hello {
            version: version_code(self.version),
            node: setup::this_node(),
            device: device.to_vec(),
            unique_ids: unique_id.iter().map(|id| id.to_vec()).collect(),
            role,
            plan: format!("{roles:?}, blocking: {}", self.config.data_blocking),
        };
        setup::agree(exchange, &hello, self.deadline)
    }

    /// The communicators of the ranks of `exchange`: the control communicator, made
    /// new (rank 0 makes its `ncclUniqueId` and sends it in the set-up round) or,
    /// where NCCL has `ncclCommGrow` (2.29.2+), grown from `parent` (a member's
    /// control communicator) or by a newcomer ([`Exchange::is_newcomer`]); the data
    /// communicators split off it, ordered by rank here; with where the ranks run
    /// (this one on the GPU of UUID `device`).
    ///
    /// # Collective
    /// Every rank of `exchange`, at the same point.
    pub(super) fn communicators(
        &self,
        exchange: &dyn Exchange,
        device: &[u8],
        parent: Option<&Comm>,
    ) -> Result<(Comm, DataComms, Placement)> {
        let (rank, world) = (exchange.rank(), exchange.world_size());
        let (control, placement) = match (&self.nccl.grow, parent) {
            (Some(fns), Some(p)) => p.splitting("ncclCommGrow", || {
                self.grown(fns, Some(p), exchange, device)
            })?,
            (Some(fns), None) if exchange.is_newcomer() => {
                self.grown(fns, None, exchange, device)?
            }
            _ => {
                let id = (rank == 0).then(|| ffi::unique_id(self.nccl)).transpose()?;
                let agreed = self.agree(exchange, Role::New, id, device)?;
                let id = agreed.unique_id()?;
                (self.control_init(world, &id, rank)?, agreed.placement)
            }
        };
        let comms = self.data(&control, rank, true)?;
        Ok((control, comms, placement))
    }

    /// The control communicator grown by `ncclCommGrow`: from `parent` on a member
    /// (the one of parent rank 0 is the root: it makes the grow's id, sending it to
    /// NCCL's boundary ranks, before the set-up round, where the newcomers get it), or
    /// on a newcomer (`parent` `None`), which takes a rank after the members'.
    fn grown(
        &self,
        fns: &ffi::GrowFns,
        parent: Option<&Comm>,
        exchange: &dyn Exchange,
        device: &[u8],
    ) -> Result<(Comm, Placement)> {
        let (role, id) = match parent {
            Some(p) => {
                // SAFETY: the parent is live and used by this thread only (the caller
                // holds its calls lock).
                let [parent_rank, ..] = unsafe { ffi::comm_rank_size_device(self.nccl, p.raw) }?;
                // SAFETY: as above.
                let id = (parent_rank == 0)
                    .then(|| unsafe { ffi::grow_unique_id(self.nccl, fns, p.raw) });
                let parent_rank = u32::try_from(parent_rank).unwrap_or(u32::MAX);
                (Role::Member { parent_rank }, id.transpose()?)
            }
            None => (Role::Newcomer, None),
        };
        let agreed = self.agree(exchange, role, id, device)?;
        let id = agreed.unique_id()?;
        let mine = agreed
            .grow
            .and_then(|ranks| ranks.get(exchange.rank()).copied());
        let (id, rank) = match parent {
            Some(_) => ((mine == Some(0)).then_some(&id), None),
            None => (Some(&id), mine),
        };
        // SAFETY: the parent, if any, is live and used by this thread only; the root
        // sent the id before the set-up round, which every rank finished before this.
        let starting = unsafe {
            ffi::comm_grow(
                self.nccl,
                fns,
                parent.map(|p| p.raw),
                exchange.world_size(),
                id,
                rank,
            )
        };
        let grown = self.finish(starting, "ncclCommGrow", false, None)?;
        Ok((grown, agreed.placement))
    }

    /// What [`NcclBackend::regroup`] does for the device:
    /// `old`'s communicators aborted (each on a thread of its own, a blocking one
    /// revoked first where NCCL has `ncclCommRevoke`) and their aborts waited for (at
    /// most [`ABORT_WAIT`]: an abort still running after that is left to its thread),
    /// and a new set among the ranks of the regrouped `exchange`: for a `grow` where
    /// NCCL has `ncclCommGrow`, grown from `old`'s control communicator, which is
    /// aborted only then.
    ///
    /// # Collective
    /// Every rank of `exchange` but the newcomers, at the same point.
    pub(super) fn survivors<D: Device>(
        &self,
        old: &Shared<D>,
        exchange: &dyn Exchange,
        device: &[u8],
        grow: bool,
    ) -> Result<(Comm, DataComms, Placement)> {
        // (A control communicator aborted already cannot grow: this rank then makes a
        // new set, and the set-up round refuses the mix on every rank at once.)
        let parent =
            (old.control.as_ref()).filter(|c| grow && self.nccl.grow.is_some() && !c.is_aborted());
        if parent.is_none() {
            self.abort(old);
        }
        let made = self.communicators(exchange, device, parent);
        if parent.is_some() {
            self.abort(old);
        }
        made
    }

    /// `old`'s communicators aborted, the aborts waited for (at most [`ABORT_WAIT`]).
    fn abort<D: Device>(&self, old: &Shared<D>) {
        let why = "aborted by the application: the group shrinks or grows into new communicators";
        let _ = old.fail(Cause::Aborted(why.into()));
        let aborted = self.deadline.cap(ABORT_WAIT);
        if old
            .all_comms()
            .any(|c| c.aborted_by(aborted) == Some(false))
        {
            tracing::warn!(
                "symmpool: rank {}: an ncclCommAbort had not returned after {ABORT_WAIT:?}; the survivors go on without waiting for it",
                old.rank
            );
        }
    }

    /// Create the non-blocking control communicator from `unique_id`, by the set-up's
    /// deadline.
    fn control_init(&self, world: usize, unique_id: &[u8; 128], rank: usize) -> Result<Comm> {
        let starting = ffi::comm_init(self.nccl, world, unique_id, rank);
        self.finish(starting, "ncclCommInitRankConfig", false, None)
    }

    /// Split `count` data communicators of `roles` off `control`, in order (blocking
    /// unless configured otherwise), each polled through the control communicator by
    /// the set-up's deadline. A failure aborts the ones made before it and, when
    /// `abort_control` (a set-up's own control communicator), the control communicator
    /// together ([`abort_together`]).
    fn data(&self, control: &Comm, rank: usize, abort_control: bool) -> Result<DataComms> {
        let blocking = self.config.data_blocking;
        let roles = roles_for(self.version, &self.config);
        let mut comms = Vec::with_capacity(roles.len());
        for role in &roles {
            // SAFETY: the control communicator is live and used by this thread only
            // (during set-up; for `Backend::split`, under its calls lock, see
            // `Comm::splitting`); every rank splits the same roles in the same order
            // (the plan is checked by the set-up round, a split's name by its channel).
            let made =
                unsafe { ffi::comm_split(self.nccl, control.raw, rank, role.cta_policy, blocking) };
            let made = self.finish(made, "ncclCommSplit", blocking, Some(control));
            // On a failure, every communicator made so far, the control one too,
            // aborted together under one deadline.
            let comm = made.inspect_err(|_| {
                let parent = abort_control.then_some(control);
                abort_together(comms.iter().map(|(_, c)| c).chain(parent));
            })?;
            let info = CommInfo {
                cta_policy: effective_policy(role.cta_policy),
                ..*role
            };
            comms.push((info, comm));
        }
        Ok(comms)
    }

    /// The backend of `exchange`'s rank on device `ctx` over `comms` (each with what the
    /// pools learn of it, in registration order) and `control`, on a job placed as
    /// `placement`, with its watchdog running; warmed up when `warm_up` (the crate's own
    /// communicators).
    fn assemble(
        &self,
        ctx: Arc<CudaContext>,
        control: Option<Comm>,
        comms: Vec<(CommInfo, Comm)>,
        placement: Placement,
        exchange: Arc<dyn Exchange>,
        warm_up: bool,
    ) -> Result<Backend> {
        let (rank, world) = (exchange.rank(), exchange.world_size());
        let (infos, comms): (Vec<_>, Vec<_>) = comms.into_iter().unzip();
        let granularity = ffi::segment_granularity(ctx.ordinal());
        let info = BackendInfo::new(
            BackendKind::Nccl,
            rank,
            world,
            self.version,
            granularity,
            infos.clone(),
        )?
        .with_nodes(placement.nodes)
        .with_shared_devices(placement.shared_devices);
        let shared = Arc::new(Shared {
            rank,
            world,
            device: ctx.clone(),
            nccl: self.nccl,
            control,
            comms,
            health: Health::watching(&exchange),
            watch: Mutex::default(),
            config: self.config,
        });
        let watchdog = Watchdog::spawn(&shared)?;
        let warmed = if warm_up {
            ffi::bind(&ctx)?;
            let stream = ctx.new_stream().map_err(ffi::cuda("cuStreamCreate"))?;
            shared.warm_up(&infos, &stream, granularity, self.deadline)?
        } else {
            Vec::new()
        };
        let parts = Arc::new(NcclBackend {
            shared,
            ordinals: Mutex::new(vec![0; infos.len()]),
            fences: Mutex::default(),
            raw_streams: Mutex::default(),
            warmed,
            watchdog,
            drain_timed_out: Default::default(),
        });
        Backend::new(info, exchange, parts)
    }
}

/// The data communicators of a set, each with what the pools learn of it.
type DataComms = Vec<(CommInfo, Comm)>;

impl NcclBackend {
    /// [`Backend::shrink`] (`grow` false) and [`Backend::grow`] on NCCL, with the
    /// regrouped `exchange`: this backend's communicators aborted and their aborts
    /// waited for, boundedly (they release their windows themselves), and a new set
    /// among the ranks of `exchange`, as [`from_env`](Self::from_env) makes one (and
    /// with its errors), on this rank's device and configuration, every wait ending
    /// by `deadline` (a survivor lost meanwhile ends NCCL's creation at once). For a
    /// grow where NCCL has `ncclCommGrow` (2.29.2+), the control communicator grows by
    /// the newcomers (who make theirs with `from_env` over the exchange they joined
    /// with), and this backend's communicators are aborted after. Not
    /// `ncclCommShrink`, which needs the parent communicator alive: the watchdog
    /// aborts it when a peer is lost.
    pub(in crate::backend) fn regroup(
        &self,
        exchange: Arc<dyn Exchange>,
        deadline: Deadline,
        grow: bool,
    ) -> Result<Backend> {
        let b = Builder::until(*self.config(), deadline, Some(exchange.clone()))?;
        self.bind()?;
        let ctx = self.shared.device.clone();
        let uuid = device_uuid(&ctx);
        let (control, comms, placement) =
            b.survivors(&self.shared, exchange.as_ref(), &uuid, grow)?;
        b.assemble(ctx, Some(control), comms, placement, exchange, true)
    }

    /// [`Backend::split`] on NCCL: the data communicators split again off this rank's
    /// control communicator (the same roles, blocking unless configured otherwise),
    /// warmed up, with a watchdog of their own, by [`NcclConfig::setup_timeout`]. A
    /// failed split aborts the communicators it made, not this backend's. The split
    /// backend has no control communicator of its own (split the original again), and
    /// splits on one rank are serialised (by the control communicator's calls lock).
    ///
    /// # Errors
    /// As [`Backend::split`]; the backend's error once it is broken,
    /// [`Error::NcclAborted`] once its control communicator is.
    pub(in crate::backend) fn split(&self, backend: &Backend, name: &str) -> Result<Backend> {
        let Some(control) = self.shared.control.as_ref() else {
            return Err(Error::config(
                "Backend::split",
                "NCCL communicators adopted without a control communicator",
                "a backend made by NcclBackend::from_env, launch or local_world",
            ));
        };
        let config = self.shared.config;
        // The ranks agree on the split (its name and place) before NCCL is called.
        let deadline = Deadline::after(config.setup_timeout);
        backend
            .exchange()
            .open_channel(&format!("backend:split:{name}"), deadline)?;
        let b = Builder {
            version: backend.nccl_version(),
            nccl: self.shared.nccl,
            config,
            deadline,
            watch: None,
        };
        self.bind()?;
        self.shared.health.check()?;
        let rank = self.shared.rank;
        let comms = control.splitting("ncclCommSplit", || b.data(control, rank, false))?;
        b.assemble(
            self.context().clone(),
            None,
            comms,
            Placement {
                nodes: backend.info().nodes,
                shared_devices: backend.info().shared_devices,
            },
            backend.exchange_handle(),
            true,
        )
    }

    /// This process's rank of a job launched with one process per GPU, on
    /// [`NcclConfig::device`] (by default picked by the launcher's local rank). Rank 0
    /// creates the control communicator's `ncclUniqueId` and publishes it over
    /// `exchange` (channel `"nccl:setup"`, with every rank's NCCL version, node identity,
    /// GPU UUID and data communicators); every rank then creates its non-blocking control
    /// communicator, splits the data communicators off it (blocking by default) and
    /// warms them up. The whole set-up ends within [`NcclConfig::setup_timeout`].
    ///
    /// # Collective
    /// Every rank of `exchange` calls it at the same point with the same `config`
    /// (but for `device`).
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`] without a driver or NCCL; [`Error::NcclTooOld`]
    /// before NCCL 2.27; [`Error::Config`] for no usable device, ranks on
    /// different NCCL versions or configurations; the exchange's errors
    /// ([`Error::Timeout`], [`Error::PeerLost`]); [`Error::NcclTimeout`] if a
    /// communicator is not made in time; [`Error::Cuda`] / [`Error::Nccl`].
    pub fn from_env(exchange: Arc<dyn Exchange>, config: NcclConfig) -> Result<Backend> {
        let b = Builder::new(config)?;
        let visible = device_count()?;
        let local = config::local_rank(&|k| std::env::var(k).ok());
        let device = config::pick_device(config.device, local, visible).map_err(|value| {
            Error::config(
                "NcclConfig::device",
                value,
                "a visible device, given or picked by the local rank",
            )
        })?;
        let ctx = context(device)?;
        let (control, comms, placement) =
            b.communicators(exchange.as_ref(), &device_uuid(&ctx), None)?;
        b.assemble(ctx, Some(control), comms, placement, exchange, true)
    }

    /// [`from_env`](Self::from_env) over a [`StoreExchange`] made from the environment
    /// ([`StoreExchange::from_env`]: torchrun's, slurm's or Open MPI's variables, with
    /// `MASTER_ADDR`/`MASTER_PORT`; rank 0 hosts the store).
    ///
    /// # Collective
    /// As [`from_env`](Self::from_env).
    ///
    /// # Errors
    /// As [`StoreExchange::from_env`] and [`from_env`](Self::from_env).
    pub fn launch(config: NcclConfig) -> Result<Backend> {
        let exchange: Arc<dyn Exchange> = Arc::new(StoreExchange::from_env()?);
        Self::from_env(exchange, config)
    }

    /// Adopt a runtime's communicator (for example PyTorch's
    /// `ProcessGroupNCCL._comm_ptr()`): the crate splits its non-blocking control
    /// communicator off it (`ncclCommSplit(comm, 0, rank, ..)`, resources not shared),
    /// then the data communicators off the control one as [`from_env`](Self::from_env)
    /// does, and warms them up, the whole set-up within [`NcclConfig::setup_timeout`].
    /// The runtime's communicator is only read and split once, never destroyed or
    /// aborted by the crate; the children are the crate's own.
    ///
    /// `device` is the CUDA ordinal (as this process sees it) the communicator lives on.
    /// [`NcclConfig::device`] is ignored.
    ///
    /// # Collective
    /// Every rank of `comm` calls it at the same point (a split is collective on the
    /// parent), with the same `config`.
    ///
    /// # Safety
    /// - `comm` is a live `ncclComm_t` of the NCCL this crate loaded (inside PyTorch,
    ///   PyTorch's `libnccl.so.2` is found first; `SYMMPOOL_NCCL_LIBRARY` names another),
    ///   on CUDA device `device`;
    /// - it stays live for the duration of this call, and nothing else calls NCCL on it
    ///   (no collective of the runtime either) until this call returns;
    /// - `exchange` groups the same processes, with the same rank numbers, as `comm`.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env); [`Error::Config`] also if the communicator
    /// disagrees with the exchange on rank or size, or with `device`.
    pub unsafe fn adopt(
        comm: ncclComm_t,
        device: usize,
        exchange: Arc<dyn Exchange>,
        config: NcclConfig,
    ) -> Result<Backend> {
        let b = Builder::new(config)?;
        let ctx = context(device)?;
        let parent = RawComm(comm);
        // SAFETY: the caller guarantees a live communicator nothing else uses now.
        let found = unsafe { ffi::comm_rank_size_device(b.nccl, parent) }?;
        let rank = same_rank(found, device, exchange.as_ref())?;
        let agreed = b.agree(exchange.as_ref(), Role::New, None, &device_uuid(&ctx))?;
        let policy = ffi::NCCL_CTA_POLICY_DEFAULT;
        // SAFETY: the caller guarantees the parent is live and used by nobody else
        // during this call; every rank makes the same split (the plan is checked by the
        // set-up round). The runtime's communicator is never aborted by the crate.
        let control = unsafe { ffi::comm_split(b.nccl, parent, rank, policy, false) };
        let control = b.finish(control, "ncclCommSplit", false, None)?;
        let comms = b.data(&control, rank, true)?;
        b.assemble(ctx, Some(control), comms, agreed.placement, exchange, true)
    }

    /// One backend per listed GPU of this process, in rank order: rank `i` drives
    /// device `devices[i]`. Each rank's control communicator is created non-blocking
    /// from a thread of its own with one shared `ncclUniqueId`, its data communicators
    /// split off it and warmed up, as [`from_env`](Self::from_env) does. Hand each
    /// backend to its own thread. [`NcclConfig::device`] is ignored.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env) (no exchange errors); [`Error::Config`] also for
    /// no devices or a device listed twice.
    pub fn local_world(devices: &[usize], config: NcclConfig) -> Result<Vec<Backend>> {
        let b = Builder::new(config)?;
        if devices.is_empty() {
            return Err(Error::config("devices", "[]", "at least one device"));
        }
        if (1..devices.len()).any(|i| devices[..i].contains(&devices[i])) {
            return Err(Error::config(
                "devices",
                format!("{devices:?}"),
                "distinct devices",
            ));
        }
        let id = ffi::unique_id(b.nccl)?;
        let world = devices.len();
        // Every context first: a device that fails here fails the call before any rank
        // starts a communicator.
        let contexts = devices
            .iter()
            .map(|&dev| context(dev))
            .collect::<Result<Vec<_>>>()?;
        let ranks = contexts.into_iter().zip(LocalExchange::group(world));
        let init = "a rank's initialisation thread";
        crate::error::in_threads(ranks.enumerate(), init, |(rank, (ctx, exchange))| {
            ffi::bind(&ctx)?;
            let control = b.control_init(world, &id, rank)?;
            let comms = b.data(&control, rank, true)?;
            let exchange = Arc::new(exchange);
            b.assemble(
                ctx,
                Some(control),
                comms,
                Placement::ONE_NODE,
                exchange,
                true,
            )
        })
    }

    /// Adopt communicators as they are (tests, interop): each with its role and the CTA
    /// policy it was created with, in the order segments are to be registered; every
    /// rank passes the same list. The backend never destroys or aborts them.
    ///
    /// They are treated as non-blocking (each call is followed by
    /// `ncclCommGetAsyncError` until done, which is immediate on a blocking one), are
    /// not warmed up, and there is no control communicator. Deadlines bound only
    /// non-blocking ones: a call on a **blocking** one (NCCL's default) waits as long as
    /// NCCL does, possibly forever, and a watchdog expiry marks the backend broken
    /// without ending the stuck collective. Prefer [`adopt`](Self::adopt), which splits
    /// the crate's own communicators off a runtime's.
    ///
    /// # Collective
    /// Every rank calls it at the same point (one exchange round, then
    /// [`Backend::new`]).
    ///
    /// # Safety
    /// - every handle is a live `ncclComm_t` of the NCCL this crate loaded, on CUDA
    ///   device `device`, and all have the same rank and size;
    /// - it stays live until this backend is dropped;
    /// - while this backend exists, nothing else calls NCCL on these communicators
    ///   concurrently with it (NCCL communicators are not thread-safe);
    /// - a communicator listed with role `CopyEngine` was created with
    ///   `CTAPolicy = NCCL_CTA_POLICY_ZERO` (else the reported path is wrong).
    ///
    /// # Errors
    /// As [`adopt`](Self::adopt) but for [`Error::NcclTimeout`]; [`Error::Config`] also
    /// for no communicators.
    pub unsafe fn from_raw(
        device: usize,
        comms: Vec<(ncclComm_t, CommRole, i32)>,
        exchange: Arc<dyn Exchange>,
        config: NcclConfig,
    ) -> Result<Backend> {
        let b = Builder::new(config)?;
        let ctx = context(device)?;
        let mut adopted = Vec::with_capacity(comms.len());
        for (raw, role, policy) in comms {
            let raw = RawComm(raw);
            // SAFETY: the caller guarantees a live communicator nobody else uses now.
            let found = unsafe { ffi::comm_rank_size_device(b.nccl, raw) }?;
            same_rank(found, device, exchange.as_ref())?;
            let info = CommInfo {
                role,
                cta_policy: effective_policy(policy),
                registers: role != CommRole::Plain,
            };
            adopted.push((info, Comm::new(b.nccl, raw, false, false)));
        }
        if adopted.is_empty() {
            return Err(Error::config(
                "communicators",
                "none",
                "at least one communicator",
            ));
        }
        let agreed = b.agree(exchange.as_ref(), Role::New, None, &device_uuid(&ctx))?;
        b.assemble(ctx, None, adopted, agreed.placement, exchange, false)
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl/build.rs"]
mod tests;
