"""Which process this is, on which device, and the default process group."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.config import ConfigError
from autopar.parallel.torch_internals import funcols_wait_at_once, set_group_timeouts


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
    """The number of processes torchrun started (1 for plain ``python``). Launch variables set
    by hand without the rest are refused: with ``RANK=1`` alone a run would train as a
    non-saving rank of a world of one, and ``WORLD_SIZE=2`` alone would wait for a rendezvous
    that no one serves."""
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    for name in ("WORLD_SIZE", "RANK"):
        value = env[name]
        if value is not None and not value.isdigit():
            raise ConfigError(f"environment {name}={value!r} must be a non-negative integer")
    size, rank = int(env["WORLD_SIZE"] or 1), int(env["RANK"] or 0)
    launch = "launch with torchrun --nproc_per_node=N train.py ..., which sets them all"
    if size < 1 or rank >= size:
        raise ConfigError(
            f"environment RANK={rank} with WORLD_SIZE={env['WORLD_SIZE'] or 'unset (1)'}: the rank must be "
            f"below the world size; {launch}, or unset RANK and WORLD_SIZE for one process"
        )
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if env[k] is None]
    if size > 1 and missing and not dist.is_initialized():  # a group joined another way needs none
        raise ConfigError(
            f"environment WORLD_SIZE={size} without {' and '.join(missing)}: {launch}, or unset "
            "WORLD_SIZE for one process"
        )
    return size


def ranks_per_node_from_env() -> int | None:
    """The ranks torchrun started on this node (``LOCAL_WORLD_SIZE``, its --nproc_per_node),
    or None when it did not launch this process."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"environment LOCAL_WORLD_SIZE={value!r} must be a positive integer")
    return int(value)


def device_for(local_rank: int) -> torch.device:
    """CUDA when present (one GPU per local rank), otherwise CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(backend: str, **kwargs: object) -> None:
    """``dist.init_process_group``; on gloo, eager functional collectives then wait as they are
    issued (``torch_internals.funcols_wait_at_once`` says why)."""
    dist.init_process_group(backend, **kwargs)  # type: ignore[arg-type]
    if backend == "gloo":
        funcols_wait_at_once()


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
        init_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def single_process(device: torch.device | str = "cpu") -> World:
    """A world of one process, for the single-device reference inside a larger job."""
    return World(rank=0, size=1, local_rank=0, device=torch.device(device))


def set_timeout(seconds: int) -> None:
    """Bound every collective of every process group (the mesh's too) to ``seconds``: a rank
    that died or hangs then fails the others' next collective instead of stalling them."""
    if not dist.is_initialized():
        return
    set_group_timeouts(seconds, skip_desc=BACKGROUND_SAVE_GROUP)


class CollectiveTimeout:
    """The bound on every collective, as the training moves between quick steps and phases that
    may keep some ranks long (compiling, writing a checkpoint). ``longer`` restores whatever
    bound was in force, so phases nest."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds
        """The bound in force: the one the process group was made with, to begin with."""

    def set(self, seconds: int) -> None:
        set_timeout(seconds)
        self.seconds = seconds

    @contextmanager
    def longer(self, seconds: int) -> Iterator[None]:
        """Bound collectives by at least ``seconds`` while entered."""
        previous = self.seconds
        self.set(max(seconds, previous))
        try:
            yield
        finally:
            self.set(previous)


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
