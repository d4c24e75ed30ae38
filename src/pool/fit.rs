//! Sizing the pool ahead: `reserve` and `reserve_small` (a segment before it is
//! needed), `fit_to_peak` (the segments a step actually used).

use super::SymmPool;
use crate::core::{Allocator, Growth, SegmentId, SizeClass};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::group::{CallKind, Op, READY};
use serde::Serialize;

/// What [`SymmPool::fit_to_peak`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct FitReport {
    /// Segments released (entirely free ones of the classes refilled), with their sizes
    /// in bytes.
    pub released: Vec<(u32, u64)>,
    /// Segments added, with their sizes in bytes.
    pub added: Vec<(u32, u64)>,
}

impl SymmPool {
    /// Size the pool from the peak of the step(s) since the last
    /// [`reset_peak`](Self::reset_peak): release the entirely free segments of each
    /// size class that needs refilling and reserve that class's observed peak (minus
    /// what buffers still alive hold) as one segment, so that a repeat of the step runs
    /// from a minimal set of segments without growing.
    ///
    /// Call it after a warm-up step, when the step's temporary buffers are freed.
    /// Buffers that stay alive (persistent shards) keep their segments; the new segment
    /// is sized for the rest. A later [`reserve`](Self::reserve) adds to the pool as
    /// usual; [`trim`](Self::trim) releases what is entirely free, including the
    /// segment added here when nothing uses it. The plan is a function of the call
    /// sequence only, so every rank computes the same one; the ranks agree on it first.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence.
    ///
    /// # Errors
    /// As [`trim`](Self::trim), and the errors of growth (see [`alloc`](Self::alloc)):
    /// [`Error::GraphCapture`](crate::Error::GraphCapture) on every rank while a stream
    /// the pool has allocated on is capturing a CUDA graph, as for
    /// [`reserve`](Self::reserve) (nothing is released or added then).
    pub fn fit_to_peak(&self) -> Result<FitReport> {
        let mut st = self.lock_open()?;
        st.history.record(CallKind::FitToPeak, 0, 0);
        let plan = st.core.plan_fit_to_peak();
        let planned_bytes = (plan.add.iter().map(|g| g.segment_bytes))
            .chain(plan.release.iter().map(|r| r.1))
            .fold(0u64, u64::wrapping_add);
        let deadline = self.group().deadline();
        // The check growth and `reserve` make: no registration while a stream the pool
        // served captures a CUDA graph (refused on every rank alike).
        self.agree_ready(&mut st, Op::FitToPeak, planned_bytes, true, READY, deadline)?;
        let released = st.core.release_planned(&plan)?;
        self.release_segments(&mut st, deadline)?;
        let mut added = Vec::new();
        for growth in &plan.add {
            let id = self.add_segment(&mut st, *growth, Allocator::add_planned, deadline)?;
            added.push((id.0, growth.segment_bytes));
        }
        let released = released.into_iter().map(|(id, b)| (id.0, b)).collect();
        Ok(FitReport { released, added })
    }
}

impl SymmPool {
    /// Pre-grow the pool by one segment of `size_bytes` (rounded up to the granularity)
    /// that any large request (over 1 MiB) may use, so that later allocations hit the
    /// cache and nothing registers on the hot path or during CUDA-graph capture.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence with the same size.
    ///
    /// # Errors
    /// [`Error::ZeroSize`], [`Error::TooLarge`], [`Error::PoolClosed`] ([`Error::Shrunk`]
    /// once a shrink replaced the pool), [`Error::PoolLimit`], and the growth errors of [`alloc`](Self::alloc).
    #[tracing::instrument(target = "symmpool::pool", level = "info", skip(self), fields(rank = self.rank(), pool = %self.inner.config.name), ret(Display), err(Display))]
    pub fn reserve(&self, size_bytes: u64) -> Result<SegmentId> {
        self.reserve_class(size_bytes, SizeClass::Large)
    }

    /// Pre-grow the pool by one *small-block* segment of at least `size_bytes`
    /// (rounded up to the granularity, and to at least `small_segment_bytes`): small
    /// requests (up to `small_request_max_bytes`, 1 MiB by default) are served from
    /// small segments only, so [`reserve`](Self::reserve) does not help them. Call it
    /// before CUDA-graph capture for the small buffers the captured code allocates.
    ///
    /// # Collective
    /// As [`reserve`](Self::reserve).
    ///
    /// # Errors
    /// As [`reserve`](Self::reserve).
    #[tracing::instrument(target = "symmpool::pool", level = "info", skip(self), fields(rank = self.rank(), pool = %self.inner.config.name), ret(Display), err(Display))]
    pub fn reserve_small(&self, size_bytes: u64) -> Result<SegmentId> {
        self.reserve_class(size_bytes, SizeClass::Small)
    }

    fn reserve_class(&self, size_bytes: u64, class: SizeClass) -> Result<SegmentId> {
        let mut st = self.lock_open()?;
        let config = *st.core.config();
        // Checked as a request is, then whole segments (at most 16 TiB: no overflow).
        let mut size =
            (config.round_request(size_bytes)?).next_multiple_of(config.granularity_bytes);
        let small = class == SizeClass::Small;
        if small {
            size = size.max(config.small_segment_bytes);
        }
        // The reserve limit is the same on every rank: check it before agreeing.
        st.core.check_reserve(size)?;
        st.history
            .record(CallKind::Reserve, size_bytes, u64::from(small));
        // Registration is refused while any stream the pool has served is capturing.
        let deadline = self.group().deadline();
        self.shared_use(|| {
            self.agree_ready(&mut st, Op::Reserve, size, true, READY, deadline)?;
            let growth = Growth {
                class,
                segment_bytes: size,
            };
            self.add_segment(&mut st, growth, Allocator::add_planned, deadline)
        })
    }
}
