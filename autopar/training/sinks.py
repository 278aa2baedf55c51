"""Where metrics.jsonl's records also go: TensorBoard scalars and Weights & Biases.

Each sink takes the very records written to ``metrics.jsonl`` (a step's, a validation's), on
the main rank only. W&B (torchtitan's ``metrics.enable_wandb``) gets the resolved job once,
as its run config, and every record at its step; ``WANDB_MODE=offline`` writes the run under
``<dump_folder>/wandb`` with no account (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig

WANDB_HINT = "pip install 'autopar[wandb]' (or pip install wandb)"


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record (it has a ``step``)."""
        ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Every number of a record as a scalar of its key at its step."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in ("step", "skipped") and value is not None:
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


def check_wandb(job: JobConfig) -> None:
    """With ``metrics.enable_wandb``, the wandb package must be installed."""
    if not job.metrics.enable_wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"metrics.enable_wandb=true needs the wandb package: {WANDB_HINT}") from None


WANDB_RUN_ID = "wandb_run_id"
"""The file in the dump folder that names the job's W&B run, so a resumed job continues it."""


class WandbSink:
    """A W&B run: the job as its config, each record's keys (all but ``step``) at its step.

    A job that resumes from a checkpoint continues the W&B run its dump folder names (W&B
    drops the steps it already has, those logged after the checkpoint the job went back to);
    a job that starts afresh starts a new run and names it there."""

    def __init__(self, job: JobConfig, resuming: bool = False) -> None:
        import wandb

        metrics = job.metrics
        folder = Path(job.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else None
        self.run = wandb.init(
            project=metrics.wandb_project,
            name=metrics.wandb_run_name,
            entity=metrics.wandb_entity,
            dir=job.job.dump_folder,
            config=dataclasses.asdict(job),
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_file.write_text(self.run.id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_sinks(job: JobConfig, is_main: bool, resuming: bool = False) -> list[Sink]:
    """The sinks a job turns on, on the main rank (none elsewhere); ``resuming``: the job
    continues from a checkpoint (W&B then continues its run)."""
    if not is_main:
        return []
    sinks: list[Sink] = []
    if job.metrics.enable_tensorboard:
        sinks.append(TensorBoardSink(Path(job.job.dump_folder) / job.metrics.save_tb_folder))
    if job.metrics.enable_wandb:
        sinks.append(WandbSink(job, resuming))
    return sinks
