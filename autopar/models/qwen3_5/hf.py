"""Qwen3.5's HF tensor names beside ours: the fused Gated DeltaNet tensors split, and the
mixture of experts in either of the two layouts real files use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.models.args import ModelArgs
from autopar.models.hf_fields import ConfigFields
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


def mtp_num_hidden_layers(config: Mapping[str, Any], source: str, error: type[Exception]) -> int:
    """The decoder layers of the multi-token-prediction head a Qwen3.5 config.json describes
    (``mtp_num_hidden_layers`` of its text model; 0 when absent). Released heads share the
    model's embedding (``mtp_use_dedicated_embeddings`` false); one with its own is refused."""
    fields = ConfigFields(text_config(config), source, error)
    if fields.bool("mtp_use_dedicated_embeddings", False):
        raise error(
            f"{source}: mtp_use_dedicated_embeddings=true gives the MTP head its own embedding, which "
            "autopar does not model (released Qwen3.5 heads share the model's); load without mtp"
        )
    return fields.int("mtp_num_hidden_layers", 0, minimum=0)


def qwen3_5_args(fields: ConfigFields, rope: ConfigFields, moe: bool) -> dict[str, Any]:
    """ModelArgs fields of a Qwen3.5 text config, each read by type (``ConfigFields``)."""
    layer_types = fields.config.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise fields.error(f"{fields.source}: layer_types={layer_types!r} must be a list of layer type names")
    args: dict[str, Any] = {
        "vocab_size": fields.int("vocab_size"),
        "hidden_size": fields.int("hidden_size"),
        "intermediate_size": fields.int("intermediate_size", 0, minimum=0)
        if moe
        else fields.int("intermediate_size"),
        "num_hidden_layers": fields.int("num_hidden_layers"),
        "num_attention_heads": fields.int("num_attention_heads"),
        "num_key_value_heads": fields.int("num_key_value_heads"),
        "head_dim": fields.int("head_dim", 256),
        "rope_theta": rope.float("rope_theta", fields.float("rope_theta", 10000.0)),
        "partial_rotary_factor": rope.float(
            "partial_rotary_factor", fields.float("partial_rotary_factor", 0.25)
        ),
        "rms_norm_eps": fields.float("rms_norm_eps", 1e-6),
        "tie_word_embeddings": fields.bool("tie_word_embeddings", False),
        "attention_bias": fields.bool("attention_bias", False),
        "qk_norm": True,
        "max_position_embeddings": fields.int("max_position_embeddings", 32768),
        "initializer_range": fields.float("initializer_range", 0.02),
        "layer_types": tuple(layer_types),
        "full_attention_interval": fields.int("full_attention_interval", 4),
        "linear_num_key_heads": fields.int("linear_num_key_heads"),
        "linear_num_value_heads": fields.int("linear_num_value_heads"),
        "linear_key_head_dim": fields.int("linear_key_head_dim"),
        "linear_value_head_dim": fields.int("linear_value_head_dim"),
        "linear_conv_kernel_dim": fields.int("linear_conv_kernel_dim", 4),
    }
    if moe:
        args.update(
            num_experts=fields.int("num_experts"),
            num_experts_per_tok=fields.int("num_experts_per_tok"),
            moe_intermediate_size=fields.int("moe_intermediate_size"),
            shared_expert_intermediate_size=fields.int("shared_expert_intermediate_size", 512, minimum=0),
            norm_topk_prob=True,
            router_aux_loss_coef=fields.float("router_aux_loss_coef", 0.001, zero_ok=True),
        )
    return args


def qwen3_5_config(args: ModelArgs) -> dict[str, Any]:
    """The text-only config.json fields transformers needs to rebuild ``args`` (the RoPE
    parameters are written beside the other families' by ``hf_config_from_args``)."""
    model_type = "qwen3_5_moe_text" if args.moe else "qwen3_5_text"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "head_dim": args.head_dim,
        "attention_bias": args.attention_bias,
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
    if args.mtp_num_hidden_layers:
        config["mtp_num_hidden_layers"] = args.mtp_num_hidden_layers
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
