"""Named model sizes, as users say them (``qwen3`` / ``8B``).

Numbers are those of the public HF ``config.json`` files. ``debug`` flavors are tiny models
for CPU runs and tests; they keep each family's quirks (GQA, head_dim != hidden/heads for
Qwen3, q/k/v bias for Qwen2.5, routed experts for ``debug-moe``) so the tiny model
exercises the same code paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.models.args import ModelArgs
from autopar.models.flavor_table import sized, tiny, with_experts
from autopar.models.qwen3_5.flavors import FLAVORS as QWEN3_5_FLAVORS

QWEN3 = {
    "vocab_size": 151936,
    "head_dim": 128,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "qk_norm": True,
    "max_position_embeddings": 40960,
}
"""What every Qwen3 size shares."""
QWEN2_5 = {
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "attention_bias": True,
    "qk_norm": False,
    "max_position_embeddings": 32768,
}
"""What every Qwen2.5 size shares (its head_dim is hidden / heads, its vocabulary one of two)."""


def _qwen2_5(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool) -> ModelArgs:
    return sized(QWEN2_5, hidden, layers, heads, kv, ffn, tied, vocab_size=vocab, head_dim=hidden // heads)


_QWEN3_DEBUG = tiny(QWEN3)

FLAVORS: dict[str, dict[str, ModelArgs]] = {
    # sized(family, hidden, layers, heads, kv heads, ffn, tied)
    "qwen3": {
        "debug": _QWEN3_DEBUG,
        "0.6B": sized(QWEN3, 1024, 28, 16, 8, 3072, tied=True),
        "1.7B": sized(QWEN3, 2048, 28, 16, 8, 6144, tied=True),
        "4B": sized(QWEN3, 2560, 36, 32, 8, 9728, tied=True),
        "8B": sized(QWEN3, 4096, 36, 32, 8, 12288, tied=False),
        "14B": sized(QWEN3, 5120, 40, 40, 8, 17408, tied=False),
        "32B": sized(QWEN3, 5120, 64, 64, 8, 25600, tied=False),
        "debug-moe": with_experts(_QWEN3_DEBUG, experts=8, top_k=2, expert_ffn=64),
        "30B-A3B": with_experts(sized(QWEN3, 2048, 48, 32, 4, 6144, tied=False), 128, 8, expert_ffn=768),
        "235B-A22B": with_experts(sized(QWEN3, 4096, 94, 64, 4, 12288, tied=False), 128, 8, expert_ffn=1536),
    },
    "qwen2.5": {
        "debug": tiny(QWEN2_5, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "0.5B": _qwen2_5(896, 24, 14, 2, 4864, 151936, tied=True),
        "1.5B": _qwen2_5(1536, 28, 12, 2, 8960, 151936, tied=True),
        "3B": _qwen2_5(2048, 36, 16, 2, 11008, 151936, tied=True),
        "7B": _qwen2_5(3584, 28, 28, 4, 18944, 152064, tied=False),
        "14B": _qwen2_5(5120, 48, 40, 8, 13824, 152064, tied=False),
        "32B": _qwen2_5(5120, 64, 40, 8, 27648, 152064, tied=False),
        "72B": _qwen2_5(8192, 80, 64, 8, 29568, 152064, tied=False),
    },
    "qwen3.5": QWEN3_5_FLAVORS,
}


def get_flavor(name: str, flavor: str, **overrides: Any) -> ModelArgs:
    """Return the args of ``name``/``flavor``, with any field replaced by ``overrides``."""
    if name not in FLAVORS:
        raise ValueError(f"model.name={name!r} is unknown; choose one of {sorted(FLAVORS)}")
    family = FLAVORS[name]
    if flavor not in family:
        raise ValueError(f"model.flavor={flavor!r} is unknown for {name}; choose one of {list(family)}")
    return with_overrides(family[flavor], overrides)


def with_overrides(args: ModelArgs, overrides: dict[str, Any]) -> ModelArgs:
    """``args`` with fields replaced by ``overrides``, checked; raises ValueError naming a bad one."""
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"model override {unknown[0]!r} is not a model field; fields: {sorted(fields)}")
    # a list from TOML or the command line; the frozen args hold a tuple
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    args = dataclasses.replace(args, **overrides)
    args.check()
    return args
