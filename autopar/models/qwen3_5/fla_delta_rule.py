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
"""

from __future__ import annotations

import torch

from autopar.models.qwen3_5.gated_deltanet import WholeSequence

FLA_VERSION = "0.6"
"""The fla-core minor version whose internal forward and backward functions this calls."""
CHUNK = 64
"""FLA's chunk length; A holds one CHUNK-wide row per token and value head."""


def fla_version_problem() -> str | None:
    """Why FLA's kernels cannot run here (not installed, another version), else None."""
    try:
        import fla
    except ImportError as error:
        return f"flash-linear-attention is not importable ({error}); pip install 'autopar[fla]'"
    version = getattr(fla, "__version__", "unknown")
    if not version.startswith(FLA_VERSION + "."):
        return f"fla-core {version} is installed; autopar calls the internals of {FLA_VERSION}.x: pip install 'autopar[fla]'"
    return None


def _cu_seqlens(documents: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> the start of every sequence in the flattened (1, B * S) batch,
    and its end: a new sequence at each row's first token and at each change of id."""
    bsz, seqlen = documents.shape
    flat = documents.flatten()
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seqlen] = True
    bounds = starts.nonzero().flatten()
    return torch.cat((bounds, bounds.new_tensor([bsz * seqlen])))


def _flat(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    """(B, S, ...) -> (1, B * S, ...) for FLA's variable-length path, contiguous either way."""
    x = x.contiguous()
    return x.flatten(0, 1)[None] if varlen else x


def _indices(documents: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    from fla.ops.utils.index import prepare_chunk_indices

    if documents is None:
        return None, None
    cu_seqlens = _cu_seqlens(documents)
    return cu_seqlens, prepare_chunk_indices(cu_seqlens, CHUNK)


@torch.library.custom_op("autopar::fla_gated_delta_rule", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, normed q, q's reciprocal norms, normed k, k's, chunk-summed decay, A), each in
    its input's (B, S, ...) layout."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    varlen = documents is not None
    cu_seqlens, chunk_indices = _indices(documents)
    q_normed, q_rstd = l2norm_fwd(_flat(q, varlen))
    k_normed, k_rstd = l2norm_fwd(_flat(k, varlen))
    g_sum, out, solve, *_ = chunk_gated_delta_rule_fwd(
        q=q_normed,
        k=k_normed,
        v=_flat(v, varlen),
        g=_flat(g, varlen),
        beta=_flat(beta, varlen),
        scale=q.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    saved = (out.to(q.dtype), q_normed, q_rstd, k_normed, k_rstd, g_sum, solve)
    bsz, seqlen = q.shape[:2]
    return tuple(x.reshape(bsz, seqlen, *x.shape[2:]) for x in saved)


@_forward.register_fake
def _(q, k, v, g, beta, documents):
    bsz, seqlen, value_heads = g.shape
    norms = (torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for x in (q, k))
    q_rstd, k_rstd = norms
    g_sum = torch.empty_like(g, dtype=torch.float32)
    solve = k.new_empty(bsz, seqlen, value_heads, CHUNK)
    return (
        v.new_empty(v.shape, dtype=q.dtype),
        torch.empty_like(q),
        q_rstd,
        torch.empty_like(k),
        k_rstd,
        g_sum,
        solve,
    )


@torch.library.custom_op("autopar::fla_gated_delta_rule_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor,
    q_normed: torch.Tensor,
    q_rstd: torch.Tensor,
    k_normed: torch.Tensor,
    k_rstd: torch.Tensor,
    v: torch.Tensor,
    g_sum: torch.Tensor,
    beta: torch.Tensor,
    solve: torch.Tensor,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the raw q, k, v, the log decay g and beta."""
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    varlen = documents is not None
    cu_seqlens, chunk_indices = _indices(documents)
    flat = [_flat(x, varlen) for x in (q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve)]
    q_flat, q_rstd_flat, k_flat, k_rstd_flat, v_flat, g_flat, beta_flat, solve_flat = flat
    grad_q, grad_k, grad_v, grad_beta, grad_g, *_ = chunk_gated_delta_rule_bwd(
        q=q_flat,
        k=k_flat,
        v=v_flat,
        g=g_flat,
        beta=beta_flat,
        A=solve_flat,
        scale=q_normed.shape[-1] ** -0.5,
        initial_state=None,
        do=_flat(grad_out, varlen),
        dht=None,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    grad_q = l2norm_bwd(q_flat, q_rstd_flat, grad_q)
    grad_k = l2norm_bwd(k_flat, k_rstd_flat, grad_k)
    grads = (grad_q, grad_k, grad_v, grad_g, grad_beta)
    likes = (q_normed, k_normed, v, g_sum, beta)
    return tuple(grad.reshape(like.shape).to(like.dtype) for grad, like in zip(grads, likes))


@_backward.register_fake
def _(grad_out, q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve, documents):
    return tuple(torch.empty_like(x) for x in (q_normed, k_normed, v, g_sum, beta))


def _setup_context(ctx, inputs, output) -> None:
    _q, _k, v, g, beta, documents = inputs
    _out, q_normed, q_rstd, k_normed, k_rstd, g_sum, solve = output
    ctx.g_dtype = g.dtype
    ctx.save_for_backward(q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve, documents)


def _autograd_backward(ctx, grad_out: torch.Tensor, *_unused: torch.Tensor | None):
    q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve, documents = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_g, grad_beta = torch.ops.autopar.fla_gated_delta_rule_backward(
        grad_out.contiguous(), q_normed, q_rstd, k_normed, k_rstd, v, g_sum, beta, solve, documents
    )
    return grad_q, grad_k, grad_v, grad_g.to(ctx.g_dtype), grad_beta, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta_rule.gated_delta_rule`` from a zero state, by FLA's kernels: the same arguments
    (q, k (B, S, HK, dk), v (B, S, HV, dv), g and beta (B, S, HV), documents (B, S)) and the
    same (B, S, HV, dv) result in q's dtype."""
    return torch.ops.autopar.fla_gated_delta_rule(q, k, v, g, beta, documents)[0]


class FlaKernels(WholeSequence):
    """``WholeSequence`` with FLA's delta rule (the convolution stays ours: compile fuses it)."""

    delta_rule = staticmethod(fla_gated_delta_rule)
