//! Who a backend is: its kind, its rank and world, its NCCL version and granularity,
//! its communicators.

use crate::error::{Error, NcclVersion, Result};
use serde::Serialize;

/// Which implementation a backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BackendKind {
    /// In-process ranks on host memory.
    Host,
    /// NCCL on GPUs.
    Nccl,
}

/// What a communicator is for. The collectives pick one per call (see
/// [`coll`](crate::coll)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CommRole {
    /// Default CTA policy, segments registered: NCCL's symmetric kernels.
    Symmetric,
    /// `CTAPolicy = NCCL_CTA_POLICY_ZERO`, segments registered: copy-engine all-gather.
    CopyEngine,
    /// Default CTA policy, nothing registered: NCCL's ring/tree kernels through its own
    /// buffers (the fastest for large reduce-scatters on two GPUs without NVLS).
    Plain,
}

/// One communicator of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CommInfo {
    /// What it is for.
    pub role: CommRole,
    /// The CTA policy it was created with (`0` default, `2` zero).
    pub cta_policy: i32,
    /// Whether the pool registers its segments on it.
    pub registers: bool,
}

impl CommInfo {
    /// A default-policy communicator whose segments are registered (symmetric kernels).
    pub const SYMMETRIC: CommInfo = CommInfo {
        role: CommRole::Symmetric,
        cta_policy: 0,
        registers: true,
    };
    /// A `CTAPolicy = NCCL_CTA_POLICY_ZERO` communicator whose segments are registered
    /// (copy-engine all-gather).
    pub const COPY_ENGINE: CommInfo = CommInfo {
        role: CommRole::CopyEngine,
        cta_policy: 2,
        registers: true,
    };
    /// A default-policy communicator where nothing is registered (ring/tree kernels).
    pub const PLAIN: CommInfo = CommInfo {
        role: CommRole::Plain,
        cta_policy: 0,
        registers: false,
    };
    /// The three communicators the crate's backends create, in registration order.
    pub const STANDARD: [CommInfo; 3] = [Self::SYMMETRIC, Self::COPY_ENGINE, Self::PLAIN];
}

/// Who a backend is: the same on every call, and (but for `rank`) on every rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BackendInfo {
    /// Which implementation.
    pub kind: BackendKind,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The NCCL version in use (the host backend reports the version whose rules it
    /// follows).
    pub nccl_version: NcclVersion,
    /// Segment size and alignment granularity in bytes, a power of two (2 MiB on H200:
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`, which `ncclMemAlloc` rounds to).
    pub granularity_bytes: u64,
    /// The communicators, in the order segments are registered. Same on every rank.
    pub communicators: Vec<CommInfo>,
    /// Number of nodes (hosts) the ranks run on, 1 unless set with
    /// [`with_nodes`](Self::with_nodes). The NCCL backend counts the ranks' node
    /// identities at set-up; path selection avoids the paths that need one NVLink
    /// domain when it is above 1.
    pub nodes: usize,
    /// Whether two or more ranks drive the same GPU (time-sharing it), false unless
    /// set with [`with_shared_devices`](Self::with_shared_devices). The NCCL backend
    /// compares the ranks' device UUIDs at set-up.
    pub shared_devices: bool,
}

impl BackendInfo {
    /// The identity of one rank of a backend.
    ///
    /// # Errors
    /// [`Error::Config`] for `rank >= world_size`, no communicators, more than
    /// 64, or a granularity that is not a power of two.
    pub fn new(
        kind: BackendKind,
        rank: usize,
        world_size: usize,
        nccl_version: NcclVersion,
        granularity_bytes: u64,
        communicators: Vec<CommInfo>,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::config(
                "rank",
                format!("{rank} in a world of {world_size}"),
                "a rank below the world size",
            ));
        }
        if communicators.is_empty() || communicators.len() > 64 {
            return Err(Error::config(
                "communicators",
                format!("{} communicators", communicators.len()),
                "1 to 64 communicators",
            ));
        }
        if !crate::core::is_pow2(granularity_bytes) {
            return Err(Error::config(
                "granularity_bytes",
                granularity_bytes.to_string(),
                "a power of two",
            ));
        }
        Ok(BackendInfo {
            kind,
            rank,
            world_size,
            nccl_version,
            granularity_bytes,
            communicators,
            nodes: 1,
            shared_devices: false,
        })
    }

    /// The same identity, with the ranks spread over `nodes` nodes (at least 1).
    pub fn with_nodes(mut self, nodes: usize) -> Self {
        self.nodes = nodes.max(1);
        self
    }

    setters! {
        /// The same identity, saying whether two or more ranks drive the same GPU.
        with_shared_devices(shared_devices: bool);
    }
}
