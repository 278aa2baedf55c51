"""Run a function on N local ranks that share one process group (gloo on CPU, NCCL on GPUs).

Used by the plan-parity tool and the multi-rank tests: one group serves many checks, since
starting processes is the slow part on a laptop CPU. Children come from a fork server that
has already imported torch and autopar, so each costs a fork rather than a fresh import.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_PRELOAD = ["torch", "autopar.training.trainer"]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_file: str,
    queue: Any,
    args: tuple,
    backend: str | None,
) -> None:
    import torch
    import torch.distributed as dist

    from autopar.cli.log import setup_logging
    from autopar.parallel.world import backend_for, device_for

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    setup_logging(rank)
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend or backend_for(device),
            init_method=f"file://{store_file}",
            rank=rank,
            world_size=world_size,
        )
        result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900, backend: str | None = None
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns every rank's result, by rank.

    ``fn`` must be importable (module level) and its results picklable. A failure on any
    rank raises RuntimeError carrying that rank's traceback. ``backend`` overrides the
    default (NCCL on GPUs, gloo on CPU), e.g. gloo for several ranks sharing one GPU.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, store, queue, args, backend), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            while len(results) < world_size:
                rank, status, payload = queue.get(timeout=timeout_s)
                if status != "ok":
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
                results[rank] = payload
        except BaseException:
            for p in procs:
                p.kill()
            raise
        finally:
            for p in procs:
                p.join(timeout=60)
    return [results[r] for r in range(world_size)]
