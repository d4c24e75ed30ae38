"""The exception classes the crate's errors map to, their attributes, and the argument
checks (timeouts, dtypes), on host and shared-memory pools: no torch, no GPU."""

import struct

import pytest

import symmpool
from conftest import FakeStore, run_ranks
from symmpool import errors


def test_the_hierarchy():
    assert issubclass(symmpool.SymmpoolError, RuntimeError)
    assert symmpool._ext.SymmpoolError is symmpool.SymmpoolError
    for cls in (
        errors.UsageError,
        errors.DivergenceError,
        errors.SymmpoolTimeoutError,
        errors.PeerLostError,
        errors.OutOfMemoryError,
        errors.ConfigurationError,
    ):
        assert issubclass(cls, symmpool.SymmpoolError)
        assert getattr(symmpool, cls.__name__) is cls
    assert issubclass(errors.SymmpoolTimeoutError, TimeoutError)
    assert issubclass(errors.OutOfMemoryError, MemoryError)
    assert issubclass(errors.ConfigurationError, ValueError)


def test_usage_errors():
    (pool,) = symmpool.Pool.host_group(1)
    with pytest.raises(errors.UsageError, match="zero-size") as e:
        pool.alloc(0)
    assert e.value.rank is None and e.value.ranks == [] and e.value.operation is None
    buf = pool.alloc(4096)
    with pytest.raises(errors.UsageError, match="live buffers") as e:
        pool.close()
    assert e.value.operation == "close" and e.value.ranks == [0]
    buf.free()
    pool.close()
    with pytest.raises(errors.UsageError, match="closed"):
        pool.alloc(4096)


def test_divergent_pool_calls_raise_divergence_on_every_rank():
    pools = symmpool.Pool.host_group(2, timeout_s=20.0)

    def rank(r):
        try:
            pools[r].alloc((3 + 2 * r) << 20)  # different sizes: the growth diverges
        except errors.DivergenceError as e:
            return e
        return None

    raised = run_ranks(2, rank)
    for e in raised:
        assert isinstance(e, errors.DivergenceError), raised
        assert e.ranks == [0, 1]
        assert e.operation
        # What differs, and each rank's value of it.
        assert e.field and sorted(e.values) == [0, 1], (e.field, e.values)
        assert e.values[0] != e.values[1]
        # The advice is said once.
        assert str(e).count("drop") <= 1, str(e)


def test_channel_mismatch_is_a_divergence():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "m", 0.05) for r in range(2)]

    def rank(r):
        try:
            exchanges[r].open_channel(f"pool:{r}", 10.0)
        except errors.DivergenceError as e:
            return e.ranks, e.operation
        return None

    assert run_ranks(2, rank) == [([0, 1], "open_channel")] * 2


def test_timeouts_are_timeout_errors_naming_the_ranks():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "b", 0.05) for r in range(2)]
    with pytest.raises(TimeoutError) as e:
        exchanges[0].all_gather(0, b"x", 0.2)
    assert isinstance(e.value, errors.SymmpoolTimeoutError)
    assert e.value.ranks == [1] and e.value.operation
    # The late rank: the group is out of step, because rank 0 timed out (kind timeout:
    # no rank was lost, so restart rather than shrink).
    with pytest.raises(errors.SymmpoolTimeoutError, match="out of step") as e:
        exchanges[1].all_gather(0, b"y", 5.0)
    assert e.value.rank == 0 and e.value.kind == "timeout"
    assert str(e.value).count("drop") == 1


def test_out_of_memory_is_a_memory_error():
    store = FakeStore()
    ex = symmpool.StoreExchange(store, 0, 1, "oom", 0.05)
    # (A registered pool's first small segment is 32 MiB.)
    pool = symmpool.Pool.shm(ex, name="small", max_reserved_bytes=40 << 20)
    pool.alloc(1 << 20).free()
    with pytest.raises(MemoryError) as e:
        pool.alloc(64 << 20)
    assert isinstance(e.value, errors.OutOfMemoryError)
    assert e.value.operation == "alloc"
    pool.close()


def test_configuration_errors_are_value_errors(monkeypatch):
    with pytest.raises(errors.ConfigurationError):
        symmpool.StoreExchange(FakeStore(), 2, 2)
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="launcher environment") as e:
        symmpool.TcpStoreExchange.from_env()
    assert isinstance(e.value, errors.ConfigurationError)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(errors.ConfigurationError, match="WORLD_SIZE"):
        symmpool.Pool.shm()


def test_negative_timeouts_are_value_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        symmpool.Pool.host_group(1, timeout_s=-1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        symmpool.Pool.host_group(1, timeout_s=float("nan"))
    ex = symmpool.StoreExchange(FakeStore(), 0, 1, "neg")
    with pytest.raises(ValueError, match="timeout_s"):
        ex.all_gather(0, b"x", -0.5)
    with pytest.raises(ValueError, match="timeout_s"):
        ex.open_channel("c", -1)
    # None and infinity: no deadline.
    assert ex.all_gather(0, b"x", None) == [b"x"]
    assert ex.all_gather(0, b"y", float("inf")) == [b"y"]


def _fake(name):
    cls = type("dtype", (), {"__module__": "torch", "__str__": lambda self: f"torch.{name}"})
    return cls()


@pytest.mark.parametrize("dtype", ["float32", "f32", _fake("float32"), _fake("float")])
def test_dtypes_as_strings_and_torch_dtypes(dtype):
    pools = symmpool.Pool.host_group(2)

    def rank(r):
        buf = pools[r].alloc(4 * 4)
        buf.write(struct.pack("<4f", *(float(r + 1),) * 4))
        buf.reduce_scatter(dtype, "sum", tag=0)
        return struct.unpack("<4f", buf.read())[2 * r : 2 * r + 2]

    assert run_ranks(2, rank) == [(3.0, 3.0)] * 2
    run_ranks(2, lambda r: pools[r].close())


def test_unsupported_dtypes_are_refused_clearly():
    (pool,) = symmpool.Pool.host_group(1)
    buf = pool.alloc(64)
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.float64: supported are float32"):
        buf.reduce_scatter(_fake("float64"), tag=0)
    with pytest.raises(ValueError, match="unsupported dtype int7"):
        buf.reduce_scatter("int7", tag=0)
    with pytest.raises(TypeError, match="string or a torch.dtype"):
        buf.reduce_scatter(32, tag=0)
    buf.free()
    pool.close()


def test_shm_pools_as_threads_over_a_store():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "shm", 0.05) for r in range(2)]

    def rank(r):
        pool = symmpool.Pool.shm(exchanges[r], name="shm", timeout_s=30.0)
        assert (pool.rank, pool.world_size, pool.device) == (r, 2, None)
        buf = pool.alloc(8)
        buf.write(bytes(4 * r) + bytes([r + 1]) * 4)
        path = buf.all_gather(tag=0)
        got = buf.read()
        buf.free()
        pool.close()
        return path, got

    for path, got in run_ranks(2, rank):
        assert got == bytes([1]) * 4 + bytes([2]) * 4
        assert path


def test_a_pool_dropped_without_close_warns_through_warnings(capfd):
    import gc

    capfd.readouterr()
    with pytest.warns(symmpool.SymmpoolWarning, match=r"DROPPED WITHOUT close\(\)"):
        pools = symmpool.Pool.host_group(1, name="forgotten")
        pools[0].alloc(4096).free()
        del pools
        gc.collect()
        symmpool.flush_logs()
    assert "DROPPED" not in capfd.readouterr().err  # nothing straight to stderr


def test_failed_calls_are_logged_once_at_debug(caplog, capfd):
    """An error the caller catches (a UsageError it expects) is the exception's to
    say: the crate's "symmpool call failed" event reaches logging at DEBUG at most,
    whichever of the crate's targets emits it, and nothing at INFO or above."""
    import logging

    caplog.set_level(logging.DEBUG, logger="symmpool")
    pools = symmpool.Pool.host_group(1)
    (pool,) = pools
    small, big = pool.alloc(64), pool.alloc(256)
    for call in (
        lambda: pool.alloc(0),  # the pool's own check (target symmpool)
        lambda: small.all_gather(out=big, tag=0),  # a wrong size (target symmpool::coll)
        lambda: small.all_gather(),  # untagged on a pool that needs tags
    ):
        with pytest.raises(errors.UsageError):
            call()
    symmpool.flush_logs()
    # (The crate may log the event at debug itself, below what reaches Python: then
    # there is none; where it logs it higher, the binding delivers it at DEBUG.)
    failed = [r for r in caplog.records if "symmpool call failed" in r.getMessage()]
    assert all(r.levelno == logging.DEBUG and r.name.startswith("symmpool") for r in failed)
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not loud, [(r.levelname, r.name, r.getMessage()) for r in loud]
    assert "symmpool call failed" not in capfd.readouterr().err
    small.free()
    big.free()
    pool.close()


@pytest.mark.parametrize(
    "bad, cls",
    [(-1, ValueError), (2**64, ValueError), (-(2**70), ValueError), ("64", TypeError), (64.0, TypeError),
     (True, TypeError), (None, TypeError)],
)
def test_bad_byte_counts_are_value_or_type_errors(bad, cls):
    """The README: a bad Python argument is a plain ValueError or TypeError (not
    pyo3's OverflowError for a negative int), and nothing is allocated."""
    (pool,) = symmpool.Pool.host_group(1)
    with pytest.raises(cls) as e:
        pool.alloc(bad)
    assert type(e.value) is cls, repr(e.value)
    assert not isinstance(e.value, (OverflowError, symmpool.SymmpoolError))
    # By address too: a negative address or size is a ValueError.
    with pytest.raises(ValueError) as e:
        pool.all_gather_at(-1, 64, tag=0)
    assert type(e.value) is ValueError
    with pytest.raises(ValueError):
        pool.reduce_scatter_into(0x1000, 64, 0x2000, -32, "f32", tag=0)
    pool.close()  # nothing live: the failed calls allocated nothing


def test_a_double_free_is_a_usage_error_and_frees_nothing_else():
    (pool,) = symmpool.Pool.host_group(1)
    buf, other = pool.alloc(64), pool.alloc(64)
    buf.free()
    with pytest.raises(errors.UsageError, match="already freed") as e:
        buf.free()
    assert e.value.kind == "usage"
    other.write(b"still here")
    assert other.read()[:10] == b"still here"  # the other block is untouched
    with pytest.raises(errors.UsageError, match="live buffers"):
        pool.close()  # `other` is still live: the second free returned nothing
    other.free()
    pool.close()
