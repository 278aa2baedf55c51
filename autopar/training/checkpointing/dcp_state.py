"""What a DCP checkpoint holds and how it is read back: the model and optimizer state under
plain parameter names (so a save under one plan loads under any other), the complete steps
of a checkpoint folder, and readers of a saved folder that need no model or collectives."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from autopar.config.sections import LoRA
from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.parallel.lora import apply_lora

_STEP_DIR = re.compile(r"^step-(\d+)$")


ModelPart = Literal["all", "trained", "frozen"]
"""Which parameters a checkpoint holds: all of them, or under LoRA the adapters a run trains
(its saves) or the frozen base they train on (its initial load)."""


class ModelState(Stateful):
    """The parameters of every local model part, under their plain (single-device) names."""

    def __init__(self, parts: list[nn.Module], which: ModelPart = "all") -> None:
        self.parts = parts
        self.which = which

    def state_dict(self) -> dict[str, Any]:
        frozen_too = StateDictOptions(ignore_frozen_params=self.which == "trained")
        state = {
            k: v for part in self.parts for k, v in get_model_state_dict(part, options=frozen_too).items()
        }
        if self.which != "frozen":
            return state
        trained = ModelState(self.parts, "trained").state_dict()
        return {k: v for k, v in state.items() if k not in trained}

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


READ_ERRORS = (Exception, CheckpointException)
"""What reading a damaged checkpoint raises: unpickling and I/O errors, or DCP's
``CheckpointException`` gathering them (a ``BaseException``, which ``except Exception`` misses)."""


def step_folders(folder: Path) -> list[int]:
    """Steps with a ``step-N`` folder in ``folder``, ascending: complete checkpoints, and
    damaged ones (a save is renamed into place whole, so a step-N without its ``.metadata``
    lost it afterwards)."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for e in folder.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir())


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder`` (its ``.metadata`` there), ascending."""
    return [s for s in step_folders(folder) if (folder / f"step-{s}" / ".metadata").is_file()]


def run_dcp(op, state: dict[str, Any], path: Path | str) -> None:
    """``dcp.save`` / ``dcp.load``; without a process group, one process does it all (DCP
    warns about that every time; here it is the intended single-device case)."""
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        op(state, checkpoint_id=str(path), no_dist=no_dist)


def saved_keys(folder: Path) -> set[str]:
    """The dotted names a DCP checkpoint holds (``model.lm_head.weight``, ``train.step``...)."""
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def model_mismatch(folder: Path, args: ModelArgs, lora: LoRA | None = None) -> str | None:
    """How the parameters saved in ``folder`` differ from those a job of ``args`` (and
    ``lora``: its adapters only) saves, or None."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in metadata.items() if k.startswith("model.")}
    with torch.device("meta"):
        model = build_model(args)
        if lora is not None and lora.enable:
            apply_lora(model, lora, torch.float32)
    expected = {
        n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
    }
    differences = [f"{name} is not in the checkpoint" for name in expected if name not in saved]
    differences += [
        f"{name} is in the checkpoint but not in the model" for name in saved if name not in expected
    ]
    differences += [
        f"{name} is {list(saved[name])} in the checkpoint, {list(shape)} in the model"
        for name, shape in expected.items()
        if name in saved and saved[name] != shape
    ]
    if not differences:
        return None
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return "; ".join(differences[:3]) + more


def saved_train_state(folder: Path) -> dict[str, Any]:
    """The train entries of the checkpoint in ``folder`` (step, data position, what the data
    was, the settings it was trained with), read without the model and without collectives:
    what a resume can be checked against before building anything."""
    keys = [k.removeprefix("train.") for k in saved_keys(folder) if k.startswith("train.")]
    state: dict[str, Any] = {"train": dict.fromkeys(keys, 0)}
    run_dcp(dcp.load, state, folder)
    return state["train"]


def readable_train_state(folder: Path) -> dict[str, Any] | None:
    """``saved_train_state`` of ``folder``, or None when its files cannot be read (a damaged
    checkpoint: the resume verifies it and falls back to the one before, saying why)."""
    try:
        return saved_train_state(folder)
    except READ_ERRORS:
        return None


def newest_readable(folder: Path, steps: list[int]) -> tuple[int, dict[str, Any]] | None:
    """The newest of ``steps`` whose train state reads, with it: the checkpoint a resume will
    start from, for checks before any work (a resume verifies every file; this reads the train
    entries only)."""
    for step in reversed(steps):
        state = readable_train_state(folder / f"step-{step}")
        if state is not None:
            return step, state
    return None


def read_model_tensors(
    checkpoint_dir: str | Path, shapes: Mapping[str, torch.Size], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Full tensors of the model parameters named in ``shapes`` from a DCP checkpoint, read in
    one process (no collectives), whatever plan saved it."""
    state = {"model": {n: torch.empty(shape, dtype=dtype) for n, shape in shapes.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    return state["model"]
