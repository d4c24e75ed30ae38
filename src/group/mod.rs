//! The communicator set ([`Group`], `set.rs`) and what its ranks compare, between the
//! backend and the pool: the ledger, the records it carries with their
//! first-differing-field diff, the call history and its hash, the agreement, and the
//! registration-order round (`docs/ARCHITECTURE.md`).

mod agree;
mod collective;
mod history;
mod ledger;
mod record;
mod registration;
mod set;

pub(crate) use agree::{
    AgreementRecord, LiveBuffer, MAX_LIVE_NAMED, Note, Op, READY, Readiness, Registered,
    agree_records,
};
pub(crate) use collective::{BufferRecord, CollKind, CollectiveRecord, RecordKind};
pub(crate) use history::{CallHead, CallKind, History, Stop, catch_up, state_digest};
pub use ledger::CheckMode;
pub(crate) use ledger::{Ledger, LedgerConfig};
pub(crate) use record::{decode, encode};
pub(crate) use registration::agree_registration_order;
pub use set::{Group, GroupConfig};
