"""Running micro-batches through a model under the job's plan, whatever the loss.

``PlanRunner`` is what a step needs of the plan beside the optimizer: this rank's model
parts, the meshes, the forward's context (``TrainContext``: context parallel, loss parallel,
FP8 autocast, the loss function) and, under pipeline parallelism, the schedule. ``run``
feeds micro-batches to the model (one after another, or through the schedule) and calls a
loss on each output, with backward or forward only. Objectives (``objectives/``) decide
what that loss is; a reference pass runs a frozen copy's parts through the same machinery.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from autopar.config.sections import JobConfig
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import ContextParallel, resolve_impl
from autopar.parallel.float8 import resolve_backend, te_autocast
from autopar.parallel.mesh import Meshes
from autopar.parallel.parallelize import ModelParts, loss_parallel_enabled
from autopar.parallel.pipelining.schedule import Pipeline, StageIO, build_pipeline, pipeline_run
from autopar.parallel.pipelining.stage_loss import LossFn
from autopar.parallel.sdpa_backend import native_gqa
from autopar.parallel.torch_internals import assume_static_stage_metadata
from autopar.parallel.world import World
from autopar.training.objectives.base import ForwardInputs
from autopar.training.train_context import LoadBalancing, TrainContext, all_reduce_sum


class PlanRunner:
    """This rank's model parts under the job's plan, and how micro-batches run through them."""

    def __init__(
        self,
        job: JobConfig,
        world: World,
        meshes: Meshes,
        built: ModelParts,
        stage_io: list[StageIO] | None = None,
    ) -> None:
        self.job = job
        self.device = world.device
        self.meshes = meshes
        self.dims = meshes.dims
        self.parts = built.parts
        self.args: ModelArgs = built.args
        self.stage_ids, self.num_stages = built.stage_ids, built.num_stages
        self.context = TrainContext(
            loss_parallel=loss_parallel_enabled(job, self.dims),
            compile_loss=job.compile.enable and "loss" in job.compile.components,
            loss_chunk_tokens=job.training.loss_chunk_tokens,
            compile_backend=job.compile.backend,
            fp8_autocast=self._te_autocast(),
            context_parallel=self._context_parallel(),
        )
        self.balance = self._load_balancing()
        """A mixture of experts' load-balancing loss, which every objective's loss adds."""
        self.pipeline: Pipeline | None = None
        if meshes.get("pp") is not None:
            self.pipeline = self.pipeline_of(self.parts, stage_io)

    def _context_parallel(self) -> ContextParallel | None:
        cp_mesh = self.meshes.get("cp")
        if cp_mesh is None:
            return None
        impl = resolve_impl(self.job.parallelism, self.device.type)
        expand = not native_gqa(self.job, self.device.type, impl)
        return ContextParallel(self.job.parallelism, cp_mesh, self.device.type, expand_kv=expand)

    def _load_balancing(self) -> LoadBalancing | None:
        args = self.args
        if not args.moe:
            return None
        return LoadBalancing(args.num_experts_per_tok, args.router_aux_loss_coef, self.meshes.get("cp"))

    def _te_autocast(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        float8 = self.job.float8
        if float8.enable and resolve_backend(float8, self.device.type) == "te":
            return functools.partial(te_autocast, float8)
        return None

    def pipeline_of(self, parts: list[nn.Module], stage_io: list[StageIO] | None = None) -> Pipeline:
        """A schedule over ``parts`` split as this rank's (the model's, or a frozen copy's for
        a reference pass). ``stage_io``: the stages' shapes, for a process group that cannot
        exchange them (the dry run's fake one)."""
        pp_mesh = self.meshes.get("pp")
        assert pp_mesh is not None
        pipeline = build_pipeline(
            parts,
            self.stage_ids,
            self.num_stages,
            pp_mesh,
            self.job.parallelism,
            self.job.training.local_batch_size,
            self.device,
            stage_io,
        )
        if stage_io is not None:
            assume_static_stage_metadata(pipeline.schedule)
        return pipeline

    @property
    def calls_per_batch(self) -> int:
        """How many times a step's loss is called per micro-batch: once, or once per pipeline
        micro-batch."""
        return 1 if self.pipeline is None else self.pipeline.n_micro

    def run(
        self,
        batches: list[Batch],
        loss: LossFn,
        inputs: ForwardInputs,
        backward: bool = True,
        model: nn.Module | Pipeline | None = None,
    ) -> int:
        """Every micro-batch's forward through ``model`` (this rank's own parts by default:
        its first part, or its pipeline), ``loss`` on its output and the batch's labels, and
        backward unless told not to; returns how many of ``loss``'s last calls are the
        micro-batches' (none on a pipeline rank without the last stage)."""
        model = model if model is not None else (self.pipeline or self.parts[0])
        if isinstance(model, Pipeline):
            return pipeline_run(
                model, batches, loss, self.context.micro_batch, dict(inputs.forward_flags), backward
            )
        context = self.context
        for batch in batches:
            split = context.split(batch, inputs.per_position(batch))
            with split as (local, positions, extras), context.loss_parallel_context():
                with context.forward_precision():
                    out = model(
                        local.inputs,
                        positions=positions,
                        documents=local.documents,
                        **inputs.forward_kwargs(extras),
                    )
                trained = loss(out, local.labels)
                del out  # the logits: what backward needs of them the loss's graph holds
                if backward:
                    trained.backward()
        return len(batches)


def sum_over(value: torch.Tensor, runner: PlanRunner, *names: str) -> torch.Tensor:
    """``value`` summed over the runner's meshes ``names`` in turn (those that exist)."""
    for name in names:
        value = all_reduce_sum(value, runner.meshes.get(name))
    return value
