//! What the ranks agree on before they make their communicators: one round on a
//! channel of its own (`"nccl:setup"`), in which every rank sends its NCCL version,
//! node identity, GPU, the data communicators it will split and how it makes the
//! control communicator ([`Role`]), and one rank also the control communicator's
//! `ncclUniqueId` (rank 0 for a new set; for an `ncclCommGrow`, the grow's root).
//! Pure logic over an [`Exchange`], tested without GPUs.

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
    /// Rank 0 of a new set, or the root of a grow: the control communicator's
    /// `ncclUniqueId` (128 bytes); empty on the other ranks, and on every rank when
    /// the control communicator is split from a runtime's.
    pub(crate) unique_ids: Vec<Vec<u8>>,
    /// How this rank makes the control communicator.
    pub(crate) role: Role,
    /// The data communicators this rank will split, and how (every rank must split the
    /// same ones: a split is collective).
    pub(crate) plan: String,
}

/// How a rank makes its control communicator.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub(crate) enum Role {
    /// In a new set (`ncclCommInitRankConfig`, or split from a runtime's).
    New,
    /// In an `ncclCommGrow` of its control communicator, where it is `parent_rank`.
    Member { parent_rank: u32 },
    /// In an `ncclCommGrow`, as a newcomer.
    Newcomer,
}

/// What the round settled, the same on every rank.
#[derive(Debug, PartialEq)]
pub(crate) struct Agreed {
    /// The NCCL version of every rank.
    pub(crate) version: NcclVersion,
    /// The unique ids of rank 0 (a new set) or of the grow's root.
    pub(crate) unique_ids: Vec<[u8; 128]>,
    /// For an `ncclCommGrow`: each rank's rank in the grown control communicator (a
    /// member keeps its parent rank; the newcomers follow, in rank order).
    pub(crate) grow: Option<Vec<usize>>,
    /// Where the ranks run.
    pub(crate) placement: Placement,
}

impl Agreed {
    /// The one unique id sent.
    ///
    /// # Errors
    /// [`Error::Protocol`] when none or several were sent.
    pub(crate) fn unique_id(&self) -> Result<[u8; 128]> {
        match self.unique_ids[..] {
            [id] => Ok(id),
            _ => Err(malformed(format!(
                "{} unique ids were sent, not 1",
                self.unique_ids.len()
            ))),
        }
    }
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

/// What the round's errors name as the operation.
const OP: &str = "NCCL set-up";

/// The error of a malformed set-up round.
fn malformed(detail: String) -> Error {
    Error::Protocol { op: OP, detail }
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
    let all = gather_records(exchange, channel, OP, hello, deadline)?;
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
    let grow = grow_ranks(hellos)?;
    // The sender: the grow's root (parent rank 0), else rank 0.
    let root = grow
        .as_ref()
        .and_then(|ranks| ranks.iter().position(|&r| r == 0))
        .unwrap_or(0);
    let unique_ids = hellos[root]
        .unique_ids
        .iter()
        .map(|id| {
            <[u8; 128]>::try_from(id.as_slice()).map_err(|_| {
                malformed(format!(
                    "rank {root} sent a unique id of {} bytes, not 128",
                    id.len()
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Agreed {
        version: NcclVersion::from_code(first.version),
        unique_ids,
        grow,
        placement: Placement {
            nodes: count_nodes(hellos.iter().map(|h| h.node.as_str())),
            shared_devices: shared_devices(hellos.iter().map(|h| h.device.as_slice())),
        },
    })
}

/// For a grow (some rank a [`Role::Member`]), each rank's rank in the grown control
/// communicator: members keep theirs, which must be `0..members`, newcomers follow in
/// rank order; `None` when every rank makes a new set.
fn grow_ranks(hellos: &[Hello]) -> Result<Option<Vec<usize>>> {
    if hellos.iter().all(|h| h.role == Role::New) {
        return Ok(None);
    }
    let members = hellos
        .iter()
        .filter(|h| matches!(h.role, Role::Member { .. }))
        .count();
    let mut next = members;
    let mut ranks = Vec::with_capacity(hellos.len());
    for h in hellos {
        ranks.push(match h.role {
            Role::Member { parent_rank } => parent_rank as usize,
            Role::Newcomer => {
                next += 1;
                next - 1
            }
            Role::New => usize::MAX,
        });
    }
    let mut sorted = ranks.clone();
    sorted.sort_unstable();
    if members == 0 || next == members || !sorted.iter().copied().eq(0..ranks.len()) {
        let roles: Vec<_> = hellos.iter().map(|h| h.role).collect();
        return Err(malformed(format!(
            "the ranks grow (ncclCommGrow) as {roles:?}, not as members 0..m and newcomers"
        )));
    }
    Ok(Some(ranks))
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
