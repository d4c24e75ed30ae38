use super::*;
use std::collections::HashMap;

/// A rank-`rank` configuration of a two-rank job from `extra` variables.
fn config(rank: &str, extra: &[(&str, &str)]) -> Result<StoreConfig> {
    let vars: HashMap<&str, &str> = [
        ("RANK", rank),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1234"),
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .collect();
    StoreConfig::from_vars(&|k| vars.get(k).map(|v| v.to_string()))
}

fn variable(e: Error) -> String {
    match e {
        Error::LaunchEnv { variable, .. } => variable,
        other => panic!("{other:?}"),
    }
}

#[test]
fn store_config_reads_token_and_timeouts() {
    let vars = [
        ("SYMMPOOL_TOKEN", "s3cret"),
        ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "2500"),
    ];
    let cfg = config("1", &vars).unwrap();
    assert_eq!(cfg.token.as_deref(), Some("s3cret"));
    assert!(!cfg.host_server);
    assert_eq!(cfg.heartbeat_timeout, Duration::from_millis(2500));
    assert!(
        !format!("{cfg:?}").contains("s3cret"),
        "the token is not logged"
    );
    let mut bad = vars.to_vec();
    bad.push(("SYMMPOOL_HEARTBEAT_INTERVAL_MS", "soon"));
    let e = config("1", &bad).unwrap_err();
    assert_eq!(variable(e), "SYMMPOOL_HEARTBEAT_INTERVAL_MS");
}

#[test]
fn the_wait_warning_interval_is_30_s_unless_set_and_never_zero() {
    let plain = config("0", &[]).unwrap();
    assert_eq!(plain.wait_warning_interval, Duration::from_secs(30));
    let set = config("0", &[("SYMMPOOL_WAIT_WARNING_MS", "250")]).unwrap();
    assert_eq!(set.wait_warning_interval, Duration::from_millis(250));
    let e = config("0", &[("SYMMPOOL_WAIT_WARNING_MS", "often")]).unwrap_err();
    assert_eq!(variable(e), "SYMMPOOL_WAIT_WARNING_MS");
    let zero = config("0", &[("SYMMPOOL_WAIT_WARNING_MS", "0")]).unwrap();
    let e = crate::control::StoreServer::bind("127.0.0.1:0", &zero).unwrap_err();
    assert!(
        matches!(e, Error::InvalidConfig(ref m) if m.contains("wait_warning_interval")),
        "{e}"
    );
}

#[test]
fn the_job_identity_comes_from_the_launcher_and_symmpool_job_id_beats_it() {
    let job = |extra: &[(&str, &str)]| config("1", extra).unwrap().job_id;
    assert_eq!(job(&[]), None);
    assert_eq!(
        job(&[("TORCHELASTIC_RUN_ID", "none")]),
        None,
        "torchrun's default"
    );
    assert_eq!(
        job(&[("TORCHELASTIC_RUN_ID", "r1")]).as_deref(),
        Some("torchrun:r1/restart:0")
    );
    assert_eq!(
        job(&[
            ("TORCHELASTIC_RUN_ID", "r1"),
            ("TORCHELASTIC_RESTART_COUNT", "2")
        ])
        .as_deref(),
        Some("torchrun:r1/restart:2")
    );
    assert_eq!(
        job(&[("SLURM_JOB_ID", "77"), ("SLURM_STEP_ID", "3")]).as_deref(),
        Some("slurm:77.3")
    );
    assert_eq!(job(&[("SLURM_JOB_ID", "77")]).as_deref(), Some("slurm:77"));
    assert_eq!(
        job(&[("OMPI_MCA_ess_base_jobid", "123"), ("SLURM_JOB_ID", "77")]).as_deref(),
        Some("openmpi:123"),
        "mpirun inside a slurm allocation: the finer one"
    );
    assert_eq!(
        job(&[("PMIX_NAMESPACE", "prterun-n0-1@1")]).as_deref(),
        Some("pmix:prterun-n0-1@1")
    );
    assert_eq!(
        job(&[
            ("SYMMPOOL_JOB_ID", "mine"),
            ("TORCHELASTIC_RUN_ID", "r1"),
            ("SLURM_JOB_ID", "77")
        ])
        .as_deref(),
        Some("mine")
    );
    let c = config("1", &[("SYMMPOOL_MAX_HANDSHAKES", "8")]).unwrap();
    assert_eq!(c.max_handshakes, 8);
    for bad in ["0", "-1", "many"] {
        let e = config("1", &[("SYMMPOOL_MAX_HANDSHAKES", bad)]).unwrap_err();
        assert_eq!(variable(e), "SYMMPOOL_MAX_HANDSHAKES");
    }
}

#[test]
fn store_config_reads_the_spin_times_and_bounds_them() {
    let with = |name: &str, value: &str| config("0", &[(name, value)]);
    let spin = "SYMMPOOL_SPIN_US";
    let server = "SYMMPOOL_SERVER_SPIN_US";
    assert_eq!(with(spin, "0").unwrap().spin, Duration::ZERO);
    assert_eq!(with(spin, "0").unwrap().server_spin, None);
    assert_eq!(with(spin, "1000").unwrap().spin, StoreConfig::MAX_SPIN);
    let s = with(server, "0").unwrap();
    assert_eq!(
        (s.spin, s.server_spin),
        (Duration::from_micros(50), Some(Duration::ZERO))
    );
    assert_eq!(
        with(server, "1000").unwrap().server_spin,
        Some(StoreConfig::MAX_SPIN)
    );
    for name in [spin, server] {
        for bad in ["1001", "-1", "50us", ""] {
            assert_eq!(variable(with(name, bad).unwrap_err()), name, "{bad:?}");
        }
    }
    // Set in code past the bound: refused where the store starts.
    for (client, server) in [(3_000_000, 0), (0, 1001)] {
        let mut cfg = with(spin, "0").unwrap();
        cfg.spin = Duration::from_micros(client);
        cfg.server_spin = Some(Duration::from_micros(server));
        let e = crate::control::StoreServer::bind("127.0.0.1:0", &cfg).unwrap_err();
        assert!(
            matches!(e, Error::InvalidConfig(ref m) if m.contains("spin")),
            "{e}"
        );
    }
}

#[test]
fn with_the_store_outside_the_ranks_no_rank_hosts_it() {
    assert!(
        config("0", &[]).unwrap().host_server,
        "rank 0 hosts by default"
    );
    assert!(
        config("0", &[("SYMMPOOL_STORE_EXTERNAL", "0")])
            .unwrap()
            .host_server
    );
    for rank in ["0", "1"] {
        let cfg = config(rank, &[("SYMMPOOL_STORE_EXTERNAL", "1")]).unwrap();
        assert!(!cfg.host_server, "rank {rank}");
    }
    for bad in ["yes", "2", ""] {
        let e = config("0", &[("SYMMPOOL_STORE_EXTERNAL", bad)]).unwrap_err();
        assert_eq!(variable(e), "SYMMPOOL_STORE_EXTERNAL", "{bad:?}");
    }
}

#[test]
fn a_newcomer_reads_symmpool_join_and_never_hosts_the_store() {
    assert!(!config("1", &[]).unwrap().join, "not a newcomer by default");
    assert!(!config("1", &[("SYMMPOOL_JOIN", "0")]).unwrap().join);
    let newcomer = config("1", &[("SYMMPOOL_JOIN", "1")]).unwrap();
    assert!(newcomer.join && !newcomer.host_server);
    newcomer.check().unwrap();
    for bad in ["yes", "2", "", "true"] {
        let e = config("1", &[("SYMMPOOL_JOIN", bad)]).unwrap_err();
        assert_eq!(variable(e), "SYMMPOOL_JOIN", "{bad:?}");
    }
    // Job rank 0 anew: only with the store in a process of its own.
    let host = config("0", &[("SYMMPOOL_JOIN", "1")]).unwrap();
    match host.check() {
        Err(Error::InvalidConfig(m)) => {
            assert!(m.contains("SYMMPOOL_JOIN") && m.contains("SYMMPOOL_STORE_EXTERNAL"));
        }
        other => panic!("{other:?}"),
    }
    let e = crate::control::StoreServer::bind("127.0.0.1:0", &host).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    let external = [("SYMMPOOL_JOIN", "1"), ("SYMMPOOL_STORE_EXTERNAL", "1")];
    let zero = config("0", &external).unwrap();
    assert!(zero.join && !zero.host_server);
    zero.check().unwrap();
}
