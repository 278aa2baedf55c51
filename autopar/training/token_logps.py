"""Each target token's log-probability (and its position's entropy) a chunk of tokens at a
time: what DPO and RL read of the logits under ``training.loss_chunk_tokens``.

Taken whole, a log-probability's graph keeps the float32 log-softmax of every position for
backward, and its forward and backward hold two or three more vocabulary-wide float32
tensors: at Qwen's 152k vocabulary the largest activations of a preference or RL step. Here
the float32 values exist for one chunk at a time, and what is kept for backward is the
log-probability's gradient with respect to the logits, in the logits' dtype (each row
``(onehot - softmax) / temperature``); backward scales it by each token's upstream gradient.
Logits split over the vocabulary (loss parallel: a DTensor) are combined across the group
per row (maximum, sum of exponents, target logit), so no rank gathers the whole vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from autopar.data.loader import IGNORE_INDEX
from autopar.parallel.torch_internals import funcol

ChunkKernel = Callable[[Tensor, Tensor, bool], tuple[Tensor, Tensor, Tensor | None]]
"""(logits rows (N, V), labels (N,), keep the gradient) -> (log-probabilities (N,) fp32,
entropies (N,) fp32, d log-probability / d logits (N, V) in the logits' dtype, or None)."""


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    if temperature == 1.0:
        return x
    return x / temperature if x is logits else x.div_(temperature)


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Each row's dot product, (N,), without an (N, V) product tensor."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


def chunk_logps(
    logits: Tensor, labels: Tensor, keep_grad: bool, temperature: float = 1.0, entropy: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``ChunkKernel`` of rows holding the whole vocabulary (entropies zero unless ``entropy``)."""
    all_logps = _scaled(logits, temperature).log_softmax(dim=-1)
    valid = labels != IGNORE_INDEX
    index = torch.where(valid, labels, 0)[:, None]
    logps = torch.where(valid, all_logps.gather(1, index)[:, 0], 0.0)
    probs = all_logps.exp()
    entropies = -_row_dot(probs, all_logps) if entropy else torch.zeros_like(logps)
    del all_logps
    if not keep_grad:
        return logps, entropies, None
    grad = probs.neg_().scatter_add_(1, index, torch.ones_like(index, dtype=probs.dtype))
    return logps, entropies, grad.mul_((valid / temperature)[:, None]).to(logits.dtype)


def vocab_parallel_chunk_logps(
    logits: Tensor,
    labels: Tensor,
    keep_grad: bool,
    group: dist.ProcessGroup,
    vocab_start: int,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``chunk_logps`` of rows whose vocabulary is split over ``group``: this rank holds
    columns ``vocab_start`` onwards; every rank gets the whole values, and the gradient of
    its own columns."""
    x = _scaled(logits, temperature)
    top = funcol.all_reduce(x.amax(dim=-1), "max", group)
    probs = (x - top[:, None]).exp_()
    total = funcol.all_reduce(probs.sum(dim=-1), "sum", group)
    probs.div_(total[:, None])
    local = labels - vocab_start
    mine = (local >= 0) & (local < x.shape[1])  # the target is one of this rank's columns
    index = torch.where(mine, local, 0)[:, None]
    target = funcol.all_reduce((x.gather(1, index)[:, 0] * mine).contiguous(), "sum", group)
    valid = labels != IGNORE_INDEX
    normalizer = top + total.log()
    logps = torch.where(valid, target - normalizer, 0.0)
    entropies = torch.zeros_like(logps)
    if entropy:  # H = log Z - sum p x over every rank's columns
        entropies = normalizer - funcol.all_reduce(_row_dot(probs, x).contiguous(), "sum", group)
    del x
    if not keep_grad:
        return logps, entropies, None
    grad = probs.neg_().scatter_add_(1, index, mine[:, None].to(probs.dtype))
    return logps, entropies, grad.mul_((valid / temperature)[:, None]).to(logits.dtype)


class _ChunkedTokenLogps(torch.autograd.Function):
    """Log-probabilities (N,) and entropies (N,) of rows ``logits`` (N, V), ``chunk`` rows at a
    time; keeps d log-probability / d logits (in the logits' dtype) with ``keep_grad``, nothing
    vocabulary-wide otherwise."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, labels: Tensor, chunk: int, kernel: ChunkKernel, keep_grad: bool
    ) -> tuple[Tensor, Tensor]:
        grad = torch.empty_like(logits) if keep_grad else None
        logps = logits.new_empty(logits.shape[0], dtype=torch.float32)
        entropies = torch.empty_like(logps)
        for start in range(0, logits.shape[0], chunk):
            rows = slice(start, start + chunk)
            logps[rows], entropies[rows], part = kernel(logits[rows], labels[rows], keep_grad)
            if grad is not None:
                grad[rows] = part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_entropies: Tensor) -> tuple[Tensor, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_logps[:, None].to(grad.dtype), None, None, None, None


def chunked_token_logps(
    logits: Tensor, labels: Tensor, chunk_tokens: int, temperature: float = 1.0, entropy: bool = False
) -> tuple[Tensor, Tensor]:
    """Each target's log-probability at ``temperature`` (0 where there is none), with its
    graph, and each position's entropy (nats, no graph; zeros unless ``entropy``), fp32 (B, S)
    from logits (B, S, V), never more than ``chunk_tokens`` positions' float32 values at once."""
    kernel: ChunkKernel = functools.partial(chunk_logps, temperature=temperature, entropy=entropy)
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        assert logits.placements == (Shard(logits.ndim - 1),), logits.placements
        width = -(-logits.shape[-1] // mesh.size())  # DTensor's Shard splits as torch.chunk does
        kernel = functools.partial(
            vocab_parallel_chunk_logps,
            group=mesh.get_group(),
            vocab_start=mesh.get_local_rank() * width,
            temperature=temperature,
            entropy=entropy,
        )
        logits = logits.to_local()  # its backward makes the gradient a vocab-sharded DTensor
    # decided here: inside ``forward`` grad mode is always off, and ``needs_input_grad`` holds
    # under no_grad too (a reference pass or pi_old's would keep a gradient nothing reads)
    keep_grad = torch.is_grad_enabled() and logits.requires_grad
    logps, entropies = _ChunkedTokenLogps.apply(
        logits.flatten(0, 1), labels.flatten(), chunk_tokens, kernel, keep_grad
    )
    return logps.view(labels.shape), entropies.view(labels.shape)
