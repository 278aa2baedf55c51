"""Training that goes wrong stops with a message, never with bad weights on disk.

- A step whose loss or gradient norm is not finite is skipped (no optimizer update) up to
  ``training.max_skipped_steps`` times in a row; then training stops with ``TrainingStopped``.
  Both values are global (reduced over every rank before they are read), so every rank takes
  the same decision without another collective.
- SIGTERM, SIGUSR1 (SLURM's warning before pre-emption) and SIGINT ask training to stop
  after the current step: the ranks agree on it (a signal may reach only some of them), save
  a checkpoint and exit normally. A second signal stops the process at once.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading

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


def skipped_too_often(step: int, bad: list[str], in_a_row: int, limit: int) -> TrainingStopped:
    first = "the loss" if "loss" in bad else "the gradients (the loss was finite)"
    return TrainingStopped(
        f"step {step}: {' and '.join(bad)} not finite, {in_a_row} step(s) in a row, more than "
        f"training.max_skipped_steps={limit}; {first} went bad first. Weights are those of the last "
        "finite step and no checkpoint was written since; lower optimizer.lr, check the data, or "
        "raise training.max_skipped_steps to ride out rare spikes"
    )


def parameters_finite(parts: list[nn.Module]) -> bool:
    """Whether every rank's parameters are finite (one all-reduce of a flag)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for part in parts for p in part.parameters()]
    bad = torch.stack([(~torch.isfinite(t)).any() for t in local]).sum().to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return not bool(bad.item())


class StopRequest:
    """While entered, turns the first stop signal into a request ``requested()`` reports on
    every rank; handlers are installed only from the main thread and restored on exit."""

    def __init__(self) -> None:
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
            "%s: stopping after this step (a checkpoint is saved); again to stop at once", self.signal_name
        )

    def requested(self, device: torch.device) -> bool:
        """Whether any rank was signalled (one all-reduce of a flag when distributed)."""
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
