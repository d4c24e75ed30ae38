use super::*;

#[test]
fn defaults() {
    let c = NcclConfig::default();
    assert_eq!(c.watchdog_timeout, Duration::from_secs(600));
    assert_eq!(c.watchdog_interval, Duration::from_millis(100));
    assert_eq!(c.setup_timeout, SETUP_TIMEOUT);
    assert!(c.watchdog_enabled());
    assert!(
        c.data_blocking,
        "data communicators are blocking by default"
    );
    assert!(!c.with_data_blocking(false).data_blocking);
    assert!(!c.with_watchdog(Duration::MAX).watchdog_enabled());
}

#[test]
fn device_choice() {
    assert_eq!(pick_device(None, Some(3), 8), Ok(3));
    assert_eq!(pick_device(Some(1), Some(3), 8), Ok(1));
    // srun --gpus-per-task=1: one visible GPU per rank.
    assert_eq!(pick_device(None, Some(3), 1), Ok(0));
    assert_eq!(pick_device(None, None, 1), Ok(0));
    assert!(pick_device(None, Some(8), 8).is_err());
    assert!(pick_device(None, None, 2).is_err());
    assert!(pick_device(Some(2), None, 2).is_err());
}

#[test]
fn local_rank_from_each_launcher() {
    let vars =
        |k: &'static str, v: &'static str| move |name: &str| (name == k).then(|| v.to_string());
    assert_eq!(local_rank(&vars("LOCAL_RANK", "2")), Some(2));
    assert_eq!(local_rank(&vars("SLURM_LOCALID", " 5 ")), Some(5));
    assert_eq!(
        local_rank(&vars("OMPI_COMM_WORLD_LOCAL_RANK", "1")),
        Some(1)
    );
    assert_eq!(local_rank(&vars("LOCAL_RANK", "x")), None);
    assert_eq!(local_rank(&|_| None), None);
}
