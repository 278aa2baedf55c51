"""One optimizer step: the objective's forward/backward over its micro-batches under the
plan, the gradient norm and the update.

Each micro-batch's loss is already its share of the step loss (``objectives.base``), so
summing the records over the data-, context- and pipeline-parallel ranks gives the step's
numbers, whatever the plan.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.data.loader import Batch
from autopar.parallel.float8 import after_optimizer_step
from autopar.parallel.pipelining.schedule import Pipeline
from autopar.parallel.world import by_mesh
from autopar.training.objectives.base import Objective, StepOutcome
from autopar.training.optim import build_optimizers, set_lr
from autopar.training.plan_runner import PlanRunner, sum_over
from autopar.training.train_context import TrainContext, all_reduce_sum


def _grads_by_mesh(parts: list[nn.Module]) -> list[list[torch.Tensor]]:
    return by_mesh(p.grad for part in parts for p in part.parameters() if p.grad is not None)


def global_grad_norm(parts: list[nn.Module], pp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Global L2 norm of all gradients, counting each parameter element once (pipeline
    stages hold disjoint parameters, so their squared norms add)."""
    squares = []
    for grads in _grads_by_mesh(parts):
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).pow(2))
    norm = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_mesh is not None and pp_mesh.size() > 1:
        norm = all_reduce_sum(norm, pp_mesh)
    return norm.sqrt()


def clip_grads(parts: list[nn.Module], max_norm: float, norm: torch.Tensor) -> None:
    for grads in _grads_by_mesh(parts):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)


class TrainStep:
    """One optimizer step of this rank: the objective's micro-batches run under the plan
    (``PlanRunner``), then one gradient norm and the update.

    The trainer calls it with the loader's batches; the dry run with synthetic ones under
    fake tensors, so both run the same step. It knows no objective: accumulation, context
    parallelism, the pipeline and the optimizer are the same whatever ``objective`` is.
    """

    def __init__(self, runner: PlanRunner, objective: Objective) -> None:
        self.runner, self.objective = runner, objective
        self.job = runner.job
        self.parts, self.meshes, self.dims = runner.parts, runner.meshes, runner.dims
        self.optimizers = build_optimizers(self.parts, self.job.optimizer)

    @property
    def context(self) -> TrainContext:
        return self.runner.context

    @property
    def pipeline(self) -> Pipeline | None:
        return self.runner.pipeline

    def __call__(self, batches: list[Batch], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step at ``lr``; (step loss, grad norm) as device tensors (no host sync)."""
        outcome = self.forward_backward(batches)
        return outcome.loss, self.update(lr)

    def forward_backward(
        self, batches: list[Batch], backward: bool = True, objective: Objective | None = None
    ) -> StepOutcome:
        """The step's micro-batches forward and (unless told not to: a held-out loss)
        backward; its numbers, summed over every rank (collective). ``objective``: another
        than the step's (a held-out pass's own)."""
        runner, objective = self.runner, self.objective if objective is None else objective
        loss, targets = objective.begin(batches, runner.calls_per_batch)
        calls = runner.run(targets, loss, objective, backward)
        local = sum_over(loss.summed(calls), runner, "pp")  # a pipeline's last stage holds them
        return objective.finish(sum_over(local, runner, "loss"), local, loss)

    def update(self, lr: float) -> torch.Tensor:
        """Clip, step the optimizers at ``lr`` and free the gradients; the grad norm."""
        norm = self.grad_norm()
        self.apply(lr, norm)
        return norm

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of this step (the same tensor value on every rank)."""
        return global_grad_norm(self.parts, self.meshes.get("pp"))

    def apply(self, lr: float, norm: torch.Tensor) -> None:
        """Clip to ``training.max_norm`` by ``norm``, step the optimizers at ``lr``, free the
        gradients."""
        set_lr(self.optimizers, lr)
        if self.job.training.max_norm > 0:
            clip_grads(self.parts, self.job.training.max_norm, norm)
        for opt in self.optimizers:
            opt.step()
        self.discard()
        after_optimizer_step(self.parts, self.job.float8)

    def discard(self) -> None:
        """Free the gradients without an update (a skipped step)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
