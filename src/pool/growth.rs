//! Growth: agree, allocate a segment on every rank, confirm, agree on the backend's
//! registration order, register it on every communicator that registers (each
//! registration followed by an outcome round, so that a failure on any rank undoes
//! the growth on every rank), add it to the core. (`reserve` and `fit_to_peak`, in
//! fit.rs, add their segments through `add_segment`.)

use super::state::{PoolState, SegmentEntry};
use super::{MemoryAction, SymmPool};
use crate::core::{AllocError, Allocator, Growth, SegmentId, SizeClass};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{self, AgreementRecord, Note, Op, READY, Readiness, Registered};
use std::sync::Arc;
use std::time::Instant;

impl SymmPool {
    /// Grow by one segment: agree, allocate, confirm, register, add to the core; every
    /// wait on the peers until `deadline`. In a `growth` span that records its
    /// duration.
    pub(super) fn grow_segment(
        &self,
        st: &mut PoolState,
        growth: Growth,
        deadline: Deadline,
    ) -> Result<SegmentId> {
        let span = tracing::info_span!(target: "symmpool::pool", "growth", rank = self.rank(),
            pool = %self.inner.config.name, class = ?growth.class,
            segment_bytes = growth.segment_bytes, seconds = tracing::field::Empty);
        let _entered = span.enter();
        let started = Instant::now();
        let out = self.shared_use(|| {
            // The agreement is a record of the ledger: a rank that grows where its
            // peers make a collective is named there, within the round.
            self.agree_ready(st, Op::Grow, growth.segment_bytes, true, READY, deadline)?;
            self.add_segment(st, growth, Allocator::add_segment, deadline)
        });
        span.record("seconds", started.elapsed().as_secs_f64());
        out
    }

    /// Run the collective pool operation `f`, noting this thread as the pool's user of
    /// the backend's communicators. A failure of the kind that communicators shared
    /// with pools used from other threads cause (a wait that timed out, registrations
    /// out of order, the pools' agreements paired across pools in their shared
    /// ledger) becomes [`Error::SharedCommunicators`] naming those pools.
    pub(super) fn shared_use<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let group = &self.inner.group;
        let (pool, name) = (self.inner.channel.ordinal(), &self.inner.config.name);
        group.note_user(pool, name, true);
        f().map_err(|error| {
            let others = match error {
                Error::Timeout { .. }
                | Error::GroupBroken { .. }
                | Error::RegistrationOrder { .. }
                | Error::RegistrationMismatch { .. }
                | Error::RegistrationBroken { .. }
                | Error::Divergence(_)
                | Error::CollectiveDivergence(_) => group.users_on_other_threads(pool),
                _ => Vec::new(),
            };
            if others.is_empty() {
                return error;
            }
            Error::SharedCommunicators {
                pools: std::iter::once(name.clone()).chain(others).collect(),
                error: Box::new(error),
            }
        })
    }

    /// Add one segment of `growth` after the ranks agreed on it: provide it
    /// ([`provide_segment`](Self::provide_segment)), hand it to the core with `how`
    /// ([`Allocator::add_segment`] for the request at hand, whose growth policy decides
    /// whether it is dedicated to it; [`Allocator::add_planned`] for one reserved ahead
    /// by `reserve` or `fit_to_peak`) and account for it. The one way a segment enters
    /// a pool; on failure nothing is left.
    pub(super) fn add_segment(
        &self,
        st: &mut PoolState,
        growth: Growth,
        how: fn(&mut Allocator, Growth) -> std::result::Result<SegmentId, AllocError>,
        deadline: Deadline,
    ) -> Result<SegmentId> {
        let id = st.core.next_segment_id();
        let entry = self.provide_segment(st, growth.segment_bytes, deadline)?;
        match how(&mut st.core, growth) {
            Ok(got) if got == id => {
                // Accounted for and reported (its departure is, in `release.rs`).
                let bytes = entry.segment.size_bytes();
                let windows = entry.windows.iter().flatten().count();
                let address = entry.segment.device_ptr();
                st.segments.insert(id, Arc::new(entry));
                st.counters.reserved_bytes_total += bytes;
                if let Some(h) = st.memory_history.as_deref_mut() {
                    h.segment(MemoryAction::SegmentAlloc, id, address, bytes);
                }
                let class = match growth.class {
                    SizeClass::Small => "small",
                    SizeClass::Large => "large",
                };
                tracing::info!(target: "symmpool::pool", rank = self.rank(),
                    pool = %self.config().name, segment = id.0, class, segment_bytes = bytes,
                    windows, reserved_bytes = st.core.stats().reserved_bytes.current,
                    "segment allocated");
                Ok(id)
            }
            Ok(got) => {
                let what = format!(
                    "the core numbered a new segment {} instead of {}",
                    got.0, id.0
                );
                Err(st.broken_by(what))
            }
            Err(e) => {
                self.undo_segment(st, entry, deadline);
                Err(e.into())
            }
        }
    }

    /// This rank's readiness for a collective pool operation that may register memory:
    /// capturing if a stream the pool has allocated on (the operation's among them) is
    /// capturing a CUDA graph, or, for a pool that never allocated, any stream the
    /// backend knows (a capture on another pool's stream is none of this pool's
    /// business). Never an error, so that every rank takes part in the round: a
    /// failed query is this rank's broken pool (logged).
    pub(super) fn readiness(&self, st: &PoolState) -> Note {
        let ready = st.readiness();
        if ready != Readiness::Ready {
            return Note::Ready(ready);
        }
        let streams = self.inner.backend.streams();
        let known = &st.known_streams;
        let capturing = (known.iter().map(|s| streams.is_capturing(s)))
            .chain(known.is_empty().then(|| streams.any_capturing()))
            .find(|c| !matches!(c, Ok(false)));
        Note::Ready(match capturing {
            None => Readiness::Ready,
            Some(Ok(_)) => Readiness::Capturing,
            Some(Err(e)) => {
                tracing::warn!(target: "symmpool::pool", rank = self.rank(), error = %e,
                    "asking whether a stream captures a CUDA graph failed");
                Readiness::PoolBroken
            }
        })
    }

    /// The agreement on a collective pool operation `op` of `size` bytes (its round
    /// named after it), saying `note` where this rank is ready (its
    /// [`readiness`](Self::readiness) if `check`: an operation that may register
    /// memory), else why not: every rank's note, once all are ready (the ranks'
    /// obstacles become the same error on every rank).
    pub(super) fn agree_ready(
        &self,
        st: &mut PoolState,
        op: Op,
        size: u64,
        check: bool,
        note: Note,
        deadline: Deadline,
    ) -> Result<Vec<Note>> {
        // A readiness round (growth, reserve, trim, fit) takes only readiness notes; a
        // shrink's or an admission's carries its own notes, a readiness where one is not.
        let only_ready = matches!(note, Note::Ready(_));
        let mine = match check.then(|| self.readiness(st)) {
            Some(ready) if ready != READY => ready,
            _ => note,
        };
        let notes = self.agree(st, op, op.name(), size, mine, deadline)?;
        let ready = |(rank, n): (usize, &Note)| match n {
            Note::Ready(r) => Ok(*r),
            _ if only_ready => Err(Error::internal(format!(
                "rank {rank} sent no readiness in its agreement"
            ))),
            _ => Ok(Readiness::Ready),
        };
        st.all_ready(
            &notes
                .iter()
                .enumerate()
                .map(ready)
                .collect::<Result<Vec<_>>>()?,
        )?;
        Ok(notes)
    }

    /// One agreement round, waiting for the peers until `deadline`: the ranks' records
    /// must match (see `group::agree`).
    pub(super) fn agree(
        &self,
        st: &mut PoolState,
        op: Op,
        during: &'static str,
        size: u64,
        extra: Note,
        deadline: Deadline,
    ) -> Result<Vec<Note>> {
        let records = self.agree_naming(st, (op, during), size, extra, Vec::new(), deadline)?;
        Ok(records.iter().map(|r| r.extra).collect())
    }

    /// [`agree`](Self::agree), naming this rank's `live` buffers in its record (a
    /// close's); every rank's record.
    pub(super) fn agree_naming(
        &self,
        st: &mut PoolState,
        (op, during): (Op, &'static str),
        size: u64,
        extra: Note,
        live: Vec<group::LiveBuffer>,
        deadline: Deadline,
    ) -> Result<Vec<AgreementRecord>> {
        st.counters.agreements += 1;
        let c = st.core.stats();
        let state = group::state_digest(&[
            u64::from(st.core.next_segment_id().0),
            c.reserved_bytes.current,
            c.allocated_bytes.current,
            c.num_allocs,
            c.num_frees,
        ]);
        let pool = self.inner.channel.ordinal();
        let broken = st.broken.is_some();
        let mut mine = AgreementRecord::new(&st.history, (pool, op), size, state, extra, broken);
        mine.live = live; // at most MAX_LIVE_NAMED: `live_buffers` takes no more
        if let Some(failure) = self.ledger().failure() {
            // The ranks are out of step: no round (the pool is broken on every rank).
            // A loss is reported as the loss it is (the survivors may shrink).
            return Err(match failure {
                Error::CollectiveDivergence(d) => Error::PoolBroken {
                    reason: d.to_string(),
                },
                e => e,
            });
        }
        let out = group::agree_records(self.ledger(), during, mine, deadline);
        match out {
            Err(Error::Divergence(d)) => {
                st.diverged = Some(d.clone());
                Err(Error::Divergence(d))
            }
            // A peer's broken pool breaks this one too: the ranks can no longer make
            // the same calls. A broken rank reports its own reason.
            Err(Error::PoolBroken { reason }) => {
                let reason = st
                    .broken
                    .get_or_insert(Error::PoolBroken { reason })
                    .reason();
                Err(Error::PoolBroken { reason })
            }
            out => out,
        }
    }

    /// Allocate a segment on this rank, confirm every rank did, and register it; every
    /// wait on the peers until `deadline`.
    pub(super) fn provide_segment(
        &self,
        st: &mut PoolState,
        size_bytes: u64,
        deadline: Deadline,
    ) -> Result<SegmentEntry> {
        let backend = &self.inner.backend;
        let started = Instant::now();
        let local = backend.segments().allocate(size_bytes);
        // Second round: nobody registers unless everybody has the memory, so one
        // rank's failure is an error on all ranks instead of a hang in registration.
        let confirmed = self
            .agree(
                st,
                Op::Grow,
                "growth confirmation",
                size_bytes,
                Note::Allocated(local.is_ok()),
                deadline,
            )
            .and_then(|notes| all_allocated(&notes, size_bytes));
        let segment = match (local, confirmed) {
            (Ok(segment), Ok(())) => segment,
            (Ok(segment), Err(e)) => {
                let entry = SegmentEntry::new(segment, 0);
                self.undo_segment(st, entry, deadline);
                return Err(e);
            }
            (Err(e), _) => return Err(e),
        };
        let mut entry = SegmentEntry::new(segment, backend.communicators().len());
        if let Err(e) = self.register_segment(st, &mut entry, deadline) {
            self.undo_segment(st, entry, deadline);
            return Err(e);
        }
        st.counters.growth_time += started.elapsed();
        Ok(entry)
    }

    /// Register `entry`'s segment on every communicator that registers, in the
    /// backend's order: after agreeing on the group's registration order, one
    /// registration and one outcome round per communicator, every wait until
    /// `deadline`. On error the windows made so far stay in `entry`, for the caller
    /// to undo.
    pub(super) fn register_segment(
        &self,
        st: &mut PoolState,
        entry: &mut SegmentEntry,
        deadline: Deadline,
    ) -> Result<()> {
        let backend = &self.inner.backend;
        let size_bytes = entry.segment.size_bytes();
        let registers =
            self.inner.config.register && backend.communicators().iter().any(|c| c.registers);
        if !registers {
            return Ok(());
        }
        // One step on this rank: the agreement and every registration of the segment.
        let (channel, _registering) = self.inner.group.registration_channel();
        // Every rank's next registration is this pool's segment of `size_bytes`.
        let (exchange, name) = (backend.exchange(), &self.inner.config.name);
        group::agree_registration_order(exchange, channel, name, size_bytes, deadline)?;
        for (c, info) in backend.communicators().iter().enumerate() {
            if !info.registers {
                continue;
            }
            let registering = Instant::now();
            // The registration gets half the time left, the outcome round the rest: a
            // rank whose registration failed before joining it waits in the outcome
            // round for peers that first wait out the registration.
            let register_by = if deadline.is_never() {
                deadline
            } else {
                Deadline::after(deadline.remaining() / 2)
            };
            // SAFETY: every rank reaches this point for the same segment (the
            // agreements before matched call sequences and, for a growth, confirmed
            // the memory on every rank, and the outcome rounds below confirmed every
            // earlier communicator's registration on every rank) and registers the
            // same communicators in the backend's order, so the registration pairs
            // the same segments; the segment is not registered on `c` (new, or new to
            // the communicators of a shrunk backend); `readiness` refused growth on
            // every rank if the allocating stream was capturing.
            let registered = unsafe { backend.segments().register(&entry.segment, c, register_by) };
            let local = registered.and_then(|window| {
                tracing::info!(target: "symmpool::pool", rank = self.rank(), comm = c,
                    role = super::role_name(info.role), segment_bytes = size_bytes,
                    seconds = registering.elapsed().as_secs_f64(), window = window.is_some(),
                    "window registered");
                st.counters.registrations[c] += 1;
                let missing = window.is_none();
                entry.windows[c] = window;
                if missing && self.inner.config.require_symmetric {
                    Err(Error::NoSymmetricSupport { comm: c })
                } else {
                    Ok(())
                }
            });
            self.agree_registered(st, c, size_bytes, local, deadline)?;
        }
        Ok(())
    }

    /// The outcome round after registering on communicator `comm`: every rank says
    /// whether its registration succeeded, so that a failure on one rank (even one
    /// after the registration itself went through, which its peers cannot see) fails
    /// the growth on every rank, at the same communicator: the caller then undoes the
    /// growth (deregisters the windows made so far, frees the segment). A failed
    /// registration marks the pool registration-broken on every rank; the failing
    /// rank returns its own error, the others [`Error::RegistrationBroken`] naming the
    /// first failing rank. Waits for the peers until `deadline`, the growth's.
    fn agree_registered(
        &self,
        st: &mut PoolState,
        comm: usize,
        size_bytes: u64,
        local: Result<()>,
        deadline: Deadline,
    ) -> Result<()> {
        let mine = match &local {
            Ok(()) => Registered::Yes,
            Err(Error::NoSymmetricSupport { .. }) => Registered::NoWindow,
            Err(Error::Timeout { .. } | Error::NcclTimeout { .. } | Error::GroupBroken { .. }) => {
                Registered::Waited
            }
            Err(_) => Registered::Failed,
        };
        let flags = match self.agree(
            st,
            Op::Grow,
            "growth registration outcome",
            size_bytes,
            Note::Registration(mine),
            deadline,
        ) {
            Ok(flags) => flags,
            Err(e) => {
                // The peers' outcomes are unknown: refuse growth from now on.
                let error = local.err().unwrap_or(e);
                st.registration_broken = Some((self.rank(), error.to_string()));
                return Err(error);
            }
        };
        let find = |r: Registered| flags.iter().position(|&f| f == Note::Registration(r));
        let unknown = (flags.iter()).position(|&f| {
            !matches!(
                f,
                Note::Registration(Registered::Yes | Registered::NoWindow)
            )
        });
        if let Some(rank) = find(Registered::Failed)
            .or(find(Registered::Waited))
            .or(unknown)
        {
            let (error, reason) = match local {
                Err(e) if mine == Registered::Failed || rank == self.rank() => {
                    let reason = e.to_string();
                    (e, reason)
                }
                _ => {
                    let reason = format!(
                        "registering a segment of {size_bytes} bytes on communicator {comm} failed on rank {rank}"
                    );
                    let error = Error::RegistrationBroken {
                        rank,
                        reason: reason.clone(),
                    };
                    (error, reason)
                }
            };
            st.registration_broken = Some((rank, reason));
            return Err(error);
        }
        if flags.contains(&Note::Registration(Registered::NoWindow)) {
            return Err(local.err().unwrap_or(Error::NoSymmetricSupport { comm }));
        }
        Ok(())
    }

    /// Deregister and free a segment that the core does not hold (failed growth),
    /// waiting in the provider until `deadline` at most. What will not deregister or
    /// free is leaked (freeing under a live window is not allowed).
    pub(super) fn undo_segment(&self, st: &mut PoolState, entry: SegmentEntry, deadline: Deadline) {
        // No block of the segment was handed out, so no work uses it.
        let counts = &mut st.counters.deregistrations;
        let Err((left, e)) =
            super::release::release_entry(&self.inner.backend, entry, counts, deadline)
        else {
            return;
        };
        if left.windows.iter().any(Option::is_some) {
            // Freeing under a live window is not allowed: leak both.
            self.record_deferred_error("deregistering a window after a failed growth".into(), e);
            tracing::error!(rank = self.rank(), "a segment of a failed growth is leaked");
            std::mem::forget(left);
        } else {
            // The provider refused the free: its handle's own drop decides what is kept.
            self.record_deferred_error("freeing a segment after a failed growth".into(), e);
        }
    }
}

/// Fail with [`Error::PeerOutOfMemory`] (for segments of `segment_bytes`) naming the
/// ranks whose note in `notes` is not that they allocated, if any.
pub(super) fn all_allocated(notes: &[Note], segment_bytes: u64) -> Result<()> {
    let ranks: Vec<usize> = (0..notes.len())
        .filter(|&r| notes[r] != Note::Allocated(true))
        .collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(Error::PeerOutOfMemory {
        segment_bytes,
        ranks,
    })
}
