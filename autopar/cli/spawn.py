"""Run a function on N local ranks that share one process group (gloo on CPU, NCCL on GPUs).

Used by the plan-parity tool and the multi-rank tests: one group serves many checks, since
starting processes is the slow part on a laptop CPU. Children come from a fork server that
has already imported torch and autopar, so each costs a fork rather than a fresh import.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from queue import Empty
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

    faulthandler.enable()  # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack
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
    rank raises RuntimeError carrying that rank's traceback, and naming every other rank
    that failed or died without one (a crash or a kill, which its peers see only as a broken
    connection). ``backend`` overrides the default (NCCL on GPUs, gloo on CPU), e.g. gloo for
    several ranks sharing one GPU.
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
        try:
            results, errors = _collect(procs, queue, timeout_s)
            if errors:
                raise RuntimeError(_failure_text(errors, world_size))
        except BaseException:
            for p in procs:
                p.kill()
            raise
        finally:
            for p in procs:
                p.join(timeout=60)
    return [results[r] for r in range(world_size)]


_GRACE_S = 10.0
"""How long the other ranks get, after the first failure, to report theirs."""


def _collect(procs: list[Any], queue: Any, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Every rank's result, or the failures: those reported in order, then ranks that exited
    without reporting. Stops ``_GRACE_S`` after the first failure."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except Empty:
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0) and rank not in results and rank not in errors:
                    errors[rank] = (
                        f"exited with code {p.exitcode} without a traceback (a negative code is the "
                        "signal; a crash's Python stacks are on its stderr)"
                    )
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    if len(results) + len(errors) < len(procs) and not errors:
        missing = sorted(set(range(len(procs))) - set(results))
        raise TimeoutError(f"ranks {missing} reported nothing within {timeout_s:g} s")
    return results, errors


def _failure_text(errors: dict[int, str], world_size: int) -> str:
    """The first failure in full, then the last line of each other one."""
    (first, text), *others = errors.items()
    lines = [f"rank {first} of {world_size} failed:\n{text}"]
    lines += [f"rank {rank} also failed: {text.strip().splitlines()[-1]}" for rank, text in others]
    return "\n".join(lines)
