//! Latency of one all-gather round of 64-byte payloads among 8 processes over the
//! crate's TCP store on loopback.
//!
//! The bench re-executes itself as the 8 ranks (`STORE_BENCH_CHILD` set); this parent
//! process hosts the store server, as rank 0's process would. Every rank times each
//! round (from its call until its result arrives) and reports p50 / p99 / max.
//!
//! `cargo bench --bench store_round` (env `STORE_BENCH_ROUNDS`, default 5000,
//! `STORE_BENCH_WORLD`, default 8, and the store's `SYMMPOOL_*` settings, such as
//! `SYMMPOOL_SPIN_US` and `SYMMPOOL_SERVER_SPIN_US`, the ranks' and the server's
//! polling times). Without `--bench` (as `cargo test --all-targets`
//! runs it) it does a 100-round smoke run.

#![allow(missing_docs)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use symmpool::Deadline;
use symmpool::control::{Exchange, StoreConfig, StoreExchange, StoreServer};

#[path = "common/quiet.rs"]
mod quiet;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The store's configuration as a launched rank reads it (`StoreConfig::from_vars`,
/// so the `SYMMPOOL_*` settings are read and bounded as in a job), with this bench's
/// rank, world size and loopback port.
fn config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let launch = |k: &str| match k {
        "RANK" => Some(rank.to_string()),
        "WORLD_SIZE" => Some(world.to_string()),
        "MASTER_ADDR" => Some("127.0.0.1".to_string()),
        "SYMMPOOL_STORE_PORT" => Some(port.to_string()),
        _ => std::env::var(k).ok(),
    };
    let mut c = StoreConfig::from_vars(&launch).unwrap_or_else(|e| {
        eprintln!("store_round: {e}");
        std::process::exit(2)
    });
    c.host_server = false;
    c.startup_timeout = Duration::from_secs(60);
    c
}

fn child() {
    let rank = env_or("STORE_BENCH_RANK", 0);
    let world = env_or("STORE_BENCH_WORLD", 8);
    let port = env_or("STORE_BENCH_PORT", 0) as u16;
    let rounds = env_or("STORE_BENCH_ROUNDS", 5000);
    let ex = StoreExchange::connect(config(rank, world, port)).unwrap();
    let ch = ex
        .open_channel("bench", Deadline::after(Duration::from_secs(60)))
        .unwrap();
    let payload = [rank as u8; 64];
    let timeout = Duration::from_secs(60);
    for _ in 0..rounds / 10 {
        ex.all_gather(ch, "bench warm-up", &payload, Deadline::after(timeout))
            .unwrap();
    }
    let mut lat = Vec::with_capacity(rounds);
    let all = Instant::now();
    for _ in 0..rounds {
        let t = Instant::now();
        let out = ex
            .all_gather(ch, "bench round", &payload, Deadline::after(timeout))
            .unwrap();
        lat.push(t.elapsed());
        assert_eq!(out.len(), world);
    }
    let total = all.elapsed();
    lat.sort();
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "@@ rank {rank}: p50 {:>7.1} us  p99 {:>7.1} us  max {:>8.1} us  ({:.0} rounds/s)",
        q(0.50).as_secs_f64() * 1e6,
        q(0.99).as_secs_f64() * 1e6,
        lat[lat.len() - 1].as_secs_f64() * 1e6,
        rounds as f64 / total.as_secs_f64(),
    );
}

struct Kill(Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn main() {
    if std::env::var_os("STORE_BENCH_CHILD").is_some() {
        child();
        return;
    }
    // Under `cargo test --all-targets`: the smoke run below, its output shown only on
    // failure (see `common/quiet.rs`).
    quiet::in_test_mode();
    let world = env_or("STORE_BENCH_WORLD", 8);
    // `cargo test --all-targets` runs this without `--bench`: a short smoke run then.
    let measuring = std::env::args().any(|a| a == "--bench");
    let rounds = env_or("STORE_BENCH_ROUNDS", if measuring { 5000 } else { 100 });
    let server_config = config(0, world, 0);
    let server = StoreServer::bind("127.0.0.1:0", &server_config).unwrap();
    let port = server.local_addr().port();
    let exe = std::env::current_exe().unwrap();
    let mut kids = Kill(Vec::new());
    for rank in 0..world {
        kids.0.push(
            Command::new(&exe)
                .env("STORE_BENCH_CHILD", "1")
                .env("STORE_BENCH_RANK", rank.to_string())
                .env("STORE_BENCH_WORLD", world.to_string())
                .env("STORE_BENCH_PORT", port.to_string())
                .env("STORE_BENCH_ROUNDS", rounds.to_string())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
    }
    println!(
        "store_round: {world} processes, 64-byte payloads, {rounds} timed rounds, {} CPUs, spin {:?}, server spin {:?} (None: by the number of cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        server_config.spin,
        server_config.server_spin,
    );
    let mut lines = Vec::new();
    for k in &mut kids.0 {
        let out = k.stdout.take().unwrap();
        for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Some(rest) = l.strip_prefix("@@ ") {
                lines.push(rest.to_string());
            }
        }
        assert!(k.wait().unwrap().success());
    }
    for l in &lines {
        println!("  {l}");
    }
    println!("server: {:?}", server.stats());
}
