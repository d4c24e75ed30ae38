//! Joining a shared-memory job from a child process (rank 0 hosts the store), and the
//! state of `/dev/shm` to check that a job left nothing behind.

use std::sync::Arc;
use symmpool::backend::{ShmBackend, ShmConfig};
use symmpool::control::{StoreConfig, StoreExchange, StoreServer};

/// Join the job from the launcher's environment: rank 0 hosts the store (and prints
/// its port as `@@port`), everyone connects; the rank, the world size and the
/// rank's shared-memory backend (its collectives wait until their pool's deadline).
///
/// # Errors
/// The store's and the backend's.
pub fn join() -> symmpool::Result<(usize, usize, symmpool::Backend)> {
    // Rank 0 hosts the store on a free port it prints, unless the store runs outside
    // the ranks (`SYMMPOOL_STORE_EXTERNAL=1`, at `MASTER_PORT`).
    let cfg = StoreConfig::from_env()?;
    let rank = cfg.launch.rank;
    let world = cfg.launch.world_size;
    let ex = if cfg.host_server {
        let server = StoreServer::bind("127.0.0.1:0", &cfg)?;
        println!("@@port {}", server.local_addr().port());
        StoreExchange::connect_hosting(cfg, server)?
    } else {
        StoreExchange::connect(cfg)?
    };
    let backend = ShmBackend::join(Arc::new(ex), ShmConfig::default())?;
    Ok((rank, world, backend))
}

/// The entries of `/dev/shm`, sorted.
pub fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            let mut v: Vec<String> = d
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        })
        .unwrap_or_default()
}
