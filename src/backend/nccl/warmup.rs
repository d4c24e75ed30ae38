//! The warm-up: everything NCCL does lazily at a communicator's first collective, done
//! during set-up under its deadline (see the [module](super), *Warm-up*).

use super::comm::{Bound, Device, Shared};
use super::ffi::{self, CollCall, CollKind};
use super::health::Cause;
use crate::backend::{CommInfo, CommRole};
use crate::deadline::Deadline;
use crate::error::Result;
use cudarc::nccl::sys;
use std::time::Instant;

/// One collective the warm-up ran: the communicator (index into
/// [`BackendInfo::communicators`](crate::backend::BackendInfo::communicators)), its role,
/// the collective and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmedPath {
    /// Index of the communicator.
    pub comm: usize,
    /// Its role.
    pub role: CommRole,
    /// The collective run on it.
    pub collective: WarmCollective,
    /// Bytes per rank (the all-gather's input, the reduce-scatter's output, the
    /// all-reduce's buffer), f32 elements.
    pub bytes_per_rank: u64,
}

/// A collective of the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmCollective {
    /// `ncclAllGather`.
    AllGather,
    /// `ncclReduceScatter` (sum).
    ReduceScatter,
    /// `ncclAllReduce` (sum).
    AllReduce,
}

/// The small size the warm-up runs, in bytes per rank (NCCL's low-latency protocols).
pub(super) const WARM_SMALL_BYTES: u64 = 4 << 10;
/// The large size the warm-up runs, in bytes per rank (the algorithms and protocols
/// NCCL picks for large messages, whose connections it sets up lazily too).
pub(super) const WARM_LARGE_BYTES: u64 = 4 << 20;

/// The collectives the warm-up runs on a communicator of `role`: those the path policy
/// can choose there.
pub(super) fn warm_collectives(role: CommRole) -> &'static [WarmCollective] {
    match role {
        CommRole::CopyEngine => &[WarmCollective::AllGather],
        CommRole::Symmetric | CommRole::Plain => &[
            WarmCollective::AllGather,
            WarmCollective::ReduceScatter,
            WarmCollective::AllReduce,
        ],
    }
}

/// The (communicator, collective) pairs of the warm-up for communicators `infos`: those
/// of [`warm_collectives`] for each, and, without a plain communicator, the plain
/// kernels' collectives on the first one (where the path policy sends them then).
pub(super) fn warm_plan(infos: &[CommInfo]) -> Vec<(usize, WarmCollective)> {
    let mut plan: Vec<_> = (infos.iter().enumerate())
        .flat_map(|(c, info)| warm_collectives(info.role).iter().map(move |&w| (c, w)))
        .collect();
    if !infos.is_empty() && !infos.iter().any(|i| i.role == CommRole::Plain) {
        for &w in warm_collectives(CommRole::Plain) {
            if !plan.contains(&(0, w)) {
                plan.push((0, w));
            }
        }
    }
    plan
}

/// The warm-up segment's size in bytes for `world` ranks: the large size's all-gather
/// output (`world` × [`WARM_LARGE_BYTES`]) rounded up to whole `granularity` granules.
pub(super) fn warm_segment_bytes(world: usize, granularity: u64) -> u64 {
    let granularity = granularity.max(1);
    let need = (world.max(1) as u64).saturating_mul(WARM_LARGE_BYTES);
    need.div_ceil(granularity).saturating_mul(granularity)
}

impl<D: Device> Shared<D> {
    /// Everything NCCL does lazily at a first collective, done now (see the
    /// [module](super), *Warm-up*): the collectives of [`warm_plan`] at both sizes on
    /// `stream`, in place on one segment of [`warm_segment_bytes`] registered on the
    /// registering communicators; then a wait for the device and the release; all by
    /// `deadline` (the watchdog sees the calls inside NCCL).
    ///
    /// # Collective
    /// Every rank, at the same point of set-up.
    ///
    /// # Errors
    /// [`Error::NcclTimeout`](crate::Error::NcclTimeout) past the deadline; the errors of
    /// the calls.
    pub(super) fn warm_up(
        &self,
        infos: &[CommInfo],
        stream: &D::Stream,
        granularity: u64,
        deadline: Deadline,
    ) -> Result<Vec<WarmedPath>> {
        let started = Instant::now();
        let segment_bytes = warm_segment_bytes(self.world, granularity);
        let ptr = ffi::mem_alloc(self.nccl, segment_bytes)?;
        let (mut windows, mut warmed) = (Vec::new(), Vec::new());
        let plan = warm_plan(infos);
        let mut run = || -> Result<()> {
            for (c, info) in infos.iter().enumerate() {
                if info.registers {
                    // SAFETY: one whole ncclMemAlloc allocation of this device, fresh.
                    let w = unsafe { self.register(c, ptr, segment_bytes, deadline) }?;
                    windows.extend(w.map(|w| (c, w)));
                }
            }
            for bytes_per_rank in [WARM_SMALL_BYTES, WARM_LARGE_BYTES] {
                // f32 elements per rank; `world` × this fits the segment.
                let count = bytes_per_rank / 4;
                let mine = ptr + self.rank as u64 * bytes_per_rank;
                debug_assert!(self.world.max(1) as u64 * bytes_per_rank <= segment_bytes);
                for &(c, collective) in &plan {
                    let sum = sys::ncclRedOp_t::ncclSum;
                    let (kind, send, recv) = match collective {
                        WarmCollective::AllGather => (CollKind::AllGather, mine, ptr),
                        WarmCollective::ReduceScatter => (CollKind::ReduceScatter(sum), ptr, mine),
                        WarmCollective::AllReduce => (CollKind::AllReduce(sum), ptr, ptr),
                    };
                    let call = CollCall {
                        kind,
                        send,
                        recv,
                        count,
                        dtype: sys::ncclDataType_t::ncclFloat32,
                    };
                    // SAFETY: every range lies in the segment allocated above (`world`
                    // × `count` elements from `ptr`, this rank's chunk inside), which is
                    // freed only after the stream was seen idle below.
                    unsafe { self.collective(c, &call, stream, Bound::By(deadline)) }?;
                    warmed.push(WarmedPath {
                        comm: c,
                        role: infos[c].role,
                        collective,
                        bytes_per_rank,
                    });
                }
            }
            Ok(())
        };
        let ran = run();
        // The device is done with the segment only once the stream is idle: after a
        // failed call too (earlier collectives may still run).
        let idle = match self.device.wait_idle(stream, deadline) {
            Ok(false) => Err(self.fail(Cause::Timeout {
                op: "warm-up",
                waited: started.elapsed(),
            })),
            idle => idle.map(drop),
        };
        if let Err(e) = idle {
            return Err(ran.err().unwrap_or(e));
        }
        // Release the windows and the segment: the stream is idle, and `deregister`
        // calls nothing on an aborted communicator once its abort returned (NCCL
        // destroyed the window), handing the window back while the abort still runs.
        let mut released = Ok(());
        for (c, w) in windows {
            // SAFETY: registered on `c` above; the stream is idle.
            if let Err((_, e)) = unsafe { self.deregister(c, w, deadline) } {
                // Not deregistered: the window (and so the segment) is leaked.
                released = Err(e);
            }
        }
        match released.and_then(|()| self.may_free()) {
            // SAFETY: from `mem_alloc` above; no window covers it any more (every
            // registration was deregistered, or went with an abort that returned) and
            // the device is done with it.
            Ok(()) => unsafe { ffi::mem_free(self.nccl, ptr) }?,
            Err(e) => {
                tracing::warn!("symmpool: the warm-up's segment is leaked: {e}");
                ran?;
                return Err(e);
            }
        }
        ran.map(|()| warmed)
    }
}
