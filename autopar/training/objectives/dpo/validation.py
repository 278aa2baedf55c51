"""Held-out DPO metrics (``[validation]`` with preference data): the loss and TRL's reward
metrics over held-out pairs, under the training plan and with the training reference, every
pass over the same pairs in the same order (a fresh loader from pair 0)."""

from __future__ import annotations

import torch

from autopar.config.sections import JobConfig
from autopar.data.errors import DataError
from autopar.data.pair_batches import PairLoader, PairSource
from autopar.training.objectives.dpo.loss import METRICS
from autopar.training.objectives.dpo.step import step_chosen_tokens
from autopar.training.step import TrainStep
from autopar.training.train_context import all_reduce_sum
from autopar.training.validation import ValidationResult


class PreferenceValidator:
    """The held-out DPO loss and metrics of this rank's model parts (collective)."""

    def __init__(self, job: JobConfig, source: PairSource, train_step: TrainStep, loader: PairLoader) -> None:
        cfg = job.validation
        self.source, self.train_step, self.training_loader = source, train_step, loader
        self.local_batch = cfg.local_batch_size
        per_step = self.local_batch * loader.dp_size
        if len(source.pairs) < per_step:
            raise DataError(
                f"validation data {source.describe()} holds fewer pairs than one batch of local_batch_size "
                f"x data-parallel degree = {per_step}; add pairs or lower validation.local_batch_size"
            )
        self.steps = len(source.pairs) // per_step if cfg.steps == -1 else cfg.steps

    def run(self) -> ValidationResult:
        """One pass over the held-out pairs: the mean loss and ``METRICS`` over them."""
        step, train = self.train_step, self.training_loader
        assert step.preference is not None
        loader = PairLoader(
            self.source.pairs,
            self.local_batch * train.dp_size,
            self.local_batch,
            train.dp_rank,
            train.dp_size,
            train.device,
            train.seq_len,
            train.pad_id,
            train.seed,
            train.packing,
            train.pipeline_groups,
        )
        loss = torch.zeros((), device=train.device)
        metrics = torch.zeros(len(METRICS), device=train.device)
        loss_mesh = step.meshes.get("loss")
        for _ in range(self.steps):
            batches = loader.next_step()
            chosen = step_chosen_tokens(batches, step.meshes.get("dp"))
            with torch.no_grad():
                local, local_metrics, _ = step.preference_pass(
                    batches, loader.global_batch, chosen, backward=False
                )
            loss += all_reduce_sum(local, loss_mesh)
            metrics += all_reduce_sum(local_metrics, loss_mesh)
        pairs = self.steps * loader.global_batch
        values = (torch.cat([loss[None], metrics]) / self.steps).tolist()
        return ValidationResult(values[0], pairs, dict(zip(METRICS, values[1:])))
