"""The chunk-parallel half of the chunked gated delta rule, batched over every chunk at once.

Per value head, in chunks of ``CHUNK`` tokens, with S_c the fp32 state (dk x c) entering
chunk c, the rule of ``delta_rule.py`` is::

    v'_c = u_c - w_c S_c                       (the values the chunk writes, net of S_c)
    o_c  = q'_c S_c + A_c v'_c                 (the chunk's outputs)
    S_c+1 = d_c S_c + K_c^T v'_c               (the state leaving it)

where u and w come from one unit lower-triangular solve per chunk (the UT transform:
u = T beta v, w = T beta exp(gamma) k, T = (I + tril(beta k k^T * decays, -1))^-1), q' is q
decayed from the chunk's entry, A the causal decayed scores q k^T, K the keys decayed to the
chunk's exit and d the whole chunk's decay. Packed documents are folded into these terms
(a decay across a document start is zero), so the recurrence itself knows nothing of them.

Everything here but the recurrence is independent per chunk: ``prepare`` forms every
chunk's terms with a few batched ops (fp32: decays, Gram matrices, the solve), ``outputs``
and ``chunk_grads`` turn the states the recurrence passes into outputs and gradients. Only
the two state passes (``S`` forward, its gradient backward) loop over chunks; torch runs them
in ``delta_rule_passes.py``, Triton in ``triton_delta_rule.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64
"""Tokens solved together; the state passes between chunks."""
LOG_DECAY_FLOOR = -60.0
"""Decays below exp(-60) (~1e-26, far under fp32's rounding of any sum they join, which holds
the token's own undecayed term) are taken as zero. Left in, a trained model's long-range
decays reach fp32's subnormal range, and on x86 CPUs every matmul and triangular solve that
touches a subnormal slows down: the debug Qwen3.5 trained 22% slower after a few steps
(BENCHMARKS.md). GPUs flush subnormals in these kernels anyway."""


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def decayed(keep: Tensor, log_decay: Tensor) -> Tensor:
    """exp(``log_decay``) where ``keep`` and above ``LOG_DECAY_FLOOR``, else exactly zero."""
    return torch.where(keep & (log_decay > LOG_DECAY_FLOOR), log_decay, float("-inf")).exp()


def _heads_first(x: Tensor, groups: int) -> Tensor:
    """(B, L, H, ...) in any dtype -> fp32 (B, K, H / K, L, ...): value heads grouped under the
    key head they read (h // (H / K)), so per-key-head products broadcast over the group."""
    x = x.float().transpose(1, 2)  # (B, H, L, ...)
    return x.reshape(x.shape[0], groups, -1, *x.shape[2:])  # (B, K, R, L, ...)


def _chunked(x: Tensor, pad: int) -> Tensor:
    """(B, K, R, L, ...) -> (B, K, R, n, CHUNK, ...), the sequence padded by ``pad`` zeros."""
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 4) + [0, pad])
    return x.unflatten(3, (-1, CHUNK))


def _document_masks(
    gamma: Tensor, documents: Tensor | None, previous_document: Tensor | None, pad: int
) -> tuple[Tensor, Tensor]:
    """(token j reaches token i of its chunk: causal, same document; (.., C, C)), (a token's
    document continues from the chunk's entry state: like ``gamma``)."""
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=gamma.device).tril()
    if documents is None:
        return lower, torch.ones_like(gamma, dtype=torch.bool)
    docs = F.pad(documents, (0, pad)).unflatten(1, (-1, CHUNK))  # (B, n, C)
    if pad:  # padding joins the last document (and carries nothing: its k, v and beta are 0)
        docs[:, -1, CHUNK - pad :] = docs[:, -1, CHUNK - pad - 1 : CHUNK - pad]
    before = torch.cat((previous_document[:, None], docs[:, :-1, -1]), dim=1)  # (B, n)
    same = lower & (docs[..., :, None] == docs[..., None, :])[:, None, None]  # (B, 1, 1, n, C, C)
    return same, (docs == before[..., None])[:, None, None].expand_as(gamma)


@dataclass
class Chunks:
    """Every chunk's terms of the recurrence, (B, HK, HV / HK, n, CHUNK, ...) per value head
    grouped under its key head, in ``prepare``'s dtype."""

    w: Tensor  # (.., n, C, dk) how much of the entry state each token's write cancels
    u: Tensor  # (.., n, C, c) the writes from a zero entry state
    k_exit: Tensor  # (.., n, C, dk) keys decayed to the chunk's exit
    exit_decay: Tensor  # (.., n) the entry state's decay across the chunk
    q_entry: Tensor | None = None  # (.., n, C, dk) queries decayed from the chunk's entry
    attend: Tensor | None = None  # (.., n, C, C) causal decayed scores, diagonal included

    def tensors(self) -> list[Tensor]:
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def stored_as(self, dtype: torch.dtype) -> Chunks:
        """The terms in ``dtype`` for the passes' products, the decay across each chunk in fp32."""
        cast = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, t in cast.items():
            if t is not None and name != "exit_decay":
                cast[name] = t.to(dtype)
        return Chunks(**cast)

    def detached(self) -> Chunks:
        return Chunks(
            **{f.name: None if (t := getattr(self, f.name)) is None else t.detach() for f in fields(self)}
        )


def prepare(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    documents: Tensor | None,
    previous_document: Tensor | None,
    columns: int,
) -> Chunks:
    """The fp32 terms of L tokens (arguments as ``DeltaRuleKernel.rule``, ``previous_document``
    given when ``documents`` is), zero-padded to whole chunks. A state wider than v
    (``columns`` > dv) carries columns - dv leading columns that receive no values: from an
    identity they track the map from the entry state (``delta_rule_map``)."""
    key_heads, key_dim = k.shape[2], k.shape[3]
    pad = -k.shape[1] % CHUNK
    k = _chunked(_heads_first(l2norm(k.float()), key_heads), pad)  # (B, K, 1, n, C, dk)
    v = _chunked(_heads_first(v, key_heads), pad)  # (B, K, R, n, C, dv)
    if columns > v.shape[-1]:
        v = F.pad(v, (columns - v.shape[-1], 0))  # (B, K, R, n, C, c)
    g, beta = (_chunked(_heads_first(x, key_heads), pad) for x in (g, beta))  # (B, K, R, n, C)

    gamma = g.cumsum(-1)  # (B, K, R, n, C) log decay from the chunk's entry to each token
    same, enter = _document_masks(gamma, documents, previous_document, pad)
    decay = decayed(same, gamma[..., :, None] - gamma[..., None, :])  # (.., C, C) exp(gamma_i - gamma_j)
    from_entry = decayed(enter, gamma)  # (B, K, R, n, C)
    to_exit = decayed(same[..., -1, :], gamma[..., -1:] - gamma)  # (.., n, C)

    gram = k @ k.transpose(-1, -2)  # (B, K, 1, n, C, C) per key head
    system = (beta[..., None] * gram * decay).tril(-1)  # (B, K, R, n, C, C)
    rhs = torch.cat((beta[..., None] * v, (beta * from_entry)[..., None] * k.expand(*beta.shape, -1)), -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split((columns, key_dim), dim=-1)  # (.., C, c), (.., C, dk)
    chunks = Chunks(w, u, k * to_exit[..., None], decayed(enter[..., -1], gamma[..., -1]))
    if q is not None:
        q = _chunked(_heads_first(l2norm(q.float()) * key_dim**-0.5, key_heads), pad)  # (B, K, 1, n, C, dk)
        chunks.attend = (q @ k.transpose(-1, -2)) * decay  # (B, K, R, n, C, C)
        chunks.q_entry = q * from_entry[..., None]  # (B, K, R, n, C, dk)
    return chunks


def outputs(chunks: Chunks, states: Tensor, values: Tensor, seqlen: int) -> Tensor:
    """(B, L, HV, c) fp32 outputs of L tokens from the states entering each chunk ``states``
    (.., n, dk, c) and the net writes ``values`` (.., n, C, c) the forward pass gave."""
    out = (chunks.q_entry @ states).float() + (chunks.attend @ values).float()  # (B, K, R, n, C, c)
    out = out.flatten(3, 4)[:, :, :, :seqlen]  # (B, K, R, L, c)
    return out.flatten(1, 2).transpose(1, 2)  # (B, L, HV, c)


def in_chunks(x: Tensor, key_heads: int) -> Tensor:
    """(B, L, HV, c) per token (an output's gradient) -> fp32 (B, K, R, n, C, c)."""
    return _chunked(_heads_first(x, key_heads), -x.shape[1] % CHUNK)


def local_value_grads(chunks: Chunks, grad_out: Tensor) -> Tensor:
    """The outputs' gradient reaching each chunk's net writes within the chunk, A^T dO
    (.., n, C, c): what the backward pass adds the later chunks' share to."""
    return chunks.attend.transpose(-1, -2) @ grad_out.to(chunks.attend.dtype)


def chunk_grads(
    chunks: Chunks,
    states: Tensor,
    values: Tensor,
    grad_out: Tensor | None,
    grad_values: Tensor,
    grad_exits: Tensor,
) -> list[Tensor]:
    """Gradients of ``chunks.tensors()`` from the forward pass's entry states and net writes
    and the backward pass's: ``grad_values`` (.., n, C, c) the net writes' whole gradient,
    ``grad_exits`` (.., n, dk, c) each chunk's exit state's; ``grad_out`` as ``in_chunks``."""
    states_t = states.transpose(-1, -2)
    grads = [
        -(grad_values @ states_t),  # w
        grad_values,  # u
        values @ grad_exits.transpose(-1, -2),  # k_exit
        (states.float() * grad_exits.float()).sum((-2, -1)),  # exit_decay
    ]
    if chunks.q_entry is not None:
        grad_out = grad_out.to(states.dtype)
        grads += [grad_out @ states_t, grad_out @ values.transpose(-1, -2)]  # q_entry, attend
    return grads
