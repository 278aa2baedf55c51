"""Which objective a job trains: DPO for preference data, else language modelling (with
Qwen3.5's multi-token-prediction head when ``[mtp]`` trains it)."""

from __future__ import annotations

from torch import nn

from autopar.config.sections import JobConfig
from autopar.data.dataset import SampleSource
from autopar.data.pair_batches import PairSource
from autopar.models.args import ModelArgs
from autopar.parallel.materialize import FullValue
from autopar.training.objectives.base import Objective
from autopar.training.objectives.dpo.job import preference_objective
from autopar.training.objectives.language_model import LanguageModel
from autopar.training.objectives.mtp.loss import MTPTraining
from autopar.training.plan_runner import PlanRunner


def build_objective(
    job: JobConfig,
    args: ModelArgs,
    runner: PlanRunner,
    initial: FullValue,
    samples: SampleSource | PairSource,
) -> tuple[Objective, list[nn.Module]]:
    """The job's objective over ``runner``'s parts, and the model parts it adds (a DPO
    reference copy; none otherwise)."""
    if isinstance(samples, PairSource):
        return preference_objective(runner, job, args, initial, samples)
    return LanguageModel(runner, MTPTraining.of(job)), []
