"""What a job trains on, per data-parallel rank: its samples (token windows, conversations, or
preference pairs) and the loader that deals them into each step's micro-batches."""

from __future__ import annotations

import torch

from autopar.config.sections import JobConfig
from autopar.data.dataset import PackedWindows, SampleSource
from autopar.data.errors import DataError
from autopar.data.loader import StepLoader, build_samples
from autopar.data.pair_batches import PairLoader, PairSource
from autopar.data.prompt_records import PromptSource
from autopar.data.tokenizer import Tokenizer
from autopar.parallel.mesh import Meshes
from autopar.training.objectives.dpo.job import is_preference, pair_loader, pair_validator, preference_source
from autopar.training.objectives.rl.engine import Rollouts
from autopar.training.objectives.rl.job import is_rl, prompt_source, rollout_validator, validation_job
from autopar.training.resolve import chat_format, tokenizer_path
from autopar.training.step import TrainStep
from autopar.training.validation import Validator, validation_samples, validation_seq_len, window_validator


def job_samples(job: JobConfig, tokenizer: Tokenizer) -> SampleSource | PairSource | PromptSource:
    """The samples of the job's ``[training]`` data (read now: bad data is refused here)."""
    training = job.training
    if is_preference(job):
        return preference_source(job, tokenizer_path(job), training.dataset, training.dataset_path)
    if is_rl(job):
        return prompt_source(job)
    return build_samples(
        training.dataset,
        training.dataset_path,
        training.dataset_blend,
        tokenizer,
        training.seq_len,
        job.debug.seed,
        chat=chat_format(job),
        document_masking=training.document_masking,
        text_field=training.dataset_text_field,
    )


def step_loader(
    job: JobConfig, samples: SampleSource | PairSource, meshes: Meshes, device: torch.device
) -> StepLoader | PairLoader:
    """This data-parallel rank's loader of ``samples`` (pairs count as samples)."""
    training, dims = job.training, meshes.dims
    dp_mesh = meshes.get("dp")
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    global_batch = training.global_batch(dims.dp)
    if isinstance(samples, PairSource):
        return pair_loader(job, samples, global_batch, dp_rank, dims.dp, device, tokenizer_path(job))
    return StepLoader(global_batch, training.local_batch_size, dp_rank, dims.dp, device, samples=samples)


def held_out_samples(job: JobConfig, tokenizer: Tokenizer) -> PackedWindows | PairSource | PromptSource:
    """The ``[validation]`` data: held-out windows, pairs for a preference job, or prompts
    for RL."""
    if is_rl(job):
        return prompt_source(validation_job(job))
    if is_preference(job):
        cfg = job.validation
        return preference_source(job, tokenizer_path(job), cfg.dataset or "", cfg.dataset_path, "validation")
    return validation_samples(job, tokenizer)


def check_held_out(job: JobConfig, held_out: PackedWindows | PairSource | PromptSource, dp: int) -> None:
    """The held-out data holds at least one validation step (validation.local_batch_size
    per data-parallel rank; RL: prompts of rl.num_generations completions each), refused
    when read: before the model is built and any weight is loaded."""
    per_step = job.validation.local_batch_size * dp
    formula = "validation.local_batch_size x data-parallel degree"
    if isinstance(held_out, PromptSource):
        have, unit = len(held_out.records), "prompts"
        per_step, formula = per_step // job.rl.num_generations, formula + " / rl.num_generations"
    elif isinstance(held_out, PairSource):
        have, unit = len(held_out.pairs), "pairs"
    else:
        have, unit = held_out.num_windows, f"sequences of {validation_seq_len(job)} tokens"
    if have < per_step:
        raise DataError(
            f"validation data {held_out.describe()} holds {have} {unit}, fewer than one batch of "
            f"{formula} = {per_step}; add data or lower validation.local_batch_size"
        )


def validator(
    job: JobConfig,
    held_out: PackedWindows | PairSource | PromptSource,
    step: TrainStep,
    loader: StepLoader | PairLoader | Rollouts,
) -> Validator:
    """What computes the held-out numbers every ``validation.freq`` steps."""
    if isinstance(held_out, PromptSource):
        assert isinstance(loader, Rollouts)
        return rollout_validator(job, held_out, step, loader)
    if isinstance(held_out, PairSource):
        assert isinstance(loader, PairLoader)
        return pair_validator(job, held_out, step, loader)
    return window_validator(job, held_out, step, loader.dp_rank, loader.device)
