"""The automatic path choice calibrated from Python (no torch, no GPU): the crate's rule
for when (never on host pools), ``Pool.calibrate`` on host pools (the same policy on
every rank, applied), ``symmpool.fsdp.install``'s ``calibrate=`` logic and the sizes it
reads from FSDP2's parameter groups (by duck typing)."""

import logging
from types import SimpleNamespace

import pytest

import symmpool
from conftest import run_ranks
from symmpool import _calibrate, errors

WORLD = 2
KIB, MIB = 1 << 10, 1 << 20


def _close(pools):
    run_ranks(len(pools), lambda r: pools[r].close())


def test_host_pools_need_no_calibration_and_say_their_policy():
    pools = symmpool.Pool.host_group(WORLD, timeout_s=30.0)
    assert pools[0].needs_calibration is False
    assert pools[0].calibration_reason is None
    assert pools[0].path_policy == (
        "all-gather: symm < 32 MiB, ce ≥ 32 MiB; reduce-scatter: symm ≤ 128 KiB, "
        "1 MiB–4 MiB, else plain; all-reduce: symm"
    )
    # "auto" does nothing where the crate says it is not needed; False never does.
    assert _calibrate.maybe_calibrate(pools[0], "auto") is None
    assert _calibrate.maybe_calibrate(pools[0], False) is None
    with pytest.raises(ValueError, match="calibrate must be"):
        _calibrate.maybe_calibrate(pools[0], "yes")
    with pytest.raises(ValueError, match="calibrate must be"):
        _calibrate.check_choice(1)
    _close(pools)


def test_calibrate_on_host_pools_agrees_and_applies(caplog):
    pools = symmpool.Pool.host_group(WORLD, timeout_s=30.0)
    caplog.set_level(logging.INFO, logger="symmpool.fsdp")

    def rank(r):
        return _calibrate.maybe_calibrate(pools[r], True, (64 * KIB, 256 * KIB))

    out = run_ranks(WORLD, rank)
    for res in out:
        assert res["reason"] == "asked"
        assert (res["min_bytes"], res["max_bytes"]) == (64 * KIB, 256 * KIB)
        assert [m["bytes"] for m in res["measurements"]] == [64 * KIB, 128 * KIB, 256 * KIB]
        assert res["ms"] >= 0
    strip = lambda d: {k: v for k, v in d.items() if k != "ms"}  # noqa: E731
    assert strip(out[0]) == strip(out[1]), "every rank gets rank 0's result"
    for p in pools:
        assert p.path_policy == out[0]["policy"], "applied"
    assert out[0]["policy"].startswith("all-gather: ")
    logged = [r.getMessage() for r in caplog.records if r.name == "symmpool.fsdp"]
    assert len(logged) == WORLD and all("calibrated (asked) over 65536 to 262144" in m for m in logged)
    # The collectives still run on the calibrated policy.
    def gather(r):
        buf = pools[r].alloc(64 * KIB * WORLD)
        buf.write(bytes([r + 1]) * (64 * KIB * WORLD))
        path = buf.all_gather(tag=0)
        data = buf.read()
        buf.free()
        return path, data[:1] + data[64 * KIB : 64 * KIB + 1]

    for path, head in run_ranks(WORLD, gather):
        assert path in ("symmetric_kernel", "copy_engine", "plain_kernel")
        assert head == b"\x01\x02"
    # A bad range is the crate's configuration error, on every rank alike.
    def bad(r):
        with pytest.raises(errors.ConfigurationError):
            pools[r].calibrate(1 * MIB, 64 * KIB)

    run_ranks(WORLD, bad)
    _close(pools)


def _dtype(itemsize):
    return SimpleNamespace(itemsize=itemsize)


def _group(shapes, dtype, param_dtype=None, reduce_dtype=None):
    params = [
        SimpleNamespace(padded_sharded_param_size=shape, sharded_param=SimpleNamespace(dtype=dtype))
        for shape in shapes
    ]
    mp = SimpleNamespace(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return SimpleNamespace(fsdp_params=params, mp_policy=mp)


def test_the_sizes_come_from_the_fsdp_parameter_groups():
    f32, bf16 = _dtype(4), _dtype(2)
    # Two layers of 512 x 1024 + 512 per rank in f32; a root with a 1000 x 64 embedding.
    layer = _group([(512, 1024), (512,)], f32)
    root = _group([(1000, 64)], f32)
    assert _calibrate.collective_range([root, layer, layer, None]) == (256000, (512 * 1024 + 512) * 4)
    # Mixed precision: bf16 all-gathers, f32 reduce-scatters.
    mixed = _group([(512, 1024)], f32, param_dtype=bf16, reduce_dtype=f32)
    assert _calibrate.collective_range([mixed]) == (512 * 1024 * 2, 512 * 1024 * 4)
    # Nothing known: None (install then calibrates over the default range).
    assert _calibrate.collective_range([]) is None
    assert _calibrate.collective_range([None]) is None
    assert _calibrate.collective_range([SimpleNamespace()]) is None
    assert _calibrate.DEFAULT_RANGE == (64 * KIB, 64 * MIB)


def test_tiny_sizes_are_raised_to_what_the_crate_measures():
    pools = symmpool.Pool.host_group(WORLD, timeout_s=30.0)
    out = run_ranks(WORLD, lambda r: _calibrate.maybe_calibrate(pools[r], True, (1, 2)))
    assert [(o["min_bytes"], o["max_bytes"]) for o in out] == [(4, 4)] * WORLD
    assert [m["bytes"] for m in out[0]["measurements"]] == [4]
    _close(pools)
