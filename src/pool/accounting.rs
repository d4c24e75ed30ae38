//! What a segment's arrival counts and reports: the reserved-bytes total, the memory
//! history's segment event, the log line (its departure is accounted in `release.rs`).

use super::MemoryAction;
use super::SymmPool;
use super::state::PoolState;
use crate::core::{SegmentId, SizeClass};

impl SymmPool {
    /// Account for, and report, a segment just added (growth or `reserve`).
    pub(crate) fn segment_added(&self, st: &mut PoolState, id: SegmentId) {
        let Some(entry) = st.segments.get(&id) else {
            return;
        };
        let bytes = entry.segment.size_bytes();
        let windows = entry.windows.iter().filter(|w| w.is_some()).count();
        st.counters.reserved_bytes_total += bytes;
        let address = entry.segment.device_ptr();
        if let Some(h) = st.memory_history.as_deref_mut() {
            h.segment(MemoryAction::SegmentAlloc, id, address, bytes);
        }
        let class = match st.core.segments().find(|s| s.0 == id).map(|s| s.1) {
            Some(SizeClass::Small) => "small",
            Some(SizeClass::Large) => "large",
            None => "unknown",
        };
        tracing::info!(target: "symmpool::pool", rank = self.rank(),
            pool = %self.config().name, segment = id.0, class, segment_bytes = bytes,
            windows, reserved_bytes = st.core.stats().reserved_bytes.current,
            "segment allocated");
    }
}
