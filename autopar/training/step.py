"""One optimizer step's forward/backward over its micro-batches, and the gradient norm.

The loss is a sum of token losses divided by the global number of target tokens
(``autopar.training.loss``); summing the per-micro-batch results over the data/context-parallel
ranks gives the mean loss of the global batch, whatever the plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.config.sections import JobConfig
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.models.qwen import split_output
from autopar.parallel.context_parallel import ContextParallel, resolve_impl
from autopar.parallel.float8 import after_optimizer_step, resolve_backend, te_autocast
from autopar.parallel.mesh import Meshes
from autopar.parallel.parallelize import ModelParts, loss_parallel_enabled
from autopar.parallel.pipelining.schedule import Pipeline, StageIO, build_pipeline, pipeline_forward_backward
from autopar.parallel.sdpa_backend import native_gqa
from autopar.parallel.world import World, by_mesh
from autopar.training.loss import (
    count_targets,
)
from autopar.training.objectives.dpo.loss import METRICS
from autopar.training.objectives.dpo.pipeline import preference_pipeline_forward_backward
from autopar.training.objectives.dpo.step import (
    PreferenceContext,
    preference_forward_backward,
    step_chosen_tokens,
)
from autopar.training.objectives.mtp.checks import METRICS as MTP_METRICS
from autopar.training.objectives.mtp.checks import global_mtp_target_count
from autopar.training.objectives.mtp.loss import HeadSequences, MTPTraining, mtp_loss_sum
from autopar.training.objectives.mtp.pipeline import stage_head, with_head_targets
from autopar.training.optim import build_optimizers, set_lr
from autopar.training.train_context import LoadBalancing, TrainContext, all_reduce_sum


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
    mtp_targets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run every micro-batch (forward only without ``backward``, e.g. under no_grad for a
    held-out loss); returns this rank's share of the step's language-model loss, of its
    load-balancing loss (zero for a dense model), and its multi-token-prediction head's
    (summed loss, accepted targets) (zeros without ``context.mtp``), detached. The trained
    loss is the first plus ``coef`` times the second, a mean over the ``global_sequences`` of
    the step, plus ``context.mtp.scale`` times the head's loss over its ``mtp_targets``."""
    total = torch.zeros((), device=global_targets.device)
    balance = torch.zeros((), device=global_targets.device)
    head = torch.zeros(2, device=global_targets.device)
    for full_batch in batches:
        whole = () if context.mtp is None else HeadSequences.of(full_batch)
        with context.split(full_batch, whole) as (batch, positions, local), context.loss_parallel_context():
            head_inputs = HeadSequences(*local) if local else None
            with context.forward_precision():
                out = model(
                    batch.inputs,
                    positions=positions,
                    documents=batch.documents,
                    **_head_args(context, head_inputs),
                )
            head_logits = None
            if context.mtp is not None:
                out, head_logits = out
            logits, routing = split_output(out)
            loss = context.loss_fn(logits, batch.labels) / global_targets
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            trained = loss
            if routing is not None and context.load_balancing is not None:
                aux = context.load_balancing.sequence_sum(routing) / global_sequences
                trained = loss + context.load_balancing.coef * aux
                balance += aux.detach()
            if head_logits is not None:
                head_sum, accepted, _ = mtp_loss_sum(head_logits, head_inputs.targets, context.loss_fn)
                if mtp_targets is not None:
                    trained = trained + context.mtp.scale * head_sum / mtp_targets.clamp(min=1)
                head += torch.stack([head_sum.detach(), accepted.to(head.dtype)])
            if backward:
                trained.backward()
        total += loss.detach()
    return total, balance, head


def _head_args(context: TrainContext, head: HeadSequences | None) -> dict[str, object]:
    """The forward's ``mtp`` and ``upcoming`` arguments when the step trains Qwen3.5's head
    (none otherwise: other models' forward takes no such argument): the next tokens from the
    whole sequences, split as the tokens under context parallel."""
    if context.mtp is None or head is None:  # one is None exactly when the other is
        return {}
    return {"mtp": context.mtp.mode, "upcoming": head.upcoming}


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
            mtp=MTPTraining.of(job),
        )
        self.local_loss = torch.zeros(())
        """This rank's share of the last step's loss, to find where a non-finite loss came from."""
        self.aux_loss = torch.zeros(())
        """The last step's load-balancing loss (mean per sequence, before its coefficient)."""
        self.targets = torch.zeros(())
        """The last step's learned tokens over the whole global batch (0: prompts only)."""
        self.preference: PreferenceContext | None = None
        """Set for preference data (``training.preference``): the step is DPO's."""
        self.preference_metrics = torch.zeros(len(METRICS))
        """The last preference step's ``METRICS`` (means over its pairs)."""
        self.step_tokens = torch.zeros(())
        """The last preference step's tokens over every rank, padding left out."""
        self.mtp_metrics = torch.zeros(len(MTP_METRICS))
        """The last step's ``MTP_METRICS`` (``[mtp] enable``): the head's loss per target and
        the fraction of targets its argmax hits."""
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
                stage_head(self.context.mtp, self.context.loss_fn) if self.context.mtp is not None else None,
            )

    def _context_parallel(self, device: torch.device) -> ContextParallel | None:
        cp_mesh = self.meshes.get("cp")
        if cp_mesh is None:
            return None
        impl = resolve_impl(self.job.parallelism, device.type)
        expand = not native_gqa(self.job, device.type, impl)
        return ContextParallel(self.job.parallelism, cp_mesh, device.type, expand_kv=expand)

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
        if self.preference is not None:
            return self._preference_forward_backward(batches)
        self.targets = global_target_count(batches, self.meshes.get("dp"))
        targets = self.targets.clamp(min=1)  # a step without targets (prompts only) has loss 0, not 0/0
        sequences = sum(b.inputs.shape[0] for b in batches) * self.dims.dp
        head_targets = self._head_targets(batches)
        if self.pipeline is not None:
            local_loss, aux, head = self._pipeline_pass(batches, targets, head_targets, sequences=sequences)
        else:
            local_loss, aux, head = microbatches_forward_backward(
                self.parts[0],
                batches,
                targets,
                self.context,
                global_sequences=sequences,
                mtp_targets=head_targets,
            )
        if head_targets is not None:
            self.mtp_metrics = self._head_metrics(head, head_targets)
        self.aux_loss = all_reduce_sum(aux, self.meshes.get("loss"))
        self.local_loss = local_loss
        return all_reduce_sum(local_loss, self.meshes.get("loss"))

    def _pipeline_pass(
        self,
        batches: list[Batch],
        targets: torch.Tensor,
        head_targets: torch.Tensor | None,
        backward: bool = True,
        sequences: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pipeline_forward_backward`` with the head's targets in the schedule's target when
        the step trains the head (``head_targets`` of them over the global batch weigh its loss
        in backward), each result summed over the pipeline ranks."""
        assert self.pipeline is not None
        if self.context.mtp is not None:
            batches = [with_head_targets(b) for b in batches]
        results = pipeline_forward_backward(
            self.pipeline, batches, targets, self.context.micro_batch, backward, sequences, head_targets
        )
        local_loss, aux, head = (all_reduce_sum(value, self.meshes.get("pp")) for value in results)
        return local_loss, aux, head

    def _head_targets(self, batches: list[Batch]) -> torch.Tensor | None:
        """The head's targets over the global batch (None when the step does not train it)."""
        if self.context.mtp is None:
            return None
        return global_mtp_target_count(batches, self.meshes.get("dp"))

    def _head_metrics(self, head: torch.Tensor, head_targets: torch.Tensor) -> torch.Tensor:
        """(mtp_loss, mtp_acceptance) from this rank's (summed loss, accepted targets)."""
        return all_reduce_sum(head, self.meshes.get("loss")) / head_targets.clamp(min=1)

    def _preference_forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """A DPO step: the loss is a mean over the step's pairs (``preference_step``)."""
        assert self.preference is not None
        dp_mesh = self.meshes.get("dp")
        pairs = self.preference.pairs_per_micro_batch * len(batches) * self.dims.dp
        # rows and real tokens (padding left out) over every rank, kept on the device
        sizes = torch.stack(
            [
                torch.stack([b.documents.new_tensor(len(b.documents)), (b.documents >= 0).sum()])
                for b in batches
            ]
        )
        rows, tokens = all_reduce_sum(sizes.sum(0).float(), dp_mesh)
        self.step_tokens = tokens
        # every pair has some chosen tokens (an empty completion is refused)
        self.targets = step_chosen_tokens(batches, dp_mesh)
        local_loss, metrics, aux = self.preference_pass(batches, pairs, self.targets, rows)
        loss_mesh = self.meshes.get("loss")
        self.preference_metrics = all_reduce_sum(metrics, loss_mesh)
        self.aux_loss = all_reduce_sum(aux, loss_mesh)
        self.local_loss = local_loss
        return all_reduce_sum(local_loss, loss_mesh)

    def preference_pass(
        self,
        batches: list[Batch],
        global_pairs: float,
        global_chosen_tokens: torch.Tensor,
        global_rows: torch.Tensor | float = 1.0,
        backward: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DPO's forward (and backward) over ``batches``, pipelined or not: this rank's share
        of the step loss, of ``METRICS`` and of a mixture's load-balancing loss."""
        assert self.preference is not None
        if self.pipeline is not None:
            return preference_pipeline_forward_backward(
                self.pipeline,
                batches,
                self.context.micro_batch,
                self.preference.reference,
                global_pairs,
                global_chosen_tokens,
                global_rows,
                (self.meshes.get("cp"), self.meshes.get("pp")),
                backward,
            )
        balance = self.context.load_balancing
        return preference_forward_backward(
            self.parts[0],
            batches,
            self.context,
            self.preference,
            global_pairs,
            global_chosen_tokens,
            None if balance is None else lambda routing: balance.sequence_sum(routing) / global_rows,
            balance.coef if balance is not None else 0.0,
            backward,
        )

    @torch.no_grad()
    def forward_loss(self, batches: list[Batch], targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of ``batches`` (``targets`` of them over every rank) without gradients:
        the same forward, plan and loss as a training step (collective); and the head's
        (summed loss, accepted targets) over every rank (zeros without ``[mtp]``)."""
        if self.pipeline is not None:
            local_loss, _, head = self._pipeline_pass(batches, targets, None, backward=False)
        else:
            local_loss, _, head = microbatches_forward_backward(
                self.parts[0], batches, targets, self.context, backward=False
            )
        loss_mesh = self.meshes.get("loss")
        return all_reduce_sum(local_loss, loss_mesh), all_reduce_sum(head, loss_mesh)

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
