"""The exceptions symmpool raises, sorted by what the caller can do about them.

Every error of the Rust crate reaches Python as one of these classes (the extension
picks the class from the crate's error variant)::

    SymmpoolError (RuntimeError)             anything else: NCCL, CUDA, the transport, a
    │                                        broken pool or backend, a bug in symmpool
    ├── UsageError                           a mistake in the calling code: a zero size,
    │                                        a freed or foreign buffer, a closed pool, a
    │                                        host stream on a GPU pool, ...
    ├── DivergenceError                      the ranks made different calls (pool calls,
    │                                        collectives, channels, registrations)
    ├── SymmpoolTimeoutError (TimeoutError)  a wait on other ranks ran out of time, or an
    │                                        earlier one did (the group is out of step)
    ├── PeerLostError                        a peer process died or stopped answering
    ├── OutOfMemoryError (MemoryError)       the pool's limit, the device or a peer had
    │                                        no memory for a segment
    └── ConfigurationError (ValueError)      a setting, the launcher's environment, the
                                             store's job or rank, the libraries found

Divergence, timeouts and lost peers leave the group unusable: drop the pool and start
the job (or the group) again. An out-of-memory error leaves the pool as it was: free
buffers, ``trim()``, and retry.

Attributes, ``None`` (or empty) where the error does not say:

- ``rank``: the peer rank the error is about (the lost rank, the rank that timed out
  first, the rank whose registration failed);
- ``ranks``: the ranks concerned (the ranks that did not arrive, the ranks that ran out
  of memory, the ranks that diverged);
- ``operation``: the operation that failed or was waited in (``"alloc"``,
  ``"all_gather"``, the crate's name for a round, an NCCL function).
"""

__all__ = [
    "ConfigurationError",
    "DivergenceError",
    "OutOfMemoryError",
    "PeerLostError",
    "SymmpoolError",
    "SymmpoolTimeoutError",
    "SymmpoolWarning",
    "UsageError",
]


class SymmpoolError(RuntimeError):
    """An error of the symmpool crate; the base of every exception symmpool raises
    for a failed pool, exchange or collective call (a bad Python argument, such as an
    unknown reduction name, is a plain ``ValueError``)."""

    #: The peer rank the error is about, or None.
    rank = None
    #: The ranks concerned, in rank order (empty when the error names none).
    ranks = ()
    #: The operation that failed or was waited in, or None.
    operation = None


class UsageError(SymmpoolError):
    """A mistake in the calling code (a zero-byte or too-large request, a freed,
    foreign or stale buffer, a closed pool, the wrong kind of stream, inconsistent
    collective arguments on this rank, growth during CUDA-graph capture)."""


class DivergenceError(SymmpoolError):
    """The ranks made different calls: different pool call sequences, collective
    arguments, channels or window registrations. Raised on every rank; the pool is
    unusable afterwards (drop it and build a new one)."""


class SymmpoolTimeoutError(SymmpoolError, TimeoutError):
    """A wait on other ranks ran out of time (``ranks``: those that did not arrive),
    or an earlier wait did on ``rank`` and the group is out of step. Also a
    ``TimeoutError``."""


class PeerLostError(SymmpoolError):
    """Peer ``rank`` disconnected, died or stopped sending heartbeats while this rank
    was in ``operation``; the group is broken for good."""


class OutOfMemoryError(SymmpoolError, MemoryError):
    """No memory for a new segment: the pool's own limit, the device (or host), or
    peer ranks (``ranks``). Nothing was allocated on any rank. Also a
    ``MemoryError``."""


class ConfigurationError(SymmpoolError, ValueError):
    """A setting with a value it cannot have, the launcher's environment, a store of
    another job or a rank claimed twice, a library that is missing or too old. Also a
    ``ValueError``."""


class SymmpoolWarning(UserWarning):
    """A warning of the symmpool crate that the calling code can act on (a pool
    dropped without ``close()``). Other diagnostics go to the ``logging`` logger
    ``"symmpool"`` (and its children, named after the crate's modules)."""
