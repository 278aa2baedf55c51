"""Distributed checkpoints (torch.distributed.checkpoint): save and resume.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/``. A save is written to a hidden
``.step-<N>.partial`` folder and renamed into place only after every rank finished, so an
interrupted save is never picked up and never costs the previous good checkpoint (leftover
partial folders are removed at the next save). Tensors are stored by parameter name with
their global shapes, so a checkpoint saved under one plan loads under any other (DCP
reshards on load).

Each save lists its files with their sizes and CRC-32 in ``manifest.json`` (see
``manifest.py``). Resuming verifies the latest checkpoint and falls back to the newest
intact one, saying which file is broken; an explicit ``checkpoint.load_step`` that is broken
is refused. The saved parameter names and shapes must equal the model's.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from autopar.config.errors import ConfigError
from autopar.config.sections import Checkpoint, LoRA
from autopar.models.args import ModelArgs
from autopar.parallel.world import background_save_group
from autopar.training.checkpointing.dcp_state import (
    READ_ERRORS,
    ModelPart,
    ModelState,
    OptimizerState,
    complete_steps,
    model_mismatch,
    newest_readable,
    readable_train_state,
    run_dcp,
    saved_keys,
    step_folders,
)
from autopar.training.checkpointing.folder_swap import finish_interrupted_swap, swap_into_place
from autopar.training.checkpointing.manifest import MANIFEST, broken_file, write_manifest
from autopar.training.faults import TrainingStopped, peer_gone

logger = logging.getLogger("autopar")


def _first_failure(err: BaseException, rank: int) -> tuple[int, BaseException]:
    """The rank and error behind ``err`` (DCP gathers every rank's failures into one)."""
    if isinstance(err, CheckpointException):
        failed_rank, (cause, _) = next(iter(err.failures.items()))
        return failed_rank, cause
    return rank, err


def _read_failure(err: BaseException, rank: int) -> tuple[int, BaseException]:
    """The rank and error behind a failed read of a checkpoint; an error that says a peer is
    gone is raised again as it is (not the checkpoint's fault: the trainer reports it)."""
    failed_rank, cause = _first_failure(err, rank)
    if peer_gone(cause):
        raise cause from None
    return failed_rank, cause


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
            run_dcp(dcp.save, self._state(dict(train), model_only), partial)
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
        if self.cfg.load_step >= 0:  # present: checked by check_load_step
            problem = self._problem(self.cfg.load_step)
            if problem is not None:
                others = [s for s in step_folders(self.folder) if s != self.cfg.load_step]
                intact = [s for s in others if self._problem(s) is None]
                raise TrainingStopped(
                    f"checkpoint.load_step={self.cfg.load_step} is broken: {problem}; "
                    + (f"pick another of {intact}, or " if intact else "")
                    + "leave load_step unset to use the newest intact one"
                )
            return self._unverified_said(self.cfg.load_step)
        steps = step_folders(self.folder)
        for step in reversed(steps):
            problem = self._problem(step)
            if problem is None:
                return self._unverified_said(step)
            logger.warning("checkpoint step-%d is broken (%s); trying the one before", step, problem)
        if steps:
            raise TrainingStopped(
                f"every checkpoint in {self.folder} is broken (steps {steps}); move the folder "
                "away to start afresh"
            )
        return None

    def _problem(self, step: int) -> str | None:
        """What is wrong with the checkpoint of ``step`` (collective), or None: its
        ``.metadata`` gone, a file that does not match its manifest, or without a manifest
        (deleted, or saved by an older autopar) train entries that cannot be read."""
        folder = self.folder / f"step-{step}"
        if not (folder / ".metadata").is_file():
            return f"{folder / '.metadata'} is missing"
        if (folder / MANIFEST).is_file():
            return broken_file(folder)
        if readable_train_state(folder) is None:
            return f"its files cannot be read, and it has no {MANIFEST} to tell which is damaged"
        return None

    @contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Reading the checkpoint of ``step``: a file that cannot be read (damaged in a
        checkpoint without a manifest, which nothing verified) stops training with one line."""
        try:
            yield
        except TrainingStopped:
            raise
        except READ_ERRORS as err:
            rank, cause = _read_failure(err, self.rank)
            raise TrainingStopped(
                f"rank {rank} could not read checkpoint {self.folder / f'step-{step}'} "
                f"({type(cause).__name__}: {cause}): a file of it is damaged; resume from another with "
                f"--checkpoint.load_step (one of {[s for s in complete_steps(self.folder) if s != step]}), "
                "or move it away"
            ) from None

    def load(self, step: int) -> dict[str, Any]:
        """Restore everything saved at ``step``; returns the train state saved with it
        ({"step", "consumed_samples"}, and the data shape of newer saves)."""
        with self._reading(step):
            return self._load(step)

    def _load(self, step: int) -> dict[str, Any]:
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
        run_dcp(dcp.load, state, path)
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

    def candidate_train_state(self) -> tuple[int, dict[str, Any]] | None:
        """The step a resume will start from and its train entries, read before building
        anything (``newest_readable``: checkpoint.load_step, else the newest complete one whose
        train entries read); None for a fresh start."""
        if not self.cfg.enable:
            return None
        steps = [self.cfg.load_step] if self.cfg.load_step >= 0 else complete_steps(self.folder)
        return newest_readable(self.folder, steps)

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
        with self._reading(step):
            return not any(k.startswith("optimizer.") for k in saved_keys(self.folder / f"step-{step}"))

    def load_model_only(self, path: str | Path) -> None:
        """Initial weights from a DCP folder (model entries only), its files verified first
        against its manifest when it has one (collective: the ranks share the checksumming)."""
        field = f"checkpoint.initial_load_path={str(path)!r}"
        problem = broken_file(Path(path))
        if problem is not None:
            raise ConfigError(
                f"{field} is damaged: {problem}; copy or save it again, or start from other weights"
            )
        try:
            run_dcp(
                dcp.load, {"model": ModelState(self.parts, "frozen" if self.lora.enable else "all")}, path
            )
        except READ_ERRORS as err:
            rank, cause = _read_failure(err, self.rank)
            raise ConfigError(
                f"{field}: rank {rank} could not read it ({type(cause).__name__}: {cause}), a file of it "
                "is damaged; copy or save it again, or start from other weights"
            ) from None

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)
