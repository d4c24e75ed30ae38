//! The warm-up: everything NCCL does lazily at a communicator's first collective, done
//! during set-up under its deadline (see the [module](super), *Warm-up*).

use super::comm::{Bound, Device, Shared};
use super::ffi::{self, CollCall, CollKind};
use super::health::Cause;
use crate::Deadline;
use crate::backend::{CommInfo, CommRole};
use crate::error::Result;
use cudarc::nccl::sys;
use std::time::Instant;

/// One collective the warm-up ran: the communicator (index into
/// [`BackendInfo::communicators`](crate::backend::BackendInfo::communicators)), its role,
/// and the collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmedPath {
    /// Index of the communicator.
    pub comm: usize,
    /// Its role.
    pub role: CommRole,
    /// The collective run on it.
    pub collective: WarmCollective,
}

/// A collective of the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmCollective {
    /// `ncclAllGather`.
    AllGather,
    /// `ncclReduceScatter`.
    ReduceScatter,
}

/// The collectives the warm-up runs on a communicator of `role`: those the path policy
/// can choose there (copy engine: all-gather on the copy-engine communicator; symmetric
/// kernel: all-gather and reduce-scatter on the symmetric one; plain: all-gather and
/// reduce-scatter on the plain one).
pub(super) fn warm_collectives(role: CommRole) -> &'static [WarmCollective] {
    match role {
        CommRole::CopyEngine => &[WarmCollective::AllGather],
        CommRole::Symmetric | CommRole::Plain => {
            &[WarmCollective::AllGather, WarmCollective::ReduceScatter]
        }
    }
}

impl<D: Device> Shared<D> {
    /// Everything NCCL does lazily at a first collective, done now: one registered
    /// segment of `segment_bytes` on `stream`, each data communicator's collectives of
    /// [`warm_collectives`] on it (all-gather and reduce-scatter in place, on the window
    /// for the registering communicators — the copy engine's first call runs
    /// `ncclCeInit`, which registers a window of its own — and as plain memory for the
    /// plain one), a wait for the device, the windows deregistered and the segment
    /// freed; all by `deadline` (the watchdog sees the calls inside NCCL).
    ///
    /// # Collective
    /// Every rank, at the same point of set-up.
    ///
    /// # Errors
    /// [`Error::NcclTimeout`] past the deadline; the errors of the calls.
    pub(super) fn warm_up(
        &self,
        infos: &[CommInfo],
        stream: &D::Stream,
        segment_bytes: u64,
        deadline: Deadline,
    ) -> Result<Vec<WarmedPath>> {
        let op = "warm-up";
        let started = Instant::now();
        let ptr = ffi::mem_alloc(self.nccl, segment_bytes)?;
        let mut windows = Vec::new();
        let mut warmed = Vec::new();
        let world = self.world.max(1) as u64;
        // f32 elements per rank: 4 KiB, fewer if the segment is small for the world.
        let count = (1024u64).min(segment_bytes / 4 / world).max(1);
        let chunk_bytes = count * 4;
        let mine = ptr + self.rank as u64 * chunk_bytes;
        let mut run = || -> Result<()> {
            for (c, info) in infos.iter().enumerate() {
                if info.registers {
                    // SAFETY: one whole ncclMemAlloc allocation of this device, fresh.
                    let w = unsafe { self.register(c, ptr, segment_bytes, deadline) }?;
                    windows.push((c, w));
                }
            }
            for (c, info) in infos.iter().enumerate() {
                for &collective in warm_collectives(info.role) {
                    let kind = match collective {
                        WarmCollective::AllGather => CollKind::AllGather,
                        WarmCollective::ReduceScatter => {
                            CollKind::ReduceScatter(sys::ncclRedOp_t::ncclSum)
                        }
                    };
                    let (send, recv) = match collective {
                        WarmCollective::AllGather => (mine, ptr),
                        WarmCollective::ReduceScatter => (ptr, mine),
                    };
                    let call = CollCall {
                        kind,
                        send,
                        recv,
                        count,
                        dtype: sys::ncclDataType_t::ncclFloat32,
                    };
                    // SAFETY: both ranges lie in the segment allocated above (world ×
                    // count elements from `ptr`, this rank's chunk inside), which is
                    // freed only after the stream was seen idle below.
                    unsafe { self.collective(c, &call, stream, Bound::By(deadline)) }?;
                    warmed.push(WarmedPath {
                        comm: c,
                        role: info.role,
                        collective,
                    });
                }
            }
            if !self.device.wait_idle(stream, deadline)? {
                return Err(self.fail(Cause::Timeout {
                    op,
                    waited: started.elapsed(),
                }));
            }
            Ok(())
        };
        let ran = run();
        if ran.is_err() {
            // Windows and the segment are leaked: the backend is broken or the set-up
            // fails, and its communicators are aborted.
            return ran.map(|()| Vec::new());
        }
        for (c, w) in windows {
            if let Some(w) = w {
                // SAFETY: registered on `c` above; the stream is idle.
                if let Err((_, e)) = unsafe { self.deregister(c, w) } {
                    return Err(e);
                }
            }
        }
        // SAFETY: from `mem_alloc` above; no window covers it any more and the device
        // is done with it.
        unsafe { ffi::mem_free(self.nccl, ptr) }?;
        Ok(warmed)
    }
}
