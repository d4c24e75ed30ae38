//! What the ranks agree on before they make their communicators: one round on a
//! channel of its own (`"nccl:setup"`), in which every rank sends its NCCL version,
//! node identity, GPU and the data communicators it will split, and rank 0 also the
//! control communicator's `ncclUniqueId`. Pure logic over an [`Exchange`], tested without GPUs.

use crate::control::{Exchange, gather_records};
use crate::deadline::Deadline;
use crate::error::{Error, NcclVersion, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// One rank's contribution to the set-up round.
#[derive(Serialize, Deserialize)]
pub(crate) struct Hello {
    /// `ncclGetVersion`'s code.
    pub(crate) version: i32,
    /// See [`node_identity`].
    pub(crate) node: String,
    /// The UUID of this rank's GPU (`cuDeviceGetUuid`; empty if unknown): ranks with
    /// the same one time-share a GPU.
    pub(crate) device: Vec<u8>,
    /// Rank 0: the control communicator's `ncclUniqueId` (128 bytes); empty on the
    /// other ranks, and on every rank when the control communicator is split from a
    /// runtime's.
    pub(crate) unique_ids: Vec<Vec<u8>>,
    /// The data communicators this rank will split, and how (every rank must split the
    /// same ones: a split is collective).
    pub(crate) plan: String,
}

/// What the round settled, the same on every rank.
#[derive(Debug, PartialEq)]
pub(crate) struct Agreed {
    /// The NCCL version of every rank.
    pub(crate) version: NcclVersion,
    /// Rank 0's unique ids.
    pub(crate) unique_ids: Vec<[u8; 128]>,
    /// Where the ranks run.
    pub(crate) placement: Placement,
}

/// Where the ranks of a backend run: how many nodes, and whether some share a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Placement {
    /// Number of distinct node identities.
    pub(crate) nodes: usize,
    /// Whether two ranks named the same GPU.
    pub(crate) shared_devices: bool,
}

impl Placement {
    /// Every rank on its own GPU of one node (the devices of one process).
    pub(crate) const ONE_NODE: Placement = Placement {
        nodes: 1,
        shared_devices: false,
    };
}

/// The channel's name.
pub(crate) const CHANNEL: &str = "nccl:setup";

/// Run the set-up round: open [`CHANNEL`] and all-gather `hello`, both by `deadline`.
///
/// # Collective
/// Every rank of `exchange`, at the same point.
///
/// # Errors
/// As [`gather_records`]; [`Error::Config`] on every rank when ranks run different
/// NCCL versions, or rank 0's payload is malformed.
pub(crate) fn agree(exchange: &dyn Exchange, hello: &Hello, deadline: Deadline) -> Result<Agreed> {
    let channel = exchange.open_channel(CHANNEL, deadline)?;
    let all = gather_records(exchange, channel, "NCCL set-up", hello, deadline)?;
    settle(&all)
}

/// What every rank concludes from all ranks' hellos (a pure function).
pub(crate) fn settle(hellos: &[Hello]) -> Result<Agreed> {
    let first = hellos
        .first()
        .ok_or_else(|| Error::config("world_size", "0", "at least one rank"))?;
    if hellos.iter().any(|h| h.version != first.version) {
        let per_rank = hellos
            .iter()
            .enumerate()
            .map(|(r, h)| format!("rank {r}: {}", NcclVersion::from_code(h.version)))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(Error::config(
            "NCCL version",
            per_rank,
            "the same NCCL on every rank",
        ));
    }
    if let Some((r, h)) = (hellos.iter().enumerate()).find(|(_, h)| h.plan != first.plan) {
        return Err(Error::config(
            "NcclConfig",
            format!(
                "ranks split different data communicators (rank 0: {}, rank {r}: {})",
                first.plan, h.plan
            ),
            "the same NcclConfig on every rank",
        ));
    }
    let unique_ids = first
        .unique_ids
        .iter()
        .map(|id| {
            <[u8; 128]>::try_from(id.as_slice()).map_err(|_| Error::Protocol {
                op: "NCCL set-up",
                detail: format!("rank 0 sent a unique id of {} bytes, not 128", id.len()),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Agreed {
        version: NcclVersion::from_code(first.version),
        unique_ids,
        placement: Placement {
            nodes: count_nodes(hellos.iter().map(|h| h.node.as_str())),
            shared_devices: shared_devices(hellos.iter().map(|h| h.device.as_slice())),
        },
    })
}

/// Whether two of the GPU identities are the same (empty ones, unknown, never match).
pub(crate) fn shared_devices<'a>(ids: impl IntoIterator<Item = &'a [u8]>) -> bool {
    let mut seen = BTreeSet::new();
    ids.into_iter().any(|id| !id.is_empty() && !seen.insert(id))
}

/// Number of distinct node identities.
pub(crate) fn count_nodes<'a>(ids: impl IntoIterator<Item = &'a str>) -> usize {
    ids.into_iter().collect::<BTreeSet<_>>().len().max(1)
}

/// A node's identity, as NCCL's host hash reads it: `NCCL_HOSTID` when set, else the
/// host name and the kernel's boot id (two containers of one host share the boot id;
/// two hosts never do). A pure function of its inputs.
pub(crate) fn node_identity(
    get: &dyn Fn(&str) -> Option<String>,
    hostname: &str,
    boot_id: Option<&str>,
) -> String {
    if let Some(id) = get("NCCL_HOSTID")
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
    {
        return format!("hostid:{id}");
    }
    match boot_id.map(str::trim).filter(|b| !b.is_empty()) {
        Some(boot) => format!("{}/{boot}", hostname.trim()),
        None => hostname.trim().to_string(),
    }
}

/// This process's node identity.
pub(crate) fn this_node() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let hostname = read("/proc/sys/kernel/hostname")
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    let boot = read("/proc/sys/kernel/random/boot_id");
    node_identity(&|k| std::env::var(k).ok(), &hostname, boot.as_deref())
}

#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl/setup.rs"]
mod tests;
