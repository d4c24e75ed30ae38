use super::{AllocError, Error, ErrorKind as K};
use crate::core::{BlockId, Growth, SegmentId, SizeClass};
use crate::error::{CollectiveDivergence, Divergence};
use std::time::Duration;

/// The position of `e`'s variant in [`Error`]: a match without a wildcard, so a new
/// variant does not compile until it is listed here (and in `one_of_each`).
fn variant(e: &Error) -> usize {
    match e {
        Error::ZeroSize => 0,
        Error::TooLarge { .. } => 1,
        Error::BadAlignment { .. } => 2,
        Error::PoolLimit { .. } => 3,
        Error::DeviceOutOfMemory { .. } => 4,
        Error::PeerOutOfMemory { .. } => 5,
        Error::ForeignBuffer { .. } => 6,
        Error::DoubleFree { .. } => 7,
        Error::WrongStream => 8,
        Error::PoolClosed => 9,
        Error::BuffersAlive { .. } => 10,
        Error::Divergence(_) => 11,
        Error::Timeout { .. } => 12,
        Error::GroupBroken { .. } => 13,
        Error::CollectiveMismatch { .. } => 14,
        Error::InvalidCollective { .. } => 15,
        Error::BadView(_) => 16,
        Error::GraphCapture => 17,
        Error::NoActivePool => 18,
        Error::LibraryUnavailable { .. } => 19,
        Error::NcclTooOld { .. } => 20,
        Error::NoSymmetricSupport { .. } => 21,
        Error::RegistrationBroken { .. } => 22,
        Error::RegistrationOrder { .. } => 23,
        Error::SharedMemory { .. } => 24,
        Error::RegistrationMismatch { .. } => 25,
        Error::Nccl { .. } => 26,
        Error::Cuda { .. } => 27,
        Error::Internal { .. } => 28,
        Error::PoolBroken { .. } => 29,
        Error::Deferred { .. } => 30,
        Error::Config { .. } => 31,
        Error::InvalidConfig(_) => 32,
        Error::Core(_) => 33,
        Error::PeerLost { .. } => 34,
        Error::Transport { .. } => 35,
        Error::Protocol { .. } => 36,
        Error::StoreRejected { .. } => 37,
        Error::JobMismatch { .. } => 38,
        Error::RankTaken { .. } => 39,
        Error::ChannelMismatch { .. } => 40,
        Error::PayloadTooLarge { .. } => 41,
        Error::LaunchEnv { .. } => 42,
        Error::NcclTimeout { .. } => 43,
        Error::NcclWatchdog { .. } => 44,
        Error::NcclAborted { .. } => 45,
        Error::CollectiveDivergence(_) => 46,
        Error::SharedCommunicators { .. } => 47,
        Error::Untagged { .. } => 48,
        Error::Shrunk { .. } => 49,
        Error::ShrinkFailed { .. } => 50,
        Error::DeclaredLost { .. } => 51,
    }
}
const VARIANTS: usize = 52;

fn io() -> std::sync::Arc<std::io::Error> {
    std::io::Error::other("test").into()
}

/// One value of every variant, with the kind a runtime should see.
fn one_of_each() -> Vec<(Error, K)> {
    let s = || "x".to_string();
    let v = crate::NcclVersion::from_code(22_800);
    vec![
        (Error::ZeroSize, K::Usage),
        (
            Error::Untagged {
                op: "all_gather",
                pool: s(),
            },
            K::Usage,
        ),
        (
            Error::SharedCommunicators {
                pools: vec![s()],
                error: Box::new(Error::WrongStream),
            },
            K::Usage,
        ),
        (
            Error::TooLarge {
                requested_bytes: 2,
                max_bytes: 1,
            },
            K::Usage,
        ),
        (
            Error::BadAlignment {
                align_bytes: 3,
                max_align_bytes: 2,
            },
            K::Usage,
        ),
        (
            Error::PoolLimit {
                segment_bytes: 1,
                would_reserve_bytes: 2,
                max_reserved_bytes: 1,
            },
            K::OutOfMemory,
        ),
        (
            Error::DeviceOutOfMemory {
                segment_bytes: 1,
                op: "x",
                code: 2,
                message: s(),
            },
            K::OutOfMemory,
        ),
        (
            Error::PeerOutOfMemory {
                segment_bytes: 1,
                ranks: vec![1],
            },
            K::OutOfMemory,
        ),
        (Error::ForeignBuffer { allocation_seq: 1 }, K::Usage),
        (Error::DoubleFree { allocation_seq: 1 }, K::Usage),
        (Error::WrongStream, K::Usage),
        (Error::PoolClosed, K::Usage),
        (
            Error::BuffersAlive {
                live_per_rank: vec![1],
                buffers: vec![],
            },
            K::Usage,
        ),
        (
            Error::Divergence(Box::new(Divergence {
                during: "x",
                first_differing_call: None,
                calls: vec![],
                history_gone: None,
            })),
            K::Divergence,
        ),
        (
            Error::Timeout {
                op: "x",
                waited: Duration::ZERO,
                missing_ranks: vec![1],
            },
            K::Timeout,
        ),
        (Error::GroupBroken { rank: 1, op: "x" }, K::Timeout),
        (Error::Shrunk { what: "a pool" }, K::Usage),
        (
            Error::ShrinkFailed {
                reason: "x".into(),
                retry: true,
            },
            K::PeerLost,
        ),
        // Shrinking again cannot help: restart.
        (
            Error::ShrinkFailed {
                reason: "x".into(),
                retry: false,
            },
            K::GroupLost,
        ),
        (
            Error::DeclaredLost {
                rank: 2,
                detail: s(),
            },
            K::GroupLost,
        ),
        (
            Error::CollectiveMismatch {
                op: "x",
                detail: s(),
            },
            K::Divergence,
        ),
        (
            Error::InvalidCollective {
                op: "x",
                detail: s(),
            },
            K::Usage,
        ),
        (Error::BadView(s()), K::Usage),
        (Error::GraphCapture, K::Usage),
        (Error::NoActivePool, K::Usage),
        (
            Error::LibraryUnavailable {
                library: "x",
                hint: "y",
            },
            K::Configuration,
        ),
        (
            Error::NcclTooOld {
                found: v,
                required: v,
                feature: "x",
            },
            K::Configuration,
        ),
        (Error::NoSymmetricSupport { comm: 0 }, K::Configuration),
        (
            Error::RegistrationBroken {
                rank: 1,
                reason: s(),
            },
            K::Broken,
        ),
        (Error::RegistrationOrder { order: vec![] }, K::Divergence),
        (
            Error::SharedMemory {
                op: "x",
                detail: s(),
                source: io(),
            },
            K::System,
        ),
        (
            Error::RegistrationMismatch {
                ordinal: 1,
                sizes: vec![],
            },
            K::Divergence,
        ),
        (
            Error::Nccl {
                op: "x",
                code: 1,
                message: s(),
            },
            K::System,
        ),
        (
            Error::Cuda {
                op: "x",
                code: 1,
                message: s(),
            },
            K::System,
        ),
        (Error::Internal { what: s() }, K::Internal),
        (Error::PoolBroken { reason: s() }, K::Broken),
        (
            Error::Deferred {
                during: s(),
                source: Box::new(Error::PeerLost {
                    rank: 1,
                    op: "x",
                    detail: s(),
                }),
            },
            K::PeerLost,
        ),
        (
            Error::Config {
                setting: "x",
                value: s(),
                expected: "y",
            },
            K::Configuration,
        ),
        (Error::InvalidConfig(s()), K::Configuration),
        (Error::Core(AllocError::Config("x")), K::Configuration),
        (
            Error::PeerLost {
                rank: 1,
                op: "x",
                detail: s(),
            },
            K::PeerLost,
        ),
        (
            Error::Transport {
                op: "x",
                detail: s(),
                source: io(),
            },
            K::Configuration,
        ),
        (
            Error::Protocol {
                op: "x",
                detail: s(),
            },
            K::Configuration,
        ),
        (Error::StoreRejected { reason: s() }, K::Configuration),
        (
            Error::JobMismatch {
                job: s(),
                store_job: s(),
            },
            K::Configuration,
        ),
        (
            Error::RankTaken {
                rank: 1,
                holder: s(),
                claimant: s(),
            },
            K::Configuration,
        ),
        (Error::ChannelMismatch { opened: vec![] }, K::Divergence),
        (
            Error::PayloadTooLarge {
                payload_bytes: 2,
                max_bytes: 1,
            },
            K::Usage,
        ),
        (
            Error::LaunchEnv {
                variable: s(),
                detail: s(),
            },
            K::Configuration,
        ),
        (
            Error::NcclTimeout {
                op: "x",
                waited: Duration::ZERO,
            },
            K::Timeout,
        ),
        (
            Error::NcclWatchdog {
                op: "x",
                comm: 0,
                waited: Duration::ZERO,
            },
            K::Timeout,
        ),
        (Error::NcclAborted { reason: s() }, K::PeerLost),
        (
            Error::CollectiveDivergence(Box::new(CollectiveDivergence {
                pool: s(),
                found_by: "x",
                record: 1,
                field: "y",
                values: vec![],
            })),
            K::Divergence,
        ),
    ]
}

#[test]
fn every_variant_has_its_kind() {
    let all = one_of_each();
    let mut seen = [false; VARIANTS];
    for (e, kind) in &all {
        seen[variant(e)] = true;
        assert_eq!(e.kind(), *kind, "{e:?}");
        assert!(!kind.name().is_empty());
    }
    assert!(seen.iter().all(|&s| s), "a variant has no sample: {seen:?}");
}

#[test]
fn core_errors_have_kinds() {
    let block = BlockId { slot: 0, seq: 1 };
    let growth = Growth {
        class: SizeClass::Small,
        segment_bytes: 1,
    };
    for (e, kind) in [
        (AllocError::ZeroSize, K::Usage),
        (
            AllocError::TooLarge {
                requested_bytes: 2,
                max_bytes: 1,
            },
            K::Usage,
        ),
        (
            AllocError::BadAlignment {
                align_bytes: 3,
                max_align_bytes: 2,
            },
            K::Usage,
        ),
        (AllocError::StaleBlock(block), K::Usage),
        (
            AllocError::OutOfMemory {
                segment_bytes: 1,
                would_reserve_bytes: 2,
                max_reserved_bytes: 1,
            },
            K::OutOfMemory,
        ),
        (AllocError::Config("x"), K::Configuration),
        (AllocError::BadLayout("x"), K::Configuration),
        (AllocError::NeedsGrowth(growth), K::Internal),
        (AllocError::BadSegmentSize { size_bytes: 1 }, K::Internal),
        (AllocError::UnknownSegment(SegmentId(0)), K::Internal),
        (AllocError::Exhausted, K::Internal),
    ] {
        assert_eq!(Error::Core(e.clone()).kind(), kind, "{e:?}");
        // The conversion the pool uses keeps the kind, and a request error its text.
        let usage = kind == K::Usage && !matches!(e, AllocError::StaleBlock(_));
        let text = e.to_string();
        let converted = Error::from(e);
        assert_eq!(converted.kind(), kind);
        if usage {
            assert_eq!(converted.to_string(), text);
        }
    }
    assert!(K::PeerLost.needs_restart() && !K::OutOfMemory.needs_restart());
}

#[test]
fn a_shrink_that_cannot_be_retried_and_a_rank_declared_lost_advise_a_restart() {
    // A runtime following the kinds shrinks on `PeerLost`; these must not send it
    // round that loop again.
    let failed = Error::ShrinkFailed {
        reason: "the store's host, job rank 0, is gone".into(),
        retry: false,
    };
    let declared = Error::DeclaredLost {
        rank: 2,
        detail: "no heartbeat for 5.2s".into(),
    };
    for e in [&failed, &declared] {
        assert_eq!(e.kind(), K::GroupLost, "{e}");
        assert!(e.kind().needs_restart());
        assert_eq!(e.kind().name(), "group_lost");
    }
    let retry = Error::ShrinkFailed {
        reason: "x".into(),
        retry: true,
    };
    assert_eq!(retry.kind(), K::PeerLost);
    let told = declared.to_string();
    assert!(
        told.starts_with("this rank (2) was declared lost by the store: no heartbeat")
            && told.contains("cannot rejoin"),
        "{told}"
    );
    assert!(
        !told.contains("store's host") && !told.contains("shrink"),
        "{told}"
    );
}
