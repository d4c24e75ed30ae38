use super::*;
use crate::control::LocalExchange;
use crate::group::agree::{Note, Op};
use crate::group::history::History;
use std::sync::mpsc;
use std::time::Instant;

/// Rank 0's ledger of a two-rank local exchange (rank 1's exchange is returned, alive
/// and silent), checked with `timeout`.
fn rank0(timeout: Duration) -> (Ledger, Arc<dyn Exchange>, LocalExchange) {
    let mut ranks = LocalExchange::group(2).into_iter();
    let exchange: Arc<dyn Exchange> = Arc::new(ranks.next().unwrap());
    let ledger = Ledger::new(LedgerConfig {
        exchange: Arc::clone(&exchange),
        channel: ChannelId::CONTROL,
        timeout,
        capacity: 8,
        abandon: Box::new(|| {}),
        users: Default::default(),
    });
    (ledger, exchange, ranks.next().unwrap())
}

fn step(n: u64) -> Entry {
    Entry::Collective(CollectiveRecord::step(0, n, (0, n), (n, n)))
}

fn agreement() -> AgreementRecord {
    AgreementRecord::new(&History::new(4), (0, Op::Grow), 1, 0, Note::Live(0), false)
}

#[test]
fn a_failed_agreement_round_that_carried_collective_records_breaks_with_its_cause() {
    // Bug 5: the round of an agreement carries this rank's collective records posted
    // before it; when it fails, their checks are lost, so the ledger breaks with the
    // round's cause (not "made no progress" 2 T later).
    let (ledger, _exchange, _silent) = rank0(Duration::from_secs(5));
    ledger.post(step(1), Deadline::never).unwrap();
    let started = Instant::now();
    let e = ledger
        .agree(
            agreement(),
            "growth",
            Deadline::after(Duration::from_millis(100)),
        )
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { op: "growth", .. }), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    match ledger.check() {
        Err(Error::PoolBroken { reason }) => {
            assert!(
                reason.contains("growth failed") && reason.contains("timed out"),
                "{reason}"
            )
        }
        other => panic!("the ledger should be broken by the round's failure: {other:?}"),
    }
}

#[test]
fn a_failed_agreement_round_alone_fails_only_its_call() {
    let (ledger, _exchange, _silent) = rank0(Duration::from_secs(5));
    let deadline = Deadline::after(Duration::from_millis(100));
    let e = ledger.agree(agreement(), "growth", deadline).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(ledger.check().is_ok());
}

#[test]
fn dropping_a_ledger_whose_thread_waits_forever_ends_the_thread() {
    // Bug 6: timeout `Duration::MAX`, rank 0's thread in a round that rank 1 never
    // joins. The drop abandons the round and joins the thread: the thread's handle on
    // the exchange is gone when the drop returns.
    let (ledger, exchange, _silent) = rank0(Duration::MAX);
    ledger.start().unwrap();
    ledger.post(step(1), Deadline::never).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(ledger);
        let _ = tx.send(());
    });
    rx.recv_timeout(DROP_WAIT * 2 + Duration::from_secs(10))
        .expect("the ledger's drop returns within a bounded time");
    assert_eq!(
        Arc::strong_count(&exchange),
        1,
        "the ledger's thread has ended and let go of the exchange"
    );
}

#[cfg(shuttle)]
#[path = "ledger_model.rs"]
pub(super) mod model;
