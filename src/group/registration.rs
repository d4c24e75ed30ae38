//! The cross-pool registration-order round: before a window registration, the ranks
//! agree on the group's registration channel that every rank's next registration is
//! the same pool's segment of the same size. Pools sharing a backend that grow in
//! different orders would otherwise pair one pool's window with another's (NCCL pairs
//! windows by call order and checks nothing).

use super::record;
use crate::control::{ChannelId, Exchange};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// One rank's next registration.
#[derive(PartialEq, Serialize, Deserialize)]
struct RegistrationRecord {
    pool: String,
    size_bytes: u64,
}

/// Agree that every rank's next registration is pool `pool`'s segment of `size_bytes`.
///
/// # Errors
/// [`Error::RegistrationOrder`] naming each rank's pool and size if they differ (an
/// unreadable record shows as an unnamed pool of 0 bytes); the exchange's errors
/// ([`Error::Timeout`] by `deadline`, [`Error::PeerLost`]).
pub(crate) fn agree_registration_order(
    exchange: &dyn Exchange,
    channel: ChannelId,
    pool: &str,
    size_bytes: u64,
    deadline: Deadline,
) -> Result<()> {
    let pool = pool.to_string();
    let mine = record::encode(&RegistrationRecord { pool, size_bytes })?;
    let all = exchange.all_gather(channel, "window registration order", &mine, deadline)?;
    let records: Vec<Option<RegistrationRecord>> = all.iter().map(|b| record::decode(b)).collect();
    if records.iter().all(|r| r.is_some() && *r == records[0]) {
        return Ok(());
    }
    let order = (records.iter().enumerate())
        .map(|(rank, r)| match r {
            Some(r) => (rank, format!("pool {:?}", r.pool), r.size_bytes),
            None => (rank, "an unreadable registration record".to_string(), 0),
        })
        .collect();
    Err(Error::RegistrationOrder { order })
}
