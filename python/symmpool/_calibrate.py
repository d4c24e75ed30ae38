"""The automatic path choice measured on the machine at hand, for
:func:`symmpool.fsdp.install`'s ``calibrate=``: whether to, over which sizes, and the
log line. No torch needed (FSDP2's parameter groups are read by duck typing).

The crate's default thresholds were measured with every rank on its own GPU of one
node (two H200s over NVLink). Elsewhere the automatic choice can be far from the best
path (two NCCL ranks time-sharing one GPU: 1.34 x the plain ring), so there
``Pool.needs_calibration`` is true (NCCL with more than one rank, when ranks share a
GPU or span several nodes) and ``Pool.calibrate`` measures every path over the job's
sizes and keeps the fastest per size."""

import logging
import math

_log = logging.getLogger("symmpool.fsdp")

#: Bytes per rank measured when the job's collective sizes are not known: 64 KiB to
#: 64 MiB (11 sizes).
DEFAULT_RANGE = (64 << 10, 64 << 20)

#: The largest size the crate measures (``symmpool::coll::MAX_CALIBRATE_BYTES``).
MAX_BYTES = 16 << 30


def collective_range(groups):
    """``(smallest, largest)`` bytes per rank of the all-gather inputs and
    reduce-scatter outputs of FSDP2 parameter groups ``groups`` (``FSDPParamGroup``:
    ``fsdp_params``, each with ``padded_sharded_param_size`` and ``sharded_param``,
    and ``mp_policy``; ``None`` entries, modules without parameters, are skipped): per
    group, the padded shards of its parameters, in the mixed-precision policy's
    ``param_dtype`` for the all-gather and ``reduce_dtype`` for the reduce-scatter
    (each the parameter's own dtype when unset). ``None`` when no size is known
    (FSDP2's private attributes not there, or nothing to gather)."""
    sizes = []
    try:
        for group in groups:
            if group is None:
                continue
            mp = getattr(group, "mp_policy", None)
            param_dtype = getattr(mp, "param_dtype", None)
            reduce_dtype = getattr(mp, "reduce_dtype", None)
            ag = rs = 0
            for p in group.fsdp_params:
                numel = math.prod(p.padded_sharded_param_size)
                ag_dtype = param_dtype or p.sharded_param.dtype
                ag += numel * ag_dtype.itemsize
                rs += numel * (reduce_dtype or ag_dtype).itemsize
            sizes += [s for s in (ag, rs) if s > 0]
    except (AttributeError, TypeError):
        return None
    return (min(sizes), max(sizes)) if sizes else None


def check_choice(calibrate):
    """Refuse a ``calibrate=`` that is not ``"auto"``, ``True`` or ``False``
    (``ValueError``), before anything collective happens."""
    if not (calibrate == "auto" or calibrate is True or calibrate is False):
        raise ValueError(f'calibrate must be "auto", True or False, not {calibrate!r}')


def maybe_calibrate(pool, calibrate="auto", sizes=None, stream=0):
    """Calibrate ``pool``'s automatic path choice (``Pool.calibrate``, applied to its
    collectives) when ``calibrate`` says so: ``"auto"`` where the crate says it is
    needed (``pool.needs_calibration``), ``True`` always, ``False`` never. Over
    ``sizes`` (``(smallest, largest)`` bytes per rank; ``None``: :data:`DEFAULT_RANGE`)
    with cheap settings (3 repetitions of about 3 calls per path and size), on the
    raw stream ``stream``. Logs the thresholds chosen at INFO on the
    ``"symmpool.fsdp"`` logger. Returns ``Pool.calibrate``'s dict with ``reason``
    added (the crate's, or ``"asked"``), or ``None`` when it did not calibrate.

    Collective: every rank calls it at the same point with the same arguments (they
    all reach the same decision)."""
    check_choice(calibrate)
    if calibrate is True:
        reason = pool.calibration_reason or "asked"
    elif calibrate is False:
        reason = None
    else:
        reason = pool.calibration_reason
    if reason is None:
        return None
    lo, hi = sizes or DEFAULT_RANGE
    # The crate measures 4 bytes to 16 GiB per rank.
    lo, hi = min(max(lo, 4), MAX_BYTES), min(max(hi, 4), MAX_BYTES)
    result = pool.calibrate(lo, hi, stream=stream)
    result["reason"] = reason
    _log.info(
        "symmpool: calibrated (%s) over %d to %d bytes per rank: %s; took %.0f ms",
        reason,
        lo,
        hi,
        result["policy"],
        result["ms"],
    )
    return result
