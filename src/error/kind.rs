//! [`ErrorKind`]: what a runtime should do with an [`Error`].

use super::Error;
use crate::core::AllocError;
use std::fmt;

/// What kind of failure an [`Error`] is, for a runtime that must decide what to do:
/// fix the program, fix the settings, free memory and retry, or restart the job.
/// [`Error::kind`] classifies every variant; match on the kind, not on the variants
/// (new variants join an existing kind).
///
/// ```
/// use symmpool::{Error, ErrorKind};
/// let e = Error::ZeroSize;
/// assert_eq!(e.kind(), ErrorKind::Usage);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller broke the API's rules on this rank (a zero-size or oversized request,
    /// a foreign or freed buffer, a wrong stream, a call on a closed pool, bad
    /// collective arguments). Nothing changed; fix the calling code. Retrying the same
    /// call fails the same way.
    Usage,
    /// The ranks made different calls (pool calls, collectives, channels, window
    /// registrations): the program is not SPMD where it must be. The pool is broken on
    /// every rank; fix the program, then restart.
    Divergence,
    /// A setting, the launcher environment or the installation is wrong (an invalid
    /// configuration, a missing or too old library, a store of another job or
    /// version, an unreachable store address). Fix it before starting again; retrying
    /// unchanged does not help.
    Configuration,
    /// Memory ran out: the device (or the host) could not allocate a segment on some
    /// rank, or the pool's own limit was reached. Nothing was allocated on any rank;
    /// free buffers (`trim`, a smaller batch) and retry the call on every rank.
    OutOfMemory,
    /// A wait on other ranks ran out of time and the store declared no rank lost: a
    /// peer is slow, stuck in a call the others did not make, or the ranks diverged.
    /// The ranks are out of step (later calls fail with [`Error::GroupBroken`], of this
    /// kind too); a shrink cannot help, as nobody was lost: restart the job, or raise
    /// the timeout if the peers were merely slow.
    Timeout,
    /// A peer rank died or froze, or the group (or the NCCL backend) broke earlier:
    /// nothing on this group can succeed any more. Restart the job (an elastic runtime
    /// restarts the ranks from the last checkpoint), or go on without the lost rank:
    /// [`SymmPool::shrink`](crate::SymmPool::shrink) on every survivor, for each of its
    /// pools. Every error of a loss seen by this rank has this kind, whichever call
    /// saw it ([`Error::PeerLost`], [`Error::NcclAborted`], and [`Error::ShrinkFailed`]
    /// with `retry`: shrink again). Where a shrink cannot
    /// help, the kind is [`GroupLost`](Self::GroupLost).
    PeerLost,
    /// This rank cannot go on in its group, and no shrink can help: the store's host
    /// (rank 0) is gone ([`Error::ShrinkFailed`] without `retry`), or the store
    /// declared this rank lost and the others went on without it
    /// ([`Error::DeclaredLost`]). Restart the job (or, under an elastic launcher, this
    /// rank's process).
    GroupLost,
    /// This pool is unusable (broken, or unable to grow after a failed registration)
    /// while the process and the group may still be fine: drop the pool (after
    /// `close`) and build a new one, or restart. (A loss that broke the pool is
    /// reported with the loss's kind, [`PeerLost`](Self::PeerLost).)
    Broken,
    /// A call into CUDA, NCCL or the operating system failed. Read the message; the
    /// device or the process is usually not worth continuing with: restart.
    System,
    /// An invariant of symmpool broke: a bug in the crate. The pool is marked broken;
    /// report the message and restart.
    Internal,
}

impl ErrorKind {
    /// The kind's name, in lower snake case (`"out_of_memory"`), for logs and bindings.
    pub fn name(self) -> &'static str {
        use ErrorKind::*;
        match self {
            Usage => "usage",
            Divergence => "divergence",
            Configuration => "configuration",
            OutOfMemory => "out_of_memory",
            Timeout => "timeout",
            PeerLost => "peer_lost",
            GroupLost => "group_lost",
            Broken => "broken",
            System => "system",
            Internal => "internal",
        }
    }

    /// Whether restarting the job (every rank) is the way on: the group, the backend
    /// or the process cannot go on ([`Timeout`](Self::Timeout),
    /// [`PeerLost`](Self::PeerLost), [`GroupLost`](Self::GroupLost),
    /// [`Divergence`](Self::Divergence), [`System`](Self::System),
    /// [`Internal`](Self::Internal)). A runtime that goes on after a lost rank checks
    /// for [`PeerLost`](Self::PeerLost) first and shrinks
    /// ([`SymmPool::shrink`](crate::SymmPool::shrink)); of the others, only a restart
    /// helps.
    pub fn needs_restart(self) -> bool {
        use ErrorKind::*;
        matches!(
            self,
            Timeout | PeerLost | GroupLost | Divergence | System | Internal
        )
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Error {
    /// What kind of failure this is (see [`ErrorKind`] for what a runtime should do
    /// with each). An [`Error::Deferred`] has its cause's kind.
    pub fn kind(&self) -> ErrorKind {
        use Error::*;
        use ErrorKind as K;
        match self {
            ZeroSize
            | TooLarge { .. }
            | BadAlignment { .. }
            | ForeignBuffer { .. }
            | DoubleFree { .. }
            | WrongStream
            | PoolClosed
            | Shrunk { .. }
            | BuffersAlive { .. }
            | InvalidCollective { .. }
            | Untagged { .. }
            | BadView(_)
            | GraphCapture
            | NoActivePool
            | PayloadTooLarge { .. } => K::Usage,
            // Shared communicators are the likely cause; the failure's own kind says
            // what to do now (a dead peer is still a restart).
            SharedCommunicators { error, .. } => error.kind(),
            Divergence(_)
            | CollectiveMismatch { .. }
            | CollectiveDivergence(_)
            | RegistrationOrder { .. }
            | RegistrationMismatch { .. }
            | ChannelMismatch { .. } => K::Divergence,
            Config { .. }
            | InvalidConfig(_)
            | LaunchEnv { .. }
            | LibraryUnavailable { .. }
            | NcclTooOld { .. }
            | NoSymmetricSupport { .. }
            | StoreRejected { .. }
            | JobMismatch { .. }
            | RankTaken { .. }
            | Protocol { .. }
            | Transport { .. } => K::Configuration,
            PoolLimit { .. } | DeviceOutOfMemory { .. } | PeerOutOfMemory { .. } => K::OutOfMemory,
            Timeout { .. } | GroupBroken { .. } | NcclTimeout { .. } | NcclWatchdog { .. } => {
                K::Timeout
            }
            PeerLost { .. } | NcclAborted { .. } | ShrinkFailed { retry: true, .. } => K::PeerLost,
            ShrinkFailed { retry: false, .. } | DeclaredLost { .. } => K::GroupLost,
            PoolBroken { .. } | RegistrationBroken { .. } => K::Broken,
            Nccl { .. } | Cuda { .. } | SharedMemory { .. } => K::System,
            Internal { .. } => K::Internal,
            Deferred { source, .. } => source.kind(),
            Core(e) => match e {
                AllocError::ZeroSize
                | AllocError::TooLarge { .. }
                | AllocError::BadAlignment { .. }
                | AllocError::StaleBlock(_) => K::Usage,
                AllocError::OutOfMemory { .. } => K::OutOfMemory,
                AllocError::Config(_) | AllocError::BadLayout(_) => K::Configuration,
                AllocError::NeedsGrowth(_)
                | AllocError::BadSegmentSize { .. }
                | AllocError::UnknownSegment(_)
                | AllocError::Exhausted => K::Internal,
            },
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/error/kind.rs"]
mod tests;
