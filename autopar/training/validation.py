"""Held-out loss (``[validation]``, torchtitan's names) under the training plan.

A validation pass runs forward only, on the same model parts, meshes, loss context and
pipeline as training, so its number is what one device would compute for the same weights:
the token-sum cross-entropy over every target of the held-out batches divided by their
number. Every pass reads the same batches (a fresh loader from sample 0), so passes at
different steps are comparable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.data.dataset import PackedWindows
from autopar.data.errors import DataError
from autopar.data.loader import Batch, StepLoader, build_samples, check_data, table_columns
from autopar.data.tokenizer import Tokenizer
from autopar.models.args import ModelArgs
from autopar.parallel.mesh import ParallelDims, check_model_split
from autopar.parallel.pipelining.schedule import check_forward_only_schedule
from autopar.training.objectives.base import Objective
from autopar.training.resolve import chat_format
from autopar.training.sample_prompts import check_sample_prompts
from autopar.training.step import TrainStep


def validation_seq_len(job: JobConfig) -> int:
    seq_len = job.validation.seq_len
    return job.training.seq_len if seq_len == -1 else seq_len


def check_validation(job: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """``[validation]`` can run under the job's plan: data named, sizes in range, and what
    the plan fixes (a pipeline's micro-batches and shapes) equal to training's."""
    cfg = job.validation
    check_sample_prompts(job, dims)
    if not cfg.enable:
        return
    if cfg.dataset is None and cfg.dataset_path is None:
        raise ConfigError("validation.enable=true needs validation.dataset_path (held-out text or tokens)")
    for name in ("freq", "local_batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"validation.{name}={getattr(cfg, name)} must be >= 1")
    if cfg.steps < 1 and cfg.steps != -1:
        raise ConfigError(f"validation.steps={cfg.steps} must be >= 1, or -1 for all the held-out data")
    seq_len = validation_seq_len(job)
    if seq_len < 2 or seq_len > args.max_position_embeddings:
        raise ConfigError(
            f"validation.seq_len={seq_len} must be in [2, model.max_position_embeddings="
            f"{args.max_position_embeddings}]"
        )
    if dims.pp > 1 and (cfg.local_batch_size, seq_len) != (
        job.training.local_batch_size,
        job.training.seq_len,
    ):
        raise ConfigError(
            f"validation.local_batch_size={cfg.local_batch_size} and seq_len={seq_len} under "
            f"pipeline_parallel_degree={dims.pp}: the pipeline's stages and micro-batches are built "
            f"for training's {job.training.local_batch_size} x {job.training.seq_len}; set both to those"
        )
    if dims.pp > 1:
        check_forward_only_schedule(job.parallelism, "validation.enable=true")
    check_model_split(
        dims,
        args,
        seq_len,
        job.parallelism.enable_sequence_parallel,
        head_tail=job.parallelism.context_parallel_load_balancer == "headtail",
        seq_field="validation.seq_len",
    )
    try:
        columns = None if job.training.dataset_format == "preference" else table_columns(job.training)
        check_data(cfg.dataset or "", cfg.dataset_path, [], "validation", columns)
    except DataError as err:
        raise ConfigError(str(err)) from None


def validation_samples(job: JobConfig, tokenizer: Tokenizer) -> PackedWindows:
    """The held-out sequences of ``[validation]``, tokenized by the training tokenizer."""
    cfg = job.validation
    samples = build_samples(
        cfg.dataset or "",
        cfg.dataset_path,
        [],
        tokenizer,
        validation_seq_len(job),
        job.debug.seed,
        "validation",
        chat_format(job),
        job.training.document_masking,
        job.training.dataset_text_field,
    )
    assert isinstance(samples, PackedWindows), "validation reads one dataset, never a blend"
    return samples


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    """Token-mean cross-entropy over the held-out targets."""
    tokens: int
    """How many targets it averages (pairs, for preference data)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """More held-out numbers under their own names (a preference job's TRL metrics, the MTP
    head's ``mtp_loss`` and ``mtp_acceptance``)."""


class HeldOutBatches(Protocol):
    """What a validation pass reads its batches from (a loader, or RL's held-out rollouts)."""

    def next_step(self) -> list[Batch]: ...


class Validator:
    """The held-out loss and metrics of this rank's model parts: the step's forward under the
    training plan, without gradients (collective over every rank)."""

    def __init__(
        self,
        step: TrainStep,
        loader: Callable[[], HeldOutBatches],
        steps: int,
        objective: Objective | None = None,
    ) -> None:
        self.step = step
        self.loader = loader
        """A fresh loader from the first held-out sample: every pass reads the same batches."""
        self.steps = steps
        self.objective = step.objective if objective is None else objective
        """What the held-out batches compute: the step's objective, or one over them (RL's
        policy loss over held-out rollouts)."""

    @torch.no_grad()
    def run(self) -> ValidationResult:
        """One pass over the held-out batches."""
        loader = self.loader()
        outcomes = [
            self.step.forward_backward(loader.next_step(), backward=False, objective=self.objective)
            for _ in range(self.steps)
        ]
        return ValidationResult(*self.objective.held_out(outcomes))


def window_validator(
    job: JobConfig, samples: PackedWindows, step: TrainStep, dp_rank: int, device: torch.device
) -> Validator:
    """``Validator`` over held-out token windows, ``validation.local_batch_size`` per rank."""
    cfg = job.validation
    local_batch, dp = cfg.local_batch_size, step.dims.dp
    per_step = local_batch * dp
    steps = samples.num_windows // per_step if cfg.steps == -1 else cfg.steps
    return Validator(
        step,
        functools.partial(StepLoader, per_step, local_batch, dp_rank, dp, device, samples=samples),
        steps,
    )
