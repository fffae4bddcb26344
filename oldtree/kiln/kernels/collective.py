"""The collectives' kernels: torch.distributed (gloo on the CPU, NCCL for device tensors), one
implementation for every backend.

A collective runs over the default process group, or over the group its ``group`` attribute names
(an axis of the rank grid: ``"tp"``, ``"pp"``), which the runtime gives this process once, when it
joins (``use_groups``); a peer is then a rank within that group.

Each writes its result into ``out`` like every other kernel. The exchanges along an axis other than
0 go through a buffer of rank-major parts (what torch.distributed exchanges), moved into place after
(all_gather) or before (reduce_scatter). NCCL's collectives are launched on the current stream, so a
CUDA graph captures them like any kernel; gloo's run at once on the host. The ``ref_`` versions say
what each computes from every rank's input, for tests that hold all of them in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .registry import register_impl

# This process's groups by name (the rank grid's axes, and the runtime's own), set when it joins the
# ranks and cleared when it leaves them (runtime/worker/rank_grid.py).
_groups: dict[str, dist.ProcessGroup] = {}


def use_groups(groups: dict[str, dist.ProcessGroup]) -> None:
    """The groups the programs' ``group`` attributes name, for this process (one rank per process)."""
    _groups.clear()
    _groups.update(groups)


def named_group(name: str | None) -> dist.ProcessGroup | None:
    """The group an axis names (None: the default group)."""
    if name is None:
        return None
    if name not in _groups:
        raise RuntimeError(f"the program runs a collective over the {name!r} group, and this process joined "
                           f"none (groups: {', '.join(_groups) or 'only the default one'})")
    return _groups[name]


def ref_all_reduce(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).sum(0)


def ref_all_gather(xs: list[torch.Tensor], axis: int) -> torch.Tensor:
    return torch.cat(xs, dim=axis)


def ref_reduce_scatter(xs: list[torch.Tensor], axis: int, rank: int) -> torch.Tensor:
    return ref_all_reduce(xs).chunk(len(xs), dim=axis)[rank]


def _check_group(op: str, world_size: int, group: str | None) -> dist.ProcessGroup | None:
    """The process group named ``group`` (None: the default one), checked to have ``world_size`` ranks."""
    handle = named_group(group)
    actual = dist.get_world_size(handle) if dist.is_initialized() else 1
    if actual != world_size:
        where = f"the {group!r} group" if group else "a group"
        raise RuntimeError(f"{op}: the program was compiled for {world_size} ranks and runs in {where} of {actual}")
    return handle


def _all_reduce(x, *, out, world_size, group=None):
    handle = _check_group("all_reduce", world_size, group)
    out.copy_(x)
    dist.all_reduce(out, group=handle)


def _all_gather(x, *, out, axis, world_size, group=None):
    handle = _check_group("all_gather", world_size, group)
    if axis == 0:
        dist.all_gather_single(out, x.contiguous(), group=handle)
        return
    parts = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(parts, x.contiguous(), group=handle)
    # [ranks, ..., part, ...] -> [..., ranks * part, ...]
    out.copy_(parts.view(world_size, *x.shape).movedim(0, axis).reshape(out.shape))


def _reduce_scatter(x, *, out, axis, world_size, group=None):
    handle = _check_group("reduce_scatter", world_size, group)
    if axis == 0:
        dist.reduce_scatter_single(out, x.contiguous(), group=handle)
        return
    # [..., ranks * part, ...] -> [ranks, ..., part, ...]
    shape = (*x.shape[:axis], world_size, x.shape[axis] // world_size, *x.shape[axis + 1:])
    parts = x.reshape(shape).movedim(axis, 0).contiguous()
    mine = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    dist.reduce_scatter_single(mine, parts.flatten(0, 1), group=handle)
    out.copy_(mine)


def _send(x, *, peer, group=None):
    handle = named_group(group)
    dist.send(x.contiguous(), peer if handle is None else dist.get_global_rank(handle, peer), group=handle)
    return x


def _recv(*, out, shape, dtype, peer, group=None):
    handle = named_group(group)
    dist.recv(out, peer if handle is None else dist.get_global_rank(handle, peer), group=handle)


register_impl("all_reduce", "torch", _all_reduce)
register_impl("all_gather", "torch", _all_gather)
register_impl("reduce_scatter", "torch", _reduce_scatter)
register_impl("send", "torch", _send)
register_impl("recv", "torch", _recv)
