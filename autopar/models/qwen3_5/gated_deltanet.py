"""Qwen3.5's Gated DeltaNet layer (``linear_attn``), single-device and plan-free.

HF fuses the q, k and v projections (``in_proj_qkv``) and their convolution (``conv1d``),
laid out [q | k | v] section-major. We keep the three apart (``in_proj_q/k/v``,
``core.conv_q/k/v``; the HF adapter splits and joins them), so that a tensor-parallel plan
shards every one of them by head with a plain ``Shard(0)``: sharding HF's fused rows
evenly would hand one rank all of q and part of k.

Everything that acts per head on the projections' outputs (the causal convolution, the
decay and write strength, the delta rule) sits in ``DeltaRuleCore``, whose parameters are
all per head (dim 0) and whose ``compute`` takes them as arguments, so a plan can run it on
a rank's local heads. The two steps that read along the sequence, the convolution and the
delta rule, go through the core's ``sequence`` (``WholeSequence`` here), which context
parallelism replaces with one that spans the ranks' shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import AUTOPAR, DeltaRuleKernel


def causal_conv(x: Tensor, weight: Tensor, documents: Tensor | None) -> Tensor:
    """Depthwise causal convolution along the sequence: x (B, S, C), weight (C, 1, K) as HF's
    ``conv1d``; token t sees tokens t-K+1..t of its own document (``documents`` (B, S) ids)."""
    width = weight.shape[-1]
    padded = F.pad(x, (0, 0, width - 1, 0))  # (B, S + K - 1, C)
    seqlen = x.shape[1]
    taps = weight[:, 0].to(x.dtype)  # (C, K), tap K-1 reads the token itself
    out = x * taps[:, -1]
    if documents is not None:
        padded_docs = F.pad(documents, (width - 1, 0), value=-1)  # (B, S + K - 1)
    for back in range(1, width):
        shifted = padded[:, width - 1 - back : width - 1 - back + seqlen]  # token t - back
        if documents is not None:
            same = padded_docs[:, width - 1 - back : width - 1 - back + seqlen] == documents  # (B, S)
            shifted = shifted * same[..., None]
        out = out + shifted * taps[:, -1 - back]
    return out


class WholeSequence:
    """The steps that read along the sequence, for a sequence held whole by this process;
    ``kernel`` runs the delta rule (``training.delta_rule_kernel`` may swap in FLA's)."""

    def __init__(self, kernel: DeltaRuleKernel = AUTOPAR) -> None:
        self.kernel = kernel

    @staticmethod
    def convolve(
        inputs: tuple[Tensor, ...], weights: tuple[Tensor, ...], documents: Tensor | None
    ) -> tuple[Tensor, ...]:
        """``causal_conv`` of each input (B, S, C_i) with its weight."""
        return tuple(causal_conv(x, w, documents) for x, w in zip(inputs, weights))

    def delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, documents: Tensor | None
    ) -> Tensor:
        """The kernel's rule over the sequence from a zero state."""
        return self.kernel.rule(q, k, v, g, beta, documents)


class DeltaRuleCore(nn.Module):
    """Convolution + SiLU, decay and write strength, and the gated delta rule, per head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        key_channels = args.linear_num_key_heads * args.linear_key_head_dim
        value_channels = args.linear_num_value_heads * args.linear_value_head_dim
        width = args.linear_conv_kernel_dim
        self.key_head_dim = args.linear_key_head_dim
        self.value_head_dim = args.linear_value_head_dim
        self.conv_q = nn.Parameter(torch.empty(key_channels, 1, width))
        self.conv_k = nn.Parameter(torch.empty(key_channels, 1, width))
        self.conv_v = nn.Parameter(torch.empty(value_channels, 1, width))
        self.A_log = nn.Parameter(torch.empty(args.linear_num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(args.linear_num_value_heads))
        self.sequence: WholeSequence = WholeSequence()
        """Runs the convolution and the delta rule; context parallelism swaps in its own."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        return self.compute(q, k, v, a, b, documents, *self.parameters(recurse=False))

    def compute(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        a: Tensor,
        b: Tensor,
        documents: Tensor | None,
        conv_q: Tensor,
        conv_k: Tensor,
        conv_v: Tensor,
        A_log: Tensor,
        dt_bias: Tensor,
    ) -> Tensor:
        """q, k (B, S, HK * dk), v (B, S, HV * dv), a, b (B, S, HV) -> (B, S, HV, dv); the
        weights as arguments, in registration order (a plan passes a rank's local heads)."""
        bsz, seqlen, _ = q.shape
        convolved = self.sequence.convolve((q, k, v), (conv_q, conv_k, conv_v), documents)
        q, k, v = (F.silu(x) for x in convolved)
        q = q.view(bsz, seqlen, -1, self.key_head_dim)  # (B, S, HK, dk)
        k = k.view(bsz, seqlen, -1, self.key_head_dim)  # (B, S, HK, dk)
        v = v.view(bsz, seqlen, -1, self.value_head_dim)  # (B, S, HV, dv)
        beta = b.sigmoid()  # (B, S, HV)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # (B, S, HV) fp32 log decay
        return self.sequence.delta_rule(q, k, v, g, beta, documents)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (plain gain, weight starts at 1), gated by SiLU(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Projections -> ``DeltaRuleCore`` -> gated per-head RMSNorm -> ``out_proj``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.hidden_size
        key_channels = args.linear_num_key_heads * args.linear_key_head_dim
        value_channels = args.linear_num_value_heads * args.linear_value_head_dim
        self.value_head_dim = args.linear_value_head_dim
        self.in_proj_q = nn.Linear(hidden, key_channels, bias=False)
        self.in_proj_k = nn.Linear(hidden, key_channels, bias=False)
        self.in_proj_v = nn.Linear(hidden, value_channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_channels, bias=False)
        self.in_proj_b = nn.Linear(hidden, args.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, args.linear_num_value_heads, bias=False)
        self.core = DeltaRuleCore(args)
        self.norm = GatedRMSNorm(args.linear_value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(value_channels, hidden, bias=False)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """x (B, S, H); ``documents`` (B, S) packed-document ids: the state and the
        convolution restart at each document."""
        bsz, seqlen, _ = x.shape
        out = self.core(
            self.in_proj_q(x),
            self.in_proj_k(x),
            self.in_proj_v(x),
            self.in_proj_a(x),
            self.in_proj_b(x),
            documents,
        )  # (B, S, HV, dv)
        z = self.in_proj_z(x).view(bsz, seqlen, -1, self.value_head_dim)  # (B, S, HV, dv)
        out = self.norm(out, z).reshape(bsz, seqlen, -1)  # (B, S, HV * dv)
        return self.out_proj(out)
