"""Run functions on N local ranks that share one process group (gloo on CPU, NCCL on GPUs).

Used by the plan-parity tool and the multi-rank tests: one group serves many checks, since
starting processes is the slow part on a laptop CPU. Children come from a fork server that
has already imported torch and autopar, so each costs a fork rather than a fresh import.

``run_each_on_ranks`` runs a list of items (plans, say) one after another and reports each
item's own outcome: a rank that raises, or dies (a native crash, a kill), fails the item it
was running, with its traceback or the stacks ``faulthandler`` wrote as it died, and fresh
ranks go on with the items after it. A crash therefore fails its own check, not every check
that shares the group.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

_PRELOAD = ["torch", "autopar.training.trainer"]


@dataclass(frozen=True)
class RankFailure:
    """Why an item did not finish: the first failing rank's traceback (or the Python stacks a
    crashed rank printed), then a line for each other rank that failed."""

    item: int
    text: str


def _child(
    fn: Callable[..., Any],
    items: Sequence[tuple],
    first: int,
    rank: int,
    world_size: int,
    folder: str,
    report: Connection,
    backend: str | None,
) -> None:
    import torch
    import torch.distributed as dist

    from autopar.cli.log import setup_logging
    from autopar.parallel.world import backend_for, device_for, init_group

    # a native crash (SIGSEGV, SIGABRT) writes every thread's Python stack where the parent
    # reads it back into the failure of the item this rank was running
    crash = open(os.path.join(folder, f"crash-{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.enable(file=crash, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    setup_logging(rank)
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    index = first
    try:
        init_group(
            backend or backend_for(device),
            init_method=f"file://{os.path.join(folder, 'store')}",
            rank=rank,
            world_size=world_size,
        )
        for index in range(first, len(items)):
            result = fn(*items[index])
            report.send((index, "ok", result))  # written before the next item starts
    except BaseException:  # report any failure to the parent instead of hanging it
        report.send((index, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_each_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    items: Sequence[tuple],
    timeout_s: float = 900,
    backend: str | None = None,
) -> list[list[Any] | RankFailure]:
    """``fn(*item)`` for each item in turn on ``world_size`` ranks sharing one process group;
    per item, every rank's result (by rank) or a ``RankFailure``. After a failure, fresh ranks
    run the items left. ``fn`` must be importable (module level) and its results picklable;
    ``timeout_s`` bounds each item. ``backend`` overrides the default (NCCL on GPUs, gloo on
    CPU), e.g. gloo for several ranks sharing one GPU."""
    outcomes: dict[int, list[Any] | RankFailure] = {}
    while len(outcomes) < len(items):
        outcomes.update(_run_from(fn, world_size, items, len(outcomes), timeout_s, backend))
    return [outcomes[i] for i in range(len(items))]


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900, backend: str | None = None
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns every rank's result, by rank. A failure
    on any rank raises RuntimeError carrying that rank's traceback (or crash stacks), naming
    every other rank that failed or died."""
    (outcome,) = run_each_on_ranks(fn, world_size, [args], timeout_s, backend)
    if isinstance(outcome, RankFailure):
        raise RuntimeError(outcome.text)
    return outcome


def _run_from(
    fn: Callable[..., Any],
    world_size: int,
    items: Sequence[tuple],
    first: int,
    timeout_s: float,
    backend: str | None,
) -> dict[int, list[Any] | RankFailure]:
    """Items ``first`` onwards on fresh ranks, until all are done or one fails."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, items, first, r, world_size, folder, pipes[r][1], backend),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the children hold theirs: a reader's end of file is its rank's exit
        try:
            return _collect(
                procs, [reader for reader, _ in pipes], first, len(items), timeout_s, Path(folder)
            )
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=60)
            for reader, _ in pipes:
                reader.close()


_DIED = "exited with code"
_GRACE_S = 10.0
"""How long the other ranks get, after the first failure, to report theirs."""


def _collect(
    procs: list[Any], readers: list[Connection], first: int, count: int, timeout_s: float, folder: Path
) -> dict[int, list[Any] | RankFailure]:
    """Each item's results as the ranks report them, until every item is done or one fails
    (then every failure reported within ``_GRACE_S``, a rank that died among them once all it
    wrote is read)."""
    results: dict[int, dict[int, Any]] = {}
    errors: dict[int, str] = {}
    done: dict[int, list[Any] | RankFailure] = {}
    rank_of = {id(reader): rank for rank, reader in enumerate(readers)}
    open_readers = list(readers)
    current = first  # the first item some rank has not finished
    deadline = time.monotonic() + timeout_s
    while current < count and time.monotonic() < deadline and open_readers:
        for reader in wait(open_readers, timeout=1.0):
            rank = rank_of[id(reader)]
            try:
                index, status, payload = reader.recv()
            except EOFError:  # the rank exited; everything it sent has been read
                open_readers.remove(reader)
                procs[rank].join(timeout=10)
                if procs[rank].exitcode != 0 and rank not in errors:
                    errors[rank] = _crash_text(procs[rank].exitcode, folder / f"crash-{rank}.txt")
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if status != "ok":
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            results.setdefault(index, {})[rank] = payload
            while current < count and len(results.get(current, {})) == len(procs):
                row = results.pop(current)
                done[current] = [row[r] for r in range(len(procs))]
                current += 1
                deadline = time.monotonic() + timeout_s
    if current < count:
        if not errors:
            missing = sorted(set(range(len(procs))) - set(results.get(current, {})))
            errors = {missing[0]: f"ranks {missing} reported nothing within {timeout_s:g} s"}
        done[current] = RankFailure(current, _failure_text(errors, len(procs)))
    return done


def _crash_text(exitcode: int, crash_file: Path) -> str:
    """A rank that exited without a traceback: its exit code and the stacks it wrote dying."""
    stacks = crash_file.read_text(errors="replace").strip() if crash_file.is_file() else ""
    head = f"{_DIED} {exitcode} without a traceback (a negative code is the signal)"
    return f"{head}; its Python stacks as it died:\n{stacks}" if stacks else f"{head}\n"


def _failure_text(errors: dict[int, str], world_size: int) -> str:
    """The first failure in full, then the last line of each other one. A rank that died
    comes first: its peers' errors (a connection closed) are what its death did to them."""
    died = [(rank, text) for rank, text in errors.items() if text.startswith(_DIED)]
    (first, text), *others = died + [
        (rank, text) for rank, text in errors.items() if not text.startswith(_DIED)
    ]
    lines = [f"rank {first} of {world_size} failed:\n{text}"]
    lines += [f"rank {rank} also failed: {_last_line(text)}" for rank, text in others]
    return "\n".join(lines)


def _last_line(text: str) -> str:
    """A failure's gist: a traceback's last line, a death's first (its exit code)."""
    lines = text.strip().splitlines()
    return lines[0] if text.startswith(_DIED) else lines[-1]
