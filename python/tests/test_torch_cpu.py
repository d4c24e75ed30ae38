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
