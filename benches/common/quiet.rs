//! Quiet test mode for the bench binaries.
//!
//! `cargo test --all-targets` (the README's test command) runs every bench binary too,
//! without `--bench`: criterion's test mode then runs each benchmark once and prints
//! `Testing ..` / `Success` lines, and the other benches print their tables. Cargo has
//! no switch that keeps a bench out of `cargo test --all-targets` but in
//! `cargo clippy --all-targets` (`test = false` does not: `--all-targets` picks benches
//! by their `bench` flag), so the bench stays a smoke test and keeps quiet instead:
//! [`in_test_mode`] re-runs the binary with its output captured and shows that output
//! only when the run fails. `cargo bench` (which passes `--bench`) is unaffected, and
//! `SYMMPOOL_BENCH_VERBOSE=1` shows the test-mode output.

use std::io::Write;
use std::process::Command;

const CHILD: &str = "SYMMPOOL_BENCH_QUIET_CHILD";

/// Call first in `main`. In test mode (no `--bench`) this runs the binary again with
/// its output captured and exits with its status, printing the output only on failure;
/// otherwise (benchmarking, the captured child, or `SYMMPOOL_BENCH_VERBOSE` set) it
/// returns and `main` goes on.
pub fn in_test_mode() {
    if std::env::args().any(|a| a == "--bench")
        || std::env::var_os(CHILD).is_some()
        || std::env::var_os("SYMMPOOL_BENCH_VERBOSE").is_some()
    {
        return;
    }
    let exe = std::env::current_exe().expect("the bench's own path");
    let out = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(CHILD, "1")
        .output()
        .expect("re-running the bench in test mode");
    if !out.status.success() {
        let _ = std::io::stdout().write_all(&out.stdout);
        let _ = std::io::stderr().write_all(&out.stderr);
        eprintln!("bench test mode failed: {}", out.status);
        std::process::exit(out.status.code().unwrap_or(101));
    }
    std::process::exit(0);
}
