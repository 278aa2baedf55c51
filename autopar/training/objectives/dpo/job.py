"""A preference job's parts: its data, its reference model and its objective (its checks:
``checks.py``).

For ``training.dataset_format = "preference"`` the trainer gets pairs instead of windows
(``data.pair_batches``), the reference's log-probabilities (``dpo.reference``) and DPO's
objective (``objective.py``) from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from autopar.config.sections import JobConfig
from autopar.data.chat import ChatFormat
from autopar.data.loader import Batch, dataset_path
from autopar.data.pair_batches import PairIds, PairLoader, PairSource, pack_groups, pack_pairs
from autopar.data.preference import load_pairs
from autopar.models.args import ModelArgs
from autopar.models.hf import HFTensors
from autopar.models.hf_config import CONFIG_FILE
from autopar.parallel.lora import adapters_off
from autopar.parallel.materialize import FullValue, tensor_values
from autopar.parallel.mesh import Meshes
from autopar.parallel.parallelize import build_parts
from autopar.parallel.pipelining.schedule import StageIO
from autopar.training.checkpointing.dcp_state import ModelState, run_dcp
from autopar.training.checkpointing.initial_load import reading_weights
from autopar.training.objectives.dpo.checks import is_preference
from autopar.training.objectives.dpo.objective import (
    Preference,
    ReferenceLogps,
    ReferencePass,
    losses_of,
    table_reference,
)
from autopar.training.objectives.dpo.reference_table import (
    TABLE_FILE,
    compute_table,
    read_table,
    save_table,
    table_key,
)
from autopar.training.plan_runner import PlanRunner
from autopar.training.resolve import tokenizer_path
from autopar.training.step import TrainStep
from autopar.training.validation import Validator

logger = logging.getLogger("autopar")


def runs_reference_forward(job: JobConfig) -> bool:
    """Whether each step runs a reference forward beside the policy's (a ``copy`` or the LoRA
    base; a precomputed table is read, its pass paid once before training)."""
    return is_preference(job) and job.dpo.reference != "precomputed"


def max_sequence_length(job: JobConfig) -> int:
    """The longest prompt + completion a pair keeps (``dpo.max_length``, else half a row)."""
    return job.dpo.max_length if job.dpo.max_length > 0 else job.training.seq_len // 2


def _reference_values(
    path: str | None, args: ModelArgs, device: torch.device, initial: FullValue
) -> FullValue:
    if path is not None and (Path(path) / CONFIG_FILE).is_file():
        return tensor_values(HFTensors(path, args), device)
    return initial


def load_model(parts: list[nn.Module], path: str, field: str) -> None:
    """Every weight of ``parts`` from the DCP checkpoint ``path`` (model entries only), the
    job's ``field``: a damaged file is one line naming it."""
    with reading_weights(path, field):
        run_dcp(dcp.load, {"model": ModelState(parts, "all")}, path)


def reference_dcp(job: JobConfig, path: str | None) -> str | None:
    """The DCP folder the reference's weights come from, if any (else HF or the initial values):
    ``path`` (the job's reference_path), else the initial DCP checkpoint."""
    if path is not None:
        return None if (Path(path) / CONFIG_FILE).is_file() else path
    checkpoint = job.checkpoint
    return checkpoint.initial_load_path if not checkpoint.initial_load_in_hf else None


def build_reference_copy(
    args: ModelArgs,
    job: JobConfig,
    meshes: Meshes,
    device: torch.device,
    initial: FullValue,
    path: str | None,
) -> list[nn.Module]:
    """The frozen reference: the model under the job's plan (without LoRA), holding the
    reference's weights (an HF folder at ``path``, else ``initial``) in the compute dtype; no
    optimizer state, no gradients. A DCP source is loaded by the caller (``reference_dcp``)."""
    plain = dataclasses.replace(job, lora=dataclasses.replace(job.lora, enable=False))
    values = _reference_values(path, args, device, initial)
    return build_parts(args, plain, meshes, device, values, frozen=True).parts


def reference_source(job: JobConfig, args: ModelArgs) -> str:
    """Where the reference's weights come from, and the model they fill (a table's key)."""
    checkpoint = job.checkpoint
    weights = (
        job.dpo.reference_path or checkpoint.initial_load_path or f"seeded (debug.seed {job.debug.seed})"
    )
    return f"{weights} | {args} | {job.training.mixed_precision_param}"


def preference_objective(
    runner: PlanRunner,
    job: JobConfig,
    args: ModelArgs,
    initial: FullValue,
    source: PairSource,
) -> tuple[Preference, list[nn.Module]]:
    """DPO with the job's reference; and the reference copy's parts (none for
    ``adapters_off`` and ``precomputed``)."""
    copy: list[nn.Module] = []
    if job.dpo.reference == "adapters_off":
        logger.info("DPO reference: the LoRA base (the policy with its adapters bypassed)")
        reference: ReferenceLogps = reference_pass(runner, job, None)
    elif job.dpo.reference == "precomputed":
        reference = table_reference(reference_table(runner, job, args, initial, source))
    else:
        copy = reference_copy(runner, job, args, initial)
        reference = reference_pass(runner, job, copy)
    return Preference(runner, losses_of(job.dpo), reference, job.training.local_batch_size), copy


def reference_pass(
    runner: PlanRunner, job: JobConfig, copy: list[nn.Module] | None, stage_io: list[StageIO] | None = None
) -> ReferencePass:
    """The reference as a forward under the job's plan: of the frozen ``copy``, or (None) of
    the policy with its adapters bypassed; pipelined where the job is (``stage_io``: the
    copy's stage shapes, for a process group that cannot exchange them, the dry run's)."""
    pairs = job.training.local_batch_size
    if copy is None:
        return ReferencePass(runner, None, pairs, functools.partial(all_adapters_off, runner.parts))
    model = runner.pipeline_of(copy, stage_io) if runner.pipeline is not None else copy[0]
    return ReferencePass(runner, model, pairs)


@contextlib.contextmanager
def all_adapters_off(parts: list[nn.Module]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(adapters_off(part))
        yield


def reference_copy(
    runner: PlanRunner, job: JobConfig, args: ModelArgs, initial: FullValue
) -> list[nn.Module]:
    copy = build_reference_copy(args, job, runner.meshes, runner.device, initial, job.dpo.reference_path)
    dcp_path = reference_dcp(job, job.dpo.reference_path)
    if dcp_path is not None:
        field = "dpo.reference_path" if job.dpo.reference_path else "checkpoint.initial_load_path"
        load_model(copy, dcp_path, field)
    logger.info("DPO reference: a frozen copy of %s", job.dpo.reference_path or "the initial weights")
    return copy


def reference_table(
    runner: PlanRunner, job: JobConfig, args: ModelArgs, initial: FullValue, source: PairSource
) -> torch.Tensor:
    """The precomputed table: read back, or computed now by a reference copy freed after."""
    path = Path(job.job.dump_folder) / TABLE_FILE
    key = table_key(source.pairs, reference_source(job, args))
    table = read_table(path, key)
    if table is not None:
        logger.info("DPO reference: log-probs of %d pairs read from %s", len(table), path)
        return table
    copy = reference_copy(runner, job, args, initial)
    table = compute_table(
        reference_pass(runner, job, copy),
        source.pairs,
        job.training.local_batch_size,
        functools.partial(
            pack_micro_batch,
            job=job,
            seq_len=job.training.seq_len,
            pad_id=ChatFormat(str(tokenizer_path(job))).pad_id(),
        ),
        runner.device,
        runner.meshes.get("dp"),
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_table(path, table, key)
    logger.info("DPO reference: log-probs of %d pairs computed and written to %s", len(table), path)
    return table


def preference_source(
    job: JobConfig, tokenizer: str, dataset: str, path: str | None, section: str = "training"
) -> PairSource:
    """The preference pairs a section's data fields name, tokenized as TRL does and cut to
    ``max_sequence_length``."""
    training = job.training
    source = dataset_path(dataset, path, section)
    loaded = load_pairs(
        source,
        ChatFormat(tokenizer, training.chat_template),
        tokenizer,
        max_sequence_length(job),
        job.dpo.truncation,
    )
    if loaded.made_identical:
        logger.warning(
            "%s: %d of %d pairs have chosen = rejected after truncation to dpo.max_length=%d (cut before their "
            "completions differ): they add log 2 to the loss and nothing to learn; raise --dpo.max_length "
            "(-1: half of --training.seq_len)",
            source,
            loaded.made_identical,
            len(loaded.pairs),
            max_sequence_length(job),
        )
    return PairSource(loaded.pairs, str(source), loaded.truncated, loaded.identical, loaded.made_identical)


def pair_loader(
    job: JobConfig,
    source: PairSource,
    global_batch: int,
    dp_rank: int,
    dp: int,
    device: torch.device,
    tokenizer: str,
) -> PairLoader:
    training = job.training
    return PairLoader(
        global_batch,
        training.local_batch_size,
        dp_rank,
        dp,
        device,
        pairs=source.pairs,
        seq_len=training.seq_len,
        pad_id=ChatFormat(tokenizer).pad_id(),
        seed=job.debug.seed,
        packing=job.dpo.packing,
        pipeline_groups=pipeline_groups(job),
    )


def pipeline_groups(job: JobConfig) -> int | None:
    """Under a pipeline, the pipeline micro-batches of a micro-step (``pack_groups``' layout)."""
    parallelism = job.parallelism
    if parallelism.pipeline_parallel_degree == 1:
        return None
    return job.training.local_batch_size // parallelism.pipeline_parallel_microbatch_size


def pack_micro_batch(pairs: Sequence[PairIds], job: JobConfig, seq_len: int, pad_id: int) -> Batch:
    """One micro-batch of ``pairs`` in the layout the job's step reads (``PairLoader``'s)."""
    groups = pipeline_groups(job)
    if groups is None:
        return pack_pairs(pairs, seq_len, pad_id, job.dpo.packing)
    return pack_groups(pairs, groups, seq_len, pad_id, job.dpo.packing)


def pair_validator(job: JobConfig, source: PairSource, step: TrainStep, training: PairLoader) -> Validator:
    """``Validator`` over held-out pairs, ``validation.local_batch_size`` per rank, laid out as
    the training loader lays out its pairs, every pass over the same pairs in the same order."""
    local_batch = job.validation.local_batch_size
    per_step = local_batch * training.dp_size
    steps = len(source.pairs) // per_step if job.validation.steps == -1 else job.validation.steps
    loader = functools.partial(
        dataclasses.replace, training, global_batch=per_step, local_batch=local_batch, pairs=source.pairs
    )
    return Validator(step, loader, steps)
