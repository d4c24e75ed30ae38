//! [`Mailbox`]: a round's result on its way to the store server's thread of a rank.

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A round's result on its way to the connection thread of a rank that contributed
/// and is polling for the result (so that the results of a round are written in
/// parallel, each by its rank's own thread, not one after another).
///
/// Lock order in the server: its state, then a writer, then a slot (a slot's lock is
/// never held while another lock is taken).
#[derive(Default)]
pub(super) struct Mailbox {
    slot: Mutex<Slot>,
    /// Set with the slot's `Delivered`: what the polling thread watches.
    delivered: AtomicBool,
}

#[derive(Default)]
enum Slot {
    /// The rank's thread is not polling: results are written to it directly.
    #[default]
    Idle,
    /// The rank's thread is polling for the result of a round it contributed to.
    Waiting,
    /// That result, for the thread to write.
    Delivered(Arc<Vec<u8>>),
}

impl Mailbox {
    /// The slot at the start of a new round of the rank's own thread: idle, since
    /// every result put in it was written before the thread read its next frame.
    fn idle_slot(&self) -> MutexGuard<'_, Slot> {
        let slot = self.slot.lock();
        debug_assert!(
            matches!(*slot, Slot::Idle),
            "a mailbox not idle at a new round"
        );
        slot
    }

    /// Put `frame` in the (locked) slot and tell a polling thread.
    fn fill(&self, slot: &mut Slot, frame: Arc<Vec<u8>>) {
        *slot = Slot::Delivered(frame);
        self.delivered.store(true, Ordering::Release);
    }

    /// The rank's own thread starts polling for a round's result.
    pub(super) fn start_waiting(&self) {
        *self.idle_slot() = Slot::Waiting;
    }

    /// The rank's own thread, the round's last contributor, leaves its own copy of
    /// the result for the thread to write after the lock is released.
    pub(super) fn put_own(&self, frame: Arc<Vec<u8>>) {
        self.fill(&mut self.idle_slot(), frame);
    }

    /// The rank's own thread stops polling: from now on the last contributor writes
    /// the result to it directly (a result already delivered stays).
    pub(super) fn stop_waiting(&self) {
        let mut slot = self.slot.lock();
        if matches!(*slot, Slot::Waiting) {
            *slot = Slot::Idle;
        }
    }

    /// Whether a result waits in the slot (what the polling thread watches).
    pub(super) fn is_delivered(&self) -> bool {
        self.delivered.load(Ordering::Acquire)
    }

    /// Hand `frame` over if the thread is waiting for it; `false`: it is not.
    pub(super) fn hand_over(&self, frame: &Arc<Vec<u8>>) -> bool {
        let mut slot = self.slot.lock();
        let waiting = matches!(*slot, Slot::Waiting);
        if waiting {
            self.fill(&mut slot, frame.clone());
        }
        waiting
    }

    /// Take a delivered frame, if any (a waiting or idle slot stays as it is).
    pub(super) fn take_delivered(&self) -> Option<Arc<Vec<u8>>> {
        let mut slot = self.slot.lock();
        match std::mem::take(&mut *slot) {
            Slot::Delivered(frame) => {
                self.delivered.store(false, Ordering::Relaxed);
                Some(frame)
            }
            other => {
                *slot = other;
                None
            }
        }
    }
}
