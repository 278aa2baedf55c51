"""Model arguments, named exactly as the fields of an HF Qwen ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of one Qwen2.5 / Qwen3 dense model.

    Field names match HF ``config.json`` so a config maps 1:1; ``qk_norm`` is the one
    addition (it is what distinguishes the ``qwen3`` architecture from ``qwen2``).
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

    @property
    def model_type(self) -> str:
        """The HF ``model_type`` this architecture is saved as."""
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
