"""Distributed checkpoints (torch.distributed.checkpoint): save, resume, export to HF.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/``. A save is written to a hidden
``.step-<N>.partial`` folder and renamed into place only after every rank finished, so an
interrupted save is never picked up and never costs the previous good checkpoint. Tensors
are stored by parameter name with their global shapes, so a checkpoint saved under one
plan loads under any other (DCP reshards on load).
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from autopar.config.errors import ConfigError
from autopar.config.job import Checkpoint
from autopar.models.args import ModelArgs
from autopar.models.hf import HFCheckpointError, read_hf_config, save_hf_streaming
from autopar.models.qwen import Qwen

logger = logging.getLogger("autopar")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class ModelState(Stateful):
    """The parameters of every local model part, under their plain (single-device) names."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """AdamW moments keyed by parameter name (flattened), so they reshard like the weights."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.pairs = list(zip(parts, optimizers))

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in self.pairs:
            merged.update(get_optimizer_state_dict(part, opt, options=self._OPTIONS))
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt in self.pairs:
            set_optimizer_state_dict(part, opt, state, options=self._OPTIONS)


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _dcp(op, state: dict[str, Any], path: Path | str) -> None:
    """``dcp.save`` / ``dcp.load``; without a process group, one process does it all (DCP
    warns about that every time; here it is the intended single-device case)."""
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        op(state, checkpoint_id=str(path), no_dist=no_dist)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and restores one job's training state."""

    def __init__(
        self,
        cfg: Checkpoint,
        dump_folder: str | Path,
        rank: int,
        parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.rank = rank
        self.parts = parts
        self.optimizers = optimizers

    def _state(self, train: dict[str, int]) -> dict[str, Any]:
        return {
            "model": ModelState(self.parts),
            "optimizer": OptimizerState(self.parts, self.optimizers),
            "train": train,
        }

    def save(self, step: int, consumed_samples: int) -> Path:
        """Write the checkpoint of ``step`` atomically; prune old ones past keep_latest_k."""
        final = self.folder / f"step-{step}"
        partial = self.folder / f".step-{step}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        train = {"step": step, "consumed_samples": consumed_samples}
        _dcp(dcp.save, self._state(train), partial)
        torch.save(torch.get_rng_state(), partial / f"rng-rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            if final.exists():  # re-saving a step: keep the old copy until the new one is in place
                stale = self.folder / f".step-{step}.stale"
                shutil.rmtree(stale, ignore_errors=True)
                final.rename(stale)
                partial.rename(final)
                shutil.rmtree(stale)
            else:
                partial.rename(final)
            self._prune()
            logger.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _prune(self) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        for step in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{step}")

    def resume_step(self) -> int | None:
        """The step to resume from: checkpoint.load_step, else the latest complete one."""
        steps = complete_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise FileNotFoundError(
                    f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step}; complete steps: {steps}"
                )
            return self.cfg.load_step
        return steps[-1] if steps else None

    def load(self, step: int) -> dict[str, int]:
        """Restore everything saved at ``step``; returns {"step", "consumed_samples"}."""
        path = self.folder / f"step-{step}"
        train = {"step": 0, "consumed_samples": 0}
        state = self._state(train)
        _dcp(dcp.load, state, path)
        rng = path / f"rng-rank{self.rank}.pt"
        if rng.is_file():  # absent when the world grew since the save; nothing draws from it
            torch.set_rng_state(torch.load(rng))
        logger.info("resumed from %s", path)
        return state["train"]

    def load_model_only(self, path: str | Path) -> None:
        """Initial weights from a DCP folder (model entries only)."""
        _dcp(dcp.load, {"model": ModelState(self.parts)}, path)

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)


def export_hf(checkpoint_dir: str | Path, args: ModelArgs, out_dir: str | Path, dtype: torch.dtype) -> None:
    """Write the model of a DCP checkpoint as an HF folder, one safetensors shard in memory
    at a time. Runs in one process (no collectives), whatever plan saved it."""
    with torch.device("meta"):
        layout = {n: (p.shape, dtype) for n, p in Qwen(args).named_parameters()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        state = {"model": {n: torch.empty(layout[n][0], dtype=dtype) for n in names}}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
        return state["model"]

    save_hf_streaming(layout, load, args, out_dir)


def check_initial_load(cfg: Checkpoint, args: ModelArgs, model_label: str) -> None:
    """``initial_load_path`` names a checkpoint of the right kind, and an HF one this model's
    shape (``model_label`` names the model in the message, e.g. ``qwen3/8B``)."""
    if cfg.initial_load_path is None:
        if cfg.initial_load_in_hf:
            raise ConfigError("checkpoint.initial_load_in_hf=true needs checkpoint.initial_load_path")
        return
    path = Path(cfg.initial_load_path)
    if not path.exists():
        raise ConfigError(f"checkpoint.initial_load_path={cfg.initial_load_path!r}: no such folder")
    if not cfg.initial_load_in_hf:
        if not (path / ".metadata").is_file():
            raise ConfigError(
                f"checkpoint.initial_load_path={cfg.initial_load_path!r} is not a DCP checkpoint "
                "(no .metadata); for an HF folder set checkpoint.initial_load_in_hf=true"
            )
        return
    try:
        hf_args = read_hf_config(path)
    except HFCheckpointError as err:
        raise ConfigError(f"checkpoint.initial_load_path: {err}") from None
    for field in ModelArgs.__dataclass_fields__:
        if field in ("initializer_range", "max_position_embeddings"):
            continue
        ours, theirs = getattr(args, field), getattr(hf_args, field)
        if ours != theirs:
            raise ConfigError(
                f"model {model_label} has {field}={ours}, but {path / 'config.json'} has "
                f"{field}={theirs}; pick the matching flavor or set --model.{field} {theirs}"
            )
