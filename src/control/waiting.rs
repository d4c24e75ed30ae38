//! [`WaitWarnings`]: a wait on other ranks that lasts says so, naming the ranks not yet
//! arrived, at least every [`WAIT_WARNING_INTERVAL`], and once more when they arrive;
//! so that a rank that never comes is seen while the others wait for it, not only at
//! the end of a start-up timeout of minutes.

use crate::deadline::Deadline;
use std::fmt;
use std::time::{Duration, Instant};

/// How often a wait on other ranks that lasts logs a warning (`tracing`, target
/// `symmpool::control`) naming the ranks not yet arrived: the default of
/// [`StoreConfig::wait_warning_interval`](super::StoreConfig::wait_warning_interval)
/// and [`KvConfig::wait_warning_interval`](super::KvConfig::wait_warning_interval),
/// and the interval of the in-process exchanges ([`LocalExchange`](super::LocalExchange)
/// and the host backend's rendezvous).
pub const WAIT_WARNING_INTERVAL: Duration = Duration::from_secs(30);

/// The warnings of one wait on other ranks: made when the wait starts (no allocation,
/// no clock read beyond the caller's), it says when the next warning is due; the
/// waiter wakes then ([`until`](Self::until)), warns ([`warn`](Self::warn)), waits on,
/// and once the ranks arrive says so ([`arrived`](Self::arrived)) if it warned.
#[derive(Debug)]
pub(crate) struct WaitWarnings {
    op: &'static str,
    started: Instant,
    interval: Duration,
    /// When the next warning is due.
    next: Deadline,
    /// Who the last warning named (empty: no warning yet).
    named: String,
}

impl WaitWarnings {
    /// The warnings of a wait in `op` that began at `started`: the first is due
    /// `interval` after it, the next ones `interval` after each.
    pub(crate) fn new(op: &'static str, started: Instant, interval: Duration) -> Self {
        WaitWarnings {
            op,
            started,
            interval,
            next: Deadline::after_from(started, interval),
            named: String::new(),
        }
    }

    /// How long to wait before looking again: until `deadline`, or the next warning
    /// if that comes first.
    pub(crate) fn until(&self, deadline: Deadline) -> Deadline {
        deadline.min(self.next)
    }

    /// Whether a warning is due.
    pub(crate) fn due(&self) -> bool {
        self.next.expired()
    }

    /// Warn that `who` (this rank, as the log should name it) has waited in this
    /// wait's op for `missing` (the ranks not arrived, [`ranks`]), which it gives up on
    /// at `deadline`; the next warning is due one interval from now.
    pub(crate) fn warn(&mut self, who: &dyn fmt::Display, missing: String, deadline: Deadline) {
        let ends = if deadline.is_never() {
            "no deadline".to_string()
        } else {
            format!("gives up in {:.1?}", deadline.remaining())
        };
        tracing::warn!(
            target: "symmpool::control",
            "symmpool: {who} has waited {:.1?} in {} for {missing}, not arrived yet ({ends})",
            self.started.elapsed(),
            self.op,
        );
        self.named = missing;
        self.next = Deadline::after(self.interval);
    }

    /// The wait is over, everyone arrived: if it warned, say so once more.
    pub(crate) fn arrived(&self, who: &dyn fmt::Display) {
        if !self.named.is_empty() {
            tracing::warn!(
                target: "symmpool::control",
                "symmpool: {who}: {} arrived in {} after {:.1?}",
                self.named,
                self.op,
                self.started.elapsed(),
            );
        }
    }
}

/// A waiting rank as a warning names it: `rank 1`, or with where it waits, `rank 1
/// (store 10.0.0.1:29500)` (formatted only when a warning is logged).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Who<'a> {
    /// The rank.
    pub(crate) rank: usize,
    /// What it waits on (`store`), or empty.
    pub(crate) on: &'static str,
    /// Which one (an address, a key prefix).
    pub(crate) at: &'a str,
}

impl fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.rank)?;
        if !self.on.is_empty() {
            write!(f, " ({} {})", self.on, self.at)?;
        }
        Ok(())
    }
}

/// `missing` ranks as a warning names them: `rank 2`, `ranks 1, 2` (none known: `the
/// other ranks`).
pub(crate) fn ranks(missing: &[usize]) -> String {
    match missing {
        [] => "the other ranks".into(),
        [one] => format!("rank {one}"),
        many => {
            let list: Vec<String> = many.iter().map(usize::to_string).collect();
            format!("ranks {}", list.join(", "))
        }
    }
}

/// Capturing the warnings in tests: one global subscriber for the test binary, which
/// keeps the message of every warning (and error).
#[cfg(test)]
pub(crate) mod capture {
    use parking_lot::{Condvar, Mutex};
    use std::sync::Once;
    use std::time::Duration;
    use tracing_subscriber::filter::LevelFilter;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::{Layer, Registry};

    static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static MORE: Condvar = Condvar::new();

    struct Keep;

    struct Message(String);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Keep {
        fn on_event(&self, e: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut m = Message(String::new());
            e.record(&mut m);
            LINES.lock().push(m.0);
            MORE.notify_all();
        }
    }

    /// Start capturing (once per test binary).
    pub(crate) fn install() {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            tracing::subscriber::set_global_default(
                Registry::default().with(LevelFilter::WARN).with(Keep),
            )
            .expect("the only global subscriber of the unit tests");
        });
    }

    /// The warnings so far that contain `marker`.
    pub(crate) fn lines(marker: &str) -> Vec<String> {
        (LINES.lock().iter())
            .filter(|l| l.contains(marker))
            .cloned()
            .collect()
    }

    /// Wait (up to `timeout`) until `n` warnings contain every one of `words`.
    ///
    /// # Panics
    /// If they do not come in time.
    pub(crate) fn wait_for(words: &[&str], n: usize, timeout: Duration) {
        let deadline = crate::Deadline::after(timeout);
        let mut lines = LINES.lock();
        loop {
            let seen = (lines.iter())
                .filter(|l| words.iter().all(|w| l.contains(w)))
                .count();
            if seen >= n {
                return;
            }
            assert!(
                !deadline.expired(),
                "no {n} warnings with {words:?} in {timeout:?}: {lines:?}"
            );
            MORE.wait_until(&mut lines, deadline.instant());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::control::Rendezvous;
    use std::thread;

    /// Every warning of `rank` about the op `op` comes before the one that says the
    /// others arrived, and that one comes (once).
    pub(crate) fn warned_then_arrived(op: &str, who: &str, late: &str) {
        let lines = capture::lines(op);
        let mine: Vec<&String> = (lines.iter())
            .filter(|l| l.contains(&format!("{who} has waited")) || l.contains(&format!("{who}: ")))
            .collect();
        let arrived = (mine.iter())
            .position(|l| l.contains(&format!("{late} arrived in {op} after")))
            .unwrap_or_else(|| panic!("{who}: no arrival: {mine:#?}"));
        assert_eq!(
            arrived,
            mine.len() - 1,
            "{who} warned after the arrival: {mine:#?}"
        );
        assert!(arrived >= 2, "{who}: fewer than two warnings: {mine:#?}");
        for l in &mine[..arrived] {
            assert!(
                l.contains(&format!("for {late}, not arrived yet")),
                "{who}: {l}"
            );
        }
    }

    #[test]
    fn a_late_rank_is_named_while_the_others_wait_and_once_more_when_it_comes() {
        capture::install();
        let op = "late-rank rendezvous";
        let rv = Rendezvous::new(3).with_wait_warning_interval(Duration::from_millis(20));
        let deadline = Deadline::after(Duration::from_secs(60));
        thread::scope(|s| {
            let early: Vec<_> = (0..2)
                .map(|rank| {
                    let rv = &rv;
                    s.spawn(move || rv.gather(op, rank, 1u64, rank, deadline))
                })
                .collect();
            // Each waiting rank names rank 2 at least twice before it comes.
            for rank in 0..2 {
                let who = format!("rank {rank} has waited");
                capture::wait_for(&[op, &who, "for rank 2,"], 2, Duration::from_secs(60));
            }
            assert_eq!(rv.gather(op, 2, 1u64, 2, deadline).unwrap(), vec![0, 1, 2]);
            for h in early {
                assert_eq!(h.join().unwrap().unwrap(), vec![0, 1, 2]);
            }
        });
        for rank in 0..2 {
            warned_then_arrived(op, &format!("rank {rank}"), "rank 2");
        }
        // Rank 2 never waited: it said nothing.
        assert!(
            capture::lines(op)
                .iter()
                .all(|l| !l.contains("rank 2 has waited")),
            "{:#?}",
            capture::lines(op)
        );
    }

    #[test]
    fn ranks_are_named_in_words() {
        assert_eq!(ranks(&[2]), "rank 2");
        assert_eq!(ranks(&[0, 3]), "ranks 0, 3");
        assert_eq!(ranks(&[]), "the other ranks");
        let at = |on, at| Who { rank: 1, on, at }.to_string();
        assert_eq!(at("", ""), "rank 1");
        assert_eq!(
            at("store", "10.0.0.1:29500"),
            "rank 1 (store 10.0.0.1:29500)"
        );
    }
}
