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
from torch.distributed.tensor import DTensor

from autopar.data.loader import IGNORE_INDEX
from autopar.training.token_logps import chunk_logps, vocab_columns, vocab_parallel_chunk_logps


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32. logits (B, S, V), labels (B, S)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy, its gradient in the logits' dtype) of rows ``logits``
    (N, V): minus the rows' log-probabilities (``token_logps.chunk_logps``) and their gradient,
    softmax minus the one-hot target, zero on ignored rows."""
    logps, _, grad = chunk_logps(logits, labels, keep_grad=True)
    assert grad is not None
    return -logps.sum(), grad.neg_()


def vocab_parallel_chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_loss_and_grad`` for rows whose vocabulary is split over ``group`` (loss
    parallel): this rank holds columns ``vocab_start`` onwards. Every rank gets the whole loss
    and the gradient of its own columns (``token_logps.vocab_parallel_chunk_logps``)."""
    logps, _, grad = vocab_parallel_chunk_logps(logits, labels, True, group, vocab_start)
    assert grad is not None
    return -logps.sum(), grad.neg_()


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
        logits, columns = vocab_columns(logits)
        kernel = functools.partial(vocab_parallel_kernel, **columns)
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), chunk_tokens, kernel)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
