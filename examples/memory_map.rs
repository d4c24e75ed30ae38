//! Render saved pool snapshots as an SVG memory map.
//!
//! ```text
//! cargo run --example memory_map -- SNAPSHOT.json OUT.svg
//! ```
//!
//! `SNAPSHOT.json` is one `symmpool::observe::PoolSnapshot` serialised with serde
//! (`serde_json::to_string(&pool.memory_snapshot())`), drawn with `render_svg`, or an
//! array of them (one per rank, as `fsdp_step --memory-map PATH` writes to
//! `PATH.json`), drawn side by side with `render_ranks` (the snapshots of the first
//! pool name, ordered by rank).

#[path = "support/render.rs"]
mod render;

use render::{render_ranks, render_svg};
use symmpool::observe::PoolSnapshot;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        eprintln!("usage: memory_map SNAPSHOT.json OUT.svg");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(input).unwrap_or_else(|e| {
        eprintln!("memory_map: reading {input}: {e}");
        std::process::exit(1)
    });
    let svg = match serde_json::from_str::<PoolSnapshot>(&text) {
        Ok(one) => render_svg(&one),
        Err(_) => match serde_json::from_str::<Vec<PoolSnapshot>>(&text) {
            Ok(mut many) if !many.is_empty() => {
                let pool = many[0].pool.clone();
                many.retain(|s| s.pool == pool);
                many.sort_by_key(|s| s.rank);
                if many.len() == 1 {
                    render_svg(&many[0])
                } else {
                    render_ranks(&many)
                }
            }
            Ok(_) => {
                eprintln!("memory_map: {input} holds no snapshot");
                std::process::exit(1)
            }
            Err(e) => {
                eprintln!("memory_map: {input} is neither a snapshot nor a list of them: {e}");
                std::process::exit(1)
            }
        },
    };
    if let Err(e) = std::fs::write(output, svg) {
        eprintln!("memory_map: writing {output}: {e}");
        std::process::exit(1);
    }
}
