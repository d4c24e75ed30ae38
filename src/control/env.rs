//! [`Launch`]: who this rank is and where the store is, from the launcher's environment.

use crate::error::{Error, Result};
use std::str::FromStr;

/// Which launcher's variables a [`Launch`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `torchrun` (or anything setting `RANK`/`WORLD_SIZE`).
    Torchrun,
    /// slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// Given explicitly with [`Launch::explicit`].
    Explicit,
}

/// Who this rank is, and where the rendezvous store listens.
///
/// | launcher | rank | world size | local rank | local world size | store address |
/// |---|---|---|---|---|---|
/// | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` | `MASTER_ADDR`, `MASTER_PORT` |
/// | slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_NTASKS_PER_NODE` (only a plain number) | `MASTER_ADDR`, `MASTER_PORT` |
/// | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` | `MASTER_ADDR`, `MASTER_PORT` |
///
/// The store listens on `MASTER_PORT`, except under torchrun (`TORCHELASTIC_RUN_ID`
/// set), whose agent already serves PyTorch's store there: then on `MASTER_PORT + 1`.
/// `SYMMPOOL_STORE_PORT` overrides both (and makes `MASTER_PORT` unnecessary).
///
/// The launchers are tried in that order: torchrun's when `RANK` is set, slurm's when
/// `SLURM_PROCID` is, Open MPI's when `OMPI_COMM_WORLD_RANK` is. Under slurm and Open
/// MPI the store address is **required** in `MASTER_ADDR` and `MASTER_PORT` (or
/// `SYMMPOOL_STORE_PORT`; this crate does not expand `SLURM_JOB_NODELIST`); in an
/// sbatch script, for example:
///
/// ```text
/// export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
/// export MASTER_PORT=29511
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// This rank's index on its node, when the launcher says.
    pub local_rank: Option<usize>,
    /// Ranks on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Host name or address of the store (rank 0's node).
    pub master_addr: String,
    /// Port of this crate's store: `MASTER_PORT`, `MASTER_PORT + 1` under torchrun, or
    /// `SYMMPOOL_STORE_PORT` (see the table above).
    pub master_port: u16,
    /// Where these values came from.
    pub source: LaunchSource,
}

pub(super) fn env_err(variable: &str, detail: impl Into<String>) -> Error {
    Error::LaunchEnv {
        variable: variable.to_string(),
        detail: detail.into(),
    }
}

/// The variable `name` read through `get` and parsed (`None`: not set).
///
/// # Errors
/// [`Error::LaunchEnv`] naming it, saying it is not `what`.
pub(super) fn parse_var<T: FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
    what: &str,
) -> Result<Option<T>> {
    let parse =
        |v: String| (v.trim().parse()).map_err(|_| env_err(name, format!("{v:?} is not {what}")));
    get(name).map(parse).transpose()
}

impl Launch {
    /// Explicit values (not from the environment).
    ///
    /// # Errors
    /// [`Error::LaunchEnv`] if `rank >= world_size` or `world_size` is 0.
    pub fn explicit(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Result<Launch> {
        Launch {
            rank,
            world_size,
            local_rank: None,
            local_world_size: None,
            master_addr: master_addr.into(),
            master_port,
            source: LaunchSource::Explicit,
        }
        .validate("rank")
    }

    /// From the process environment; see [`Launch`] for the variables.
    ///
    /// # Errors
    /// As [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<Launch> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// From variables read through `get` (a pure function of it, for tests).
    ///
    /// # Errors
    /// [`Error::LaunchEnv`] naming the variable: none of the launchers' variables set,
    /// one missing or not a number, a rank not below the world size, `MASTER_ADDR`
    /// or `MASTER_PORT` missing (without `SYMMPOOL_STORE_PORT`) or invalid.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Launch> {
        // Each launcher's variables (rank, world size, local rank, local world size), in
        // the order they are tried (the first whose rank is set).
        let launchers = [
            (
                LaunchSource::Torchrun,
                "torchrun's",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            ),
            (
                LaunchSource::Slurm,
                "slurm's",
                [
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                ],
            ),
            (
                LaunchSource::OpenMpi,
                "Open MPI's",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
        ];
        let Some((source, launcher, [rank_var, size_var, local_var, local_size_var])) =
            launchers.into_iter().find(|l| get(l.2[0]).is_some())
        else {
            return Err(env_err(
                "RANK",
                "no launcher environment found: run under torchrun, srun or mpirun, or set \
                 RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
            ));
        };
        let count = |name: &str| parse_var::<usize>(get, name, "a non-negative integer");
        let required = |name: &str| {
            count(name)?
                .ok_or_else(|| env_err(name, format!("not set, but {launcher} variables are")))
        };
        let rank = required(rank_var)?;
        let world_size = required(size_var)?;
        let local_rank = count(local_var)?;
        let local_world_size = count(local_size_var)?;
        let master_addr = get("MASTER_ADDR")
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .ok_or_else(|| {
                env_err(
                    "MASTER_ADDR",
                    "not set: set it to the host name or address of rank 0's node",
                )
            })?;
        let port = |name: &str| parse_var::<u16>(get, name, "a port number");
        let master_port = match port("SYMMPOOL_STORE_PORT")? {
            // The store's own port is given: MASTER_PORT is not needed (nor read).
            Some(p) => p,
            None => {
                let p = port("MASTER_PORT")?.ok_or_else(|| {
                    env_err(
                        "MASTER_PORT",
                        "not set: set it to a free TCP port on rank 0's node, the same on every \
                         rank (or set SYMMPOOL_STORE_PORT)",
                    )
                })?;
                // torchrun's agent already serves its own store on MASTER_PORT: this
                // crate's goes on the next port.
                let torchrun =
                    source == LaunchSource::Torchrun && get("TORCHELASTIC_RUN_ID").is_some();
                p.checked_add(u16::from(torchrun)).ok_or_else(|| {
                    let why = "65535 leaves no port above it for symmpool's store under torchrun; \
                               set SYMMPOOL_STORE_PORT";
                    env_err("MASTER_PORT", why)
                })?
            }
        };
        let l = Launch {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source,
        }
        .validate(rank_var)?;
        if let (Some(lr), Some(lws)) = (local_rank, local_world_size)
            && lr >= lws
        {
            return Err(env_err(
                local_var,
                format!("local rank {lr} is not below {local_size_var}={lws}"),
            ));
        }
        Ok(l)
    }

    /// This launch, if its rank is below its world size, which is not 0 (else an
    /// error naming `rank_var`).
    fn validate(self, rank_var: &str) -> Result<Launch> {
        let (rank, world) = (self.rank, self.world_size);
        if world == 0 {
            return Err(env_err(rank_var, "the world size is 0"));
        }
        if rank >= world {
            let why = format!("rank {rank} is not below the world size {world}");
            return Err(env_err(rank_var, why));
        }
        Ok(self)
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/env.rs"]
mod tests;
