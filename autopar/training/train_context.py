"""What a step's forward and backward run under: context parallelism's split, loss
parallelism, Transformer Engine's FP8 autocast, and the token loss function
(``TrainContext``); and a mixture's load-balancing loss, which every objective adds."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from autopar.config.sections import JobConfig
from autopar.data.loader import Batch
from autopar.models.moe import load_balancing_loss
from autopar.parallel.context_parallel import ContextParallel
from autopar.parallel.torch_internals import key_compile_cache_on_vector_isa
from autopar.training.loss import (
    chunk_loss_and_grad,
    chunked_token_loss_sum,
    token_loss_sum,
    vocab_parallel_chunk_loss_and_grad,
)


def fuses_token_loss(job: JobConfig, loss_parallel: bool) -> bool:
    """Whether the job's token loss runs as one compiled cross-entropy, which inductor fuses
    (no float32 copy of the logits, their gradient in their own dtype): not under loss
    parallel (a DTensor op dispatch, eager) and not chunked (its kernels compile instead)."""
    compiled = job.compile.enable and "loss" in job.compile.components
    return compiled and not loss_parallel and job.training.loss_chunk_tokens == 0


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
        compile_backend: str = "inductor",
        fp8_autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        context_parallel: ContextParallel | None = None,
    ):
        self.loss_parallel = loss_parallel
        self.fp8_autocast = fp8_autocast
        self.context_parallel = context_parallel
        if compile_loss:
            key_compile_cache_on_vector_isa()
        # vocab-parallel cross-entropy is a DTensor op dispatch that does not trace; it is
        # already a fused collective-aware kernel, so it stays eager
        if loss_chunk_tokens > 0:
            kernels = (chunk_loss_and_grad, vocab_parallel_chunk_loss_and_grad)
            compiled = (torch.compile(k, backend=compile_backend) for k in kernels)
            plain, vocab_parallel = compiled if compile_loss else kernels
            self.loss_fn = functools.partial(
                chunked_token_loss_sum,
                chunk_tokens=loss_chunk_tokens,
                kernel=plain,
                vocab_parallel_kernel=vocab_parallel,
            )
        elif compile_loss and not loss_parallel:
            self.loss_fn = torch.compile(token_loss_sum, backend=compile_backend)
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

    def split(
        self, batch: Batch, per_position: tuple[torch.Tensor | None, ...]
    ) -> contextlib.AbstractContextManager:
        """``sequence``, and this rank's part of ``per_position``'s (B, S) tensors built on
        the whole sequences (``ContextParallel.split``): a third item yielded."""
        if self.context_parallel is None:
            return contextlib.nullcontext((batch, None, per_position))
        return self.context_parallel.split(batch, per_position)

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        with self.sequence(batch) as local, self.loss_parallel_context(), self.forward_precision():
            yield local
