//! What the ranks compare, between the backend and the pool: the ledger (one ordered
//! stream of records per communicator set, one verdict), the records it carries
//! (agreements, collectives with their identity, step boundaries) with one
//! first-differing-field diff, the call history and its running hash, the agreement
//! and its readiness flags, and the cross-pool registration-order round.
//!
//! Records travel as serde values (`postcard`) over the
//! [`Exchange`](crate::Exchange). This floor imports the backend, the control plane
//! and the core, never the pool or the collectives.

mod agree;
mod collective;
mod history;
mod ledger;
mod record;
mod registration;

pub(crate) use agree::{
    AgreementRecord, LiveBuffer, MAX_LIVE_NAMED, Note, Op, Readiness, Registered, agree_records,
};
pub(crate) use collective::{
    BufferRecord, CollKind, CollectiveRecord, RecordKind, dtype_code, reduce_code,
};
pub(crate) use history::{CallHead, CallKind, History, state_digest};
pub use ledger::CheckMode;
pub(crate) use ledger::{Failure, Ledger, LedgerConfig};
pub(crate) use record::{decode, encode};
pub(crate) use registration::agree_registration_order;
