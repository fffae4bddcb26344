"""The collectives' kernels: torch.distributed on the default process group (gloo on the CPU, NCCL
for device tensors), one implementation for every backend.

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


def ref_all_reduce(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).sum(0)


def ref_all_gather(xs: list[torch.Tensor], axis: int) -> torch.Tensor:
    return torch.cat(xs, dim=axis)


def ref_reduce_scatter(xs: list[torch.Tensor], axis: int, rank: int) -> torch.Tensor:
    return ref_all_reduce(xs).chunk(len(xs), dim=axis)[rank]


def _check_group(op: str, world_size: int) -> None:
    actual = dist.get_world_size() if dist.is_initialized() else 1
    if actual != world_size:
        raise RuntimeError(f"{op}: the program was compiled for {world_size} ranks and runs in a group of {actual}")


def _all_reduce(x, *, out, world_size):
    _check_group("all_reduce", world_size)
    out.copy_(x)
    dist.all_reduce(out)


def _all_gather(x, *, out, axis, world_size):
    _check_group("all_gather", world_size)
    if axis == 0:
        dist.all_gather_single(out, x.contiguous())
        return
    parts = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(parts, x.contiguous())
    # [ranks, ..., part, ...] -> [..., ranks * part, ...]
    out.copy_(parts.view(world_size, *x.shape).movedim(0, axis).reshape(out.shape))


def _reduce_scatter(x, *, out, axis, world_size):
    _check_group("reduce_scatter", world_size)
    if axis == 0:
        dist.reduce_scatter_single(out, x.contiguous())
        return
    # [..., ranks * part, ...] -> [ranks, ..., part, ...]
    shape = (*x.shape[:axis], world_size, x.shape[axis] // world_size, *x.shape[axis + 1:])
    parts = x.reshape(shape).movedim(axis, 0).contiguous()
    mine = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    dist.reduce_scatter_single(mine, parts.flatten(0, 1))
    out.copy_(mine)


def _send(x, *, peer):
    dist.send(x.contiguous(), peer)
    return x


def _recv(*, out, shape, dtype, peer):
    dist.recv(out, peer)


register_impl("all_reduce", "torch", _all_reduce)
register_impl("all_gather", "torch", _all_gather)
register_impl("reduce_scatter", "torch", _reduce_scatter)
register_impl("send", "torch", _send)
register_impl("recv", "torch", _recv)
