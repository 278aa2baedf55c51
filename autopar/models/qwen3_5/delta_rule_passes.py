"""The chunked delta rule's two state passes, and the segment loop that drives a kernel.

A kernel here is the chunk-parallel work of ``delta_rule_chunks.py`` (batched over every
chunk of a segment) around two passes over the chunks, the only sequential part:

- forward: from the entry state, each chunk's net writes v' = u - w S and the next state
  S <- d S + K^T v' (and, for the outputs, the state entering each chunk);
- backward, newest chunk first, from the exit state's gradient G: each chunk's net writes'
  whole gradient dv' = A^T dO + K G (the first term batched beforehand) and the entering
  state's G <- d G + q'^T dO - w^T dv'.

``TORCH_PASSES`` runs them as a loop of small matmuls (any device; the ``autopar`` kernel);
``triton_delta_rule.py`` as Triton programs. Both keep the state and its gradient in fp32.

``ChunkedRule`` runs a sequence in segments of ``segment`` tokens. The forward keeps its
inputs and the fp32 state entering each segment; the backward walks the segments newest
first, re-forms a segment's chunk terms with autograd on, reruns its forward pass for the
states entering its chunks, runs the backward pass, forms every chunk term's gradient in a
few batched matmuls and lets autograd carry them back through the terms to q, k, v, g and
beta. So what it keeps for backward is its inputs and one state per segment, and what it
holds while differentiating is one segment's terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from autopar.models.qwen3_5.delta_rule_chunks import (
    Chunks,
    chunk_grads,
    in_chunks,
    local_value_grads,
    outputs,
    prepare,
)


class StatePasses(Protocol):
    """The two passes over a segment's chunks (``Chunks`` of shape (B, K, R, n, C, ...))."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the chunk terms and products for inputs of ``dtype``."""
        ...

    def forward(
        self, chunks: Chunks, state: Tensor, keep_states: bool
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """(the state entering each chunk (.., n, dk, c) if ``keep_states``, the net writes
        (.., n, C, c), the exit state (.., dk, c) fp32) from the entry ``state``."""
        ...

    def backward(
        self, chunks: Chunks, grad_out: Tensor | None, local_grads: Tensor | None, grad_exit: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(each chunk's exit-state gradient (.., n, dk, c), the net writes' gradient
        (.., n, C, c), the entry state's gradient fp32) from the exit state's ``grad_exit``,
        the outputs' gradient ``grad_out`` (.., n, C, c) and its in-chunk share A^T dO."""
        ...


class TorchPasses:
    """The passes as a loop of batched small matmuls over the chunks."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def forward(
        self, chunks: Chunks, state: Tensor, keep_states: bool
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        entering, values = [], []
        per_chunk = (
            t.unbind(3) for t in (chunks.w, chunks.u, chunks.k_exit, chunks.exit_decay[..., None, None])
        )
        for w, u, key, decay in zip(*per_chunk):
            entering.append(state)
            value = u - w @ state.to(w.dtype)  # (B, K, R, C, c)
            values.append(value)
            state = decay * state + (key.transpose(-1, -2) @ value).float()
        kept = torch.stack(entering, dim=3).to(chunks.w.dtype) if keep_states else None
        return kept, torch.stack(values, dim=3), state

    def backward(
        self, chunks: Chunks, grad_out: Tensor | None, local_grads: Tensor | None, grad_exit: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        exits, grad_values = [], []
        grad = grad_exit
        for c in reversed(range(chunks.w.shape[3])):
            exits.append(grad)
            key = chunks.k_exit[:, :, :, c]
            grad_value = key @ grad.to(key.dtype)  # (B, K, R, C, c)
            if local_grads is not None:
                grad_value = grad_value + local_grads[:, :, :, c]
            grad_values.append(grad_value)
            decay = chunks.exit_decay[:, :, :, c, None, None]
            grad = decay * grad - (chunks.w[:, :, :, c].transpose(-1, -2) @ grad_value).float()
            if grad_out is not None:
                grad = grad + (chunks.q_entry[:, :, :, c].transpose(-1, -2) @ grad_out[:, :, :, c]).float()
        exits = torch.stack(exits[::-1], dim=3).to(chunks.w.dtype)
        return exits, torch.stack(grad_values[::-1], dim=3), grad


TORCH_PASSES = TorchPasses()


def with_autograd() -> torch._C._ForceDispatchKeyGuard:
    """Autograd back on inside a custom op's kernel, which the dispatcher runs below autograd
    (its keys excluded for the call): the backward differentiates each segment's chunk
    terms. A private guard; ``tests/test_delta_rule.py`` fails by name if torch renames it."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _previous_document(documents: Tensor | None, start: int, before_first: Tensor | None) -> Tensor | None:
    """The document of the token before ``start``: ``before_first`` (B,) for the first
    segment (from another rank), else the sequence's own token (the first token's at 0,
    which lets a given entry state flow in)."""
    if documents is None:
        return None
    if start == 0 and before_first is not None:
        return before_first
    return documents[:, max(start - 1, 0)]


@dataclass(frozen=True)
class ChunkedRule:
    """A kernel: ``passes`` over chunks, recomputed in backward ``segment`` tokens at a time."""

    passes: StatePasses
    segment: int

    def bounds(self, seqlen: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.segment, seqlen)) for s in range(0, seqlen, self.segment)]

    def segments(self, seqlen: int) -> int:
        return -(-seqlen // self.segment)

    def forward(
        self,
        q: Tensor | None,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        documents: Tensor | None,
        state: Tensor,
        previous_document: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(outputs in v's dtype, empty without q; the fp32 state entering each segment
        (B, segments, HK, R, dk, c); the exit state) from the entry ``state``."""
        dtype = self.passes.storage_dtype(v.dtype)
        outs, states = [], []
        for start, end in self.bounds(k.shape[1]):
            states.append(state)
            piece_q = None if q is None else q[:, start:end]
            pieces = (x[:, start:end] for x in (k, v, g, beta))
            docs = None if documents is None else documents[:, start:end]
            before = _previous_document(documents, start, previous_document)
            chunks = prepare(piece_q, *pieces, docs, before, state.shape[-1]).stored_as(dtype)
            entering, values, state = self.passes.forward(chunks, state, keep_states=q is not None)
            if q is not None:
                outs.append(outputs(chunks, entering, values, end - start))
        out = v.new_empty(0) if q is None else torch.cat(outs, dim=1).to(v.dtype)
        return out, torch.stack(states, dim=1), state

    def backward(
        self,
        grad_out: Tensor | None,
        grad_exit: Tensor | None,
        q: Tensor | None,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        documents: Tensor | None,
        previous_document: Tensor | None,
        states: Tensor,
    ) -> tuple[list[Tensor], Tensor]:
        """(gradients of [q,] k, v, g, beta, the entry state's gradient fp32)."""
        inputs = [k, v, g, beta] if q is None else [q, k, v, g, beta]
        grads = [torch.zeros_like(x) for x in inputs]
        grad_state = torch.zeros_like(states[:, 0]) if grad_exit is None else grad_exit.float()
        dtype = self.passes.storage_dtype(v.dtype)
        bounds = self.bounds(k.shape[1])
        for index in reversed(range(len(bounds))):
            start, end = bounds[index]
            with with_autograd(), torch.enable_grad():
                pieces = [x[:, start:end].detach().requires_grad_() for x in inputs]
                docs = None if documents is None else documents[:, start:end]
                before = _previous_document(documents, start, previous_document)
                columns = states.shape[-1]
                terms = prepare(*([None] if q is None else []), *pieces, docs, before, columns).stored_as(
                    dtype
                )
            chunks = terms.detached()
            entering, values, _ = self.passes.forward(chunks, states[:, index], keep_states=True)
            upstream = local = None
            if q is not None:
                piece_grad = torch.zeros_like(v[:, start:end]) if grad_out is None else grad_out[:, start:end]
                upstream = in_chunks(piece_grad, k.shape[2]).to(dtype)  # (B, K, R, n, C, dv)
                local = local_value_grads(chunks, upstream)
            exits, grad_values, grad_state = self.passes.backward(chunks, upstream, local, grad_state)
            term_grads = chunk_grads(chunks, entering, values, upstream, grad_values, exits)
            outs = terms.tensors()
            term_grads = [d.to(t.dtype) for d, t in zip(term_grads, outs)]
            with with_autograd():
                found = torch.autograd.grad(outs, pieces, term_grads, allow_unused=True)
            for total, piece in zip(grads, found):
                if piece is not None:
                    total[:, start:end] = piece
        return grads, grad_state
