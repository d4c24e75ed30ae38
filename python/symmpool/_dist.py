"""Set-up from ``torch.distributed``: the default store, the group's ``ncclComm_t``."""

import itertools
from collections import defaultdict

import torch
import torch.distributed as dist

from ._ext import Pool, StoreExchange

_counters = defaultdict(itertools.count)

#: ``ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO``.
CTA_POLICY_ZERO = 2


def _group(group):
    return group if group is not None else dist.group.WORLD


def _group_name(group):
    return getattr(group, "group_name", None) or "default"


def store_exchange(group=None, *, name="symmpool", poll_s=None):
    """A :class:`StoreExchange` over ``torch.distributed``'s default store for
    ``group``: keys ``symmpool/<group>/<name>/<n>/...``, ``n`` counting the exchanges
    this process made for that group and name (the same on every rank when ranks make
    them in the same order). Each call on it uses a connection of its own to the
    store (``store.clone()``), so a rank's blocking wait never holds up its other
    threads' calls or torch's own; ``poll_s``: see :class:`StoreExchange`."""
    from torch.distributed.distributed_c10d import _get_default_store

    group = _group(group)
    store = _get_default_store()
    gname = _group_name(group)
    n = next(_counters[(gname, name)])
    prefix = f"symmpool/{gname}/{name}/{n}"
    return StoreExchange(
        store, dist.get_rank(group), dist.get_world_size(group), prefix, poll_s
    )


def device_of(group=None):
    """The CUDA device index this rank uses."""
    return torch.cuda.current_device()


def comm_ptr(group=None, device=None):
    """The group's raw ``ncclComm_t`` on ``device`` (the current device by default);
    makes the communicator with one barrier if it does not exist yet."""
    group = _group(group)
    device = torch.cuda.current_device() if device is None else device
    if torch.cuda.current_device() != device:
        raise RuntimeError(
            f"the current CUDA device is {torch.cuda.current_device()}, not {device}: "
            "call torch.cuda.set_device first (_comm_ptr() looks the communicator up by it)"
        )
    backend = group._get_backend(torch.device("cuda", device))
    ptr = backend._comm_ptr()
    if ptr == 0:
        dist.barrier(group=group, device_ids=[device])
        torch.cuda.synchronize(device)
        ptr = backend._comm_ptr()
    if ptr == 0:
        raise RuntimeError(
            "the process group has no NCCL communicator on this device "
            "(init_process_group(..., device_id=...) creates it eagerly)"
        )
    return ptr


def group_cta_policy(group=None, device=None):
    """The CTA policy the group's NCCL config asks for (0 when unknown)."""
    group = _group(group)
    device = torch.cuda.current_device() if device is None else device
    try:
        backend = group._get_backend(torch.device("cuda", device))
        return int(backend.options.config.cta_policy)
    except Exception:
        return 0


def pool_from_group(group=None, *, mode="adopt", name="symmpool", poll_s=None, **kwargs):
    """See :func:`symmpool.from_group`."""
    group = _group(group)
    device = torch.cuda.current_device()
    ptr = comm_ptr(group, device)
    # Nothing of torch's may run on the communicator while the crate splits it.
    torch.cuda.synchronize(device)
    exchange = store_exchange(group, name=name, poll_s=poll_s)
    if mode == "adopt":
        return Pool.nccl_adopt(ptr, device, exchange, name=name, **kwargs)
    if mode == "wrap":
        kwargs.setdefault("cta_policy", group_cta_policy(group, device))
        return Pool.nccl_wrap(ptr, device, exchange, name=name, **kwargs)
    raise ValueError(f"mode must be 'adopt' or 'wrap', not {mode!r}")
