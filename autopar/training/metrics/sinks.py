"""Where metrics.jsonl's records also go: TensorBoard scalars and Weights & Biases.

Each sink takes the very records written to ``metrics.jsonl`` (a step's, a validation's), on
the main rank only. W&B (torchtitan's ``metrics.enable_wandb``) gets the resolved job once,
as its run config, and every record at its step; ``WANDB_MODE=offline`` writes the run under
``<dump_folder>/wandb`` (``$WANDB_DIR/wandb`` when W&B's ``WANDB_DIR`` is set) with no account
(``wandb sync`` uploads it later). Settings W&B would refuse are refused before any work, in one
line naming the setting; what only ``wandb.init`` can tell (no API key, an unknown entity, no
network) is said in one line before the first step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from autopar.config.checks import unwritable
from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig

logger = logging.getLogger("autopar")

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
    """With ``metrics.enable_wandb``: the wandb package is installed, and W&B accepts
    ``WANDB_MODE``, the project name and ``WANDB_DIR``, so none fails in ``wandb.init``."""
    if not job.metrics.enable_wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"metrics.enable_wandb=true needs the wandb package: {WANDB_HINT}") from None
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and _wandb_refuses(mode=mode):
        raise ConfigError(
            f"WANDB_MODE={mode!r} is not a W&B mode (metrics.enable_wandb=true): set it to online, "
            "offline (no account; wandb sync uploads the run later) or disabled, or unset it"
        )
    project = job.metrics.wandb_project
    if reason := _wandb_refuses(project=project):
        raise ConfigError(f"metrics.wandb_project={project!r}: {reason}; choose another project name")
    wandb_dir = os.environ.get("WANDB_DIR")
    if wandb_dir is not None and (problem := unwritable(Path(wandb_dir))):
        raise ConfigError(
            f"WANDB_DIR={wandb_dir!r}: cannot write the W&B run there: {problem}; point it at a "
            "folder this job can write, or unset it (the run then goes under job.dump_folder/wandb)"
        )


def _wandb_refuses(**setting: str) -> str | None:
    """W&B's own reason to refuse a setting's value (its ``Settings`` check), or None."""
    import wandb

    try:
        wandb.Settings(**setting)
    except wandb.errors.Error as err:
        return str(err)
    except ValueError as err:  # pydantic's ValidationError: its first error's own words
        errors = getattr(err, "errors", None)
        return errors()[0]["msg"] if callable(errors) else str(err)
    return None


WANDB_RUN_ID = "wandb_run_id"
"""The file in the dump folder that names the job's W&B run, so a resumed job continues it."""


def saved_run_id(id_file: Path) -> str | None:
    """The W&B run id ``id_file`` names, or None (no file). A damaged file (not one line of
    text W&B takes as an id) is said in one line and gives None: the job resumes its training
    and starts a new W&B run, whose id then replaces the file (refusing would hold back the
    training over its logging; the old run stays in W&B)."""
    if not id_file.exists():
        return None
    try:
        run_id = id_file.read_text(encoding="utf-8").strip()
        reason = _wandb_refuses(run_id=run_id) if run_id.isprintable() else "not one line of text"
    except (OSError, UnicodeDecodeError) as err:
        reason = str(err)
    if reason is None:
        return run_id
    logger.warning(
        "%s is damaged (%s): this job starts a new W&B run instead of continuing the last, and "
        "names the new one there",
        id_file,
        reason,
    )
    return None


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
        run_id = saved_run_id(id_file) if resuming else None
        try:
            self.run = wandb.init(
                project=metrics.wandb_project,
                name=metrics.wandb_run_name,
                entity=metrics.wandb_entity,
                dir=os.environ.get("WANDB_DIR") or job.job.dump_folder,
                config=dataclasses.asdict(job),
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as err:  # W&B's own, pydantic's, the network's: to the user, one mistake
            raise ConfigError(
                f"metrics.enable_wandb=true: W&B did not start the run ({type(err).__name__}: "
                f"{_first_line(err)}); fix that (wandb login or WANDB_API_KEY, metrics.wandb_entity), "
                "or log with no account (WANDB_MODE=offline; wandb sync uploads it later), or turn "
                "W&B off (--metrics.enable_wandb false)"
            ) from None
        id_file.write_text(self.run.id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), "no reason given")


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
