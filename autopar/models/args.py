"""Model arguments, named exactly as the fields of an HF Qwen ``config.json``."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

Mixer = Literal["attention", "gated_attention", "linear_attention"]
"""How a layer mixes tokens: softmax attention (Qwen2.5/3), gated attention (Qwen3.5's
``full_attention`` layers) or a Gated DeltaNet (Qwen3.5's ``linear_attention`` layers)."""
FeedForward = Literal["mlp", "moe"]
"""A layer's feed-forward: a dense SwiGLU or a routed mixture of experts."""
LayerKind = tuple[Mixer, FeedForward]
HF_LAYER_TYPES = {"full_attention": "gated_attention", "linear_attention": "linear_attention"}
"""Qwen3.5 ``config.json`` ``layer_types`` values -> our mixers."""
ROPE_TYPES = ("default", "yarn")
"""The RoPE variants autopar computes (HF ``rope_parameters.rope_type``)."""
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "num_experts": 1 << 14,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
    "linear_num_key_heads": 1 << 12,
    "linear_num_value_heads": 1 << 12,
    "linear_key_head_dim": 1 << 12,
    "linear_value_head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26,
    "mtp_num_hidden_layers": 1 << 4,
}
"""Largest value of each size field: 10x and more beyond any Qwen released (the largest:
vocabulary 248,320, hidden 8,192, MLP 29,568, 94 layers, 96 heads, 512 experts, 1M positions),
so a damaged or hostile config.json (``intermediate_size`` 2**40, a million layers) is one
line before anything is allocated or looped over per layer."""


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of one Qwen2.5 / Qwen3 / Qwen3.5 model, dense or mixture of experts.

    Field names match HF ``config.json`` so a config maps 1:1; ``qk_norm`` is the one
    addition (it is what distinguishes the ``qwen3`` architecture from ``qwen2``), and the
    ``rope_*`` fields are the keys of HF's ``rope_parameters`` (``rope_scaling`` in v4 files).
    ``linear_num_value_heads > 0`` makes it the hybrid Qwen3.5: Gated DeltaNet layers with
    a gated attention layer every ``full_attention_interval``-th (or as ``layer_types`` say).
    ``num_experts > 0`` makes it Qwen3-MoE: layer ``i`` has a routed mixture of experts
    unless ``i`` is in ``mlp_only_layers`` or ``i + 1`` is not a multiple of
    ``decoder_sparse_step`` (then a dense SwiGLU of ``intermediate_size``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Per-head width; independent of hidden_size / num_attention_heads (Qwen3-0.6B, 4B, 32B)."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2.5). o_proj never has one."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    num_experts_per_tok: int = 8
    """Experts each token is sent to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width."""
    norm_topk_prob: bool = False
    """Renormalize the top-k routing probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer is MoE."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers kept dense."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training loss."""
    shared_expert_intermediate_size: int = 0
    """Qwen3.5-MoE: width of the shared expert every token also runs (0: none)."""
    layer_types: tuple[str, ...] = ()
    """Qwen3.5: ``full_attention`` or ``linear_attention`` per layer; empty: every
    ``full_attention_interval``-th layer is full attention."""
    full_attention_interval: int = 4
    """Qwen3.5, without ``layer_types``: layer i is full attention when (i + 1) is a multiple."""
    partial_rotary_factor: float = 1.0
    """Share of each head's dims that RoPE rotates (the first ones); Qwen3.5: 0.25."""
    linear_num_key_heads: int = 0
    """Gated DeltaNet query/key heads; 0: not a hybrid model."""
    linear_num_value_heads: int = 0
    """Gated DeltaNet value heads (a multiple of the key heads; each group reads one key head)."""
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution before the delta rule."""
    rope_type: Literal["default", "yarn"] = "default"
    """RoPE variant (HF ``rope_parameters.rope_type`` / ``rope_scaling.type``): 'yarn' stretches
    the context ``rope_factor`` times (Qwen2.5 / Qwen3 beyond 32K tokens, Qwen2.5-1M)."""
    rope_factor: float = 1.0
    """YaRN: context extension factor; low-frequency dims are interpolated by it."""
    rope_original_max_position_embeddings: int = 0
    """YaRN: the context length the model was pretrained at (Qwen: 32768)."""
    rope_attention_factor: float = 0.0
    """YaRN: scale of cos and sin; 0: 0.1 ln(rope_factor) + 1, the YaRN paper's."""
    rope_beta_fast: float = 32.0
    """YaRN: rotations per context above which a dim is extrapolated (kept)."""
    rope_beta_slow: float = 1.0
    """YaRN: rotations per context below which a dim is interpolated (divided by the factor)."""
    rope_truncate: bool = True
    """YaRN: round the interpolation ramp's ends to whole dims (HF ``truncate``)."""
    mtp_num_hidden_layers: int = 0
    """Qwen3.5: decoder layers of the multi-token-prediction head built beside the model (HF
    ``mtp_num_hidden_layers``); 0: no head. Set only when a job loads a checkpoint's head
    (``from_hf(..., mtp=True)``), so a model without it keeps its parameters and plans."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def hybrid(self) -> bool:
        """Qwen3.5: Gated DeltaNet layers beside gated attention ones."""
        return self.linear_num_value_heads > 0

    @property
    def family(self) -> str:
        """The model family (``model.name``) these args belong to."""
        if self.hybrid:
            return "qwen3.5"
        return "qwen3" if self.qk_norm else "qwen2.5"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` routes to experts (HF's rule)."""
        return self.moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def mixer(self, layer: int) -> Mixer:
        """How layer ``layer`` mixes tokens."""
        if not self.hybrid:
            return "attention"
        if self.layer_types:
            return HF_LAYER_TYPES[self.layer_types[layer]]
        full = (layer + 1) % self.full_attention_interval == 0
        return "gated_attention" if full else "linear_attention"

    def layer_kind(self, layer: int) -> LayerKind:
        """(mixer, feed-forward) of layer ``layer``: what plans, the planner and HF I/O key on."""
        return self.mixer(layer), "moe" if self.is_moe_layer(layer) else "mlp"

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's scale of cos and sin (``rope_attention_factor``, or the paper's from the factor)."""
        if self.rope_attention_factor:
            return self.rope_attention_factor
        return 0.1 * math.log(self.rope_factor) + 1.0 if self.rope_factor > 1 else 1.0

    def yarn_ramp(self, dim: int) -> tuple[float, float]:
        """YaRN's (low, high) dims of ``dim`` rotated ones: dims below ``low`` turn more than
        ``rope_beta_fast`` times over the original context and are kept, dims above ``high``
        fewer than ``rope_beta_slow`` times and are interpolated; a linear blend in between
        (transformers' ``find_correction_range``)."""

        def correction_dim(rotations: float) -> float:
            turns = self.rope_original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(self.rope_theta))

        low, high = correction_dim(self.rope_beta_fast), correction_dim(self.rope_beta_slow)
        if self.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def model_type(self) -> str:
        """The HF ``model_type`` this architecture is saved as."""
        if self.hybrid:
            return "qwen3_5_moe" if self.moe else "qwen3_5"
        if self.moe:
            return "qwen3_moe"
        return "qwen3" if self.qk_norm else "qwen2"

    def check(self) -> None:
        """Raise ValueError naming the field when the shape is not a valid model."""
        for name, limit in SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(
                    f"model.{name}={getattr(self, name)} is beyond any Qwen model (at most {limit}); "
                    "fix the value, or the config.json it came from"
                )
        for name in ("mlp_only_layers", "layer_types"):
            if len(getattr(self, name)) > SIZE_LIMITS["num_hidden_layers"]:
                raise ValueError(
                    f"model.{name} lists {len(getattr(self, name))} layers, beyond any Qwen model "
                    f"(at most {SIZE_LIMITS['num_hidden_layers']})"
                )
        if self.decoder_sparse_step <= 0:  # before has_dense_layers divides by it
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be positive")
        positive = (
            "vocab_size",
            "hidden_size",
            *(("intermediate_size",) if self.has_dense_layers else ()),
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}; grouped-query attention "
                "needs whole groups"
            )
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{name}={value} must be a finite number > 0")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.moe:
            self._check_moe()
        if self.hybrid:
            self._check_hybrid()
        if self.rope_type != "default":
            self._check_yarn()
        if self.mtp_num_hidden_layers < 0 or (self.mtp_num_hidden_layers and not self.hybrid):
            raise ValueError(
                f"model.mtp_num_hidden_layers={self.mtp_num_hidden_layers}: a multi-token-prediction head is Qwen3.5's "
                "(linear_num_value_heads > 0); use 0, or a Qwen3.5 model"
            )

    @functools.cached_property
    def has_dense_layers(self) -> bool:
        """Whether any layer has the dense SwiGLU of ``intermediate_size`` (one pass over the
        layers, once: the planner asks it of every candidate plan)."""
        dense = set(self.mlp_only_layers)
        step = self.decoder_sparse_step
        return not self.moe or any(i in dense or (i + 1) % step for i in range(self.num_hidden_layers))

    def _check_hybrid(self) -> None:
        for name in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"model.linear_num_key_heads={self.linear_num_key_heads}; each key head serves whole groups"
            )
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"model.linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 1")
        unknown = [t for t in self.layer_types if t not in HF_LAYER_TYPES]
        if unknown:
            raise ValueError(
                f"model.layer_types has {unknown[0]!r}; each layer is one of {sorted(HF_LAYER_TYPES)}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"model.layer_types lists {len(self.layer_types)} layers but num_hidden_layers="
                f"{self.num_hidden_layers}; give one type per layer, or none (every "
                f"full_attention_interval-th layer is full attention)"
            )
        if not self.layer_types and self.full_attention_interval < 1:
            raise ValueError(f"model.full_attention_interval={self.full_attention_interval} must be >= 1")
        if not self.qk_norm:
            raise ValueError("Qwen3.5 (linear_num_value_heads > 0) has q/k norms: set model.qk_norm=true")
        if self.rotary_dim % 2 or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} must give an even number of "
                f"rotated dims in (0, head_dim={self.head_dim}]"
            )

    def _check_moe(self) -> None:
        if not self.qk_norm:
            raise ValueError("model.num_experts > 0 is Qwen3-MoE, which has qk_norm; use model.name qwen3")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"model.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be >= 0"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"model.num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"model.moe_intermediate_size={self.moe_intermediate_size} must be positive")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(
                f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be finite and >= 0"
            )

    def _check_yarn(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r} is not one of {list(ROPE_TYPES)}")
        if self.rope_original_max_position_embeddings < 1:
            raise ValueError(
                "model.rope_type='yarn' needs model.rope_original_max_position_embeddings, the "
                "pretrained context length (Qwen: 32768)"
            )
        for name in ("rope_factor", "rope_beta_fast", "rope_beta_slow"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{name}={value} must be a finite number > 0")
        if not (math.isfinite(self.rope_attention_factor) and self.rope_attention_factor >= 0):
            raise ValueError(f"model.rope_attention_factor={self.rope_attention_factor} must be >= 0")
