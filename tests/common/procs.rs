//! Multi-process jobs for tests: the test binary re-executes itself as every rank
//! (running one test function, chosen by name, with torchrun-style variables on
//! 127.0.0.1), reads their `@@`-prefixed lines, and kills and reaps every child on
//! every path.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Set in a child: run the child role.
pub const CHILD: &str = "SYMMPOOL_TEST_CHILD";

/// A job of child processes, killed and reaped on every path.
pub struct Job {
    /// The test function the children run (by `--exact` name).
    entry: &'static str,
    /// The children, by rank.
    pub children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    tx: mpsc::Sender<(usize, String)>,
    /// Lines read and not yet consumed.
    pub seen: Vec<(usize, String)>,
    /// The threads reading each child's output, by rank (they end at its end).
    readers: Vec<Vec<thread::JoinHandle<()>>>,
    /// The store port rank 0 reported.
    pub port: u16,
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub const HEARTBEAT_MS: u64 = 200;
pub const HEARTBEAT_TIMEOUT_MS: u64 = 1000;

impl Job {
    /// Start rank 0 (which reports its port), then the others; `env(rank)` adds
    /// variables.
    pub fn start(
        entry: &'static str,
        world: usize,
        env: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Job {
        let (tx, lines) = mpsc::channel();
        let mut job = Job {
            entry,
            children: Vec::new(),
            lines,
            tx,
            seen: Vec::new(),
            readers: Vec::new(),
            port: 0,
        };
        job.spawn(0, world, &env(0));
        let port = job.expect(0, "@@port ", Duration::from_secs(30));
        job.port = port.trim().parse().unwrap();
        for rank in 1..world {
            job.spawn(rank, world, &env(rank));
        }
        job
    }

    /// Start every rank at once on a free port chosen here (for children that bind
    /// `MASTER_PORT` themselves, as a launcher's ranks do).
    pub fn start_on_free_port(
        entry: &'static str,
        world: usize,
        env: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Job {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        Job::start_on_port(entry, world, port, env)
    }

    /// Start every rank at once, their store at `port` (a store of the test's own, or
    /// one the children bind).
    pub fn start_on_port(
        entry: &'static str,
        world: usize,
        port: u16,
        env: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Job {
        let (tx, lines) = mpsc::channel();
        let mut job = Job {
            entry,
            children: Vec::new(),
            lines,
            tx,
            seen: Vec::new(),
            readers: Vec::new(),
            port,
        };
        for rank in 0..world {
            job.spawn(rank, world, &env(rank));
        }
        job
    }

    /// Start a child as `rank` of `world`; its lines and its exit are this job's
    /// child number `self.children.len()` (the rank, for the ranks a job starts with).
    pub fn spawn(&mut self, rank: usize, world: usize, extra: &[(&'static str, String)]) {
        let slot = self.children.len();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", self.entry, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string())
            .env("SYMMPOOL_TOKEN", "job-token")
            .env("SYMMPOOL_HEARTBEAT_INTERVAL_MS", HEARTBEAT_MS.to_string())
            .env(
                "SYMMPOOL_HEARTBEAT_TIMEOUT_MS",
                HEARTBEAT_TIMEOUT_MS.to_string(),
            )
            .env("SYMMPOOL_HANDSHAKE_TIMEOUT_MS", "2000")
            .env("SYMMPOOL_STARTUP_TIMEOUT_MS", "60000")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut readers = Vec::new();
        // A child's standard error is kept, marked, to explain a failure.
        if let Some(err) = child.stderr.take() {
            let tx = self.tx.clone();
            readers.push(thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((slot, format!("stderr: {line}")));
                }
            }));
        }
        let out = child.stdout.take().unwrap();
        let tx = self.tx.clone();
        readers.push(thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                // libtest prints "test child_process_entry ... " before the first line.
                // Lines with a `@@` marker are kept from the marker on; others whole.
                let kept = match line.find("@@") {
                    Some(at) => line[at..].to_string(),
                    None => line,
                };
                let _ = tx.send((slot, kept));
            }
        }));
        self.children.push(child);
        self.readers.push(readers);
    }

    /// The rest of `rank`'s first line starting with `prefix`, waiting up to `timeout`.
    pub fn expect(&mut self, rank: usize, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self
                .seen
                .iter()
                .position(|(r, l)| *r == rank && l.starts_with(prefix))
            {
                return self.seen.remove(i).1[prefix.len()..].to_string();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "rank {rank} did not print {prefix:?} within {timeout:?}; seen {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Wait for the given ranks to exit and for all they printed to be read (the
    /// readers end at the end of their output, which may come after the exit is seen);
    /// their exit codes.
    pub fn wait(&mut self, ranks: &[usize], timeout: Duration) -> Vec<i32> {
        let deadline = Instant::now() + timeout;
        let mut codes: HashMap<usize, i32> = HashMap::new();
        let read =
            |job: &Self| (ranks.iter()).all(|&r| job.readers[r].iter().all(|h| h.is_finished()));
        while codes.len() < ranks.len() || !read(self) {
            for &r in ranks {
                if let std::collections::hash_map::Entry::Vacant(e) = codes.entry(r)
                    && let Some(st) = self.children[r].try_wait().unwrap()
                {
                    e.insert(st.code().unwrap_or(-1));
                }
            }
            // Lines read meanwhile are kept, to explain a failure.
            self.seen.extend(self.lines.try_iter());
            assert!(
                Instant::now() < deadline,
                "ranks {ranks:?} did not all exit and end their output within {timeout:?} (exited: {codes:?})"
            );
            thread::sleep(Duration::from_millis(10));
        }
        self.seen.extend(self.lines.try_iter());
        ranks.iter().map(|r| codes[r]).collect()
    }
}
