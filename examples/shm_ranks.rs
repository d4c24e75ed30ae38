//! One process per rank without a GPU: the shared-memory backend under a launcher.
//!
//! ```text
//! cargo run --example shm_ranks                 # starts 4 rank processes itself
//! torchrun --nproc-per-node 4 --no-python target/debug/examples/shm_ranks
//! ```
//! Each rank joins the crate's store (rank, world size and address from torchrun's,
//! slurm's or Open MPI's variables), maps its peers' segments in shared memory, makes
//! a pool and all-gathers its shard into every rank's buffer.

use std::process::Command;
use std::sync::Arc;
use symmpool::{
    Coll, CollectiveCalls, ErrorKind, PoolConfig, ShmBackend, ShmConfig, StoreExchange, Stream,
};
use symmpool::{Group, GroupConfig, ReduceOp, SymmPool};

/// Started without a launcher: run `world` copies of this program as the ranks.
fn launch(world: usize) -> std::io::Result<bool> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let children = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe()?)
                .envs(
                    [("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)]
                        .map(|(k, v)| (k, v.to_string())),
                )
                .envs([
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.to_string()),
                ])
                .spawn()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut ok = true;
    for mut child in children {
        ok &= child.wait()?.success();
    }
    Ok(ok)
}

fn rank_main() -> symmpool::Result<()> {
    let exchange = Arc::new(StoreExchange::from_env()?);
    let backend = ShmBackend::join(exchange, ShmConfig::default())?;
    // The group: this rank's communicators, checked as `SYMMPOOL_CHECK` says (async by
    // default). Making it and the pool is collective: every rank, in the same order.
    let group = Group::new(backend, GroupConfig::from_env())?;
    let pool = SymmPool::new(&group, PoolConfig::default())?;
    let coll = Coll::new(&pool)?;
    let (rank, world, n) = (pool.rank(), pool.world_size(), 1 << 16);
    let stream = Stream::host();
    // FSDP style: this rank's shard sits inside the gathered buffer.
    let params = pool.alloc((world * n * 4) as u64, &stream)?;
    let mine = params.view::<f32>()?.slice(rank * n, n)?;
    mine.copy_from_host(&vec![rank as f32; n])?;
    // Each collective carries its identity (a tag), so that ranks making different
    // calls of the same shape fail at that call.
    coll.tagged(1)
        .all_gather_in_place::<f32>(&params, &stream)?;
    let all = params.read::<f32>()?;
    assert!((0..world).all(|r| all[r * n] == r as f32 && all[r * n + n - 1] == r as f32));
    // And back: every rank's sum of the gathered buffers, scattered.
    (coll.tagged(2)).reduce_scatter_in_place::<f32>(&params, ReduceOp::Sum, &stream)?;
    assert_eq!(params.read::<f32>()?[rank * n], (world * rank) as f32);
    coll.end_step()?; // the end of a step: the ranks compare how many calls each made
    println!("rank {rank}/{world}: gathered and reduced through the peers' shared memory");
    drop((params, coll));
    pool.close()
}

fn main() {
    if std::env::var_os("RANK").is_none() {
        let ok = launch(4).unwrap_or_else(|e| panic!("starting the ranks: {e}"));
        std::process::exit(i32::from(!ok));
    }
    if let Err(e) = rank_main() {
        eprintln!("shm_ranks: {e}");
        let configuration = e.kind() == ErrorKind::Configuration;
        std::process::exit(if configuration { 78 } else { 1 });
    }
}
