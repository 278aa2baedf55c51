"""Model arguments, named exactly as the fields of an HF Qwen ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of one Qwen2.5 / Qwen3 model, dense or mixture of experts.

    Field names match HF ``config.json`` so a config maps 1:1; ``qk_norm`` is the one
    addition (it is what distinguishes the ``qwen3`` architecture from ``qwen2``).
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

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` routes to experts (HF's rule)."""
        return self.moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def model_type(self) -> str:
        """The HF ``model_type`` this architecture is saved as."""
        if self.moe:
            return "qwen3_moe"
        return "qwen3" if self.qk_norm else "qwen2"

    def check(self) -> None:
        """Raise ValueError naming the field when the shape is not a valid model."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
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

    def _check_moe(self) -> None:
        if not self.qk_norm:
            raise ValueError("model.num_experts > 0 is Qwen3-MoE, which has qk_norm; use model.name qwen3")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"model.num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"model.moe_intermediate_size={self.moe_intermediate_size} must be positive")
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be positive")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(
                f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be finite and >= 0"
            )
