"""Which objective a job trains: DPO for preference data, on-policy RL for prompt-only data,
else language modelling (with Qwen3.5's multi-token-prediction head when ``[mtp]`` trains it)."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from autopar.config.sections import JobConfig
from autopar.data.dataset import SampleSource
from autopar.data.pair_batches import PairSource
from autopar.data.prompt_records import PromptSource
from autopar.models.args import ModelArgs
from autopar.parallel.materialize import FullValue
from autopar.training.objectives.base import Objective
from autopar.training.objectives.dpo.job import preference_objective
from autopar.training.objectives.language_model import LanguageModel
from autopar.training.objectives.mtp.loss import MTPTraining
from autopar.training.objectives.rl.engine import Rollouts
from autopar.training.objectives.rl.job import rl_objective
from autopar.training.plan_runner import PlanRunner


class BuiltObjective(NamedTuple):
    objective: Objective
    reference: list[nn.Module]
    """The model parts it adds: a frozen reference copy (DPO, RL with beta > 0), or none."""
    loader: Rollouts | None = None
    """What stands for the loader where the objective makes its own data (RL's rollouts)."""


def packs_documents(job: JobConfig) -> bool:
    """Whether a micro-batch's rows hold documents that attend within themselves only:
    preference pairs and RL completions always, language modelling under
    ``training.document_masking``."""
    return job.training.document_masking or job.training.dataset_format in ("preference", "prompts")


def copies_reference(job: JobConfig) -> bool:
    """Whether the objective keeps a frozen reference copy of the model (DPO's ``copy``, RL's
    ``copy`` where ``rl.beta > 0``)."""
    if job.training.dataset_format == "preference":
        return job.dpo.reference == "copy"
    return job.training.dataset_format == "prompts" and job.rl.beta != 0 and job.rl.reference == "copy"


def build_objective(
    job: JobConfig,
    args: ModelArgs,
    runner: PlanRunner,
    initial: FullValue,
    samples: SampleSource | PairSource | PromptSource,
) -> BuiltObjective:
    """The job's objective over ``runner``'s parts."""
    if isinstance(samples, PairSource):
        return BuiltObjective(*preference_objective(runner, job, args, initial, samples))
    if isinstance(samples, PromptSource):
        return BuiltObjective(*rl_objective(runner, job, args, initial, samples))
    return BuiltObjective(LanguageModel(runner, MTPTraining.of(job)), [])
