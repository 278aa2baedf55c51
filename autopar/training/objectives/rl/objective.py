"""On-policy RL (GRPO and its variants) as a training objective: the policy loss of TRL 1.16
(``loss.py``) on the completions the rollouts packed (``engine.py``), and TRL's metrics."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.data.loader import Batch
from autopar.training.objectives.base import MicroBatchLoss, Objective, StepOutcome
from autopar.training.objectives.rl.engine import Rollouts
from autopar.training.objectives.rl.loss import METRIC_SUMS, Columns, PolicyLoss, policy_loss
from autopar.training.plan_runner import PlanRunner
from autopar.training.train_context import all_reduce_sum

TRAINING_METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's names of what the loss measures (``kl`` with beta > 0; cispo's clipping is
``cispo_clip_ratio``)."""
SAMPLING_METRICS = ("sampling/logp_diff_mean", "sampling/logp_diff_max")
"""|pi_old (the sampler's) - pi (the first training forward's)| over the completion tokens."""
ROLLOUT_METRICS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "time/rollout",
    "time/scoring",
)
"""TRL's completion lengths over the step's completions, and the seconds its rollout took
(sampling, then scoring and packing; training is the rest of ``step_time_s``)."""
GAP_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
"""TRL's |pi_old - sampler| over the learned tokens, where pi_old is the trainer's recomputed."""
RATIO_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
"""TRL's statistics of an importance correction's factors (per completion at the sequence level)."""
_INDEX = {name: i for i, name in enumerate(METRIC_SUMS)}


class PolicyGradientLoss(MicroBatchLoss):
    """A micro-batch's share of the policy loss; records it and ``METRIC_SUMS``, and keeps the
    largest sampler-trainer gap it saw."""

    width = 1 + len(METRIC_SUMS)

    def __init__(
        self,
        settings: PolicyLoss,
        sequences: int,
        runner: PlanRunner,
        rows: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        super().__init__(runner.balance, rows, runner.device)
        self.settings, self.sequences, self.cp_mesh = settings, sequences, runner.meshes.get("cp")
        self.gap_max = torch.zeros((), device=runner.device)
        self.tokens = tokens
        """The step's tokens over every rank, padding left out (what tokens/s counts)."""

    def term(
        self, logits: torch.Tensor, extra: object, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, sums, gap = policy_loss(self.settings, logits, Columns.of(target), self.sequences, self.cp_mesh)
        self.gap_max = torch.maximum(self.gap_max, gap)
        return loss, torch.cat([loss.detach().reshape(1), sums])


class PolicyGradient(Objective):
    """The policy loss on the step's rollouts (their advantages, pi_old and reference)."""

    def __init__(self, runner: PlanRunner, settings: PolicyLoss, rollouts: Rollouts) -> None:
        self.runner, self.settings, self.rollouts = runner, settings, rollouts
        clip = ("cispo_clip_ratio",) if settings.loss_type == "cispo" else TRAINING_METRICS[2:]
        kl = ("kl",) if settings.beta != 0.0 else ()
        rewards = tuple(f"rewards/{r.name}/{stat}" for r in rollouts.rewards for stat in ("mean", "std"))
        cfg = rollouts.job.rl
        recomputed = cfg.old_logps == "trainer" or cfg.importance_correction != "none"
        correction = (
            (*GAP_METRICS, *(RATIO_METRICS if cfg.importance_correction != "none" else ()))
            if recomputed
            else ()
        )
        self.rollout_names = (
            *rewards,
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            *ROLLOUT_METRICS,
            *correction,
        )
        self.metric_names = ("entropy", *kl, *clip, *SAMPLING_METRICS, *self.rollout_names)

    def begin(self, batches: list[Batch], calls_per_batch: int) -> tuple[MicroBatchLoss, list[Batch]]:
        """The step's loss; its rows and tokens (prompts and completions, padding left out:
        completions pack into fewer rows than the batch counts) over every rank."""
        counts = torch.stack(
            [
                torch.tensor(float(sum(b.inputs.shape[0] for b in batches)), device=self.runner.device),
                sum(((b.documents >= 0).sum() for b in batches), torch.zeros((), device=self.runner.device)),
            ]
        )
        rows, tokens = all_reduce_sum(counts.float(), self.runner.meshes.get("dp"))
        return PolicyGradientLoss(
            self.settings, self.rollouts.local_batch, self.runner, rows, tokens
        ), batches

    def finish(self, sums: torch.Tensor, local: torch.Tensor, loss: MicroBatchLoss) -> StepOutcome:
        assert isinstance(loss, PolicyGradientLoss)
        at = {name: sums[1 + i] for name, i in _INDEX.items()}
        tokens, units = at["tokens"].clamp(min=1), at["clip_units"].clamp(min=1)
        values = {
            "entropy": at["entropy"] / tokens,
            "kl": at["kl"] / tokens,
            "clip_ratio/low_mean": at["clip_low"] / units,
            "clip_ratio/high_mean": at["clip_high"] / units,
            "clip_ratio/region_mean": at["clip_region"] / units,
            "cispo_clip_ratio": at["clip_high"] / units,
            "sampling/logp_diff_mean": at["logp_diff"] / tokens,
            "sampling/logp_diff_max": self._largest(loss.gap_max),
        }
        stats = self.rollouts.stats
        values |= {name: torch.tensor(stats.get(name, float("nan"))) for name in self.rollout_names}
        metrics = torch.stack([values[name].to(sums.device).float() for name in self.metric_names])
        completions = torch.tensor(float(self.rollouts.global_batch), device=sums.device)
        return StepOutcome(
            sums[0], local[0], sums[-1], at["tokens"], completions, metrics, tokens=loss.tokens
        )

    def _largest(self, value: torch.Tensor) -> torch.Tensor:
        """``value``'s maximum over every rank that holds a share of the step."""
        value = value.clone()
        for name in ("pp", "loss"):
            mesh = self.runner.meshes.get(name)
            if mesh is not None and mesh.size() > 1:
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return value
