"""Token-summed cross-entropy, normalized once per optimizer step by the global token count.

Summing token losses and dividing by the number of target tokens in the whole global batch
(all micro-steps, all data-parallel and context-parallel ranks) makes the loss and the
gradients independent of how the batch is split: accumulation 4x2 equals batch 8, and every
parallel plan sees the single-device numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from autopar.data.loader import IGNORE_INDEX


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


ChunkKernel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
    logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, kernel: ChunkKernel = chunk_loss_and_grad
) -> torch.Tensor:
    """``token_loss_sum`` that never holds fp32 logits for more than ``chunk_tokens`` tokens;
    ``kernel`` may be ``chunk_loss_and_grad`` compiled."""
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), chunk_tokens, kernel)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
