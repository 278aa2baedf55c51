"""FLA's Triton kernels for the gated delta rule, behind the same call as ours.

``training.delta_rule_kernel = "fla"`` runs flash-linear-attention's chunked kernels
(``fla-core`` 0.6; ``pip install 'autopar[fla]'``) in place of ``delta_rule.py``'s on CUDA.
Their math is the same rule: q and k L2-normed (eps 1e-6) and q scaled by ``dk ** -0.5``,
value head h reading key head ``h // (HV / HK)``, the state in fp32 and restarting at each
packed document, which FLA takes as variable-length sequences (``cu_seqlens`` over the
flattened batch).

FLA's public ``chunk_gated_delta_rule`` is an autograd function that ``torch.compile`` may not
enter (it is marked ``torch.compiler.disable``), so a compiled model would break its graph at
every DeltaNet layer. Here its forward and backward halves are two ``torch.library`` custom ops
with fake implementations, as ours are: the compiled graph calls them whole, ``fullgraph=True``
included. They call FLA's forward and backward functions (not its public entry point), which
is why the version is pinned; the forward keeps what FLA's own autograd function keeps (the
normed q and k with their reciprocal norms, the chunk-summed decay and the per-chunk solve A).

Context parallelism needs what ours gives it: a run from a given entry state, the exit
state, and gradients for both. FLA takes an initial state per sequence and returns its
gradient, and returns each sequence's final state and takes its gradient: the entry state
goes to each row's first sequence (if that row's first token continues ``previous_document``),
and a row's exit is its last sequence's final state. A range's map [M | U] is FLA's run from
[I | 0] with values [0 | v], as ours is (``delta_rule.delta_rule_map``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from autopar.models.qwen3_5.delta_rule import (
    DeltaRuleKernel,
    empty_exit_state,
    entry_wants_grad,
    identity_entry,
)

FLA_VERSION = "0.6"
"""The fla-core minor version whose internal forward and backward functions this calls."""
CHUNK = 64
"""FLA's chunk length; A holds one CHUNK-wide row per token and value head."""


BAD_HOPPER_TRITON = ((3, 4, 0), (3, 7, 1))
"""Triton releases in [first, last) whose gated ``chunk_bwd_dqkwg`` is wrong on Hopper (fla-core
issue #640): fla-core 0.6 raises in the first backward unless tilelang replaces it, so a job
would fail after building (seen on an H100 with torch 2.11's Triton, 2026-11-27)."""


def _release(version: str) -> tuple[int, ...]:
    """'3.6.0+git1234' -> (3, 6, 0)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def hopper_triton_problem(capability: tuple[int, int], triton_version: str, has_tilelang: bool) -> str | None:
    """Why FLA's backward cannot run on a GPU of ``capability`` with this Triton, else None."""
    first, last = BAD_HOPPER_TRITON
    if capability[0] != 9 or has_tilelang or not first <= _release(triton_version) < last:
        return None
    return (
        f"Triton {triton_version} gives wrong gradients in FLA's gated backward on Hopper (fla-core "
        "issue #640), and fla-core refuses it: install triton>=3.7.1 or tilelang (pip install tilelang)"
    )


def fla_version_problem() -> str | None:
    """Why FLA's kernels cannot run here (not installed, another version, a Triton it refuses
    on this GPU), else None."""
    try:
        import fla
    except ImportError as error:
        return f"flash-linear-attention is not importable ({error}); pip install 'autopar[fla]'"
    version = getattr(fla, "__version__", "unknown")
    if not version.startswith(FLA_VERSION + "."):
        return f"fla-core {version} is installed; autopar calls the internals of {FLA_VERSION}.x: pip install 'autopar[fla]'"
    if not torch.cuda.is_available():
        return None
    import importlib.util

    import triton

    has_tilelang = importlib.util.find_spec("tilelang") is not None
    return hopper_triton_problem(torch.cuda.get_device_capability(), triton.__version__, has_tilelang)


def _cu_seqlens(documents: Tensor) -> Tensor:
    """(B, S) document ids -> the start of every sequence in the flattened (1, B * S) batch,
    and its end: a new sequence at each row's first token and at each change of id."""
    bsz, seqlen = documents.shape
    flat = documents.flatten()
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seqlen] = True
    bounds = starts.nonzero().flatten()
    return torch.cat((bounds, bounds.new_tensor([bsz * seqlen])))


def _row_sequences(cu_seqlens: Tensor, bsz: int, seqlen: int) -> tuple[Tensor, Tensor]:
    """(index of each row's first sequence, of its last) among the flattened batch's."""
    rows = torch.arange(bsz, device=cu_seqlens.device) * seqlen
    first = torch.searchsorted(cu_seqlens, rows, right=True) - 1
    return first, torch.searchsorted(cu_seqlens, rows + seqlen - 1, right=True) - 1


def _flat(x: Tensor, varlen: bool) -> Tensor:
    """(B, S, ...) -> (1, B * S, ...) for FLA's variable-length path, contiguous either way."""
    x = x.contiguous()
    return x.flatten(0, 1)[None] if varlen else x


class _Layout:
    """How the batch's rows map to FLA's sequences: plain (one per row) or variable-length
    (``cu_seqlens`` over the flattened batch, with chunk indices and each row's first and
    last sequence)."""

    def __init__(self, documents: Tensor | None, previous_document: Tensor | None) -> None:
        self.varlen = documents is not None
        self.cu_seqlens = self.chunk_indices = self.first = self.last = None
        self.continues = None
        if documents is None:
            return
        from fla.ops.utils.index import prepare_chunk_indices

        bsz, seqlen = documents.shape
        self.cu_seqlens = _cu_seqlens(documents)
        self.chunk_indices = prepare_chunk_indices(self.cu_seqlens, CHUNK)
        self.first, self.last = _row_sequences(self.cu_seqlens, bsz, seqlen)
        before = documents[:, 0] if previous_document is None else previous_document
        self.continues = documents[:, 0] == before  # (B,) a row's first token takes the entry state

    def initial_states(self, entry: Tensor | None) -> Tensor | None:
        """(B, HK, R, dk, c) entry states -> FLA's (N, HV, dk, c), one per sequence."""
        if entry is None:
            return None
        per_row = entry.flatten(1, 2).contiguous()  # (B, HV, dk, c): value head h reads key head h // R
        if not self.varlen:
            return per_row
        states = per_row.new_zeros(len(self.cu_seqlens) - 1, *per_row.shape[1:])
        states[self.first] = per_row * self.continues[:, None, None, None]
        return states

    def entry_grads(self, grads: Tensor, like: Tensor) -> Tensor:
        """FLA's (N, HV, dk, c) initial-state gradients -> the (B, HK, R, dk, c) entry's."""
        per_row = grads if not self.varlen else grads[self.first] * self.continues[:, None, None, None]
        return per_row.reshape(like.shape).to(like.dtype)

    def exits(self, finals: Tensor, bsz: int, key_heads: int) -> Tensor:
        """FLA's (N, HV, dk, c) final states -> each row's exit state (B, HK, R, dk, c)."""
        per_row = finals if not self.varlen else finals[self.last]
        return per_row.unflatten(1, (key_heads, -1))

    def final_grads(self, grad_exit: Tensor | None, n: int) -> Tensor | None:
        """Each row's exit-state gradient (B, HK, R, dk, c) -> FLA's (N, HV, dk, c)."""
        if grad_exit is None:
            return None
        per_row = grad_exit.flatten(1, 2).float().contiguous()
        if not self.varlen:
            return per_row
        grads = per_row.new_zeros(n, *per_row.shape[1:])
        grads[self.last] = per_row
        return grads


@torch.library.custom_op("autopar::fla_gated_delta_rule", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    documents: Tensor | None,
    initial_state: Tensor | None,
    previous_document: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(output, exit state, then what backward needs: normed q, q's reciprocal norms, normed
    k, k's, chunk-summed decay, A), the tokens' in their input's (B, S, ...) layout."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    layout = _Layout(documents, previous_document)
    q_normed, q_rstd = l2norm_fwd(_flat(q, layout.varlen))
    k_normed, k_rstd = l2norm_fwd(_flat(k, layout.varlen))
    g_sum, out, solve, finals, *_ = chunk_gated_delta_rule_fwd(
        q=q_normed,
        k=k_normed,
        v=_flat(v, layout.varlen),
        g=_flat(g, layout.varlen),
        beta=_flat(beta, layout.varlen),
        scale=q.shape[-1] ** -0.5,
        initial_state=layout.initial_states(initial_state),
        output_final_state=True,
        cu_seqlens=layout.cu_seqlens,
        chunk_indices=layout.chunk_indices,
    )
    bsz, seqlen, key_heads = k.shape[:3]
    saved = (out.to(q.dtype), q_normed, q_rstd, k_normed, k_rstd, g_sum, solve)
    saved = tuple(x.reshape(bsz, seqlen, *x.shape[2:]) for x in saved)
    return saved[0], layout.exits(finals, bsz, key_heads), *saved[1:]


@_forward.register_fake
def _(q, k, v, g, beta, documents, initial_state, previous_document):
    bsz, seqlen, value_heads = g.shape
    exit_state = empty_exit_state(k, v, initial_state)
    q_rstd, k_rstd = (torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for x in (q, k))
    g_sum = torch.empty_like(g, dtype=torch.float32)
    solve = k.new_empty(bsz, seqlen, value_heads, CHUNK)
    out = v.new_empty(v.shape, dtype=q.dtype)
    return out, exit_state, torch.empty_like(q), q_rstd, torch.empty_like(k), k_rstd, g_sum, solve


@torch.library.custom_op("autopar::fla_gated_delta_rule_backward", mutates_args=())
def _backward(
    grad_out: Tensor | None,
    grad_exit: Tensor | None,
    q_normed: Tensor,
    q_rstd: Tensor,
    k_normed: Tensor,
    k_rstd: Tensor,
    v: Tensor,
    g_sum: Tensor,
    beta: Tensor,
    solve: Tensor,
    documents: Tensor | None,
    initial_state: Tensor | None,
    previous_document: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the raw q, k, v, the log decay g, beta and the entry state (empty
    without one)."""
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    layout = _Layout(documents, previous_document)
    flat = [_flat(x, layout.varlen) for x in (q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve)]
    q_flat, q_rstd_flat, k_flat, k_rstd_flat, v_flat, g_flat, beta_flat, solve_flat = flat
    initial = layout.initial_states(initial_state)
    sequences = q_flat.shape[0] if not layout.varlen else len(layout.cu_seqlens) - 1
    upstream = torch.zeros_like(v_flat) if grad_out is None else _flat(grad_out, layout.varlen)
    grad_q, grad_k, grad_v, grad_beta, grad_g, grad_initial, *_ = chunk_gated_delta_rule_bwd(
        q=q_flat,
        k=k_flat,
        v=v_flat,
        g=g_flat,
        beta=beta_flat,
        A=solve_flat,
        scale=q_normed.shape[-1] ** -0.5,
        initial_state=initial,
        do=upstream,
        dht=layout.final_grads(grad_exit, sequences),
        cu_seqlens=layout.cu_seqlens,
        chunk_indices=layout.chunk_indices,
    )
    grad_q = l2norm_bwd(q_flat, q_rstd_flat, grad_q)
    grad_k = l2norm_bwd(k_flat, k_rstd_flat, grad_k)
    grads = (grad_q, grad_k, grad_v, grad_g, grad_beta)
    likes = (q_normed, k_normed, v, g_sum, beta)
    grads = tuple(grad.reshape(like.shape).to(like.dtype) for grad, like in zip(grads, likes))
    entry = v.new_empty(0) if initial_state is None else layout.entry_grads(grad_initial, initial_state)
    return (*grads, entry)


@_backward.register_fake
def _(
    grad_out,
    grad_exit,
    q_normed,
    q_rstd,
    k_normed,
    k_rstd,
    v,
    g_sum,
    beta,
    solve,
    documents,
    initial_state,
    previous_document,
):
    grads = tuple(torch.empty_like(x) for x in (q_normed, k_normed, v, g_sum, beta))
    return (*grads, v.new_empty(0) if initial_state is None else torch.empty_like(initial_state))


def _setup_context(ctx, inputs, output) -> None:
    _q, _k, v, g, beta, documents, initial_state, previous_document = inputs
    _out, _exit, q_normed, q_rstd, k_normed, k_rstd, g_sum, solve = output
    ctx.g_dtype = g.dtype
    ctx.entry_grad = entry_wants_grad(ctx, inputs)
    saved = (
        q_normed,
        q_rstd,
        k_normed,
        k_rstd,
        v,
        g_sum,
        beta,
        solve,
        documents,
        initial_state,
        previous_document,
    )
    ctx.save_for_backward(*saved)


def _autograd_backward(ctx, grad_out: Tensor | None, grad_exit: Tensor | None, *_unused):
    saved = ctx.saved_tensors
    upstream = None if grad_out is None else grad_out.contiguous()
    grad_q, grad_k, grad_v, grad_g, grad_beta, grad_entry = torch.ops.autopar.fla_gated_delta_rule_backward(
        upstream, grad_exit, *saved
    )
    entry = grad_entry if ctx.entry_grad else None
    return grad_q, grad_k, grad_v, grad_g.to(ctx.g_dtype), grad_beta, None, entry, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def fla_delta_rule_map(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    documents: Tensor | None = None,
    previous_document: Tensor | None = None,
) -> Tensor:
    """``delta_rule.delta_rule_map`` by FLA's kernels: the run from [I | 0] with values
    [0 | v] (k stands in for the queries, whose output is not used)."""
    values = torch.cat((v.new_zeros(*v.shape[:-1], k.shape[-1]), v), dim=-1)
    entry = identity_entry(k, v)
    return torch.ops.autopar.fla_gated_delta_rule(k, k, values, g, beta, documents, entry, previous_document)[
        1
    ]


FLA = DeltaRuleKernel("fla", torch.ops.autopar.fla_gated_delta_rule, fla_delta_rule_map)
"""FLA's kernels, as ``delta_rule.AUTOPAR`` is ours."""
fla_gated_delta_rule = FLA.rule
"""``DeltaRuleKernel.rule`` by FLA's kernels: the same arguments and result as ours."""
