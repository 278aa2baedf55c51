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

The rule is affine in the state it starts from: a token range maps an entry state S to
``M S + U`` (M dk x dk, U dk x dv per value head, fp32, whatever the range's length).
``delta_rule_map`` computes [M | U] by running the same kernel from [I | 0] with values
[0 | v]; context parallelism combines the ranks' maps into each rank's entry state and then
runs ``gated_delta_rule`` from it (``autopar/parallel/state_passing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens solved together; the state passes between chunks."""
SEGMENT = 8 * CHUNK
"""Tokens recomputed together in backward; one fp32 state per segment is kept from forward."""
LOG_DECAY_FLOOR = -60.0
"""Decays below exp(-60) (~1e-26, far under fp32's rounding of any sum they join, which holds
the token's own undecayed term) are taken as zero. Left in, a trained model's long-range
decays reach fp32's subnormal range, and on x86 CPUs every matmul and triangular solve that
touches a subnormal slows down: the debug Qwen3.5 trained 22% slower after a few steps
(BENCHMARKS.md). GPUs flush subnormals in these kernels anyway."""


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


def _document_masks(
    gamma: torch.Tensor, documents: torch.Tensor | None, previous_document: torch.Tensor | None, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token j reaches token i of its chunk: causal, same document; (.., C, C)), (a token's
    document continues from the chunk's entry state: like ``gamma``)."""
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=gamma.device).tril()
    if documents is None:
        return lower, torch.ones_like(gamma, dtype=torch.bool)
    docs = _chunks(documents, 1, pad)  # (B, n, C); padding joins document 0, and carries nothing
    if pad:
        docs[:, -1, CHUNK - pad :] = docs[:, -1, CHUNK - pad - 1 : CHUNK - pad]
    before = torch.cat((previous_document[:, None], docs[:, :-1, -1]), dim=1)  # (B, n)
    same = lower & (docs[..., :, None] == docs[..., None, :])[:, None, None]  # (B, 1, 1, n, C, C)
    return same, (docs == before[..., None])[:, None, None].expand_as(gamma)


def _segment(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
    state: torch.Tensor,
    previous_document: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Outputs (B, L, HV, c) fp32 (None without ``q``) and exit state of one segment of L
    tokens entered with ``state`` (B, HK, R, dk, c). A state wider than v (c > dv) carries
    c - dv leading columns that receive no values: from an identity they track the map from
    the entry state (``delta_rule_map``). ``previous_document`` (B,): the document of the
    token before the segment (its state carries only into that document)."""
    _bsz, seqlen, key_heads, key_dim = k.shape
    pad = -seqlen % CHUNK
    k = l2norm(k.float())
    k = _chunks(_heads_first(k, key_heads), 3, pad)  # (B, K, 1, n, C, dk)
    v = _chunks(_heads_first(v, key_heads), 3, pad)  # (B, K, R, n, C, dv)
    if state.shape[-1] > v.shape[-1]:
        v = F.pad(v, (state.shape[-1] - v.shape[-1], 0))  # (B, K, R, n, C, c)
    g, beta = (_chunks(_heads_first(x, key_heads), 3, pad) for x in (g, beta))  # (B, K, R, n, C)

    gamma = g.cumsum(-1)  # (B, K, R, n, C) log decay from the chunk's entry to each token
    same, enter = _document_masks(gamma, documents, previous_document, pad)
    diff = gamma[..., :, None] - gamma[..., None, :]  # (..., C, C) i - j
    decay = _decay(same, diff)  # exp(gamma_i - gamma_j), j <= i, same document
    from_entry = _decay(enter, gamma)  # (B, K, R, n, C)
    to_exit = _decay(same[..., -1, :], gamma[..., -1:] - gamma)  # (.., n, C)

    gram = k @ k.transpose(-1, -2)  # (B, K, 1, n, C, C) per key head
    system = (beta[..., None] * gram * decay).tril(-1)  # (B, K, R, n, C, C)
    rhs = torch.cat((beta[..., None] * v, (beta * from_entry)[..., None] * k.expand(*beta.shape, -1)), -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, reads = solved.split((v.shape[-1], key_dim), dim=-1)  # (.., C, c), (.., C, dk)
    k_exit = k * to_exit[..., None]
    exit_decay = _decay(enter[..., -1], gamma[..., -1])[..., None, None]
    if q is None:
        for value, read, key, decay_c in zip(*(t.unbind(3) for t in (values, reads, k_exit, exit_decay))):
            state = decay_c * state + key.transpose(-1, -2) @ (value - read @ state)
        return None, state

    q = _chunks(_heads_first(l2norm(q.float()) * key_dim**-0.5, key_heads), 3, pad)  # (B, K, 1, n, C, dk)
    attend = (q @ k.transpose(-1, -2)) * decay  # (B, K, R, n, C, C)
    q_entry = q * from_entry[..., None]  # (B, K, R, n, C, dk)
    outputs = []
    # unbind once: indexing chunk c in the loop would make backward fill a whole-segment zero
    # tensor per chunk
    per_chunk = (t.unbind(3) for t in (values, reads, q_entry, attend, k_exit, exit_decay))
    for value, read, query, scores, key, decay_c in zip(*per_chunk):
        u = value - read @ state  # (B, K, R, C, c)
        outputs.append(query @ state + scores @ u)
        state = decay_c * state + key.transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=3).flatten(3, 4)[:, :, :, :seqlen]  # (B, K, R, L, c)
    return out.flatten(1, 2).transpose(1, 2), state  # (B, L, HV, c)


def _decay(keep: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """exp(``log_decay``) where ``keep`` and above ``LOG_DECAY_FLOOR``, else exactly zero."""
    return torch.where(keep & (log_decay > LOG_DECAY_FLOOR), log_decay, float("-inf")).exp()


def _with_autograd() -> torch._C._ForceDispatchKeyGuard:
    """Autograd back on inside a custom op's kernel, which the dispatcher runs below autograd
    (its keys excluded for the call): the backward recomputes each segment and differentiates
    it. A private guard; ``tests/test_delta_rule.py`` fails by name if torch renames it."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _bounds(seqlen: int) -> list[tuple[int, int]]:
    return [(s, min(s + SEGMENT, seqlen)) for s in range(0, seqlen, SEGMENT)]


def _previous_document(
    documents: torch.Tensor | None, start: int, before_first: torch.Tensor | None
) -> torch.Tensor | None:
    """The document of the token before ``start``: ``before_first`` (B,) for the first
    segment (from another rank), else the sequence's own token (the first token's at 0,
    which lets a given entry state flow in)."""
    if documents is None:
        return None
    if start == 0 and before_first is not None:
        return before_first
    return documents[:, max(start - 1, 0)]


@torch.library.custom_op("autopar::gated_delta_rule", mutates_args=())
def _forward(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    previous_document: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outputs, the state entering each segment, the exit state); outputs empty without q."""
    state = v.new_zeros(state_shape(k, v), dtype=torch.float32) if initial_state is None else initial_state
    outputs, states = [], []
    for start, end in _bounds(k.shape[1]):
        states.append(state)
        piece_q = None if q is None else q[:, start:end]
        pieces = (x[:, start:end] for x in (k, v, g, beta))
        docs = None if documents is None else documents[:, start:end]
        out, state = _segment(
            piece_q, *pieces, docs, state, _previous_document(documents, start, previous_document)
        )
        outputs.append(out)
    out = v.new_empty(0) if q is None else torch.cat(outputs, dim=1).to(v.dtype)
    return out, torch.stack(states, dim=1), state


@_forward.register_fake
def _(q, k, v, g, beta, documents, initial_state, previous_document):
    exit_state = empty_exit_state(k, v, initial_state)
    segments = (k.shape[1] + SEGMENT - 1) // SEGMENT
    states = exit_state.new_empty(k.shape[0], segments, *exit_state.shape[1:])
    return (v.new_empty(0) if q is None else torch.empty_like(v)), states, exit_state


@torch.library.custom_op("autopar::gated_delta_rule_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor | None,
    grad_exit: torch.Tensor | None,
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
    previous_document: torch.Tensor | None,
    states: torch.Tensor,
    entry_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q (empty without q), k, v, g, beta and, with ``entry_grad``, of the
    initial state (else empty)."""
    inputs = [k, v, g, beta] if q is None else [q, k, v, g, beta]
    grads = [torch.zeros_like(x) for x in inputs]
    grad_state = torch.zeros_like(states[:, 0]) if grad_exit is None else grad_exit.float()
    grad_entry = states.new_empty(0)
    bounds = _bounds(k.shape[1])
    for index in reversed(range(len(bounds))):
        start, end = bounds[index]
        wants_entry = index > 0 or entry_grad
        with _with_autograd(), torch.enable_grad():
            pieces = [x[:, start:end].detach().requires_grad_() for x in inputs]
            entry = states[:, index].detach().requires_grad_(wants_entry)
            docs = None if documents is None else documents[:, start:end]
            before = _previous_document(documents, start, previous_document)
            out, exit_state = _segment(*([None] if q is None else []), *pieces, docs, entry, before)
            wrt = pieces + ([entry] if wants_entry else [])
            if q is None:
                found = torch.autograd.grad(exit_state, wrt, grad_state, allow_unused=True)
            else:
                upstream = torch.zeros_like(out) if grad_out is None else grad_out[:, start:end].float()
                found = torch.autograd.grad((out, exit_state), wrt, (upstream, grad_state), allow_unused=True)
        for total, piece in zip(grads, found[: len(inputs)]):
            if piece is not None:
                total[:, start:end] = piece
        if index > 0:
            grad_state = found[-1]
        elif entry_grad:
            grad_entry = found[-1]
    if q is None:
        grads.insert(0, k.new_empty(0))
    return (*grads, grad_entry)


@_backward.register_fake
def _(grad_out, grad_exit, q, k, v, g, beta, documents, previous_document, states, entry_grad):
    grad_q = k.new_empty(0) if q is None else torch.empty_like(q)
    grad_entry = torch.empty_like(states[:, 0]) if entry_grad else states.new_empty(0)
    return (grad_q, *(torch.empty_like(x) for x in (k, v, g, beta)), grad_entry)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, documents, _initial_state, previous_document = inputs
    ctx.has_q = q is not None
    ctx.entry_grad = entry_wants_grad(ctx, inputs)
    ctx.save_for_backward(q, k, v, g, beta, documents, previous_document, output[1])


def _autograd_backward(
    ctx, grad_out: torch.Tensor | None, _grad_states: torch.Tensor, grad_exit: torch.Tensor | None
):
    q, k, v, g, beta, documents, previous_document, states = ctx.saved_tensors
    grads = torch.ops.autopar.gated_delta_rule_backward(
        grad_out if ctx.has_q else None,
        grad_exit,
        q,
        k,
        v,
        g,
        beta,
        documents,
        previous_document,
        states,
        ctx.entry_grad,
    )
    grad_q, *middle, grad_entry = grads
    return (
        grad_q if ctx.has_q else None,
        *middle,
        None,
        grad_entry if ctx.entry_grad else None,
        None,
    )


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def delta_rule_map(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None = None,
    previous_document: torch.Tensor | None = None,
) -> torch.Tensor:
    """The affine map of a token range on the state, [M | U] (B, HK, HV / HK, dk, dk + dv)
    fp32: the range turns an entry state S into its exit state ``M S + U`` (M is zero when a
    document starts inside the range or at its first token). Arguments as ``DeltaRuleKernel.rule``."""
    entry = identity_entry(k, v)
    return torch.ops.autopar.gated_delta_rule(None, k, v, g, beta, documents, entry, previous_document)[2]


def identity_entry(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[I | 0] (B, HK, HV / HK, dk, dk + dv) fp32: the entry state whose exit is a range's map."""
    key_dim = k.shape[-1]
    identity = torch.eye(key_dim, key_dim + v.shape[-1], device=k.device, dtype=torch.float32)
    return identity.expand(state_shape(k, v, key_dim + v.shape[-1])).contiguous()


def state_shape(k: torch.Tensor, v: torch.Tensor, columns: int | None = None) -> tuple[int, ...]:
    """(B, HK, HV / HK, dk, c): the state of a run over k (B, S, HK, dk) and v (B, S, HV, dv),
    value heads grouped under the key head they read; c is dv, or ``columns`` for a state
    wider than v (a map's [M | U] has dk + dv)."""
    bsz, _, key_heads, key_dim = k.shape
    return (bsz, key_heads, v.shape[2] // key_heads, key_dim, v.shape[-1] if columns is None else columns)


def empty_exit_state(k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """The exit state a kernel's op returns, for its fake implementation: fp32, as wide as
    the entry state (as v without one)."""
    columns = None if initial_state is None else initial_state.shape[-1]
    return v.new_empty(state_shape(k, v, columns), dtype=torch.float32)


def entry_wants_grad(ctx, inputs: tuple) -> bool:
    """Whether a kernel's backward computes the entry state's gradient: one was given
    (``inputs`` are the forward op's: q, k, v, g, beta, documents, initial_state,
    previous_document) and autograd asks for it."""
    return inputs[6] is not None and ctx.needs_input_grad[6]


@dataclass(frozen=True)
class DeltaRuleKernel:
    """A delta-rule implementation as the model and context parallelism call it: ``rule``
    (from a zero or given entry state) and ``map`` as ``delta_rule_map``. ``forward`` is the
    kernel's custom op, taking ``rule``'s arguments, all given, and returning the outputs first."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, ...]]
    map: Callable[..., torch.Tensor]

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        documents: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        previous_document: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gated delta rule over a sequence, from a zero state or ``initial_state``.

        q, k (B, S, HK, dk) and v (B, S, HV, dv) in the compute dtype, HV a multiple of HK;
        g (B, S, HV) the log decay (<= 0, fp32) and beta (B, S, HV) the write strength;
        ``documents`` (B, S) int64 ids of packed documents (equal ids contiguous): the state
        restarts at each. ``initial_state`` (B, HK, HV / HK, dk, dv) fp32 enters at the first
        token if that token continues ``previous_document`` (B,), the document of the token
        before the sequence (default: the first token's own). Returns (B, S, HV, dv) in v's
        dtype; the recurrence runs in fp32.
        """
        return self.forward(q, k, v, g, beta, documents, initial_state, previous_document)[0]


AUTOPAR = DeltaRuleKernel("autopar", torch.ops.autopar.gated_delta_rule, delta_rule_map)
"""This module's kernel: plain torch, any device."""
gated_delta_rule = AUTOPAR.rule
"""``DeltaRuleKernel.rule`` by this module's kernel."""


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
