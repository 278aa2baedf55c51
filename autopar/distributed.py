"""Which process this is, on which device, and the default process group."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class World:
    """This process's place among the job's processes."""

    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 for plain ``python``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def device_for(local_rank: int) -> torch.device:
    """CUDA when present (one GPU per local rank), otherwise CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_world(timeout_s: int = 300) -> World:
    """Join the process group torchrun set up (or none for one process); same code on CPU and GPU.
    Every rank must join within ``timeout_s``, which also bounds each collective until
    ``set_timeout`` changes it."""
    size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def single_process(device: torch.device | str = "cpu") -> World:
    """A world of one process, for the single-device reference inside a larger job."""
    return World(rank=0, size=1, local_rank=0, device=torch.device(device))


def set_timeout(seconds: int) -> None:
    """Bound every collective of every process group (the mesh's too) to ``seconds``: a rank
    that died or hangs then fails the others' next collective instead of stalling them."""
    if not dist.is_initialized():
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        if group.group_desc != BACKGROUND_SAVE_GROUP:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


BACKGROUND_SAVE_GROUP = "background_save"
"""The gloo group of background (async) checkpoint saves: its collectives wait for the
slowest rank's writes, so it keeps the long timeout it was made with."""


def background_save_group(timeout_s: int) -> dist.ProcessGroup | None:
    """A gloo group of every rank for DCP's background saves (collective), or None in a
    world of one process. Its own group: the background thread's collectives must not
    interleave with the training's, and DCP async saves need a CPU backend."""
    if not dist.is_initialized():
        return None
    return dist.new_group(
        backend="gloo", timeout=timedelta(seconds=timeout_s), group_desc=BACKGROUND_SAVE_GROUP
    )


def by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device mesh, in first-seen order (plain tensors together):
    DTensor ops, foreach ones included, cannot mix meshes, and expert weights live on
    another mesh than the rest."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())
