use super::*;

#[test]
fn roles_follow_version_and_config() {
    let c = NcclConfig::default();
    assert_eq!(
        roles_for(NcclVersion::new(2, 28, 3), &c),
        CommInfo::STANDARD.to_vec()
    );
    assert_eq!(
        roles_for(NcclVersion::new(2, 27, 7), &c),
        vec![CommInfo::SYMMETRIC, CommInfo::PLAIN]
    );
    assert_eq!(
        roles_for(
            NcclVersion::new(2, 29, 0),
            &c.with_communicators(false, false)
        ),
        vec![CommInfo::SYMMETRIC]
    );
    assert_eq!(version_code(NcclVersion::new(2, 28, 9)), 22809);
    assert_eq!(
        NcclVersion::from_code(version_code(NcclVersion::new(2, 30, 3))),
        NcclVersion::new(2, 30, 3)
    );
}

#[test]
fn same_rank_checks_the_exchange_and_the_device() {
    let ex = LocalExchange::group(2).remove(1);
    assert_eq!(same_rank([1, 2, 3], 3, &ex).unwrap(), 1);
    for wrong in [[0, 2, 3], [1, 4, 3], [1, 2, 0]] {
        assert!(matches!(
            same_rank(wrong, 3, &ex),
            Err(Error::Config { .. })
        ));
    }
}
