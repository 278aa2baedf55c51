"""Qwen2.5 / Qwen3 dense decoder, single-device and free of any parallel code.

Plans in ``autopar.parallel`` parallelize this module after construction. To let them, the
code here follows three rules: shapes come from tensors (``view(..., -1, head_dim)``), never
from head counts, so a tensor-parallel shard with fewer heads still works; rotary positions
can be passed in, so a context-parallel shard knows where its tokens sit; and every top-level
part may be ``None``, so a pipeline stage is this same class with parts removed and keeps
its parameter names.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.models.args import ModelArgs
from autopar.models.moe import MoE


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (as HF Qwen does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * self.normalized(x).to(x.dtype)

    def normalized(self, x: Tensor) -> Tensor:
        """``x`` in fp32 divided by its root mean square (before any weight)."""
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary_cos_sin(
    positions: Tensor, head_dim: int, theta: float, yarn: ModelArgs | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables for ``positions`` in fp32, shape (*positions.shape, head_dim).

    ``yarn``: the args of a ``rope_type='yarn'`` model, whose frequencies are blended and
    tables scaled by YaRN (transformers' ``_compute_yarn_parameters``)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    scale = 1.0
    if yarn is not None:
        inv_freq, scale = _yarn_frequencies(theta**exponent, yarn, head_dim)
    freqs = positions.float()[..., None] * inv_freq  # (..., S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., S, D)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def _yarn_frequencies(wavelengths: Tensor, args: ModelArgs, dim: int) -> tuple[Tensor, float]:
    """YaRN's inverse frequencies from ``wavelengths`` = theta ** (2i / dim), and its scale of
    cos and sin: fast dims kept, slow ones divided by the factor, a linear ramp between."""
    low, high = args.yarn_ramp(dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    index = torch.arange(dim // 2, device=wavelengths.device, dtype=torch.float32)
    kept = 1 - ((index - low) / (high - low)).clamp(0, 1)  # (D/2,) 1: extrapolated, 0: interpolated
    extrapolated = 1.0 / wavelengths
    interpolated = 1.0 / (args.rope_factor * wavelengths)
    return interpolated * (1 - kept) + extrapolated * kept, args.yarn_attention_factor


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, S, H, D) by the half-split RoPE layout HF checkpoints use."""
    cos = cos.to(x.dtype).unsqueeze(-2)  # (S, 1, D) or (B, S, 1, D)
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, S, H, D)
    return x * cos + rotated * sin


def document_positions(documents: Tensor) -> Tensor:
    """RoPE positions that restart at 0 where each packed document starts (Megatron's
    reset_position_ids); ``documents`` (B, S) holds each token's document id, equal ids
    contiguous."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (B, S) start of each token's document
    return index - first


def document_mask(documents: Tensor) -> Tensor:
    """(B, 1, S, S) boolean SDPA mask: a token sees the earlier tokens of its own document
    (Megatron's reset_attention_mask)."""
    seqlen = documents.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]  # (B, S, S)
    return (same & causal)[:, None]


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Expand (B, Hkv, S, D) to (B, Hkv * n_rep, S, D) so every query head has its k/v."""
    if n_rep == 1:
        return x
    bsz, kv_heads, seqlen, head_dim = x.shape
    x = x[:, :, None].expand(bsz, kv_heads, n_rep, seqlen, head_dim)  # (B, Hkv, R, S, D)
    return x.reshape(bsz, kv_heads * n_rep, seqlen, head_dim)  # (B, H, S, D)


class ScaledDotProduct(nn.Module):
    """The attention kernel's call: parameter-free, so that a plan can swap in another (a pinned
    SDPA backend, expanded k/v heads) and the model's repr shows which one runs.

    ``native_gqa``: query heads share their k/v head inside SDPA (``enable_gqa``), so no
    expanded k/v copy is made or saved. Where the kernel that would run has no grouped-query
    support (CUDA's memory-efficient one) the copies are made here instead
    (``parallel.sdpa_backend.native_gqa`` decides per job and device).
    """

    def __init__(self, native_gqa: bool = True) -> None:
        super().__init__()
        self.native_gqa = native_gqa

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """q (B, Hq, S, D), k and v (B, Hkv, S, D) -> (B, Hq, S, D); causal unless ``mask``."""
        n_rep = q.shape[1] // k.shape[1]
        gqa = n_rep > 1 and self.native_gqa
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def extra_repr(self) -> str:
        return f"native_gqa={self.native_gqa}"


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; Qwen3 adds a per-head RMSNorm on q and k.

    Qwen3.5's ``GatedAttention`` is this with ``queries=2`` (a gate beside each query head),
    RoPE on the first ``rotary_dim`` dims, a biased ``o_proj`` and zero-centred norms."""

    def __init__(
        self,
        args: ModelArgs,
        *,
        queries: int = 1,
        rotary_dim: int | None = None,
        output_bias: bool = False,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.rotary_dim = args.head_dim if rotary_dim is None else rotary_dim
        self.rope_theta = args.rope_theta
        self.yarn = args if args.rope_type == "yarn" else None
        q_out = args.num_attention_heads * args.head_dim
        kv_out = args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, queries * q_out, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=output_bias)
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.sdpa = ScaledDotProduct()

    def forward(self, x: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """``mask``: a boolean (B, 1, S, S) attention mask replacing the causal one."""
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, Hq, D)
        out = self.attend(x, q, positions, mask)  # (B, S, Hq, D)
        return self.o_proj(out.reshape(bsz, seqlen, -1))  # (B, S, H)

    def attend(self, x: Tensor, q: Tensor, positions: Tensor | None, mask: Tensor | None) -> Tensor:
        """The heads' outputs (B, S, Hq, D) for queries ``q`` (B, S, Hq, D) over the keys and
        values of ``x`` (B, S, H): q/k norms, RoPE, then the kernel."""
        bsz, seqlen, _ = x.shape
        k = self.k_proj(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.v_proj(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, Hkv, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if positions is None:
            positions = torch.arange(seqlen, device=x.device)
        cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rope_theta, self.yarn)
        q = self.rotate(q, cos, sin).transpose(1, 2)  # (B, Hq, S, D)
        k = self.rotate(k, cos, sin).transpose(1, 2)  # (B, Hkv, S, D)
        return self.sdpa(q, k, v.transpose(1, 2), mask).transpose(1, 2)  # (B, S, Hq, D)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on the first ``rotary_dim`` dims of each head of ``x`` (B, S, H, D)."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        turned, kept = x.split((self.rotary_dim, self.head_dim - self.rotary_dim), dim=-1)
        return torch.cat((apply_rotary(turned, cos, sin), kept), dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = args.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + mixer(norm(x)), then + mlp(norm(.)). With a mixture of
    experts as its mlp it also returns the routing statistics (see ``moe.MoE``).

    The token mixer is attention (``self_attn``), or a layer that carries state along the
    sequence (``linear_attn``, Qwen3.5's Gated DeltaNet), whichever is not None. A family with
    other parts (``HybridBlock``) names its norm and MoE classes and overrides ``add_mixer``;
    the residual structure stays here."""

    norm_type: type[RMSNorm] = RMSNorm
    moe_type: type[MoE] = MoE

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = self.norm_type(args.hidden_size, args.rms_norm_eps)
        self.add_mixer(args, layer)
        self.post_attention_layernorm = self.norm_type(args.hidden_size, args.rms_norm_eps)
        self.mlp: MLP | MoE = self.moe_type(args) if args.is_moe_layer(layer) else MLP(args)

    def add_mixer(self, args: ModelArgs, layer: int) -> None:
        """Register the token mixer of ``layer``."""
        self.linear_attn: nn.Module | None = None
        self.self_attn: nn.Module | None = Attention(args)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``mask`` (and ``positions``) are what attention reads; ``documents`` (B, S), the ids
        behind them, what ``linear_attn`` reads: its state restarts at each document."""
        normed = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = x + self.linear_attn(normed, documents)
        else:
            h = x + self.self_attn(normed, positions, mask)
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            return h + out[0], out[1]
        return h + out


def canonical_name(name: str) -> str:
    """A parameter name with wrapper prefixes (activation checkpointing, compile) removed."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def dense_start(args: ModelArgs, name: str, out: Tensor, generator: torch.Generator) -> Tensor:
    """Fill ``out`` (fp32) with the start of parameter ``name`` (canonical): norms 1, biases 0,
    other weights normal(0, ``initializer_range``), residual projections with the
    depth-scaled std of GPT-2 / Megatron."""
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if name.endswith(".bias"):
        return out.zero_()
    std = args.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std /= math.sqrt(2 * args.num_hidden_layers)
    return out.normal_(0.0, std, generator=generator)


def named_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded by (seed, parameter name): a value drawn from it depends on nothing
    else (not on the plan, nor on which parameters a rank holds)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return generator


class Qwen(nn.Module):
    """Embeddings -> blocks -> norm -> lm_head; ``forward(tokens) -> logits``.

    Parameter names follow HF checkpoints without the ``model.`` prefix, so the HF adapter is
    a prefix mapping. A part set to ``None`` is skipped: with no embedding the input is
    already hidden states, with no head the output is hidden states. A family with other
    blocks and their norm names its ``block_type`` (``Qwen35``).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.check()
        self.args = args
        self.embed_tokens: nn.Embedding | None = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.make_block(args, i) for i in range(args.num_hidden_layers)})
        self.norm: nn.Module | None = self.make_norm(args)
        self.lm_head: nn.Linear | None = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    block_type: type[Block] = Block
    """The family's block; its ``norm_type`` is the final norm's too."""

    def make_block(self, args: ModelArgs, layer: int) -> nn.Module:
        return self.block_type(args, layer)

    def make_norm(self, args: ModelArgs) -> nn.Module:
        return self.block_type.norm_type(args.hidden_size, args.rms_norm_eps)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the head when tied (``to_empty`` unties them)."""
        if self.args.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: Tensor,
        routing: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tokens (B, S) int64, or hidden (B, S, H) for a stage without embeddings.

        ``documents`` (B, S): the id of the packed document each token belongs to; attention
        then stays within a document and RoPE positions restart at each (unless ``positions``
        are given).

        A mixture-of-experts model returns ``(output, routing)``: the routing statistics of
        its MoE layers summed (B, 2, E), added to those of earlier pipeline stages
        (``routing``), so the last stage holds the whole model's (``moe.load_balancing_loss``).
        """
        h, routing = self.trunk(tokens, routing, positions=positions, documents=documents)
        out = self.lm_head(h) if self.lm_head is not None else h  # (B, S, V)
        return self.with_routing(out, routing, h)

    def with_routing(
        self, out: Tensor, routing: Tensor | None, hidden: Tensor
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``out``, and for a mixture of experts its routing statistics (B, 2, E) (zeros where
        no expert ran yet: a stage of dense layers only), as ``forward`` returns them."""
        if not self.args.moe:
            return out
        if routing is None:
            routing = hidden.new_zeros(hidden.shape[0], 2, self.args.num_experts, dtype=torch.float32)
        return out, routing

    def trunk(
        self,
        tokens: Tensor,
        routing: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``forward`` up to the head: the final-normed hidden states (B, S, H) and the routing
        statistics so far (None without experts). Heads that read the hidden states (Qwen3.5's
        multi-token prediction) start here."""
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens  # (B, S, H)
        return self.decode(h, routing, positions=positions, documents=documents)

    def decode(
        self,
        h: Tensor,
        routing: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``trunk`` from the embedded tokens (B, S, H) on: the blocks and the final norm. A
        forward that reads the embeddings again (Qwen3.5's head) embeds once and calls this,
        so the embedding runs once per forward (one FSDP gather, one gradient)."""
        mask = None
        if documents is not None:
            mask = document_mask(documents)
            if positions is None:
                positions = document_positions(documents)
        for layer in self.layers.values():
            h, stats = split_output(layer(h, positions, mask, documents))
            if stats is not None:
                routing = stats if routing is None else routing + stats
        if self.norm is not None:
            h = self.norm(h)
        return h, routing

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter with its deterministic initial value (see ``initial_value``)."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(self.args, name, param.shape, seed, param.device, param.dtype))

    start = staticmethod(dense_start)
    """Fills a parameter's fp32 start by its name (a family with other rules overrides it)."""

    @classmethod
    def initial_value(
        cls,
        args: ModelArgs,
        name: str,
        shape: torch.Size | tuple[int, ...],
        seed: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> Tensor:
        """The full initial tensor of parameter ``name``.

        Each parameter draws from its own generator seeded by (seed, name), so its value
        depends on nothing else: not on which parameters a pipeline stage holds, nor on how a
        plan shards it. That is what lets every plan start from the single-device weights.
        The draw is in fp32 whatever ``dtype`` (bf16 sampling would differ, and gives -inf
        for Qwen3.5's ``A_log``), then cast."""
        name = canonical_name(name)
        out = torch.empty(shape, device=device, dtype=torch.float32)
        return cls.start(args, name, out, named_generator(seed, name, device)).to(dtype)


def split_output(output: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """A ``Qwen`` (or ``Block``) output as (logits or hidden states, routing statistics or
    None): a mixture of experts also returns its routing statistics, a dense model only its
    output (see ``Qwen.forward``)."""
    return output if isinstance(output, tuple) else (output, None)
