"""The gated delta rule (Gated DeltaNet's recurrence): the kernels' contract, and ours.

Per value head h, reading key head ``h // (HV / HK)``, with q and k L2-normed and q scaled
by ``dk ** -0.5``, the fp32 state S (dk x dv) runs over the tokens t::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

and restarts from zero where a packed document starts. Chunks of ``CHUNK`` tokens turn the
recurrence into matmuls (the UT transform: a unit lower-triangular solve per chunk), batched
over every chunk at once (``delta_rule_chunks.py``), and only the state crosses from chunk to
chunk, in two passes (``delta_rule_passes.py``): ``autopar`` runs them in torch (any device),
``triton`` as Triton programs (``triton_delta_rule.py``).

Memory is why a kernel is an op of its own rather than autograd over the chunk math:
autograd would keep every chunk's pairwise decays, Gram matrices and solves (transformers'
torch reference keeps about 15x its inputs). Here the forward keeps its inputs and the state
entering each segment of ``SEGMENT`` tokens (fp32, dk x dv per value head), and the
backward recomputes one segment at a time, newest first, carrying the state's gradient
back. The two are ``torch.library`` custom ops with fake implementations, so compiled graphs
call them without a graph break and without unrolling the chunk loop for each length.

The rule is affine in the state it starts from: a token range maps an entry state S to
``M S + U`` (M dk x dk, U dk x dv per value head, fp32, whatever the range's length).
A kernel's ``map`` computes [M | U] by running the same kernel from [I | 0] with values
[0 | v]; context parallelism combines the ranks' maps into each rank's entry state and then
runs the kernel's ``rule`` from it (``autopar/parallel/state_passing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from autopar.models.qwen3_5.delta_rule_chunks import CHUNK, l2norm
from autopar.models.qwen3_5.delta_rule_passes import TORCH_PASSES, ChunkedRule

SEGMENT = 8 * CHUNK
"""Tokens recomputed together in backward by the ``autopar`` kernel; one fp32 state per
segment is kept from forward."""


def state_shape(k: Tensor, v: Tensor, columns: int | None = None) -> tuple[int, ...]:
    """(B, HK, HV / HK, dk, c): the state of a run over k (B, S, HK, dk) and v (B, S, HV, dv),
    value heads grouped under the key head they read; c is dv, or ``columns`` for a state
    wider than v (a map's [M | U] has dk + dv)."""
    bsz, _, key_heads, key_dim = k.shape
    return (bsz, key_heads, v.shape[2] // key_heads, key_dim, v.shape[-1] if columns is None else columns)


def identity_entry(k: Tensor, v: Tensor) -> Tensor:
    """[I | 0] (B, HK, HV / HK, dk, dk + dv) fp32: the entry state whose exit is a range's map."""
    key_dim = k.shape[-1]
    identity = torch.eye(key_dim, key_dim + v.shape[-1], device=k.device, dtype=torch.float32)
    return identity.expand(state_shape(k, v, key_dim + v.shape[-1])).contiguous()


def empty_exit_state(k: Tensor, v: Tensor, initial_state: Tensor | None) -> Tensor:
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
    (from a zero or given entry state) and ``map`` (a token range's [M | U] (B, HK, HV / HK,
    dk, dk + dv) fp32: the range turns an entry state S into its exit state ``M S + U``; M is
    zero when a document starts inside the range or at its first token; arguments k, v, g,
    beta, documents, previous_document as ``rule``'s). ``forward`` is the kernel's custom
    op, taking ``rule``'s arguments, all given, and returning the outputs first."""

    name: str
    forward: Callable[..., tuple[Tensor, ...]]
    map: Callable[..., Tensor]

    def rule(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        documents: Tensor | None = None,
        initial_state: Tensor | None = None,
        previous_document: Tensor | None = None,
    ) -> Tensor:
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


def _chunked_ops(op_name: str, rule: ChunkedRule):
    """``rule`` as the custom ops ``autopar::{op_name}`` (forward: outputs, the state entering
    each segment, the exit state) and ``autopar::{op_name}_backward``, with fake kernels."""

    def forward(
        q: Tensor | None,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        documents: Tensor | None,
        initial_state: Tensor | None,
        previous_document: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        state = (
            v.new_zeros(state_shape(k, v), dtype=torch.float32) if initial_state is None else initial_state
        )
        return rule.forward(q, k, v, g, beta, documents, state, previous_document)

    def fake_forward(q, k, v, g, beta, documents, initial_state, previous_document):
        exit_state = empty_exit_state(k, v, initial_state)
        states = exit_state.new_empty(k.shape[0], rule.segments(k.shape[1]), *exit_state.shape[1:])
        return (v.new_empty(0) if q is None else torch.empty_like(v)), states, exit_state

    def backward(
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
        entry_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Gradients of q (empty without q), k, v, g, beta and, with ``entry_grad``, of the
        initial state (else empty)."""
        grads, grad_entry = rule.backward(
            grad_out, grad_exit, q, k, v, g, beta, documents, previous_document, states
        )
        if q is None:
            grads.insert(0, k.new_empty(0))
        return (*grads, grad_entry if entry_grad else states.new_empty(0))

    def fake_backward(
        grad_out, grad_exit, q, k, v, g, beta, documents, previous_document, states, entry_grad
    ):
        grad_q = k.new_empty(0) if q is None else torch.empty_like(q)
        grad_entry = torch.empty_like(states[:, 0]) if entry_grad else states.new_empty(0)
        return (grad_q, *(torch.empty_like(x) for x in (k, v, g, beta)), grad_entry)

    forward_op = torch.library.custom_op(f"autopar::{op_name}", forward, mutates_args=())
    forward_op.register_fake(fake_forward)
    backward_op = torch.library.custom_op(f"autopar::{op_name}_backward", backward, mutates_args=())
    backward_op.register_fake(fake_backward)
    return forward_op, backward_op


def _register_autograd(forward_op, backward_op) -> None:
    """The forward op's backward: the backward op, from its inputs and the segment states."""

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, g, beta, documents, _initial_state, previous_document = inputs
        ctx.has_q = q is not None
        ctx.entry_grad = entry_wants_grad(ctx, inputs)
        ctx.save_for_backward(q, k, v, g, beta, documents, previous_document, output[1])

    def autograd_backward(ctx, grad_out: Tensor | None, _grad_states, grad_exit: Tensor | None):
        q, k, v, g, beta, documents, previous_document, states = ctx.saved_tensors
        upstream = grad_out if ctx.has_q else None
        grads = backward_op(
            upstream, grad_exit, q, k, v, g, beta, documents, previous_document, states, ctx.entry_grad
        )
        grad_q, *middle, grad_entry = grads
        return (grad_q if ctx.has_q else None, *middle, None, grad_entry if ctx.entry_grad else None, None)

    forward_op.register_autograd(autograd_backward, setup_context=setup_context)


def chunked_kernel(name: str, op_name: str, rule: ChunkedRule) -> DeltaRuleKernel:
    """Register ``rule`` as the custom ops ``autopar::{op_name}`` and
    ``autopar::{op_name}_backward``, with fake implementations and autograd, and return the
    kernel ``name`` that calls them."""
    forward_op, backward_op = _chunked_ops(op_name, rule)
    _register_autograd(forward_op, backward_op)

    def delta_rule_map(
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        documents: Tensor | None = None,
        previous_document: Tensor | None = None,
    ) -> Tensor:
        return forward_op(None, k, v, g, beta, documents, identity_entry(k, v), previous_document)[2]

    # the op's packet, not its definition: a model holding the kernel stays deep-copyable
    return DeltaRuleKernel(name, getattr(torch.ops.autopar, op_name), delta_rule_map)


AUTOPAR = chunked_kernel("autopar", "gated_delta_rule", ChunkedRule(TORCH_PASSES, SEGMENT))
"""Our kernel in plain torch, any device: the reference the others are held to."""
gated_delta_rule = AUTOPAR.rule
"""``DeltaRuleKernel.rule`` by this module's kernel."""
delta_rule_map = AUTOPAR.map
"""``DeltaRuleKernel.map`` by this module's kernel."""


def reference_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    documents: Tensor | None = None,
    initial_state: Tensor | None = None,
    previous_document: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token in ``dtype``: the definition the chunked kernels must
    equal. Arguments as ``DeltaRuleKernel.rule``; returns (outputs (B, S, HV, dv), the exit
    state (B, HK, HV / HK, dk, dv)), both in ``dtype``."""
    bsz, seqlen, key_heads, key_dim = k.shape
    groups = v.shape[2] // key_heads
    q = (l2norm(q.to(dtype)) * key_dim**-0.5).repeat_interleave(groups, dim=2)  # (B, S, HV, dk)
    k = l2norm(k.to(dtype)).repeat_interleave(groups, dim=2)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    state = v.new_zeros(bsz, v.shape[2], key_dim, v.shape[-1])  # (B, HV, dk, dv)
    if initial_state is not None:
        state = initial_state.to(dtype).flatten(1, 2)
    outputs = []
    for t in range(seqlen):
        if documents is not None:
            before = (
                documents[:, t - 1]
                if t
                else documents[:, 0]
                if previous_document is None
                else previous_document
            )
            state = state * (documents[:, t] == before)[:, None, None, None]  # a document starts: S = 0
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - (state * k[:, t, :, :, None]).sum(-2))  # (B, HV, dv)
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1), state.unflatten(1, (key_heads, groups))  # (B, S, HV, dv)
