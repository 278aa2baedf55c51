"""One way to declare a family's flavor table: the fields every size of the family shares,
once, then a row per size with the fields that vary (``sized``), a tiny CPU ``debug`` size
(``tiny``) and routed experts on top of either (``with_experts``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.models.args import ModelArgs

TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}
"""The ``debug`` flavors' sizes: small enough for CPU tests, with grouped query heads and
``head_dim`` apart from hidden / heads, so the tiny model runs the real code paths."""


def sized(
    family: dict[str, Any], hidden: int, layers: int, heads: int, kv: int, ffn: int, tied: bool, **fields: Any
) -> ModelArgs:
    """One released size: ``family``'s shared fields with the sizes that vary between its
    releases (hidden, layers, attention heads, key/value heads, MLP width, tied embeddings)
    and any other ``fields`` the row names."""
    sizes = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "tie_word_embeddings": tied,
    }
    return ModelArgs(**{**family, **sizes, **fields})


def tiny(family: dict[str, Any], **quirks: Any) -> ModelArgs:
    """The family's ``debug`` flavor: its shared fields at ``TINY``'s sizes, with the
    ``quirks`` that keep the family's shape (Qwen2.5's fewer heads, tied embeddings...)."""
    return ModelArgs(**{**family, **TINY, **quirks})


def with_experts(dense: ModelArgs, experts: int, top_k: int, expert_ffn: int, **fields: Any) -> ModelArgs:
    """``dense`` with a routed mixture of ``experts`` (``top_k`` per token, each of width
    ``expert_ffn``, routing probabilities renormalized as every Qwen MoE does)."""
    return dataclasses.replace(
        dense,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_ffn,
        norm_topk_prob=True,
        **fields,
    )
