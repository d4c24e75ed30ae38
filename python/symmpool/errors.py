"""The exceptions symmpool raises, sorted by what the caller can do about them.

Every error of the Rust crate reaches Python as the class of its kind (the crate's
``ErrorKind``, ``Error::kind()``), from one table, :data:`CLASSES`::

    SymmpoolError (RuntimeError)             kinds broken, system, internal: a broken
    │                                        pool, NCCL, CUDA, the OS, a bug in symmpool
    ├── UsageError                           usage: a mistake in the calling code: a zero
    │                                        size, a freed or foreign buffer, a closed
    │                                        pool, a host stream on a GPU pool, ...
    ├── DivergenceError                      divergence: the ranks made different calls
    │                                        (pool calls, collectives, channels,
    │                                        registrations)
    ├── SymmpoolTimeoutError (TimeoutError)  timeout: a wait on other ranks ran out of
    │                                        time, here or earlier on another rank (the
    │                                        ranks are out of step): restart
    ├── PeerLostError                        peer_lost: a peer process died or stopped
    │                                        answering; the survivors may go on:
    │                                        Pool.shrink()
    ├── GroupLostError                       group_lost: this rank cannot go on in its
    │                                        group and no shrink can help (the store's
    │                                        host is gone, or the others went on
    │                                        without this rank): restart
    ├── ShrinkFailed                         Pool.shrink() could not shrink the group
    │                                        (whatever its kind): ``retry`` says whether
    │                                        to call it again
    ├── OutOfMemoryError (MemoryError)       out_of_memory: the pool's limit, the device
    │                                        or a peer had no memory for a segment
    └── ConfigurationError (ValueError)      configuration: a setting, the launcher's
                                             environment, the store's job or rank, the
                                             control plane's address, the libraries found

Divergence and timeouts leave the group unusable: drop the pool and start the job (or
the group) again. After a lost peer (:class:`PeerLostError`) the same, or the
survivors go on without it: ``pool, report = pool.shrink()`` on every survivor (see
:class:`ShrinkFailed`), and later grow back with newcomers (``pool.grow()``; a
:class:`PeerLostError` from it: shrink first, then grow). An out-of-memory error
leaves the pool as it was: free buffers, ``trim()``, and retry.

Attributes, ``None`` (or empty) where the error does not say:

- ``kind``: the crate's kind of the error (``"usage"``, ``"divergence"``, ...,
  ``"broken"``, ``"system"``, ``"internal"``), the key of :data:`CLASSES`;
- ``rank``: the peer rank the error is about (the lost rank, the rank that timed out
  first, the rank whose registration failed);
- ``ranks``: the ranks concerned (the ranks that did not arrive, the ranks that ran out
  of memory, the ranks a divergence reports on);
- ``operation``: the operation that failed or was waited in (``"alloc"``,
  ``"all_gather"``, the crate's name for a round or a check, an NCCL function);
- on a :class:`DivergenceError`, ``field`` (what differs: a collective record's field
  such as ``"tag"`` or ``"count"``, ``"pool call"``, ``"channel"``) and ``values``
  (each rank's value of it: ``{rank: text}``);
- on a :class:`ShrinkFailed`, ``retry`` (whether ``shrink()`` again can succeed).
"""

from types import MappingProxyType

__all__ = [
    "CLASSES",
    "ConfigurationError",
    "DivergenceError",
    "GroupLostError",
    "OutOfMemoryError",
    "PeerLostError",
    "ShrinkFailed",
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
    #: The crate's kind of the error (a key of :data:`CLASSES`), or None.
    kind = None


class UsageError(SymmpoolError):
    """A mistake in the calling code (a zero-byte or too-large request, a freed,
    foreign or stale buffer, a closed pool, the wrong kind of stream, inconsistent
    collective arguments on this rank, growth during CUDA-graph capture)."""


class DivergenceError(SymmpoolError):
    """The ranks made different calls: different pool call sequences, collective
    arguments, channels or window registrations. Raised on every rank; the pool is
    unusable afterwards (drop it and build a new one).

    ``ranks`` are the ranks the report names, ``field`` what differs and ``values``
    each of those ranks' value of it (``{rank: text}``): for a checked collective the
    first differing field of its record (``"tag"`` when the ranks' calls carry
    different tags, for example one rank skipped a tagged call), in every check mode."""

    #: What differs, or None.
    field = None
    #: Each rank's value of ``field``: ``{rank: text}`` (empty when the error names none).
    values = MappingProxyType({})


class SymmpoolTimeoutError(SymmpoolError, TimeoutError):
    """A wait on other ranks ran out of time (``ranks``: those that did not arrive),
    or one did earlier on rank ``rank``, so the ranks are out of step and the group is
    broken for good: restart (no rank was lost, so there is nothing to shrink past).
    Also a ``TimeoutError``."""


class PeerLostError(SymmpoolError):
    """Peer ``rank`` disconnected, died or stopped sending heartbeats while this rank
    was in ``operation`` (or the NCCL backend was aborted); the group is broken for
    good.

    Restart the job, or go on without the lost rank: ``pool.shrink()`` on every
    survivor, for each of its pools in the same order, returns the survivors' pool
    (see :class:`ShrinkFailed` for when it cannot); a newcomer started as the lost
    rank joins them later, when they ``pool.grow()``. From ``grow()`` itself: the
    group lost a rank, so shrink past it first, then grow."""


class GroupLostError(SymmpoolError):
    """This rank cannot go on in its group, and no shrink can help: the rank that
    hosted the crate's store (rank 0) is gone, or the store declared this rank lost
    (it stopped answering for a while) and the others went on without it. Restart the
    job (or, under an elastic launcher, this rank's process)."""


class ShrinkFailed(SymmpoolError):
    """``Pool.shrink()`` could not shrink the group after a loss: the store's host
    (rank 0 of the crate's store) is the rank lost, another rank was lost while the
    survivors agreed, the store went on without this rank, or the pool's exchange
    cannot shrink (a store outside the crate's, such as torch's). The pool is left
    as it was (broken).

    ``retry``: ``True`` when ``shrink()`` again can succeed (a second loss while the
    survivors agreed: call it again, on every survivor); ``False``: restart the job.
    Not a :class:`PeerLostError`, whatever its ``kind``: a loop that shrinks on
    ``PeerLostError`` does not catch it, so a failure that says restart is never
    asked again."""

    #: Whether ``shrink()`` again can succeed.
    retry = False


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


#: The exception class of each kind of the crate's errors (the crate's
#: ``ErrorKind::name()``): the one table the extension raises by. A kind the table
#: does not name (a newer crate's) is a :class:`SymmpoolError`.
CLASSES = {
    "usage": UsageError,
    "divergence": DivergenceError,
    "configuration": ConfigurationError,
    "out_of_memory": OutOfMemoryError,
    "timeout": SymmpoolTimeoutError,
    "peer_lost": PeerLostError,
    "group_lost": GroupLostError,
    "broken": SymmpoolError,
    "system": SymmpoolError,
    "internal": SymmpoolError,
}


def _from_crate(kind, message, rank=None, ranks=(), operation=None, field=None, values=(), retry=None):
    """The exception for a crate error of ``kind`` (the extension calls this):
    ``CLASSES[kind]`` with the attributes set, or :class:`ShrinkFailed` for a failed
    shrink (``retry`` not None, whatever the kind). ``values``: ``(rank, text)``
    pairs."""
    if retry is not None:
        e = ShrinkFailed(message)
        e.retry = bool(retry)
    else:
        e = CLASSES.get(kind, SymmpoolError)(message)
    e.kind = kind
    e.rank = rank
    e.ranks = list(ranks)
    e.operation = operation
    if field is not None or values:
        e.field = field
        e.values = dict(values)
    return e
