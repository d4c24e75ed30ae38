//! `SYMMPOOL_CHECK`: the environment sets the check mode of the
//! collectives handles through `GroupConfig::from_env` (never `default`), code that sets
//! the mode beats it, and a value that names no
//! mode is a typed configuration error when the group is made. One test, so that the
//! process environment changes in one thread only.

use std::time::Duration;
use symmpool::{CheckMode, Coll, Error, ErrorKind, Group, GroupConfig, PoolConfig, SymmPool};

fn set(value: Option<&str>) {
    // SAFETY: this test binary has one test, which runs on one thread; nothing else
    // reads or writes the environment meanwhile.
    unsafe {
        match value {
            Some(v) => std::env::set_var("SYMMPOOL_CHECK", v),
            None => std::env::remove_var("SYMMPOOL_CHECK"),
        }
    }
}

/// The check mode of the handles made on 2 ranks whose groups are made from `config`.
fn modes(config: GroupConfig) -> Result<Vec<CheckMode>, Error> {
    let groups = Group::host(2, &config.with_timeout(Duration::from_secs(10)))?;
    let pools = SymmPool::world(&groups, &PoolConfig::default())?;
    let colls = Coll::world(&pools);
    let out = colls.map(|cs| cs.iter().map(Coll::check_mode).collect());
    // Closing is collective: every rank at once.
    std::thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| p.close())).collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })?;
    out
}

#[test]
fn the_environment_sets_the_default_check_mode() {
    set(None);
    assert_eq!(GroupConfig::from_env().check, CheckMode::Async);
    assert_eq!(GroupConfig::from_env(), GroupConfig::default());
    assert_eq!(
        modes(GroupConfig::default()).unwrap(),
        [CheckMode::Async; 2]
    );
    for (value, mode) in [
        ("strict", CheckMode::Strict),
        ("off", CheckMode::Off),
        (" Async ", CheckMode::Async),
        ("", CheckMode::Async),
    ] {
        set(Some(value));
        assert_eq!(GroupConfig::from_env().check, mode, "{value:?}");
        // `default()` reads no environment.
        assert_eq!(GroupConfig::default().check, CheckMode::Async, "{value:?}");
        assert_eq!(
            modes(GroupConfig::from_env()).unwrap(),
            [mode; 2],
            "{value:?}"
        );
        // Code beats the environment.
        let coded = GroupConfig::from_env().with_check(CheckMode::Off);
        assert_eq!(modes(coded).unwrap(), [CheckMode::Off; 2]);
    }
    set(Some("paranoid"));
    assert_eq!(
        modes(GroupConfig::default()).unwrap(),
        [CheckMode::Async; 2]
    );
    let err = modes(GroupConfig::from_env()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config {
                setting: "SYMMPOOL_CHECK",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.kind(), ErrorKind::Configuration);
    assert!(err.to_string().contains("paranoid"), "{err}");
    // A mode set in code makes the bad value harmless.
    let coded = GroupConfig::from_env().with_check(CheckMode::Strict);
    assert_eq!(modes(coded).unwrap(), [CheckMode::Strict; 2]);
    set(None);
}
