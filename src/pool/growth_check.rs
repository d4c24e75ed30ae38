//! The checks that layers above the pool run before it grows or closes
//! ([`GrowthCheck`]).

use super::SymmPool;
use crate::deadline::Deadline;
use crate::error::Result;
use crate::group::GrowthPoint;
use std::sync::{Arc, Weak};

/// A layer above the pool that checks a growth against the peers' calls before the
/// pool agrees on it: the collectives handles, whose checks then see a rank that
/// grows where its peers make a collective (an extra allocation) within one exchange
/// round, instead of both waiting out the timeout in different rounds.
pub(crate) trait GrowthCheck: Send + Sync {
    /// The pool is about to grow at `growth`: check that the peers grow at the same
    /// point, waiting for them until `deadline`.
    ///
    /// # Errors
    /// [`Error::CollectiveDivergence`](crate::Error::CollectiveDivergence) naming
    /// where each rank is; the check's errors.
    fn before_growth(&self, growth: &GrowthPoint, deadline: Deadline) -> Result<()>;

    /// The pool is about to close: compare what is still to be compared with the
    /// peers, waiting for them until `deadline` (what it finds breaks the pool).
    ///
    /// # Errors
    /// The check's errors.
    fn before_close(&self, deadline: Deadline) -> Result<()>;
}

impl SymmPool {
    /// Have `check` look at every growth of the pool first (while it lives).
    pub(crate) fn add_growth_check(&self, check: Weak<dyn GrowthCheck>) {
        let mut checks = self.inner.growth_checks.lock();
        checks.retain(|c| c.strong_count() > 0);
        checks.push(check);
    }

    /// Run the close checks of the layers above (see [`GrowthCheck::before_close`]).
    /// Their outcome is in the pool's state afterwards (a divergence breaks it), so
    /// their errors are not returned.
    pub(crate) fn check_close(&self, deadline: Deadline) {
        let checks: Vec<Arc<dyn GrowthCheck>> = (self.inner.growth_checks.lock().iter())
            .filter_map(Weak::upgrade)
            .collect();
        for check in checks {
            let _ = check.before_close(deadline);
        }
    }

    /// Run the growth checks of the layers above (see [`GrowthCheck`]).
    pub(crate) fn check_growth(&self, segment_bytes: u64, deadline: Deadline) -> Result<()> {
        let checks: Vec<Arc<dyn GrowthCheck>> = (self.inner.growth_checks.lock().iter())
            .filter_map(Weak::upgrade)
            .collect();
        let growth = GrowthPoint {
            pool: self.inner.channel.ordinal(),
            call: self.call_head(),
            segment_bytes,
        };
        for check in checks {
            check.before_growth(&growth, deadline)?;
        }
        Ok(())
    }
}
