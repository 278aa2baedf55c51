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
from autopar.models.qwen3_5.flavors import FLAVORS as QWEN3_5_FLAVORS


def _qwen3(hidden: int, layers: int, heads: int, inter: int, tied: bool) -> ModelArgs:
    return ModelArgs(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attention_bias=False,
        qk_norm=True,
        max_position_embeddings=40960,
    )


def _qwen3_moe(hidden: int, layers: int, heads: int, inter: int, moe_inter: int) -> ModelArgs:
    return dataclasses.replace(
        _qwen3(hidden, layers, heads, inter, tied=False),
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=True,
    )


def _qwen25(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attention_bias=True,
        qk_norm=False,
        max_position_embeddings=32768,
    )


_QWEN3_DEBUG = ModelArgs(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    tie_word_embeddings=False,
    qk_norm=True,
    max_position_embeddings=4096,
)

FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "qwen3": {
        "debug": _QWEN3_DEBUG,
        "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
        "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
        "4B": _qwen3(2560, 36, 32, 9728, tied=True),
        "8B": _qwen3(4096, 36, 32, 12288, tied=False),
        "14B": _qwen3(5120, 40, 40, 17408, tied=False),
        "32B": _qwen3(5120, 64, 64, 25600, tied=False),
        "debug-moe": dataclasses.replace(
            _QWEN3_DEBUG, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True
        ),
        "30B-A3B": _qwen3_moe(2048, 48, 32, 6144, 768),
        "235B-A22B": _qwen3_moe(4096, 94, 64, 12288, 1536),
    },
    "qwen2.5": {
        "debug": ModelArgs(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            attention_bias=True,
            max_position_embeddings=4096,
        ),
        "0.5B": _qwen25(896, 24, 14, 2, 4864, 151936, tied=True),
        "1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, tied=True),
        "3B": _qwen25(2048, 36, 16, 2, 11008, 151936, tied=True),
        "7B": _qwen25(3584, 28, 28, 4, 18944, 152064, tied=False),
        "14B": _qwen25(5120, 48, 40, 8, 13824, 152064, tied=False),
        "32B": _qwen25(5120, 64, 40, 8, 27648, 152064, tied=False),
        "72B": _qwen25(8192, 80, 64, 8, 29568, 152064, tied=False),
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
