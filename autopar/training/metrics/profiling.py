"""Traces and memory snapshots of a training run, with torchtitan's ``[profiling]`` names.

``Profiler`` wraps the training loop; the trainer calls ``step(n)`` after each optimizer step.
torch.profiler traces one step in every ``profile_freq`` (the steps before it warm the
profiler up) on CPU and GPU alike; CUDA memory snapshots record the allocator's history and
are dumped every ``profile_freq`` steps and when a step runs out of memory.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from types import TracebackType

import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import Profiling

logger = logging.getLogger("autopar")

_WARMUP_STEPS = 3
_SNAPSHOT_ENTRIES = 100_000


def check_profiling(cfg: Profiling, device_type: str) -> None:
    if cfg.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot=true records the CUDA allocator and needs a GPU; "
            "use profiling.enable_profiling for CPU traces"
        )


class Profiler(contextlib.AbstractContextManager):
    """The run's profiler and memory recorder (each only when enabled)."""

    def __init__(self, cfg: Profiling, dump_folder: str | Path, rank: int, first_step: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.first_step = first_step
        self.done = first_step - 1
        """The last optimizer step finished."""
        self.traces = Path(dump_folder) / cfg.save_traces_folder
        self.snapshots = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self._torch_profiler: torch.profiler.profile | None = None

    def __enter__(self) -> Profiler:
        if self.cfg.enable_profiling:
            warmup = min(_WARMUP_STEPS, self.cfg.profile_freq - 1)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=self.cfg.profile_freq - warmup - 1, warmup=warmup, active=1
                ),
                on_trace_ready=self._write_trace,
            )
            self._torch_profiler.__enter__()
        if self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)
        return self

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        folder = self.traces / f"iteration_{self.first_step + prof.step_num - 1}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        logger.info("wrote profiler trace %s", folder)

    def _write_snapshot(self, step: int, why: str = "") -> None:
        folder = self.snapshots / f"iteration_{step}{why}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))
        logger.info("wrote memory snapshot %s", folder)

    def step(self, step: int) -> None:
        """Optimizer step ``step`` is done."""
        self.done = step
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.cfg.enable_memory_snapshot and step % self.cfg.profile_freq == 0:
            self._write_snapshot(step)

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.cfg.enable_memory_snapshot:
            if isinstance(err, torch.OutOfMemoryError):
                self._write_snapshot(self.done + 1, "_out_of_memory")
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._torch_profiler is not None:
            self._torch_profiler.__exit__(kind, err, tb)
