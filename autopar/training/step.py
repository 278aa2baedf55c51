"""One optimizer step's forward/backward over its micro-batches, and the gradient norm.

The loss is a sum of token losses divided by the global number of target tokens
(``autopar.training.loss``); summing the per-micro-batch results over the data/context-parallel
ranks gives the mean loss of the global batch, whatever the plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autopar.config.sections import JobConfig
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.models.moe import load_balancing_loss
from autopar.models.qwen import split_output
from autopar.parallel.context_parallel import ContextParallel
from autopar.parallel.float8 import after_optimizer_step, resolve_backend, te_autocast
from autopar.parallel.mesh import Meshes
from autopar.parallel.parallelize import ModelParts, loss_parallel_enabled
from autopar.parallel.pipelining.schedule import Pipeline, StageIO, build_pipeline, pipeline_forward_backward
from autopar.parallel.world import World, by_mesh
from autopar.training.loss import (
    chunk_loss_and_grad,
    chunked_token_loss_sum,
    count_targets,
    token_loss_sum,
    vocab_parallel_chunk_loss_and_grad,
)
from autopar.training.optim import build_optimizers, set_lr


def all_reduce_sum(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum ``value`` over a 1-D ``mesh`` (a no-op without one or on a single rank)."""
    if mesh is None or mesh.size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=mesh.get_group())
    return value


@dataclass(frozen=True)
class LoadBalancing:
    """A mixture-of-experts model's load-balancing loss (HF's, per sequence; see
    ``models.moe``) and its weight in the training loss."""

    top_k: int
    coef: float
    cp_mesh: DeviceMesh | None = None
    """The ranks sharing each sequence: their expert counts are summed before the loss."""

    def sequence_sum(self, routing: torch.Tensor) -> torch.Tensor:
        """The loss summed over this rank's sequences; under context parallel this rank's
        share (the expert counts are the whole sequence's, the probabilities its own
        tokens'), so the shares add up to the sequence's loss."""
        counts, probs = routing.unbind(dim=1)  # (B, E) each
        counts = all_reduce_sum(counts.detach(), self.cp_mesh)
        return load_balancing_loss(torch.stack((counts, probs), dim=1), self.top_k).sum()


class TrainContext:
    """What forward/backward runs under, and the loss function.

    ``sequence(batch)`` covers a micro-batch's forward and backward (context parallel);
    ``forward_precision()`` the model's forward (Transformer Engine's FP8 autocast; bf16 is
    the model parts' own, see ``plans/mixed_precision.py``);
    ``loss_parallel_context()`` the loss and its backward (vocab-parallel cross-entropy needs
    both inside); ``micro_batch(batch)`` all three, for a pipeline schedule that runs forward,
    loss and backward in one call.
    """

    def __init__(
        self,
        loss_parallel: bool,
        compile_loss: bool = False,
        loss_chunk_tokens: int = 0,
        fp8_autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        context_parallel: Callable[[Batch], contextlib.AbstractContextManager] | None = None,
        load_balancing: LoadBalancing | None = None,
    ):
        self.loss_parallel = loss_parallel
        self.load_balancing = load_balancing
        self.fp8_autocast = fp8_autocast
        self.context_parallel = context_parallel
        # vocab-parallel cross-entropy is a DTensor op dispatch that does not trace; it is
        # already a fused collective-aware kernel, so it stays eager
        if loss_chunk_tokens > 0:
            kernels = (chunk_loss_and_grad, vocab_parallel_chunk_loss_and_grad)
            plain, vocab_parallel = (torch.compile(k) for k in kernels) if compile_loss else kernels
            self.loss_fn = functools.partial(
                chunked_token_loss_sum,
                chunk_tokens=loss_chunk_tokens,
                kernel=plain,
                vocab_parallel_kernel=vocab_parallel,
            )
        elif compile_loss and not loss_parallel:
            self.loss_fn = torch.compile(token_loss_sum)
        else:
            self.loss_fn = token_loss_sum

    def forward_precision(self) -> contextlib.AbstractContextManager:
        return self.fp8_autocast() if self.fp8_autocast is not None else contextlib.nullcontext()

    def loss_parallel_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def sequence(self, batch: Batch) -> contextlib.AbstractContextManager:
        """(this rank's part of ``batch``, its RoPE positions or None) while attention runs;
        with context parallel, a slice of every sequence and attention across CP ranks."""
        if self.context_parallel is None:
            return contextlib.nullcontext((batch, None))
        return self.context_parallel(batch)

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        with self.sequence(batch) as local, self.loss_parallel_context(), self.forward_precision():
            yield local


def global_target_count(batches: list[Batch], dp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Target tokens of the whole global batch: all micro-steps of all data-parallel ranks
    (counted before any context-parallel split, so CP ranks of one group agree)."""
    local = sum(count_targets(b.labels) for b in batches).to(torch.float32)
    return all_reduce_sum(local, dp_mesh)


def microbatches_forward_backward(
    model: nn.Module,
    batches: list[Batch],
    global_targets: torch.Tensor,
    context: TrainContext,
    backward: bool = True,
    global_sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every micro-batch (forward only without ``backward``, e.g. under no_grad for a
    held-out loss); returns this rank's share of the step's language-model loss and of its
    load-balancing loss (zero for a dense model), detached. The trained loss is the first
    plus ``coef`` times the second, a mean over the ``global_sequences`` of the step."""
    total = torch.zeros((), device=global_targets.device)
    balance = torch.zeros((), device=global_targets.device)
    for full_batch in batches:
        with context.sequence(full_batch) as (batch, positions), context.loss_parallel_context():
            with context.forward_precision():
                out = model(batch.inputs, positions=positions, documents=batch.documents)
            logits, routing = split_output(out)
            loss = context.loss_fn(logits, batch.labels) / global_targets
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            trained = loss
            if routing is not None and context.load_balancing is not None:
                aux = context.load_balancing.sequence_sum(routing) / global_sequences
                trained = loss + context.load_balancing.coef * aux
                balance += aux.detach()
            if backward:
                trained.backward()
        total += loss.detach()
    return total, balance


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
    """This rank's model parts, optimizers, loss context and pipeline: one optimizer step.

    The trainer calls it with the loader's batches; the dry run with synthetic ones under
    fake tensors, so both run the same step.
    """

    def __init__(
        self,
        job: JobConfig,
        world: World,
        meshes: Meshes,
        built: ModelParts,
        stage_io: list[StageIO] | None = None,
    ) -> None:
        self.job = job
        self.dims = meshes.dims
        self.meshes = meshes
        self.parts = built.parts
        self.optimizers = build_optimizers(self.parts, job.optimizer)
        self.context = TrainContext(
            loss_parallel=loss_parallel_enabled(job, self.dims),
            compile_loss=job.compile.enable and "loss" in job.compile.components,
            loss_chunk_tokens=job.training.loss_chunk_tokens,
            fp8_autocast=self._te_autocast(world.device),
            context_parallel=self._context_parallel(world.device),
            load_balancing=self._load_balancing(built.args),
        )
        self.local_loss = torch.zeros(())
        """This rank's share of the last step's loss, to find where a non-finite loss came from."""
        self.aux_loss = torch.zeros(())
        """The last step's load-balancing loss (mean per sequence, before its coefficient)."""
        self.targets = torch.zeros(())
        """The last step's learned tokens over the whole global batch (0: prompts only)."""
        self.pipeline: Pipeline | None = None
        pp_mesh = self.meshes.get("pp")
        if pp_mesh is not None:
            self.pipeline = build_pipeline(
                self.parts,
                built.stage_ids,
                built.num_stages,
                pp_mesh,
                job.parallelism,
                job.training.local_batch_size,
                world.device,
                self.context.loss_fn,
                stage_io,
                self.context.load_balancing.sequence_sum if self.context.load_balancing else None,
                built.args.router_aux_loss_coef,
            )

    def _context_parallel(self, device: torch.device) -> ContextParallel | None:
        cp_mesh = self.meshes.get("cp")
        if cp_mesh is None:
            return None
        return ContextParallel(self.job.parallelism, cp_mesh, device.type)

    def _load_balancing(self, args: ModelArgs) -> LoadBalancing | None:
        if not args.moe:
            return None
        return LoadBalancing(args.num_experts_per_tok, args.router_aux_loss_coef, self.meshes.get("cp"))

    def _te_autocast(self, device: torch.device) -> Callable[[], contextlib.AbstractContextManager] | None:
        float8 = self.job.float8
        if float8.enable and resolve_backend(float8, device.type) == "te":
            return functools.partial(te_autocast, float8)
        return None

    def __call__(self, batches: list[Batch], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step at ``lr``; (step loss, grad norm) as device tensors (no host sync)."""
        loss = self.forward_backward(batches)
        return loss, self.update(lr)

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Gradients of the step's micro-batches; the step loss summed over all ranks."""
        self.targets = global_target_count(batches, self.meshes.get("dp"))
        targets = self.targets.clamp(min=1)  # a step without targets (prompts only) has loss 0, not 0/0
        sequences = sum(b.inputs.shape[0] for b in batches) * self.dims.dp
        if self.pipeline is not None:
            local_loss, aux = pipeline_forward_backward(
                self.pipeline, batches, targets, self.context.micro_batch, global_sequences=sequences
            )
            local_loss, aux = (all_reduce_sum(value, self.meshes.get("pp")) for value in (local_loss, aux))
        else:
            local_loss, aux = microbatches_forward_backward(
                self.parts[0], batches, targets, self.context, global_sequences=sequences
            )
        self.aux_loss = all_reduce_sum(aux, self.meshes.get("loss"))
        self.local_loss = local_loss
        return all_reduce_sum(local_loss, self.meshes.get("loss"))

    @torch.no_grad()
    def forward_loss(self, batches: list[Batch], targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``batches`` (``targets`` of them over every rank) without gradients:
        the same forward, plan and loss as a training step (collective)."""
        if self.pipeline is not None:
            local_loss, _ = pipeline_forward_backward(
                self.pipeline, batches, targets, self.context.micro_batch, backward=False
            )
            local_loss = all_reduce_sum(local_loss, self.meshes.get("pp"))
        else:
            local_loss, _ = microbatches_forward_backward(
                self.parts[0], batches, targets, self.context, backward=False
            )
        return all_reduce_sum(local_loss, self.meshes.get("loss"))

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
