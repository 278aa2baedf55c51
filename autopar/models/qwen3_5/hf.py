"""Qwen3.5's HF tensor names beside ours: the fused Gated DeltaNet tensors split, and the
mixture of experts in either of the two layouts real files use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.models.args import ModelArgs
from autopar.models.hf_layout import HFLayout, Piece

_SECTIONS = {"q": 0, "k": 1, "v": 2}


def _rows(args: ModelArgs, section: str) -> tuple[int, int]:
    """Rows of section q, k or v in HF's fused [q | k | v] ``in_proj_qkv`` / ``conv1d``."""
    key = args.linear_num_key_heads * args.linear_key_head_dim
    value = args.linear_num_value_heads * args.linear_value_head_dim
    start = key * _SECTIONS[section]
    return start, start + (value if section == "v" else key)


def qwen3_5_pieces(
    args: ModelArgs, name: str, shape: tuple[int, ...], layout: HFLayout
) -> list[Piece] | None:
    """The pieces of ``name`` where Qwen3.5 names differ from ours; None where they do not."""
    module, _, leaf = name.rpartition(".")
    block, _, part = module.rpartition(".")
    if part in ("in_proj_q", "in_proj_k", "in_proj_v") and block.endswith("linear_attn"):
        start, stop = _rows(args, part[-1])
        hf_name = f"{layout.prefix}{block}.in_proj_qkv.weight"
        return [Piece(hf_name, tuple(shape), (0, start, stop))]
    if part == "core" and leaf.startswith("conv_"):
        start, stop = _rows(args, leaf[-1])
        return [Piece(f"{layout.prefix}{block}.conv1d.weight", tuple(shape), (0, start, stop))]
    if part == "core":  # A_log, dt_bias
        return [Piece(f"{layout.prefix}{block}.{leaf}", tuple(shape))]
    if part == "experts" and layout.fused_experts:
        width = args.moe_intermediate_size
        if leaf == "down_proj":
            return [Piece(f"{layout.prefix}{module}.down_proj", tuple(shape))]
        start = 0 if leaf == "gate_proj" else width
        return [Piece(f"{layout.prefix}{module}.gate_up_proj", tuple(shape), (1, start, start + width))]
    return None


TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""Vision-language ``model_type`` -> its text model's, as config.json spells them."""
ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's fields of a Qwen3.5 config.json (a vision-language one nests them
    under ``text_config`` and keeps the tie flag at the top)."""
    if config.get("model_type") not in TEXT_TYPES:
        return dict(config)
    text = dict(config.get("text_config") or {})
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def qwen3_5_args(config: Mapping[str, Any], moe: bool) -> dict[str, Any]:
    """ModelArgs fields of a Qwen3.5 text config (KeyError names a missing required field)."""
    rope = config.get("rope_parameters") or {}
    layer_types = tuple(config.get("layer_types") or ())
    fields: dict[str, Any] = {
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config.get("intermediate_size", 0) if moe else config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim", 256),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "partial_rotary_factor": float(rope.get("partial_rotary_factor", 0.25)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
        "qk_norm": True,
        "max_position_embeddings": config.get("max_position_embeddings", 32768),
        "initializer_range": config.get("initializer_range", 0.02),
        "layer_types": layer_types,
        "full_attention_interval": config.get("full_attention_interval", 4),
        "linear_num_key_heads": config["linear_num_key_heads"],
        "linear_num_value_heads": config["linear_num_value_heads"],
        "linear_key_head_dim": config["linear_key_head_dim"],
        "linear_value_head_dim": config["linear_value_head_dim"],
        "linear_conv_kernel_dim": config.get("linear_conv_kernel_dim", 4),
    }
    if moe:
        fields.update(
            num_experts=config["num_experts"],
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=True,
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        )
    return fields


def qwen3_5_config(args: ModelArgs) -> dict[str, Any]:
    """The text-only config.json fields transformers needs to rebuild ``args``."""
    model_type = "qwen3_5_moe_text" if args.moe else "qwen3_5_text"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "head_dim": args.head_dim,
        "attention_bias": args.attention_bias,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "layer_types": [
            "linear_attention" if args.mixer(i) == "linear_attention" else "full_attention"
            for i in range(args.num_hidden_layers)
        ],
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
    }
    if args.moe:
        config.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            shared_expert_intermediate_size=args.shared_expert_intermediate_size,
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=False,
        )
    return config
