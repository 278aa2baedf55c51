"""Training that goes wrong stops with a message, never with bad weights on disk.

- A step whose loss or gradient norm is not finite is skipped (no optimizer update) up to
  ``training.max_skipped_steps`` times in a row; then training stops with ``TrainingStopped``.
  Both values are global (reduced over every rank before they are read), so every rank takes
  the same decision without another collective.
- A collective that fails because another rank died or hangs (bounded by
  ``comm.train_timeout_seconds``) becomes ``TrainingStopped`` naming this rank and the bound.
- SIGTERM, SIGUSR1 (SLURM's warning before pre-emption) and SIGINT ask training to stop
  after the current step: the ranks agree on it (a signal may reach only some of them), save
  a checkpoint and exit normally. A second signal stops the process at once.
- Under torchrun, a worker whose launcher died (``kill -9``) sends itself SIGTERM, so it
  stops as a pre-empted one does instead of training on as an orphan.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger("autopar")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class TrainingStopped(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


def nonfinite(loss: float, grad_norm: float) -> list[str]:
    """Which of the step's global loss and gradient norm are not finite."""
    return [name for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def ranks_not_finite(local_loss: torch.Tensor, parts: list[nn.Module]) -> str:
    """Which ranks' share of the loss, and which ranks' gradients, are not finite, in words.
    One all-gather; called by every rank after a step whose global values were not finite."""
    grads = [_local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
    grads_bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any() if grads else False
    flags = torch.stack(
        [(~torch.isfinite(local_loss)).float(), torch.as_tensor(grads_bad, device=local_loss.device).float()]
    )
    gathered = [flags]
    if dist.is_initialized():
        gathered = [torch.empty_like(flags) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flags)
    table = torch.stack(gathered).bool().tolist()
    found = {
        what: [r for r, flags in enumerate(table) if flags[i]] for i, what in enumerate(("loss", "gradients"))
    }
    return (
        "; ".join(f"{what} on rank(s) {ranks}" for what, ranks in found.items() if ranks)
        or "every rank's own values were finite: their sum overflowed"
    )


def skipped_too_often(step: int, bad: list[str], where: str, in_a_row: int, limit: int) -> TrainingStopped:
    first = "the loss" if "loss" in bad else "the gradients (the loss was finite)"
    return TrainingStopped(
        f"step {step}: {' and '.join(bad)} not finite ({where}), {in_a_row} step(s) in a row, more than "
        f"training.max_skipped_steps={limit}; {first} went bad first. Weights are those of the last "
        "finite step and no checkpoint was written since; lower optimizer.lr, check the data, or "
        "raise training.max_skipped_steps to ride out rare spikes"
    )


def parameters_finite(parts: list[nn.Module]) -> bool:
    """Whether every rank's parameters are finite (one all-reduce of a flag)."""
    local = [_local(p) for part in parts for p in part.parameters()]
    bad = torch.stack([(~torch.isfinite(t)).any() for t in local]).sum().to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return not bool(bad.item())


_PEER_GONE = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer")
"""How gloo words a collective whose peer died or hangs (NCCL's watchdog aborts the process
itself after the same timeout, with its own message)."""


def peer_gone(err: BaseException) -> bool:
    """Whether ``err`` says another rank died or hangs."""
    return isinstance(err, dist.DistError) or any(words in str(err) for words in _PEER_GONE)


def peer_failure(err: RuntimeError, rank: int, timeout_s: int) -> TrainingStopped | None:
    """``err`` as a stop naming the cause, when it says another rank died or hangs."""
    if not peer_gone(err):
        return None
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return TrainingStopped(
        f"rank {rank}: a collective failed ({first_line}): another rank died (its log says why) "
        f"or hung past comm.train_timeout_seconds={timeout_s}. Rerun the same command to resume "
        "from the last checkpoint"
    )


OUT_OF_MEMORY = ("CUDA out of memory", "can't allocate memory", "not enough memory")
"""What torch's allocators say when an allocation fails (CUDA raises OutOfMemoryError; the
CPU allocator a RuntimeError)."""


def out_of_memory(err: RuntimeError, step: int, rank: int, local_batch: int) -> TrainingStopped | None:
    """``err`` as a stop naming what to lower, when an allocation failed."""
    if not (isinstance(err, torch.OutOfMemoryError) or any(s in str(err) for s in OUT_OF_MEMORY)):
        return None
    first_line = str(err).strip().splitlines()[0][:300]
    return TrainingStopped(
        f"rank {rank}: out of memory in step {step} ({first_line}); lower training.local_batch_size "
        f"(now {local_batch}) or seq_len, turn on --activation_checkpoint.mode full, or size the job "
        "first with python -m autopar.plan or --dry-run --world-size N"
    )


class StopRequest:
    """While entered, turns the first stop signal into a request ``requested()`` reports on
    every rank; handlers are installed only from the main thread and restored on exit."""

    def __init__(self, keeps: str = "its checkpoint is saved") -> None:
        self.keeps = keeps
        """What the stopped run leaves, for the line that acknowledges the signal."""
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signal_name is not None:  # the second one: stop now, as without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning(
            "%s: stopping after this step (%s); again to stop at once", self.signal_name, self.keeps
        )

    def requested(self, device: torch.device) -> bool:
        """Whether any rank was signalled (one all-reduce of a flag when distributed)."""
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


LAUNCHER_POLL_S = 1.0
"""How often a torchrun worker looks whether its launcher is still its parent."""


def end_with_launcher(poll_s: float = LAUNCHER_POLL_S) -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), SIGTERM this process within ``poll_s``
    of its launcher's death: a killed launcher can no longer stop its workers, and the
    kernel gives them to another parent, which is what this watches for (portable, unlike
    Linux's PR_SET_PDEATHSIG, which follows the launcher's forking thread, not its process)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher and launcher != 1:
            time.sleep(poll_s)
        logger.warning("the torchrun launcher (pid %d) is gone; stopping this worker", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def tell_launcher(line: str) -> None:
    """Under torchrun, leave this worker's one-line refusal where the launcher looks for a
    worker's error (``TORCHELASTIC_ERROR_FILE``): torchrun's closing report, which follows
    every failed worker with its own ``ChildFailedError`` traceback, then shows ``line`` as the
    root cause in place of a link to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):  # the report is a courtesy: the line is on stderr already
        Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
