//! The ledger's model check (`RUSTFLAGS="--cfg shuttle" cargo test --lib ledger`, in
//! `.ci/run`): the ledger built on shuttle's locks and threads (the parking_lot-like
//! shim below), two ranks on an exchange made of shuttle's locks, and shuttle's
//! scheduler trying interleavings of posts, settles (`wait_compared`, agreements) and
//! drops. A deadlock, a lost wake-up or a panic fails; shuttle's timed waits never
//! time out, so every wait must end by a notification.

use super::*;
use shuttle::sync::{Condvar as SCondvar, Mutex as SMutex, MutexGuard as SGuard};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::time::Instant;

/// `parking_lot::Mutex`'s interface over shuttle's.
pub(crate) struct Mutex<T>(SMutex<T>);
pub(crate) struct MutexGuard<'a, T>(Option<SGuard<'a, T>>);
pub(crate) struct Condvar(SCondvar);
pub(crate) struct Waited;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Mutex(SMutex::new(value))
    }
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard(Some(self.0.lock().unwrap()))
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().unwrap()
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().unwrap()
    }
}

impl Waited {
    pub(crate) fn timed_out(&self) -> bool {
        false
    }
}

impl Condvar {
    pub(crate) fn new() -> Self {
        Condvar(SCondvar::new())
    }
    pub(crate) fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
        let inner = guard.0.take().unwrap();
        guard.0 = Some(self.0.wait(inner).unwrap());
    }
    pub(crate) fn wait_until<T>(&self, guard: &mut MutexGuard<'_, T>, _at: Instant) -> Waited {
        self.wait(guard);
        Waited
    }
    pub(crate) fn notify_all(&self) {
        self.0.notify_all();
    }
}

/// Two ranks' all-gather on shuttle's locks: round *k* of a channel pairs the ranks'
/// *k*th calls; an abandoned channel's wait ends at once.
#[derive(Default)]
struct Rounds {
    posted: HashMap<(u64, usize), Vec<Option<Vec<u8>>>>,
    calls: [HashMap<u64, usize>; 2],
    abandoned: [Vec<u64>; 2],
}

#[derive(Default)]
struct Hub {
    rounds: SMutex<Rounds>,
    changed: SCondvar,
}

struct Rank(std::sync::Arc<Hub>, usize);

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}", self.1)
    }
}

impl Exchange for Rank {
    fn rank(&self) -> usize {
        self.1
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_gather(
        &self,
        c: ChannelId,
        op: &'static str,
        p: &[u8],
        _: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let (hub, me, c) = (&self.0, self.1, c.ordinal());
        let mut r = hub.rounds.lock().unwrap();
        let n = *r.calls[me].entry(c).and_modify(|n| *n += 1).or_insert(1);
        r.posted.entry((c, n)).or_insert_with(|| vec![None, None])[me] = Some(p.to_vec());
        hub.changed.notify_all();
        loop {
            if let Some(all) = r.posted[&(c, n)]
                .iter()
                .cloned()
                .collect::<Option<Vec<_>>>()
            {
                return Ok(all);
            }
            if r.abandoned[me].contains(&c) {
                return Err(Error::timeout_since(op, Instant::now(), &[]));
            }
            r = hub.changed.wait(r).unwrap();
        }
    }
    fn open_channel(&self, _: &str, _: Deadline) -> Result<ChannelId> {
        Ok(ChannelId::CONTROL)
    }
    fn abandon(&self, c: ChannelId) {
        self.0.rounds.lock().unwrap().abandoned[self.1].push(c.ordinal());
        self.0.changed.notify_all();
    }
}

fn ledger(hub: &std::sync::Arc<Hub>, rank: usize, thread: bool) -> Ledger {
    let ledger = Ledger::new(LedgerConfig {
        exchange: std::sync::Arc::new(Rank(hub.clone(), rank)),
        channel: ChannelId::CONTROL,
        timeout: Duration::MAX,
        capacity: 1,
        abandon: Box::new(|| {}),
        users: Default::default(),
    });
    if thread {
        ledger.start().unwrap();
    }
    ledger
}

/// Each rank posts `records` (rank 1's last one differs if `diverge`), one of its
/// threads waiting for the checks meanwhile, then makes an agreement and drops its
/// ledger.
fn ranks(records: u64, diverge: bool, thread: bool) {
    let hub = std::sync::Arc::new(Hub::default());
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let hub = hub.clone();
            shuttle::thread::spawn(move || {
                let ledger = std::sync::Arc::new(ledger(&hub, rank, thread));
                let waiter = {
                    let ledger = ledger.clone();
                    shuttle::thread::spawn(move || ledger.wait_compared(Deadline::never()))
                };
                let mut failed = false;
                for n in 1..=records {
                    let n = if diverge && rank == 1 && n == records {
                        99
                    } else {
                        n
                    };
                    failed |= ledger.post(step(n), Deadline::never).is_err();
                }
                let agreed = ledger.agree(agreement(), "growth", Deadline::never());
                match &agreed {
                    Err(crate::error::Error::CollectiveDivergence { .. }) => assert!(diverge),
                    other => assert!(other.is_ok() && !diverge, "{other:?}"),
                }
                if let Ok(all) = agreed {
                    assert_eq!(all.len(), 2);
                    assert!(!failed);
                }
                let _ = waiter.join().unwrap();
                drop(std::sync::Arc::into_inner(ledger).unwrap());
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn post_settle_drop_interleavings_with_the_thread() {
    shuttle::check_random(|| ranks(3, false, true), 300);
    shuttle::check_pct(|| ranks(2, true, true), 300, 3);
}

#[test]
fn post_settle_drop_interleavings_without_the_thread() {
    shuttle::check_random(|| ranks(2, false, false), 300);
    shuttle::check_pct(|| ranks(2, true, false), 300, 3);
}
