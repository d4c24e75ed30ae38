//! One round of a control-plane test: every rank's byte, gathered on the control
//! channel. The library's unit tests include this file too (through `#[path]`), where
//! the crate is `crate`, not `symmpool`; so it names the crate's items through its
//! parent module, which has `ChannelId`, `Deadline`, `Error` and `Exchange` in scope.

use super::{ChannelId, Deadline, Error, Exchange};
use std::time::Duration;

/// The deadline of the waits that should succeed: long, so that they never run out on
/// a busy machine.
pub(crate) const LONG: Duration = Duration::from_secs(30);

/// `payload` all-gathered on `ex`'s control channel (op `"a round"`), by [`LONG`]
/// from now: every rank's payload, in rank order.
///
/// # Errors
/// Those of [`Exchange::all_gather`].
pub(crate) fn round(ex: &dyn Exchange, payload: u8) -> Result<Vec<Vec<u8>>, Error> {
    ex.all_gather(
        ChannelId::CONTROL,
        "a round",
        &[payload],
        Deadline::after(LONG),
    )
}
