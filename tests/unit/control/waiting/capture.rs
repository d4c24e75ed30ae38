//! Capturing the warnings in tests: one global subscriber for the test binary, which
//! keeps the message of every warning (and error).

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
