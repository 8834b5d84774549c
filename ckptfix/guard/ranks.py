"""The guard on several ranks (torchrun: FSDP2, DDP): local data tests, one agreed verdict.

On a DTensor, `any()`, `.item()` and `torch.equal` are themselves collectives (or, worse, silently
per-rank answers), so a branch on such a value makes ranks issue different collectives and hang in
the next one. The guard therefore never asks a DTensor about its data: every test runs on this rank's
own piece (`local`), the tensors tested are chosen by names and metadata (the same on every rank), and
the per-rank numbers of one check travel in ONE all_reduce (`gather`), after which every rank holds
every rank's numbers and draws the same findings with global counts. Outside a process group of more
than one rank nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ckptfix.errors import CkptfixError

__all__ = ["ShardedUnsupported", "gather", "has_dtensors", "is_dtensor", "local", "local_box", "world_size"]


class ShardedUnsupported(CkptfixError, NotImplementedError):
    """What the guard cannot do yet on sharded (DTensor) objects; decided from metadata, so raised on every rank."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


def has_dtensors(model: Any) -> bool:
    """Any parameter a DTensor (fully_shard, tensor parallel): metadata, the same answer on every rank."""
    return any(is_dtensor(p) for p in model.parameters())


def local(t: Any) -> torch.Tensor:
    """This rank's own piece: a DTensor's local shard, any other tensor itself (DDP: the full replica)."""
    return t.to_local() if is_dtensor(t) else t


def world_size() -> int:
    """Ranks that take part in the guard's agreement (1 outside an initialised process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def counts_once(t: Any) -> bool:
    """Does this rank's piece count toward a global element count? A DTensor replicated over a mesh
    dimension (HSDP) holds each shard on several ranks: only coordinate 0 of such a dimension counts."""
    if not is_dtensor(t):
        return True
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # not on this mesh
        return False
    return all(c == 0 for c, p in zip(coordinate, t.placements) if not p.is_shard())


def local_box(t: Any) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece and where it sits in the whole tensor (slices per dim; the whole for non-DTensors)."""
    if not is_dtensor(t):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _device() -> torch.device:
    """Where the agreement tensor lives: the CPU for gloo (also in 'cpu:gloo,cuda:nccl'), else the accelerator."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    accelerator = torch.accelerator.current_accelerator()
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def gather(values: Sequence[int]) -> list[list[int]]:
    """Every rank's `values`, on every rank: one all_reduce (SUM) of a (world, len) int64 tensor in
    which each rank fills only its own row. `values` must have the same length on every rank (the
    callers lay them out by parameter names, which every rank shares)."""
    world = world_size()
    if world == 1 or not values:  # an empty layout is empty on every rank: nothing to agree on
        return [list(values)] * world
    import torch.distributed as dist

    table = torch.zeros(world, len(values), dtype=torch.int64, device=_device())
    table[dist.get_rank()] = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(table)
    return table.cpu().tolist()
