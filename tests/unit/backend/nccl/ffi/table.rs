use super::*;

#[test]
fn loader_prefers_an_already_loaded_libnccl_so_2() {
    assert_eq!(
        candidates(None),
        vec![
            Candidate::AlreadyLoaded("libnccl.so.2"),
            Candidate::Load("libnccl.so.2".into()),
            Candidate::Load("libnccl.so".into()),
        ]
    );
    assert_eq!(candidates(Some("  ")), candidates(None));
    let with = candidates(Some("/opt/nccl/lib/libnccl.so.2"));
    assert_eq!(
        with[0],
        Candidate::Load("/opt/nccl/lib/libnccl.so.2".into())
    );
    assert_eq!(with[1..], candidates(None)[..]);
}

#[test]
fn version_gate() {
    let old = NcclVersion::new(2, 26, 5);
    match require(old, NcclVersion::WINDOWS, "symmetric windows") {
        Err(Error::NcclTooOld {
            found, required, ..
        }) => {
            assert_eq!((found, required), (old, NcclVersion::new(2, 27, 0)));
        }
        other => panic!("{other:?}"),
    }
    assert!(require(NcclVersion::new(2, 28, 3), NcclVersion::COPY_ENGINE, "ce").is_ok());
    assert_eq!(NcclVersion::from_code(22803), NcclVersion::new(2, 28, 3));
    assert_eq!(NcclVersion::from_code(2708), NcclVersion::new(2, 7, 8));
}
