"""Token-summed cross-entropy, normalized once per optimizer step by the global token count.

Summing token losses and dividing by the number of target tokens in the whole global batch
(all micro-steps, all data-parallel and context-parallel ranks) makes the loss and the
gradients independent of how the batch is split: accumulation 4x2 equals batch 8, and every
parallel plan sees the single-device numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from autopar.data.loader import IGNORE_INDEX
from autopar.parallel.torch_internals import funcol


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32. logits (B, S, V), labels (B, S)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy, its gradient in the logits' dtype) of rows ``logits``
    (N, V): softmax minus the one-hot target, zero on ignored rows."""
    logp = logits.float().log_softmax(dim=-1)
    valid = labels != IGNORE_INDEX
    target = labels.clamp(min=0)[:, None]
    loss = -(logp.gather(1, target)[:, 0] * valid).sum()
    grad = logp.exp().scatter_add_(1, target, -torch.ones_like(target, dtype=logp.dtype))
    return loss, (grad * valid[:, None]).to(logits.dtype)


def vocab_parallel_chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_loss_and_grad`` for rows whose vocabulary is split over ``group`` (loss
    parallel): this rank holds columns ``vocab_start`` onwards. The row maxima, the sums of
    exponents and the targets' logits are combined over the group, so every rank gets the
    whole loss; the gradient is this rank's columns."""
    x = logits.float()
    top = funcol.all_reduce(x.amax(dim=-1), "max", group)
    exp = (x - top[:, None]).exp()
    total = funcol.all_reduce(exp.sum(dim=-1), "sum", group)
    local = labels - vocab_start
    mine = (local >= 0) & (local < x.shape[1])  # the target is one of this rank's columns
    index = torch.where(mine, local, 0)[:, None]
    target = funcol.all_reduce((x.gather(1, index)[:, 0] * mine).contiguous(), "sum", group)
    valid = labels != IGNORE_INDEX
    loss = ((top + total.log() - target) * valid).sum()
    grad = (exp / total[:, None]).scatter_add_(1, index, -mine[:, None].to(exp.dtype))
    return loss, (grad * valid[:, None]).to(logits.dtype)


ChunkKernel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
VocabParallelKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy whose gradient is computed in forward, ``chunk`` rows at a time:
    the fp32 logits, their softmax and its gradient exist for one chunk only, and what is
    kept for backward is one gradient in the logits' dtype (instead of fp32 logits and
    log-probabilities over the whole micro-batch)."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int, kernel: ChunkKernel
    ) -> torch.Tensor:
        grad = torch.empty_like(logits)
        total = torch.zeros((), device=logits.device, dtype=torch.float32)
        for start in range(0, logits.shape[0], chunk):
            loss, grad[start : start + chunk] = kernel(
                logits[start : start + chunk], labels[start : start + chunk]
            )
            total += loss
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


def chunked_token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    kernel: ChunkKernel = chunk_loss_and_grad,
    vocab_parallel_kernel: VocabParallelKernel = vocab_parallel_chunk_loss_and_grad,
) -> torch.Tensor:
    """``token_loss_sum`` that never holds fp32 logits for more than ``chunk_tokens`` tokens;
    ``kernel`` may be ``chunk_loss_and_grad`` compiled. Logits sharded over the vocabulary
    (a DTensor, loss parallel) go through ``vocab_parallel_kernel`` on each rank's columns."""
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        assert logits.placements == (Shard(logits.ndim - 1),), logits.placements
        width = -(-logits.shape[-1] // mesh.size())  # DTensor's Shard splits as torch.chunk does
        kernel = functools.partial(
            vocab_parallel_kernel, group=mesh.get_group(), vocab_start=mesh.get_local_rank() * width
        )
        logits = logits.to_local()  # its backward makes the gradient a vocab-sharded DTensor
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), chunk_tokens, kernel)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
