"""What needs torch but no GPU: the FSDP and allocator modules import, the comm objects
are FSDP2's types. Skipped (with the reason) where torch is not installed."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")


def test_fsdp_module_imports_and_subclasses_fsdp_api():
    from symmpool import fsdp

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        pytest.skip("this torch has no FSDP2 comm API")
    assert issubclass(fsdp.AllGather, AllGather)
    assert issubclass(fsdp.ReduceScatter, ReduceScatter)


def test_allocator_names_the_extension():
    from symmpool import allocator

    assert allocator.ALLOC_FN == "symmpool_alloc"
    assert allocator.FREE_FN == "symmpool_free"


def test_store_exchange_over_torchs_tcp_store_never_waits_on_a_poll():
    """Two ranks as threads, each with its own client of a c10d ``TCPStore`` (behind a
    ``PrefixStore``, as torch's default store is), shared-memory pools checked under
    async: each store call runs on a clone of the rank's client, so the async check's
    blocking wait never holds up the rank's other calls. With one shared client these
    10 steps took about 15 s (each overlap waited out a 1 s poll); now milliseconds.
    The bound is loose: it only tells the two apart."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import symmpool
    from conftest import run_ranks

    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=timedelta(seconds=60))
    stores = [dist.PrefixStore("default_pg", s) for s in (master, client)]
    exchanges = [symmpool.StoreExchange(stores[r], r, 2, "torch-store") for r in range(2)]

    def rank(r):
        pool = symmpool.Pool.shm(exchanges[r], name="torch-store", check="async", timeout_s=60.0)
        buf = pool.alloc(8 * 2)
        for step in range(10):
            for layer in range(3):
                buf.write(bytes(8 * r) + bytes([step + layer + r]) * 8 + bytes(8 * (1 - r)))
                buf.all_gather(tag=(step << 8) | layer)
                assert buf.read() == bytes([step + layer]) * 8 + bytes([step + layer + 1]) * 8
            pool.end_step()
        pool.wait_checks()
        buf.free()
        pool.close()

    t0 = time.monotonic()
    run_ranks(2, rank)
    took = time.monotonic() - t0
    assert took < 8.0, f"10 async steps over torch's store took {took:.1f} s"
    assert all(ex.store_clients >= 1 for ex in exchanges)
