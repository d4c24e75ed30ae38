"""Collectives from Python on host pools (ranks as threads, no torch, no GPU): tags
(0 a tag like any other; untagged calls refused unless the pool was made for them),
end_step and wait_checks, the check modes,
all-reduce in and out of place, freed buffers, the exception classes from the one
table of the crate's error kinds."""

import struct

import pytest

import symmpool
from conftest import FakeStore, run_ranks
from symmpool import errors

WORLD = 2


def _floats(values):
    return struct.pack(f"<{len(values)}f", *values)


def _unfloats(data):
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def _close(pools):
    run_ranks(len(pools), lambda r: pools[r].close())


def _close_broken(pools):
    """Close pools that a divergence broke: each rank releases its memory (a close
    that reports why the pool broke is fine too)."""

    def close(r):
        try:
            pools[r].close()
        except errors.SymmpoolError as e:
            assert e.kind in ("broken", "divergence"), (e.kind, str(e))

    run_ranks(len(pools), close)


@pytest.mark.parametrize("check", ["strict", "async", "off"])
def test_tagged_collectives_and_end_step(check):
    pools = symmpool.Pool.host_group(WORLD, check=check, timeout_s=30.0)
    assert pools[0].check == check

    def rank(r):
        buf = pools[r].alloc(8 * WORLD)
        for tag in (0, 1, 2**64 - 1):  # 0 is a tag like any other
            buf.write(bytes(8 * r) + bytes([r + 1]) * 8 + bytes(8 * (WORLD - 1 - r)))
            assert buf.all_gather(tag=tag)
            assert buf.read() == b"".join(bytes([q + 1]) * 8 for q in range(WORLD))
        pools[r].end_step()
        pools[r].wait_checks()
        buf.free()

    run_ranks(WORLD, rank)
    _close(pools)


def test_tags_are_ints_in_range():
    (pool,) = symmpool.Pool.host_group(1)
    buf = pool.alloc(64)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="tag must be from 0 to 2"):
            buf.all_gather(tag=bad)
    for bad in ("layer", 1.0, True):
        with pytest.raises(TypeError, match="tag must be an int"):
            buf.all_gather(tag=bad)
    with pytest.raises(TypeError):
        buf.all_gather(7)  # keyword only
    buf.free()
    pool.close()


def test_check_arguments_are_checked():
    with pytest.raises(ValueError, match='check must be "strict", "async", "off" or None'):
        symmpool.Pool.host_group(2, check="sometimes")
    with pytest.raises(ValueError, match="check_queue must be at least 1"):
        symmpool.Pool.host_group(2, check_queue=0)
    # World size 1 has no peer to compare with: off, whatever the setting.
    (pool,) = symmpool.Pool.host_group(1, check="strict")
    assert pool.check == "off"
    pool.end_step()  # nothing to compare: returns at once
    pool.close()


def _gather_with_tags(pools, tags_of_rank):
    """Each rank writes its shard, all-gathers with its tag and returns the error it
    got, the buffer's bytes before and after (read only after the checks passed)."""

    def rank(r):
        buf = pools[r].alloc(4 * WORLD)
        mine = bytes(4 * r) + bytes([r + 1]) * 4 + bytes(4 * (WORLD - 1 - r))
        buf.write(mine)
        try:
            buf.all_gather(tag=tags_of_rank[r])
            pools[r].wait_checks()
            return None, buf.read()
        except errors.DivergenceError as e:
            return e, mine
        finally:
            buf.free()

    return run_ranks(WORLD, rank)


@pytest.mark.parametrize("check", ["strict", "async"])
def test_different_tags_are_a_divergence_on_every_rank(check):
    pools = symmpool.Pool.host_group(WORLD, check=check, check_queue=1, timeout_s=30.0)
    results = _gather_with_tags(pools, {0: 0, 1: 5})  # tag 0 is a tag, not "untagged"
    for e, _ in results:
        assert isinstance(e, errors.DivergenceError), results
        assert type(e) is errors.CLASSES[e.kind] and e.kind == "divergence"
        assert e.ranks == [0, 1] and e.field == "tag", (e.ranks, e.field, str(e))
        assert sorted(e.values) == [0, 1] and e.values[0] != e.values[1], e.values
        assert "5" in e.values[1], e.values
        assert e.operation == f"{check} check"
    # Broken from now on: the next call says the same, on every rank, a pool call
    # (an allocation) too.
    with pytest.raises(errors.DivergenceError):
        pools[0].end_step()
    with pytest.raises(errors.DivergenceError) as e:
        pools[1].alloc(64)
    assert e.value.field == "tag" and e.value.ranks == [0, 1]
    _close_broken(pools)


def test_strict_moves_no_data_on_a_divergence():
    pools = symmpool.Pool.host_group(WORLD, check="strict", timeout_s=30.0)

    def rank(r):
        buf = pools[r].alloc(4 * WORLD)
        mine = bytes(4 * r) + bytes([r + 1]) * 4 + bytes(4 * (WORLD - 1 - r))
        buf.write(mine)
        with pytest.raises(errors.DivergenceError):
            buf.all_gather(tag=r)
        # The check ran before the launch: this rank's buffer is as it wrote it.
        assert buf.read() == mine
        buf.free()

    run_ranks(WORLD, rank)
    _close_broken(pools)


@pytest.mark.parametrize("tag", [7, None])
def test_same_tags_pass_and_untagged_calls_too(tag):
    # Untagged calls on a pool made for them.
    untagged = tag is None
    pools = symmpool.Pool.host_group(WORLD, check="strict", timeout_s=30.0, untagged_collectives=untagged)
    assert all(p.untagged_collectives == untagged for p in pools)
    for e, got in _gather_with_tags(pools, {0: tag, 1: tag}):
        assert e is None and got == b"".join(bytes([q + 1]) * 4 for q in range(WORLD))
    _close(pools)


@pytest.mark.parametrize("op, expected", [("sum", 3.0), ("max", 2.0), ("min", 1.0), ("avg", 1.5)])
def test_all_reduce_in_place(op, expected):
    pools = symmpool.Pool.host_group(WORLD, check="strict", timeout_s=30.0)

    def rank(r):
        buf = pools[r].alloc(4 * 6)
        buf.write(_floats([float(r + 1)] * 6))
        assert buf.all_reduce("float32", op, tag=3)
        got = _unfloats(buf.read())
        buf.free()
        return got

    for got in run_ranks(WORLD, rank):
        assert got == [expected] * 6
    _close(pools)


def test_out_of_place_collectives():
    pools = symmpool.Pool.host_group(WORLD, check="strict", timeout_s=30.0)

    def rank(r):
        pool = pools[r]
        src = pool.alloc(4 * 4)
        src.write(_floats([float(r + 1), 10.0 * (r + 1), 0.5, -1.0]))
        summed = pool.alloc(4 * 4)
        src.all_reduce("f32", "sum", out=summed, tag=0)
        scattered = pool.alloc(4 * 4 // WORLD)
        src.reduce_scatter("f32", "sum", out=scattered, tag=1)
        gathered = pool.alloc(4 * 4 * WORLD)
        src.all_gather(out=gathered, tag=2)
        out = (
            _unfloats(src.read()),
            _unfloats(summed.read()),
            _unfloats(scattered.read()),
            _unfloats(gathered.read()),
        )
        for b in (src, summed, scattered, gathered):
            b.free()
        return out

    results = run_ranks(WORLD, rank)
    for r, (src, summed, scattered, gathered) in enumerate(results):
        assert src == [float(r + 1), 10.0 * (r + 1), 0.5, -1.0]  # the input is unchanged
        assert summed == [3.0, 30.0, 1.0, -2.0]
        assert scattered == [3.0, 30.0, 1.0, -2.0][2 * r : 2 * r + 2]
        assert gathered == results[0][0] + results[1][0]
    _close(pools)


def test_a_freed_buffer_is_a_usage_error():
    (pool,) = symmpool.Pool.host_group(1)
    buf = pool.alloc(64)
    other = pool.alloc(64)
    buf.free()
    for use in (
        lambda: buf.free(),  # a second free (the README: a freed buffer is a UsageError)
        lambda: buf.nbytes,
        lambda: buf.read(),
        lambda: buf.write(b"x"),
        lambda: buf.all_gather(tag=0),
        lambda: buf.reduce_scatter("f32", tag=0),
        lambda: buf.all_reduce("f32", tag=0),
        lambda: other.all_reduce("u8", out=buf, tag=0),
    ):
        with pytest.raises(errors.UsageError, match="freed") as e:
            use()
        assert e.value.kind == "usage" and "freed" in symmpool.last_error()
    other.free()
    pool.close()


def test_error_classes_come_from_one_table_of_kinds():
    assert set(errors.CLASSES) == {
        "usage", "divergence", "configuration", "out_of_memory", "timeout", "peer_lost",
        "group_lost", "broken", "system", "internal",
    }
    assert errors.CLASSES["usage"] is errors.UsageError
    assert errors.CLASSES["timeout"] is errors.SymmpoolTimeoutError
    assert errors.CLASSES["peer_lost"] is errors.PeerLostError
    assert errors.CLASSES["group_lost"] is errors.GroupLostError
    # A failed shrink is ShrinkFailed whatever its kind (retry or not), never a
    # PeerLostError: a loop that shrinks on PeerLostError does not ask again when the
    # failure says restart.
    for kind, retry in (("peer_lost", True), ("group_lost", False), ("peer_lost", False)):
        e = errors._from_crate(kind, "m", None, [], "shrink", None, (), retry)
        assert type(e) is errors.ShrinkFailed and (e.kind, e.retry) == (kind, retry)
        assert not isinstance(e, errors.PeerLostError) and isinstance(e, symmpool.SymmpoolError)
    assert symmpool.ShrinkFailed is errors.ShrinkFailed
    for kind in ("broken", "system", "internal"):
        assert errors.CLASSES[kind] is errors.SymmpoolError
    # A kind a newer crate adds is a SymmpoolError, with its kind kept.
    e = errors._from_crate("something_new", "m", 3, [3], "op")
    assert type(e) is errors.SymmpoolError and (e.kind, e.rank, e.ranks, e.operation) == ("something_new", 3, [3], "op")
    # Errors raised by the crate are their kind's class.
    (pool,) = symmpool.Pool.host_group(1)
    raised = []
    for call in (lambda: pool.alloc(0), lambda: symmpool.Pool.host_group(2, timeout_s=-1)):
        try:
            call()
        except Exception as e:  # noqa: BLE001
            raised.append(e)
    usage, negative = raised
    assert type(usage) is errors.CLASSES[usage.kind] is errors.UsageError
    assert type(negative) is ValueError  # a bad Python argument, not a crate error
    pool.close()
    with pytest.raises(errors.UsageError) as e:
        pool.alloc(64)  # closed
    assert e.value.kind == "usage"


@pytest.mark.parametrize("world", [1, WORLD])
@pytest.mark.parametrize("check", ["strict", "async", "off"])
def test_untagged_collectives_raise_usage_error_by_default(check, world):
    # Every collective needs tag= on a pool with the default settings; nothing runs.
    pools = symmpool.Pool.host_group(world, check=check, timeout_s=30.0)
    assert not any(p.untagged_collectives for p in pools)

    def rank(r):
        buf = pools[r].alloc(8 * world)
        out = pools[r].alloc(8 * world)
        mine = bytes([r + 7]) * (8 * world)
        for call in (
            lambda: buf.all_gather(),
            lambda: buf.reduce_scatter("f32"),
            lambda: buf.all_reduce("f32", out=out),
            lambda: buf.all_reduce("u8", "max"),
        ):
            buf.write(mine)
            with pytest.raises(errors.UsageError, match="has no identity") as e:
                call()
            assert e.value.kind == "usage"
            assert "tag=" in str(e.value) and "untagged_collectives=True" in str(e.value)
            assert buf.read() == mine  # nothing ran
        assert buf.all_gather(tag=1)
        pools[r].end_step()
        buf.free()
        out.free()

    run_ranks(world, rank)
    _close(pools)


@pytest.mark.parametrize("check", ["strict", "async", "off"])
def test_a_pool_made_for_untagged_collectives_runs_them(check):
    pools = symmpool.Pool.host_group(WORLD, check=check, timeout_s=30.0, untagged_collectives=True)
    assert all(p.untagged_collectives for p in pools)

    def rank(r):
        buf = pools[r].alloc(8 * WORLD)
        buf.write(bytes(8 * r) + bytes([r + 1]) * 8 + bytes(8 * (WORLD - 1 - r)))
        assert buf.all_gather()
        got = buf.read()
        assert buf.all_gather(tag=3)  # tagged calls too
        pools[r].end_step()
        buf.free()
        return got

    for got in run_ranks(WORLD, rank):
        assert got == b"".join(bytes([q + 1]) * 8 for q in range(WORLD))
    _close(pools)


@pytest.mark.parametrize("check", ["strict", "async"])
def test_grow_without_a_newcomer_is_none_on_every_rank_and_the_pools_go_on(check):
    world = 3
    pools = symmpool.Pool.host_group(world, check=check, timeout_s=30.0)
    assert all(p.joined is None for p in pools)  # made with the group, not joined

    def rank(r):
        pool = pools[r]
        before = pool.alloc(8 * world)  # a live buffer across the ask: nothing changes
        grown = pool.grow(wait=False)  # every rank asks; no newcomer waits
        before.write(bytes(8 * r) + bytes([r + 1]) * 8 + bytes(8 * (world - 1 - r)))
        assert before.all_gather(tag=1)  # the same pool goes on
        got = before.read()
        pool.end_step()
        before.free()
        return grown, got

    for grown, got in run_ranks(world, rank):
        assert grown is None
        assert got == b"".join(bytes([q + 1]) * 8 for q in range(world))
    with pytest.raises(TypeError):
        pools[0].grow(True)  # wait is keyword-only: pool.grow(wait=True)
    _close(pools)
    # A closed pool cannot grow (on every rank alike: nothing is asked).
    with pytest.raises(symmpool.UsageError):
        pools[0].grow(wait=False)


def test_grow_over_a_python_store_is_a_configuration_error():
    """Only the crate's store (TcpStoreExchange) and a host world take newcomers: a
    pool over torch's kind of store cannot grow, and says so in Python's words."""
    store = FakeStore()
    exchanges = [symmpool.StoreExchange(store, r, WORLD, "g", 0.05) for r in range(WORLD)]
    pools = symmpool.Pool.host_group(WORLD, exchanges=exchanges, timeout_s=30.0)

    def rank(r):
        with pytest.raises(symmpool.ConfigurationError) as e:
            pools[r].grow(wait=False)
        assert "TcpStoreExchange" in str(e.value), str(e.value)
        buf = pools[r].alloc(64)  # the pool is as it was
        buf.free()

    run_ranks(WORLD, rank)
    _close(pools)
