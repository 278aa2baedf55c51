"""Distributed checkpoints (torch.distributed.checkpoint): save, resume, export to HF.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/``. A save is written to a hidden
``.step-<N>.partial`` folder and renamed into place only after every rank finished, so an
interrupted save is never picked up and never costs the previous good checkpoint (leftover
partial folders are removed at the next save). Tensors are stored by parameter name with
their global shapes, so a checkpoint saved under one plan loads under any other (DCP
reshards on load).

Each save lists its files with their sizes and CRC-32 in ``manifest.json`` (CRC-32: zlib
streams it at disk speed, and it catches truncation and flipped bytes, which is what goes
wrong on disk; it is no defence against tampering). The ranks share the checksumming, on
save and on resume. Resuming verifies the latest checkpoint and falls back to the newest
intact one, saying which file is broken; an explicit ``checkpoint.load_step`` that is broken
is refused. The saved parameter names and shapes must equal the model's.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from autopar.config.errors import ConfigError
from autopar.config.sections import Checkpoint, LoRA
from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.models.hf import HFTensors, carry_through, checkpoint_layout, save_hf_streaming
from autopar.models.hf_config import HFCheckpointError, read_hf_config
from autopar.models.hf_layout import HFLayout
from autopar.parallel.lora import apply_lora
from autopar.parallel.world import background_save_group
from autopar.training.faults import TrainingStopped, peer_gone

logger = logging.getLogger("autopar")
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


def _first_failure(err: BaseException, rank: int) -> tuple[int, BaseException]:
    """The rank and error behind ``err`` (DCP gathers every rank's failures into one)."""
    if isinstance(err, CheckpointException):
        failed_rank, (cause, _) = next(iter(err.failures.items()))
        return failed_rank, cause
    return rank, err


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


MANIFEST = "manifest.json"


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(names: list[str]) -> list[str]:
    """This rank's part of a list every rank holds: every world-size-th name."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gathered(mine: list[Any]) -> list[Any]:
    """Every rank's list, concatenated in rank order (the same on every rank)."""
    if not dist.is_initialized():
        return mine
    every: list[list[Any]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return [item for items in every for item in items]


def write_manifest(folder: Path) -> None:
    """List every file in ``folder`` with its size and CRC-32 (collective: ranks share the
    checksumming, rank 0 writes the list)."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    mine = [(name, (folder / name).stat().st_size, _crc32(folder / name)) for name in _my_share(names)]
    files = {name: {"bytes": size, "crc32": crc} for name, size, crc in _gathered(mine)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def broken_file(folder: Path) -> str | None:
    """What is wrong with the checkpoint in ``folder`` by its manifest (collective), or None.
    A checkpoint without a manifest (saved before manifests existed) is not checked."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    files, problems = _read_manifest(manifest)
    for name in _my_share(sorted(files)):
        path, expected = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (size := path.stat().st_size) != expected["bytes"]:
            problems.append(f"{path} has {size} bytes, {expected['bytes']} were written")
        elif _crc32(path) != expected["crc32"]:
            problems.append(f"{path} does not match the checksum written with it")
    problems = _gathered(problems)
    return problems[0] if problems else None


def _read_manifest(manifest: Path) -> tuple[dict[str, Any], list[str]]:
    """The files a manifest lists ({name: {"bytes", "crc32"}}), or none and the problem when
    the manifest itself is damaged (the checkpoint then counts as broken)."""
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        if all(isinstance(e["bytes"], int) and isinstance(e["crc32"], int) for e in files.values()):
            return files, []
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not a manifest's
        pass
    return {}, [f"{manifest} is damaged (not a JSON list of files, sizes and checksums)"]


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


def swap_into_place(new: Path, final: Path, aside: Path) -> None:
    """Rename the complete folder ``new`` to ``final``. A ``final`` already there is renamed to
    ``aside`` first and deleted only once ``new`` is in place, so at every moment one of them
    is whole on disk (``finish_interrupted_swap`` tidies up after a kill in between)."""
    finish_interrupted_swap(final, aside)
    if final.exists():
        final.rename(aside)
    new.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


def finish_interrupted_swap(final: Path, aside: Path) -> None:
    """After ``swap_into_place`` was killed: the old folder goes back to ``final`` when the
    new one never got there, and is deleted when it did."""
    if not aside.exists():
        return
    if final.exists():
        shutil.rmtree(aside)
    else:
        aside.rename(final)
        logger.warning("%s: put back in place (a replacement of it was interrupted)", final)


@dataclass
class _Writing:
    """A save DCP is still writing in the background (checkpoint.async_mode)."""

    step: int
    partial: Path
    future: Future


class Checkpointer:
    """Saves and restores one job's training state."""

    def __init__(
        self,
        cfg: Checkpoint,
        dump_folder: str | Path,
        rank: int,
        args: ModelArgs,
        parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        init_timeout_s: int = 300,
        lora: LoRA | None = None,
    ) -> None:
        self.cfg = cfg
        self.lora = lora or LoRA()
        self.saved_part: ModelPart = "trained" if self.lora.enable else "all"
        self.args = args
        self.folder = Path(dump_folder) / cfg.folder
        self.rank = rank
        self.parts = parts
        self.optimizers = optimizers
        self._writing: _Writing | None = None
        self.last_saved: Path | None = None
        """The checkpoint this run saved last (None before its first save)."""
        self._stager: DefaultStager | None = None
        self._group = None
        if cfg.enable and cfg.async_mode != "disabled":
            self._group = background_save_group(init_timeout_s)
            pinned = cfg.async_mode == "async_with_pinned_mem" and torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )

    def _state(self, train: dict[str, Any], model_only: bool = False) -> dict[str, Any]:
        state: dict[str, Any] = {"model": ModelState(self.parts, self.saved_part), "train": train}
        if not model_only:
            state["optimizer"] = OptimizerState(self.parts, self.optimizers)
        return state

    def save(self, train: dict[str, Any], model_only: bool = False) -> Path:
        """Write the checkpoint of step ``train["step"]`` (``train`` is saved beside the
        weights) atomically; prune old ones past keep_latest_k. ``model_only`` leaves out
        the optimizer. With checkpoint.async_mode, returns once the state is copied aside and
        the folder appears when ``wait`` (the next save, or the end) has finished writing."""
        self.wait()
        step = train["step"]
        partial = self.folder / f".step-{step}.partial"
        if self.rank == 0:
            self._remove_leftovers()
            partial.mkdir(parents=True)
        _barrier()
        try:
            torch.save(torch.get_rng_state(), partial / f"rng-rank{self.rank}.pt")
            if self._stager is not None:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    future = dcp.async_save(
                        self._state(dict(train), model_only),
                        checkpoint_id=str(partial),
                        process_group=self._group,
                        async_stager=self._stager,
                        no_dist=self._group is None,
                    )
                self._writing = _Writing(step, partial, future)
                return self.folder / f"step-{step}"
            _dcp(dcp.save, self._state(dict(train), model_only), partial)
        except (OSError, RuntimeError, CheckpointException) as err:
            self._failed(step, partial, err)
        return self._finish(step, partial)

    def wait(self) -> None:
        """Finish the save still being written in the background, if any (collective)."""
        if self._writing is None:
            return
        writing, self._writing = self._writing, None
        try:
            writing.future.result()
        except (OSError, RuntimeError, CheckpointException) as err:
            self._failed(writing.step, writing.partial, err)
        self._finish(writing.step, writing.partial)

    def close(self) -> None:
        """Finish any background save and free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _finish(self, step: int, partial: Path) -> Path:
        """Checksum a written save and move it into place as step-N (collective)."""
        final = self.folder / f"step-{step}"
        try:
            _barrier()
            write_manifest(partial)
        except (OSError, RuntimeError, CheckpointException) as err:
            self._failed(step, partial, err)
        _barrier()
        if self.rank == 0:
            swap_into_place(partial, final, self.folder / f".step-{step}.stale")
            self._prune()
            logger.info("saved checkpoint %s", final)
        _barrier()
        self.last_saved = final
        return final

    def _failed(self, step: int, partial: Path, err: BaseException) -> NoReturn:
        shutil.rmtree(partial, ignore_errors=True)
        rank, cause = _first_failure(err, self.rank)
        if peer_gone(cause):  # not this save's fault: the trainer reports it
            raise cause from None
        raise TrainingStopped(self._save_failed(step, rank, cause)) from None

    def _save_failed(self, step: int, rank: int, err: BaseException) -> str:
        free_gib = shutil.disk_usage(self.folder).free / 2**30
        # torch.save's own words for a write the OS cut short
        reason = "a write was cut short" if "unexpected pos" in str(err) else f"{type(err).__name__}: {err}"
        return (
            f"rank {rank} could not write checkpoint step-{step} in {self.folder}: {reason} "
            f"({free_gib:.1f} GiB free there). The checkpoints already there are kept; free space "
            "or set checkpoint.folder elsewhere, then rerun the same command to resume"
        )

    def _remove_leftovers(self) -> None:
        """Partial folders of interrupted saves, and stale ones (see ``_put_back_stale``)."""
        for leftover in self.folder.glob(".step-*.partial"):
            shutil.rmtree(leftover, ignore_errors=True)
        self._put_back_stale()

    def _put_back_stale(self) -> None:
        """Checkpoints a re-save set aside and was killed before replacing (rank 0)."""
        for stale in self.folder.glob(".step-*.stale"):
            finish_interrupted_swap(self.folder / stale.name[1:].removesuffix(".stale"), stale)

    def _prune(self) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        for step in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{step}")

    def resume_step(self) -> int | None:
        """The step to resume from: checkpoint.load_step, else the newest intact checkpoint
        (collective: every rank verifies a share of the files)."""
        if self.rank == 0:
            self._put_back_stale()
        _barrier()
        steps = complete_steps(self.folder)
        if self.cfg.load_step >= 0:  # present: checked by check_load_step
            problem = broken_file(self.folder / f"step-{self.cfg.load_step}")
            if problem is not None:
                raise TrainingStopped(
                    f"checkpoint.load_step={self.cfg.load_step} is broken: {problem}; "
                    f"pick another of {steps}, or leave load_step unset to use the newest intact one"
                )
            return self._unverified_said(self.cfg.load_step)
        for step in reversed(steps):
            problem = broken_file(self.folder / f"step-{step}")
            if problem is None:
                return self._unverified_said(step)
            logger.warning("checkpoint step-%d is broken (%s); trying the one before", step, problem)
        if steps:
            raise TrainingStopped(
                f"every checkpoint in {self.folder} is broken (steps {steps}); move the folder "
                "away to start afresh"
            )
        return None

    def load(self, step: int) -> dict[str, Any]:
        """Restore everything saved at ``step``; returns the train state saved with it
        ({"step", "consumed_samples"}, and the data shape of newer saves)."""
        path = self.folder / f"step-{step}"
        mismatch = model_mismatch(path, self.args, self.lora)
        if mismatch is not None:
            raise TrainingStopped(
                f"checkpoint {path} was saved from another model: {mismatch}; resume with the "
                "model it was saved with, or train into a new job.dump_folder"
            )
        if self.model_only(step):
            raise TrainingStopped(
                f"checkpoint {path} holds the model only (checkpoint.last_save_model_only=true), so "
                "training cannot resume from it; start a new job from it with "
                f"--checkpoint.initial_load_path {path}, or resume from an earlier step "
                f"(--checkpoint.load_step, one of {complete_steps(self.folder)[:-1]})"
            )
        train = {k.removeprefix("train."): 0 for k in saved_keys(path) if k.startswith("train.")}
        state = self._state(train)
        _dcp(dcp.load, state, path)
        rng = path / f"rng-rank{self.rank}.pt"
        if rng.is_file():  # absent when the world grew since the save; nothing draws from it
            torch.set_rng_state(torch.load(rng))
        logger.info("resumed from %s", path)
        return state["train"]

    def _unverified_said(self, step: int) -> int:
        """``step``, after a warning when its files could not be verified for want of a manifest."""
        if not (self.folder / f"step-{step}" / MANIFEST).is_file():
            logger.warning(
                "checkpoint step-%d has no %s (deleted, or saved by an older autopar): resuming from it "
                "without verifying its files",
                step,
                MANIFEST,
            )
        return step

    def train_state(self, step: int) -> dict[str, Any]:
        """The train entries saved at ``step`` (see ``saved_train_state``)."""
        return saved_train_state(self.folder / f"step-{step}")

    def discard_after(self, step: int) -> list[int]:
        """Delete the complete checkpoints after ``step`` (a rewind to it; collective: rank 0
        deletes); the steps they were."""
        later = [s for s in complete_steps(self.folder) if s > step]
        _barrier()
        if self.rank == 0:
            for s in later:
                shutil.rmtree(self.folder / f"step-{s}")
        _barrier()
        return later

    def resume_candidate(self) -> int | None:
        """The step a resume would start from if its files are intact (no verification, no
        collective): checkpoint.load_step, else the newest complete one."""
        if not self.cfg.enable:
            return None
        if self.cfg.load_step >= 0:
            return self.cfg.load_step
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def model_only(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` holds the model without its optimizer."""
        return not any(k.startswith("optimizer.") for k in saved_keys(self.folder / f"step-{step}"))

    def load_model_only(self, path: str | Path) -> None:
        """Initial weights from a DCP folder (model entries only)."""
        _dcp(dcp.load, {"model": ModelState(self.parts, "frozen" if self.lora.enable else "all")}, path)

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)


def saved_train_state(folder: Path) -> dict[str, Any]:
    """The train entries of the checkpoint in ``folder`` (step, data position, what the data
    was, the settings it was trained with), read without the model and without collectives:
    what a resume can be checked against before building anything."""
    keys = [k.removeprefix("train.") for k in saved_keys(folder) if k.startswith("train.")]
    state: dict[str, Any] = {"train": dict.fromkeys(keys, 0)}
    _dcp(dcp.load, state, folder)
    return state["train"]


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


def export_hf(
    checkpoint_dir: str | Path,
    args: ModelArgs,
    out_dir: str | Path,
    dtype: torch.dtype,
    source: str | Path | None = None,
) -> None:
    """Write the model of a DCP checkpoint as an HF folder, one safetensors shard in memory
    at a time. From a vision-language ``source`` (the HF folder the run started from) it
    writes that layout, and the source's vision tower, MTP head and config.json come along
    unchanged: the export loads and serves as the whole model did."""
    with torch.device("meta"):
        layout = {n: (p.shape, dtype) for n, p in build_model(args).named_parameters()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        return read_model_tensors(checkpoint_dir, {n: layout[n][0] for n in names}, dtype)

    hf_layout = checkpoint_layout(source) if source is not None else HFLayout()
    save_hf_streaming(layout, load, args, out_dir, hf_layout=hf_layout)
    if hf_layout.vision_language:
        carry_through(source, out_dir)


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
        _check_initial_dcp(path, args, model_label)
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
    try:
        HFTensors(path, args)  # every file readable, every tensor there in its shape
    except HFCheckpointError as err:
        raise ConfigError(f"checkpoint.initial_load_path: {err}") from None


def _check_initial_dcp(path: Path, args: ModelArgs, model_label: str) -> None:
    """A DCP ``initial_load_path`` holds every weight of this model, each in its shape (the
    load itself is not strict: a missing or extra weight would pass unnoticed)."""
    field = f"checkpoint.initial_load_path={str(path)!r}"
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"{field} is not a DCP checkpoint (no .metadata); for an HF folder set "
            "checkpoint.initial_load_in_hf=true"
        )
    try:
        mismatch = model_mismatch(path, args)
    except Exception as err:  # DCP unpickles .metadata: any error means a damaged file
        raise ConfigError(f"{field}: {path / '.metadata'} is not readable ({type(err).__name__})") from None
    if mismatch is not None:
        raise ConfigError(
            f"{field} was saved from another model than {model_label}: {mismatch}; start from a "
            "checkpoint of this model (a LoRA run's saves hold its adapters only), or set the "
            "--model.* fields it was saved with"
        )


def check_load_step(cfg: Checkpoint, dump_folder: str) -> None:
    """An explicit ``load_step`` names a complete checkpoint of this job (whether its files
    are intact is checked when resuming, by every rank)."""
    if cfg.load_step < -1:
        raise ConfigError(
            f"checkpoint.load_step={cfg.load_step}: use -1 (the latest complete checkpoint) or a saved step number"
        )
    if cfg.load_step == -1:
        return
    if not cfg.enable:
        raise ConfigError(f"checkpoint.load_step={cfg.load_step} needs checkpoint.enable=true")
    folder = Path(dump_folder) / cfg.folder
    steps = complete_steps(folder)
    if cfg.load_step not in steps:
        raise ConfigError(
            f"checkpoint.load_step={cfg.load_step}: no complete checkpoint {folder}/step-{cfg.load_step}; "
            f"complete steps there: {steps}"
        )
