use super::*;

#[test]
fn config_is_the_initializer_blocking_or_not() {
    let c = config(NCCL_CTA_POLICY_ZERO, false);
    assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
    assert_eq!(c.magic, 0xcafe_beef);
    assert!(
        c.version >= 22700,
        "CTAPolicy is ignored below config version 2.27"
    );
    assert_eq!(c.CTAPolicy, 2);
    assert_eq!(c.blocking, 0, "the control communicator is non-blocking");
    assert_eq!(config(NCCL_CTA_POLICY_ZERO, true).blocking, 1);
    assert_eq!(c.splitShare, 0, "children never share a parent's resources");
    assert_eq!(c.cgaClusterSize, i32::MIN);
    assert!(c.netName.is_null() && c.commName.is_null());
    assert_eq!(config(NCCL_CTA_POLICY_DEFAULT, true).CTAPolicy, 0);
}

#[test]
fn result_codes() {
    let s = crate::backend::nccl::fake::syms(false);
    assert_eq!(status(s, "x", SUCCESS, None).unwrap(), Status::Done);
    assert_eq!(
        status(s, "x", IN_PROGRESS, None).unwrap(),
        Status::InProgress
    );
    // A code no cudarc enum knows (e.g. 2.30's ncclTimeout = 8, or a later one) is
    // an error, never an invalid enum value.
    for code in [3, 6, 8, 42] {
        match status(s, "op", code, None) {
            Err(Error::Nccl { op, code: c, .. }) => assert_eq!((op, c), ("op", code)),
            other => panic!("{other:?}"),
        }
    }
    assert!(check(s, "x", IN_PROGRESS, None).is_err());
}
