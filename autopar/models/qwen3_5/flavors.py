"""Qwen3.5 / 3.6 sizes, from the public config.json files (Qwen3.6-27B and Qwen3.8-27B are
Qwen3.5-27B's shapes field for field; Qwen3.6-35B-A3B is Qwen3.5-35B-A3B's)."""

from __future__ import annotations

from autopar.models.args import ModelArgs
from autopar.models.flavor_table import sized, tiny, with_experts

QWEN3_5 = {
    "vocab_size": 248320,
    "head_dim": 256,
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "qk_norm": True,
    "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
"""What every Qwen3.5 size shares."""


def _dense(
    hidden: int, layers: int, heads: int, kv: int, value_heads: int, ffn: int, tied: bool
) -> ModelArgs:
    return sized(QWEN3_5, hidden, layers, heads, kv, ffn, tied, linear_num_value_heads=value_heads)


def _moe(
    hidden: int, layers: int, heads: int, value_heads: int, expert: int, experts: int, top_k: int
) -> ModelArgs:
    dense = _dense(hidden, layers, heads, 2, value_heads, 0, tied=False)
    return with_experts(dense, experts, top_k, expert, shared_expert_intermediate_size=expert)


DEBUG = tiny(
    QWEN3_5,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
)
"""Tiny, with the family's quirks: grouped value heads, key and value head dims apart,
partial rotary, a gated attention layer after three Gated DeltaNet ones."""

FLAVORS: dict[str, ModelArgs] = {
    "debug": DEBUG,
    "debug-moe": with_experts(
        DEBUG, experts=8, top_k=2, expert_ffn=64, intermediate_size=0, shared_expert_intermediate_size=96
    ),
    # _dense(hidden, layers, heads, kv heads, value heads, ffn, tied)
    "0.8B": _dense(1024, 24, 8, 2, 16, 3584, tied=True),
    "2B": _dense(2048, 24, 8, 2, 16, 6144, tied=True),
    "4B": _dense(2560, 32, 16, 4, 32, 9216, tied=True),
    "9B": _dense(4096, 32, 16, 4, 32, 12288, tied=False),
    "27B": _dense(5120, 64, 24, 4, 48, 17408, tied=False),
    # _moe(hidden, layers, heads, value heads, expert ffn, experts, top-k)
    "35B-A3B": _moe(2048, 40, 16, 32, 512, 256, 8),
    "122B-A10B": _moe(3072, 48, 32, 64, 1024, 256, 8),
    "397B-A17B": _moe(4096, 60, 32, 64, 1024, 512, 10),
}
