"""Qwen3.5 / 3.6 sizes, from the public config.json files (Qwen3.6-27B and Qwen3.8-27B are
Qwen3.5-27B's shapes field for field; Qwen3.6-35B-A3B is Qwen3.5-35B-A3B's)."""

from __future__ import annotations

import dataclasses

from autopar.models.args import ModelArgs


def _qwen3_5(
    hidden: int, layers: int, heads: int, kv: int, value_heads: int, ffn: int, tied: bool
) -> ModelArgs:
    return ModelArgs(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=256,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        qk_norm=True,
        max_position_embeddings=262144,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


def _qwen3_5_moe(
    hidden: int, layers: int, heads: int, value_heads: int, expert: int, experts: int, top_k: int
) -> ModelArgs:
    return dataclasses.replace(
        _qwen3_5(hidden, layers, heads, 2, value_heads, 0, tied=False),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert,
        shared_expert_intermediate_size=expert,
        norm_topk_prob=True,
    )


DEBUG = ModelArgs(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    rope_theta=1e7,
    qk_norm=True,
    max_position_embeddings=4096,
    full_attention_interval=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
)
"""Tiny, with the family's quirks: grouped value heads, key and value head dims apart,
partial rotary, a gated attention layer after three Gated DeltaNet ones."""

FLAVORS: dict[str, ModelArgs] = {
    "debug": DEBUG,
    "debug-moe": dataclasses.replace(
        DEBUG,
        intermediate_size=0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=True,
    ),
    "0.8B": _qwen3_5(1024, 24, 8, 2, 16, 3584, tied=True),
    "2B": _qwen3_5(2048, 24, 8, 2, 16, 6144, tied=True),
    "4B": _qwen3_5(2560, 32, 16, 4, 32, 9216, tied=True),
    "9B": _qwen3_5(4096, 32, 16, 4, 32, 12288, tied=False),
    "27B": _qwen3_5(5120, 64, 24, 4, 48, 17408, tied=False),
    "35B-A3B": _qwen3_5_moe(2048, 40, 16, 32, 512, 256, 8),
    "122B-A10B": _qwen3_5_moe(3072, 48, 32, 64, 1024, 256, 8),
    "397B-A17B": _qwen3_5_moe(4096, 60, 32, 64, 1024, 512, 10),
}
