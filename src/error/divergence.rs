//! The details of a divergence between ranks: at an agreement ([`Divergence`]) or
//! in the checked records of the collectives ([`CollectiveDivergence`]).

use std::fmt;

/// Details of a divergence between ranks, found when they agree before a collective
/// pool operation (growth, `reserve`, `trim`, `close`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// The operation being agreed on when the divergence was found.
    pub during: &'static str,
    /// Sequence number (1-based count of pool calls) of the first call that differs,
    /// when the ranks' histories show it.
    pub first_differing_call: Option<u64>,
    /// For each rank, its description of that call (`None`: the rank had not made it),
    /// or of where it is (call count, hash, latest call) when the first differing
    /// call is older than the history.
    pub calls: Vec<(usize, Option<String>)>,
    /// When the first differing call is older than every call the ranks remember: how
    /// many calls a rank remembers ([`PoolConfig::history_len`](crate::PoolConfig::history_len)).
    pub history_gone: Option<usize>,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ranks diverged (found during {})", self.during)?;
        match (self.first_differing_call, self.history_gone) {
            (Some(k), _) => write!(f, ": first differing call is #{k}:")?,
            (None, Some(n)) => write!(
                f,
                ": the first differing call is older than the {n} calls each rank remembers, gone from the history (raise PoolConfig::history_len, at most 65 536, to name it); where each rank is:"
            )?,
            (None, None) => f.write_str(" before the recorded history:")?,
        }
        for (rank, call) in &self.calls {
            let call = call.as_deref().unwrap_or("(no such call)");
            write!(f, " rank {rank}: {call};")?;
        }
        Ok(())
    }
}

/// Details of a [`Error::CollectiveDivergence`](crate::Error::CollectiveDivergence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveDivergence {
    /// The pool's name.
    pub pool: String,
    /// Which check found it: `"strict check"`, `"async check"`.
    pub found_by: &'static str,
    /// Position (1-based) of the differing record among the records the handle's ranks
    /// compared: its collectives, its pools' growths, and at each step boundary one
    /// record per pool and communicator.
    pub record: u64,
    /// The first field that differs (for example `"count"`, `"reduction"`,
    /// `"output offset"`, `"pool call hash"`).
    pub field: &'static str,
    /// Each rank's value of that field, in rank order.
    pub values: Vec<(usize, String)>,
}

impl fmt::Display for CollectiveDivergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ranks diverged at checked record #{} of pool {:?} (found by the {}): {} differs:",
            self.record, self.pool, self.found_by, self.field
        )?;
        for (rank, v) in &self.values {
            write!(f, " rank {rank} has {v};")?;
        }
        write!(f, " the pool is broken: drop it and build a new one")
    }
}
