//! Fitting the segments to the peak: [`FitPlan`] and the allocator's half of
//! `fit_to_peak`.

use super::Allocator;
use super::align::align_up;
use super::allocator::{BlockUse, Released};
use super::config::GrowthPolicy;
use super::error::AllocError;
use super::types::{Growth, SegmentId, SizeClass};
use serde::{Deserialize, Serialize};

/// What [`Allocator::plan_fit_to_peak`] proposes: entirely free segments to release,
/// then segments to add, sized to the peak observed since the last
/// [`reset_peak`](Allocator::reset_peak).
///
/// A pure function of the call sequence, so every rank computes the same plan; the
/// pool can compare plans across ranks before acting on one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FitPlan {
    /// Segments to release, in ascending id order, with their sizes in bytes. All are
    /// entirely free when planned.
    pub release: Vec<(SegmentId, u64)>,
    /// Segments to add after the release, in order (at most one small, then at most
    /// one large). Add them with [`Allocator::add_planned`].
    pub add: Vec<Growth>,
}

impl FitPlan {
    /// Whether the plan changes nothing.
    pub fn is_empty(&self) -> bool {
        self.release.is_empty() && self.add.is_empty()
    }
}

impl Allocator {
    /// Bytes in the allocated blocks of one size class now (block sizes, after
    /// rounding): the class's reserved bytes less its free blocks. Computed on demand
    /// (O(free blocks of the class)), since the alloc and free paths keep no per-class
    /// figure; the two classes add up to `stats().allocated_bytes.current`.
    pub fn class_allocated_bytes(&self, class: SizeClass) -> u64 {
        // Saturating only so that `check_invariants` reports a broken reserved figure
        // instead of panicking here.
        self.stats
            .class(class)
            .reserved_bytes
            .current
            .saturating_sub(self.free[class.index()].total_bytes())
    }

    /// Plan a refit of the segments to the peak observed since the last
    /// [`reset_peak`](Self::reset_peak) (the core half of a collective "fit to peak"
    /// call, typically after the first training step).
    ///
    /// Per size class with at least one entirely free segment (others are left as they
    /// are): every entirely free segment of the class is released, and one segment is
    /// added of `need` plus `fit_headroom_percent` of it (registered policy), at most
    /// `R - L_c`, rounded up to `granularity_bytes` (small: at least
    /// `small_segment_bytes`; none when `need` is 0). Here `need = min(P - L, R - L_c)`
    /// bounds what the class's blocks allocated in the window took at its peak: `P` is
    /// the peak of `allocated_bytes` in the window, `L` the bytes of the blocks live now
    /// that were allocated before the window (live throughout it, they stay where they
    /// are), `L_c` their part in the class, and `R` the peak of the class's
    /// `reserved_bytes` in the window. Both terms bound the class's own peak less `L_c`
    /// (the alloc and free paths keep no per-class allocated peak): the first
    /// over-counts the other class's window blocks live at the overall peak, the second
    /// is what the class held the window in. Conservative: the kept segments' free
    /// space counts as zero, and window blocks still live count in full.
    ///
    /// Replaying the window's calls (the next identical step) then needs no growth when
    /// the new segment holds the window's blocks without fragmentation (each class's
    /// peak reached with no hole in between, as in the FSDP traces of the tests);
    /// otherwise `fit_headroom_percent` gives room, and growth stays possible.
    ///
    /// Carry the plan out with [`release_planned`](Self::release_planned), then (after
    /// the backend work) [`add_planned`](Self::add_planned) for each growth in order, or
    /// all at once with [`apply_fit_plan`](Self::apply_fit_plan). Unlike
    /// [`release_free_segments`](Self::release_free_segments) (trim), this releases
    /// only in classes it refills, but there it releases reserved segments
    /// ([`add_shared_segment`](Self::add_shared_segment)) too.
    pub fn plan_fit_to_peak(&self) -> FitPlan {
        let mut plan = FitPlan::default();
        let headroom = match self.config.growth {
            GrowthPolicy::Registered {
                fit_headroom_percent,
                ..
            } => fit_headroom_percent,
            _ => 0,
        };
        // Per class: the entirely free segments, and the bytes of the blocks live now
        // that were allocated before the window.
        let mut release: [Released; 2] = Default::default();
        let mut old_live = [0u64; 2];
        for (&id, seg) in &self.segments {
            let c = seg.class.index();
            if self.entirely_free(seg) {
                release[c].push((id, seg.size));
                continue;
            }
            for b in self.blocks_of(seg) {
                if let BlockUse::Allocated { seq, .. } = b.usage
                    && seq < self.window_seq
                {
                    old_live[c] += b.size;
                }
            }
        }
        let peak = self.stats.allocated_bytes.peak;
        let window_peak = peak.saturating_sub(old_live[0] + old_live[1]);
        for class in [SizeClass::Small, SizeClass::Large] {
            let c = class.index();
            let release = std::mem::take(&mut release[c]);
            if release.is_empty() {
                continue;
            }
            plan.release.extend(release);
            let held = self
                .stats
                .class(class)
                .reserved_bytes
                .peak
                .saturating_sub(old_live[c]);
            let need = window_peak.min(held);
            if need == 0 {
                continue;
            }
            let need = need
                .saturating_add(need / 100 * headroom + (need % 100) * headroom / 100)
                .min(held);
            let gran = self.config.granularity_bytes;
            let mut size = align_up(need, gran).unwrap_or(u64::MAX / gran * gran);
            if class == SizeClass::Small {
                size = size.max(self.config.small_segment_bytes);
            }
            plan.add.push(Growth {
                class,
                segment_bytes: size.min(super::config::MAX_SEGMENT_BYTES),
            });
        }
        plan.release.sort_unstable();
        plan
    }

    /// Release the segments a [`FitPlan`] lists, and return them with their sizes (the
    /// caller frees their memory).
    ///
    /// # Errors
    /// [`AllocError::UnknownSegment`] naming the first listed segment that does not
    /// exist or is not entirely free (the plan is stale); nothing changes then.
    pub fn release_planned(&mut self, plan: &FitPlan) -> Result<Vec<(SegmentId, u64)>, AllocError> {
        for &(id, size) in &plan.release {
            let ok = self
                .segments
                .get(&id)
                .is_some_and(|seg| seg.size == size && self.entirely_free(seg));
            if !ok {
                return Err(AllocError::UnknownSegment(id));
            }
        }
        plan.release
            .iter()
            .map(|&(id, _)| Ok((id, self.release_segment(id)?)))
            .collect()
    }

    /// Add one segment of a [`FitPlan`]: a large one as a shared segment (like
    /// [`add_shared_segment`](Self::add_shared_segment)), a small one with
    /// [`add_segment`](Self::add_segment).
    ///
    /// # Errors
    /// As [`add_segment`](Self::add_segment).
    pub fn add_planned(&mut self, growth: Growth) -> Result<SegmentId, AllocError> {
        match growth.class {
            SizeClass::Large => self.add_shared_segment(growth.segment_bytes),
            SizeClass::Small => self.add_segment(growth),
        }
    }

    /// [`release_planned`](Self::release_planned) then
    /// [`add_planned`](Self::add_planned) for every growth of the plan: for callers
    /// with no backend work in between (tests, simulations). Returns the released
    /// segments and the ids of the added ones.
    ///
    /// # Errors
    /// As [`release_planned`](Self::release_planned) (nothing changes) and
    /// [`add_planned`](Self::add_planned) (the release and earlier additions stay).
    pub fn apply_fit_plan(
        &mut self,
        plan: &FitPlan,
    ) -> Result<(Released, Vec<SegmentId>), AllocError> {
        let released = self.release_planned(plan)?;
        let added = plan
            .add
            .iter()
            .map(|&g| self.add_planned(g))
            .collect::<Result<_, _>>()?;
        Ok((released, added))
    }
}
