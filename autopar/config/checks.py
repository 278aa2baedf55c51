"""Checks that need nothing but the job's own numbers (the config floor's share of ``training.preflight``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig


def changed_fields(section: Any) -> list[str]:
    """The fields of a config section (a dataclass that builds with no arguments) set away
    from their defaults: what a job that never reads the section would silently drop."""
    default = _default(type(section))
    if section.__dict__ == default.__dict__:  # its fields, as ``==`` compares them, but faster
        return []
    return [
        f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)
    ]


@functools.lru_cache(maxsize=64)
def _default(section_type: type) -> Any:
    """A section as built with no arguments, built once (the planner checks a hundred
    thousand candidate jobs' sections against it); read, never changed."""
    return section_type()


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def check_numbers(job: JobConfig) -> None:
    """Every field whose valid range is known without the model, data or world."""
    training, optimizer, scheduler = job.training, job.optimizer, job.lr_scheduler
    require(training.steps >= 1, f"training.steps={training.steps} must be >= 1")
    require(
        training.local_batch_size >= 1,
        f"training.local_batch_size={training.local_batch_size} must be >= 1",
    )
    require(training.seq_len >= 2, f"training.seq_len={training.seq_len} must be >= 2")
    require(
        training.max_norm >= 0,
        f"training.max_norm={training.max_norm} must be >= 0 (0 disables clipping)",
    )
    require(
        training.max_skipped_steps >= 0,
        f"training.max_skipped_steps={training.max_skipped_steps} must be >= 0 (0 stops at the first "
        "non-finite step)",
    )
    require(
        training.global_batch_size == -1 or training.global_batch_size >= 1,
        f"training.global_batch_size={training.global_batch_size} must be -1 or >= 1",
    )
    require(
        optimizer.lr >= 0 and math.isfinite(optimizer.lr),
        f"optimizer.lr={optimizer.lr} must be a finite number >= 0",
    )
    for name in ("beta1", "beta2"):
        value = getattr(optimizer, name)
        require(0 <= value < 1, f"optimizer.{name}={value} must be in [0, 1)")
    require(optimizer.eps > 0, f"optimizer.eps={optimizer.eps} must be > 0")
    require(optimizer.weight_decay >= 0, f"optimizer.weight_decay={optimizer.weight_decay} must be >= 0")
    require(scheduler.warmup_steps >= 0, f"lr_scheduler.warmup_steps={scheduler.warmup_steps} must be >= 0")
    require(
        scheduler.decay_ratio is None or 0 < scheduler.decay_ratio <= 1,
        f"lr_scheduler.decay_ratio={scheduler.decay_ratio} must be in (0, 1], or unset",
    )
    require(
        0 <= scheduler.min_lr_factor <= 1,
        f"lr_scheduler.min_lr_factor={scheduler.min_lr_factor} must be in [0, 1]",
    )
    require(job.metrics.log_freq >= 1, f"metrics.log_freq={job.metrics.log_freq} must be >= 1")
    require(job.debug.seed >= 0, f"debug.seed={job.debug.seed} must be >= 0")
    require(
        not job.metrics.enable_tensorboard or importlib.util.find_spec("tensorboard") is not None,
        "metrics.enable_tensorboard=true needs tensorboard: pip install tensorboard",
    )
    require(
        job.profiling.profile_freq >= 1, f"profiling.profile_freq={job.profiling.profile_freq} must be >= 1"
    )
    for name in ("init_timeout_seconds", "train_timeout_seconds"):
        value = getattr(job.comm, name)
        require(value >= 1, f"comm.{name}={value} must be >= 1")
    checkpoint = job.checkpoint
    require(checkpoint.interval >= 1, f"checkpoint.interval={checkpoint.interval} must be >= 1")
    require(
        checkpoint.keep_latest_k >= 0,
        f"checkpoint.keep_latest_k={checkpoint.keep_latest_k} must be >= 0 (0 keeps all)",
    )


def unwritable(folder: Path) -> str | None:
    """Why ``folder`` could not be created or written to, or None; leaves nothing behind. It
    makes and removes a folder in the nearest existing one: permission bits alone pass
    ``/proc`` or a read-only bind mount for root."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".autopar-probe-", dir=existing))
    except OSError as err:
        return f"nothing can be created in {existing} ({err.strerror})"
    return None


def check_output_file(path: Path, option: str, example: str) -> None:
    """``path``, named by command-line ``option``, can be written as a file: checked before the
    work whose result goes there. ``example`` is a file name to suggest inside a folder."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; name a file in it, e.g. {option} {path / example}")
    problem = unwritable(path.parent)
    if problem is None and path.exists() and not os.access(path, os.W_OK):
        problem = f"{path} is not writable"
    if problem is not None:
        raise ConfigError(
            f"{option} {path}: cannot write it: {problem}; name a file in a folder you can write"
        )


def check_output_folders(job: JobConfig) -> None:
    """The folders the job writes (metrics, checkpoints) can be written, so a mistake there is
    found now rather than at the first save."""
    require(
        job.job.dump_folder.strip() != "",
        "job.dump_folder is empty (it would write into the current folder); name a folder, e.g. ./outputs",
    )
    dump = Path(job.job.dump_folder)
    folders = {"job.dump_folder": dump}
    if job.checkpoint.enable:
        folders["checkpoint.folder"] = dump / job.checkpoint.folder
    for name, folder in folders.items():
        problem = unwritable(folder)
        require(problem is None, f"{name}: cannot write {folder}: {problem}; pick another folder")


def inert_float8(job: JobConfig) -> str | None:
    """Where the job names an FP8 backend or recipe but leaves ``float8.enable`` false, what to
    tell the user: such a job means FP8, and would otherwise run in bf16 without a word (a
    template may keep the settings switched off, so this warns rather than refuses)."""
    cfg = job.float8
    if cfg.enable or (cfg.backend == "auto" and cfg.recipe == "default"):
        return None
    named = f"float8.backend={cfg.backend!r}" if cfg.backend != "auto" else f"float8.recipe={cfg.recipe!r}"
    return (
        f"{named} has no effect while float8.enable is false: no linear runs in FP8; add "
        "--float8.enable true to train in FP8"
    )
