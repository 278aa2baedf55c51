"""The gated delta rule (Gated DeltaNet's recurrence) as a chunked kernel in plain torch.

Per value head h, reading key head ``h // (HV / HK)``, with q and k L2-normed and q scaled
by ``dk ** -0.5``, the fp32 state S (dk x dv) runs over the tokens t::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

and restarts from zero where a packed document starts. Chunks of ``CHUNK`` tokens turn the
recurrence into matmuls (the UT transform: a unit lower-triangular solve per chunk), and only
the state crosses from chunk to chunk.

Memory is why this is an op of its own rather than autograd over the chunk math: autograd
would keep every chunk's pairwise decays, Gram matrices and solves (transformers' torch
reference keeps about 15x its inputs). Here the forward keeps its inputs and the state
entering each segment of ``SEGMENT`` tokens (fp32, dk x dv per value head), and the
backward recomputes one segment at a time, newest first, carrying the state's gradient
back. The two are ``torch.library`` custom ops with fake implementations, so compiled graphs
call them without a graph break and without unrolling the chunk loop for each length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens solved together; the state passes between chunks."""
SEGMENT = 8 * CHUNK
"""Tokens recomputed together in backward; one fp32 state per segment is kept from forward."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, L, H, ...) in any dtype -> fp32 (B, K, H / K, L, ...): value heads grouped under the
    key head they read (h // (H / K)), so per-key-head products broadcast over the group."""
    x = x.float().transpose(1, 2)  # (B, H, L, ...)
    return x.reshape(x.shape[0], groups, -1, *x.shape[2:])  # (B, K, R, L, ...)


def _chunks(x: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """Pad the sequence dim ``dim`` by ``pad`` zeros and split it into (n, CHUNK)."""
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, widths)
    return x.unflatten(dim, (-1, CHUNK))


def _segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
    state: torch.Tensor,
    previous_document: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs (B, L, HV, dv) fp32 and exit state of one segment of L tokens entered with
    ``state`` (B, HK, R, dk, dv). ``previous_document`` (B,): the document of the token before
    the segment (its state carries only into that document)."""
    _bsz, seqlen, key_heads, key_dim = k.shape
    pad = -seqlen % CHUNK
    q = l2norm(q.float()) * key_dim**-0.5
    k = l2norm(k.float())
    q, k = (_chunks(_heads_first(x, key_heads), 3, pad) for x in (q, k))  # (B, K, 1, n, C, dk)
    v = _chunks(_heads_first(v, key_heads), 3, pad)  # (B, K, R, n, C, dv)
    g, beta = (_chunks(_heads_first(x, key_heads), 3, pad) for x in (g, beta))  # (B, K, R, n, C)

    gamma = g.cumsum(-1)  # (B, K, R, n, C) log decay from the chunk's entry to each token
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    same = lower
    enter = torch.ones_like(gamma, dtype=torch.bool)
    if documents is not None:
        docs = _chunks(documents, 1, pad)  # (B, n, C); padding joins document 0, and carries nothing
        if pad:
            docs[:, -1, CHUNK - pad :] = docs[:, -1, CHUNK - pad - 1 : CHUNK - pad]
        before = torch.cat((previous_document[:, None], docs[:, :-1, -1]), dim=1)  # (B, n)
        same = lower & (docs[..., :, None] == docs[..., None, :])[:, None, None]  # (B, 1, 1, n, C, C)
        enter = (docs == before[..., None])[:, None, None].expand_as(gamma)
    diff = gamma[..., :, None] - gamma[..., None, :]  # (..., C, C) i - j
    decay = torch.where(same, diff, float("-inf")).exp()  # exp(gamma_i - gamma_j), j <= i, same document
    from_entry = torch.where(enter, gamma, float("-inf")).exp()  # (B, K, R, n, C)
    to_exit = torch.where(same[..., -1, :], gamma[..., -1:] - gamma, float("-inf")).exp()  # (.., n, C)

    gram = k @ k.transpose(-1, -2)  # (B, K, 1, n, C, C) per key head
    system = (beta[..., None] * gram * decay).tril(-1)  # (B, K, R, n, C, C)
    rhs = torch.cat((beta[..., None] * v, (beta * from_entry)[..., None] * k.expand(*beta.shape, -1)), -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, reads = solved.split((v.shape[-1], key_dim), dim=-1)  # (.., C, dv), (.., C, dk)
    attend = (q @ k.transpose(-1, -2)) * decay  # (B, K, R, n, C, C)
    q_entry = q * from_entry[..., None]  # (B, K, R, n, C, dk)
    k_exit = k * to_exit[..., None]
    exit_decay = torch.where(enter[..., -1], gamma[..., -1], float("-inf")).exp()[..., None, None]

    outputs = []
    # unbind once: indexing chunk c in the loop would make backward fill a whole-segment zero
    # tensor per chunk
    per_chunk = (t.unbind(3) for t in (values, reads, q_entry, attend, k_exit, exit_decay))
    for value, read, query, scores, key, decay_c in zip(*per_chunk):
        u = value - read @ state  # (B, K, R, C, dv)
        outputs.append(query @ state + scores @ u)
        state = decay_c * state + key.transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=3).flatten(3, 4)[:, :, :, :seqlen]  # (B, K, R, L, dv)
    return out.flatten(1, 2).transpose(1, 2), state  # (B, L, HV, dv)


def _with_autograd() -> torch._C._ForceDispatchKeyGuard:
    """Autograd back on inside a custom op's kernel, which the dispatcher runs below autograd
    (its keys excluded for the call): the backward recomputes each segment and differentiates
    it. A private guard; ``tests/test_delta_rule.py`` fails by name if torch renames it."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _bounds(seqlen: int) -> list[tuple[int, int]]:
    return [(s, min(s + SEGMENT, seqlen)) for s in range(0, seqlen, SEGMENT)]


def _previous_document(documents: torch.Tensor | None, start: int) -> torch.Tensor | None:
    if documents is None:
        return None
    return documents[:, max(start - 1, 0)]


@torch.library.custom_op("autopar::gated_delta_rule", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, seqlen, key_heads, key_dim = k.shape
    value_heads = v.shape[2]
    state = v.new_zeros(bsz, key_heads, value_heads // key_heads, key_dim, v.shape[-1], dtype=torch.float32)
    outputs, states = [], []
    for start, end in _bounds(seqlen):
        states.append(state)
        pieces = (x[:, start:end] for x in (q, k, v, g, beta))
        docs = None if documents is None else documents[:, start:end]
        out, state = _segment(*pieces, docs, state, _previous_document(documents, start))
        outputs.append(out)
    return torch.cat(outputs, dim=1).to(v.dtype), torch.stack(states, dim=1)


@_forward.register_fake
def _(q, k, v, g, beta, documents):
    bsz, seqlen, key_heads, key_dim = k.shape
    segments = (seqlen + SEGMENT - 1) // SEGMENT
    states = v.new_empty(
        bsz, segments, key_heads, v.shape[2] // key_heads, key_dim, v.shape[-1], dtype=torch.float32
    )
    return torch.empty_like(v), states


@torch.library.custom_op("autopar::gated_delta_rule_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    grad_state = torch.zeros_like(states[:, 0])
    bounds = _bounds(q.shape[1])
    for index in reversed(range(len(bounds))):
        start, end = bounds[index]
        with _with_autograd(), torch.enable_grad():
            pieces = [x[:, start:end].detach().requires_grad_() for x in (q, k, v, g, beta)]
            entry = states[:, index].detach().requires_grad_(index > 0)
            docs = None if documents is None else documents[:, start:end]
            out, exit_state = _segment(*pieces, docs, entry, _previous_document(documents, start))
            wrt = pieces + ([entry] if index > 0 else [])
            found = torch.autograd.grad(
                (out, exit_state), wrt, (grad_out[:, start:end].float(), grad_state), allow_unused=True
            )
        for total, piece in zip(grads, found[:5]):
            if piece is not None:
                total[:, start:end] = piece
        if index > 0:
            grad_state = found[5]
    return tuple(grads)


@_backward.register_fake
def _(grad_out, q, k, v, g, beta, documents, states):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, documents = inputs
    ctx.save_for_backward(q, k, v, g, beta, documents, output[1])


def _autograd_backward(ctx, grad_out: torch.Tensor, _grad_states: torch.Tensor):
    q, k, v, g, beta, documents, states = ctx.saved_tensors
    grads = torch.ops.autopar.gated_delta_rule_backward(grad_out, q, k, v, g, beta, documents, states)
    return (*grads, None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a whole sequence, from a zero state.

    q, k (B, S, HK, dk) and v (B, S, HV, dv) in the compute dtype, HV a multiple of HK;
    g (B, S, HV) the log decay (<= 0, fp32) and beta (B, S, HV) the write strength;
    ``documents`` (B, S) int64 ids of packed documents (equal ids contiguous): the state
    restarts at each. Returns (B, S, HV, dv) in v's dtype; the recurrence runs in fp32.
    """
    return torch.ops.autopar.gated_delta_rule(q, k, v, g, beta, documents)[0]


def reference_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The recurrence token by token, in fp32: the definition the chunked kernel must equal."""
    bsz, seqlen, key_heads, key_dim = k.shape
    groups = v.shape[2] // key_heads
    q = (l2norm(q.float()) * key_dim**-0.5).repeat_interleave(groups, dim=2)  # (B, S, HV, dk)
    k = l2norm(k.float()).repeat_interleave(groups, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    state = v.new_zeros(bsz, v.shape[2], key_dim, v.shape[-1])  # (B, HV, dk, dv)
    outputs = []
    for t in range(seqlen):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - (state * k[:, t, :, :, None]).sum(-2))  # (B, HV, dv)
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1)  # (B, S, HV, dv)
