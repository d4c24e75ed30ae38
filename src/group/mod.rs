//! What the ranks compare, between the backend and the pool: the call history and its
//! running hash, the records the ranks exchange (agreements, registrations,
//! collectives) with one first-differing-field diff, the agreement and its readiness
//! flags, the collective checker, and the cross-pool registration-order round.
//!
//! Records travel as serde values (`postcard`) over the
//! [`Exchange`](crate::Exchange). This floor imports the backend, the control plane
//! and the core, never the pool or the collectives.

mod agree;
mod check;
mod collective;
mod history;
mod record;
mod registration;

pub(crate) use agree::{AgreementRecord, LiveBuffer, MAX_LIVE_NAMED, Op, Readiness, agree_records};
pub use check::CheckMode;
pub(crate) use check::{CheckSite, Checker, Failure};
pub(crate) use collective::{
    BufferRecord, CollKind, CollectiveRecord, GrowthPoint, RecordKind, dtype_code, reduce_code,
};
pub(crate) use history::{CallHead, CallKind, History, state_digest};
pub(crate) use record::{decode, encode};
pub(crate) use registration::agree_registration_order;
