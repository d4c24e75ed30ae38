//! The rendezvous store in a process of its own, as a launcher's agent would host it,
//! so that no rank hosts it and any rank, rank 0 included, can be lost while the
//! survivors shrink and go on.
//!
//! ```text
//! export MASTER_ADDR=$(hostname) SYMMPOOL_STORE_PORT=29511 SYMMPOOL_JOB_ID=job-$RANDOM
//! cargo run --release --example store -- --world-size 8 &   # ranks' settings, as rank 0
//! SYMMPOOL_STORE_EXTERNAL=1 torchrun --nproc-per-node 8 train.py   # no rank hosts it
//! ```
//!
//! It reads the settings a rank reads (`SYMMPOOL_STORE_PORT` or `MASTER_PORT`,
//! `SYMMPOOL_TOKEN`, the job identity, the heartbeat settings; see
//! `symmpool::control::StoreServer::bind_from_env`), serves the job, and exits 0 once
//! every rank has joined and left (ended or lost), 1 at `--timeout-s`, when not every
//! rank joined within the ranks' start-up timeout, or on a bad setting. From Python:
//! `python -m symmpool.store --world-size 8`.

use clap::Parser;
use std::time::Duration;
use symmpool::Deadline;
use symmpool::control::{JobEnd, StoreServer};

/// The rendezvous store of one job, in a process of its own.
#[derive(Parser)]
struct Args {
    /// How many ranks the job has (at least 1).
    #[arg(long)]
    world_size: std::num::NonZeroUsize,
    /// The address to listen on (default: every interface).
    #[arg(long, default_value = "0.0.0.0")]
    bind: String,
    /// Exit with status 1 if the job has not ended after this many seconds.
    #[arg(long, default_value_t = 7 * 24 * 3600)]
    timeout_s: u64,
}

fn main() {
    // The store's refusals (another job, a wrong token) and losses, at INFO by default.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let served = StoreServer::bind_from_env(args.world_size.get(), &args.bind);
    let server = served.unwrap_or_else(|e| {
        eprintln!("store: {e:?}");
        std::process::exit(1)
    });
    println!(
        "store: listening on {} for {} ranks",
        server.local_addr(),
        args.world_size
    );
    match server.wait_until_done(Deadline::after(Duration::from_secs(args.timeout_s))) {
        JobEnd::Ended => {}
        JobEnd::NotAssembled => {
            eprintln!("store: not every rank joined within the start-up timeout");
            std::process::exit(1);
        }
        _ => {
            eprintln!("store: the job had not ended after {} s", args.timeout_s);
            std::process::exit(1);
        }
    }
    let stats = server.stats();
    println!(
        "store: the job ended ({} ranks departed, {} rounds)",
        stats.ranks_departed, stats.rounds_completed
    );
}
