"""What runs without torch and without a GPU: the module, the C functions, the
store-backed exchange (two ranks as threads over a fake store), host pools."""

import ctypes
import json

import pytest

import symmpool
from conftest import FakeStore, run_ranks


def test_import_and_version():
    assert symmpool.__version__
    assert symmpool._ext.__file__.endswith(".so")
    assert issubclass(symmpool.SymmpoolError, RuntimeError)


def test_last_error_starts_empty_and_clears():
    symmpool.clear_error()
    assert symmpool.last_error() is None


def _lib():
    lib = ctypes.CDLL(symmpool._ext.__file__)
    lib.symmpool_alloc.restype = ctypes.c_void_p
    lib.symmpool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.symmpool_free.restype = None
    lib.symmpool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def test_c_alloc_without_a_pool_returns_null_and_keeps_the_reason():
    symmpool.install_allocator(None)
    symmpool.clear_error()
    assert _lib().symmpool_alloc(1 << 20, 0, None) is None
    assert "no pool installed" in symmpool.last_error()


def test_c_alloc_from_a_host_pool_is_refused_with_a_reason():
    (pool,) = symmpool.Pool.host_group(1)
    symmpool.install_allocator(pool)
    try:
        symmpool.clear_error()
        assert _lib().symmpool_alloc(4096, 0, None) is None
        assert "host pool" in symmpool.last_error()
    finally:
        assert symmpool.install_allocator(None) == "symmpool"


def test_c_free_of_an_unknown_pointer_keeps_the_reason():
    symmpool.clear_error()
    _lib().symmpool_free(0x1234, 64, 0, None)
    assert "not a symmpool buffer" in symmpool.last_error()


def test_store_exchange_two_ranks_as_threads():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "t", 0.05) for r in range(2)]

    def rank(r):
        ex = exchanges[r]
        ch = ex.open_channel("pool:a", 10.0)
        out = []
        for i in range(4):
            out.append(ex.all_gather(ch, bytes([r, i]), 10.0))
        return ch, out

    results = run_ranks(2, rank)
    for ch, out in results:
        assert ch == 1
        assert out == [[bytes([0, i]), bytes([1, i])] for i in range(4)]
    # Keys of finished rounds are deleted: only the last round of channel 1 remains.
    assert sorted(k for k in store.data if k.startswith("t/1/")) == ["t/1/3/0", "t/1/3/1"]
    assert repr(exchanges[0]) == 'StoreExchange(rank=0, world_size=2, prefix="t")'


def test_store_exchange_mismatched_channels_fail_on_every_rank():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "m", 0.05) for r in range(2)]

    def rank(r):
        try:
            exchanges[r].open_channel(f"pool:{r}", 10.0)
        except symmpool.SymmpoolError as e:
            return str(e)
        return None

    msgs = run_ranks(2, rank)
    assert all(m and "different channels" in m for m in msgs), msgs


def test_store_exchange_timeout_breaks_the_group():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "b", 0.05) for r in range(2)]
    with pytest.raises(symmpool.SymmpoolError, match=r"timed out .* ranks \[1\] did not arrive"):
        exchanges[0].all_gather(0, b"x", 0.2)
    assert "timed out" in symmpool.last_error()
    # The late rank learns that the group is broken instead of pairing with a ghost.
    with pytest.raises(symmpool.SymmpoolError, match="out of step"):
        exchanges[1].all_gather(0, b"y", 5.0)
    with pytest.raises(symmpool.SymmpoolError, match="out of step"):
        exchanges[0].all_gather(0, b"x", 5.0)


def test_store_exchange_store_errors_surface():
    class Broken(FakeStore):
        def set(self, key, value):
            raise OSError("store connection reset")

    ex = symmpool.StoreExchange(Broken(), 0, 1, "e")
    with pytest.raises(symmpool.SymmpoolError, match="store connection reset"):
        ex.all_gather(0, b"x", 1.0)


def test_host_pools_over_the_store_place_alike_and_gather():
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, 2, "p", 0.05) for r in range(2)]
    pools = symmpool.Pool.host_group(2, name="hostpool", exchanges=exchanges)
    assert [p.rank for p in pools] == [0, 1]
    assert pools[0].device is None

    def rank(r):
        pool = pools[r]
        small = pool.alloc(1000)
        big = pool.alloc(3 << 20)  # grows the pool: an agreement over the store
        big.write(bytes([r + 1]) * (3 << 19))  # this rank's half, for the in-place gather
        if r == 1:  # rank 1's shard sits in the second half
            data = bytes(3 << 19) + bytes([2]) * (3 << 19)
            big.write(data)
        path = big.all_gather(tag=0)
        got = big.read()
        return (small.segment, small.offset), (big.segment, big.offset), path, got[0], got[-1]

    results = run_ranks(2, rank)
    assert results[0][:2] == results[1][:2]  # same placement on both ranks
    for _, _, path, first, last in results:
        assert path in ("symmetric_kernel", "copy_engine", "plain_kernel")
        assert (first, last) == (1, 2)
    assert store.calls > 0

    stats = pools[0].memory_stats()
    assert stats["num_device_alloc"] >= 2
    assert stats["allocation.all.current"] == 0  # the buffers died with the threads
    assert isinstance(stats["growth_seconds"], float)
    snap = pools[0].memory_snapshot()
    assert snap["rank"] == 0 and snap["pool"] == "hostpool" and snap["segments"]
    text = pools[0].memory_snapshot(as_json=True)
    assert json.loads(text) == snap
    svg = pools[0].memory_map_svg()
    assert svg.lstrip().startswith("<svg") or "<svg" in svg
    both = symmpool.render_ranks_svg([p.memory_snapshot_json() for p in pools])
    assert "<svg" in both
    run_ranks(2, lambda r: pools[r].close())


def test_host_reduce_scatter_and_freed_buffers():
    pools = symmpool.Pool.host_group(2)

    def rank(r):
        import struct

        buf = pools[r].alloc(4 * 4)
        buf.write(struct.pack("<4f", *(float(r + 1),) * 4))
        path = buf.reduce_scatter("f32", "sum", tag=0)
        values = struct.unpack("<4f", buf.read())
        buf.free()
        with pytest.raises(symmpool.UsageError, match="freed"):
            buf.nbytes
        return path, values[2 * r : 2 * r + 2]

    for path, mine in run_ranks(2, rank):
        assert mine == (3.0, 3.0)
        assert path in ("symmetric_kernel", "plain_kernel")
    assert pools[0].memory_stats()["allocation.all.current"] == 0


def test_dlpack_needs_a_gpu_pool():
    (pool,) = symmpool.Pool.host_group(1)
    with pytest.raises(RuntimeError, match="NCCL"):
        pool.alloc_dlpack(1024)


def test_bad_arguments():
    (pool,) = symmpool.Pool.host_group(1)
    with pytest.raises(ValueError, match="not the start of a symmpool buffer"):
        pool.all_gather_at(0xDEAD000, 1024, tag=0)
    with pytest.raises(ValueError, match="not the start of a symmpool buffer"):
        pool.reduce_scatter_into(0xDEAD000, 1024, 0xBEEF000, 512, "f32", tag=0)
    with pytest.raises(ValueError, match="unknown reduction"):
        pool.alloc(1024).reduce_scatter("f32", "xor", tag=0)
    with pytest.raises(symmpool.SymmpoolError):
        pool.alloc(0)
    with pytest.raises(symmpool.SymmpoolError):
        symmpool.StoreExchange(FakeStore(), 2, 2)


def test_nccl_mappings_reads_proc_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libnccl.so.2.28.3\n"
        "7f01-7f02 r--p 00001000 08:01 123 /usr/lib/libnccl.so.2.28.3\n"
        "7f02-7f03 r-xp 00000000 08:01 456 /site-packages/nvidia/nccl/lib/libnccl.so.2\n"
        "7f03-7f04 r-xp 00000000 08:01 789 /usr/lib/libc.so.6\n"
    )
    assert symmpool.nccl_mappings(str(maps)) == 2
    assert symmpool.nccl_libraries(str(maps))[0].endswith("libnccl.so.2")
    assert symmpool.nccl_mappings() in (0, 1)  # this process: no NCCL or one


def test_nccl_version_is_an_error_or_a_version():
    try:
        v = symmpool.nccl_version()
    except symmpool.SymmpoolError as e:
        # No driver here, or no NCCL: a clear error, never a crash.
        assert "not available" in str(e) or "NCCL" in str(e)
    else:
        assert v >= (2, 0, 0)


def test_memory_history_and_a_snapshot_memory_viz_opens(tmp_path):
    """The snapshot in PyTorch's format, with the recorded history, pickled: the keys
    `torch.cuda.memory._snapshot()` has; where torch is installed, its memory_viz
    reads the file (its segment and trace plots)."""
    import pickle

    (pool,) = symmpool.Pool.host_group(1)
    pool.record_memory_history(1000)
    a = pool.alloc(1 << 20)
    b = pool.alloc(3 << 20)
    a.free()
    path = tmp_path / "snapshot.pickle"
    pool.dump_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}, snap.keys()
    seg = snap["segments"][0]
    assert {"address", "total_size", "stream", "segment_type", "allocated_size", "blocks"} <= set(seg), seg
    states = [blk["state"] for s in snap["segments"] for blk in s["blocks"]]
    assert "active_allocated" in states and "inactive" in states, states
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions.count("alloc") == 2 and "free_completed" in actions, actions
    assert "segment_alloc" in actions, actions
    try:
        from torch.cuda import _memory_viz
    except ImportError:
        pass
    else:
        assert _memory_viz.segment_plot(snap)
        assert _memory_viz.trace_plot(snap)
    pool.record_memory_history(0)
    assert pool.torch_memory_snapshot()["device_traces"] in ([], [[]])
    b.free()
    pool.close()


def test_store_exchange_poll_setting():
    ex = symmpool.StoreExchange(FakeStore(), 0, 1, "poll")
    assert ex.poll_s is None  # one blocking wait per round, up to the deadline
    assert symmpool.StoreExchange(FakeStore(), 0, 1, "poll", 0.25).poll_s == 0.25
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="poll_s"):
            symmpool.StoreExchange(FakeStore(), 0, 1, "poll", bad)


@pytest.mark.parametrize("check", ["async", "strict"])
def test_a_blocking_wait_never_holds_up_another_call_of_the_rank(check):
    """Each store call runs on a client of its own (``store.clone()``): the async
    check's thread waiting for a round on one client never holds up the caller's
    thread posting its key on another (a c10d client serves one request at a time;
    sharing one, each such overlap cost up to poll_s, 1 s: FSDP2 under async was
    ten times slower than under strict; here, 10 steps took 15 s). Checked without
    timing: no call of the exchange ever waited for another on the same client."""
    from conftest import ClientStore

    root = ClientStore()
    stores = [root.clone() for _ in range(2)]  # each rank's own client, as in torch
    exchanges = [symmpool.StoreExchange(stores[r], r, 2, "clients") for r in range(2)]
    assert all(ex.poll_s is None for ex in exchanges)

    def rank(r):
        # Shared-memory pools (ranks as threads): their checks run over the store.
        pool = symmpool.Pool.shm(exchanges[r], name="clients", check=check, timeout_s=60.0)
        buf = pool.alloc(8 * 2)
        for step in range(10):
            for layer in range(3):
                buf.write(bytes(8 * r) + bytes([step + layer + r]) * 8 + bytes(8 * (1 - r)))
                buf.all_gather(tag=(step << 8) | layer)
                expected = bytes([step + layer]) * 8 + bytes([step + layer + 1]) * 8
                assert buf.read() == expected
            pool.end_step()
        pool.wait_checks()
        buf.free()
        pool.close()

    run_ranks(2, rank)
    assert root.contended == 0, root.counter
    assert all(ex.store_clients >= 1 for ex in exchanges)
