"""HF ``config.json`` beside our ``ModelArgs``, both ways, for every family."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from autopar.models.args import ModelArgs
from autopar.models.dtypes import dtype_name
from autopar.models.hf_fields import ConfigFields
from autopar.models.qwen3_5.hf import qwen3_5_args, qwen3_5_config, text_config

CONFIG_FILE = "config.json"
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


class HFCheckpointError(ValueError):
    """An HF checkpoint directory that does not describe a model autopar can load."""


def args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelArgs:
    """ModelArgs from an HF config dict; raises HFCheckpointError on what we cannot model."""
    model_type = config.get("model_type")
    if model_type in QWEN3_5_TYPES:
        return _hybrid_args(text_config(config), source)
    if model_type not in _ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: model_type={model_type!r} is not supported; autopar loads "
            f"{sorted([*_ARCHITECTURES, *QWEN3_5_TYPES])} (Qwen2.5, Qwen3, Qwen3-MoE and Qwen3.5 / 3.6)"
        )
    fields = ConfigFields(config, source, HFCheckpointError)
    rope = _check_rope_and_activation(fields)
    is_qwen3 = model_type in ("qwen3", "qwen3_moe")
    if is_qwen3 and fields.bool("attention_bias"):
        raise HFCheckpointError(
            f"{source}: attention_bias=true for qwen3 would put a bias on o_proj, "
            "which no released Qwen3 has and autopar does not model"
        )
    heads = fields.int("num_attention_heads")
    head_dim = fields.int("head_dim", None)
    return ModelArgs(
        vocab_size=fields.int("vocab_size"),
        hidden_size=fields.int("hidden_size"),
        intermediate_size=fields.int("intermediate_size"),
        num_hidden_layers=fields.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.int("num_key_value_heads", heads),
        head_dim=head_dim or fields.int("hidden_size") // heads,
        rope_theta=rope.float("rope_theta", fields.float("rope_theta", 10000.0)),
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        attention_bias=not is_qwen3,
        qk_norm=is_qwen3,
        max_position_embeddings=fields.int("max_position_embeddings", 32768),
        initializer_range=fields.float("initializer_range", 0.02),
        **(_moe_args(fields) if model_type == "qwen3_moe" else {}),
    )


def _check_rope_and_activation(fields: ConfigFields) -> ConfigFields:
    """Refuse what Qwen's attention and MLP do not do; returns the typed rope_parameters."""
    source = fields.source
    rope = ConfigFields(fields.mapping("rope_parameters"), f"{source} rope_parameters", HFCheckpointError)
    scaling = fields.mapping("rope_scaling")
    rope_type = rope.config.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise HFCheckpointError(f"{source}: rope type {rope_type!r} is not supported; only 'default'")
    if fields.bool("use_sliding_window"):
        raise HFCheckpointError(f"{source}: use_sliding_window=true is not supported")
    if fields.config.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act={fields.config['hidden_act']!r}; Qwen uses 'silu'")
    return rope


def _hybrid_args(config: Mapping[str, Any], source: str) -> ModelArgs:
    """Qwen3.5 / 3.6 (dense or MoE, text-only or vision-language config) as ModelArgs."""
    fields = ConfigFields(config, source, HFCheckpointError)
    rope = _check_rope_and_activation(fields)
    args = ModelArgs(**qwen3_5_args(fields, rope, moe=config.get("model_type") == "qwen3_5_moe_text"))
    try:
        args.check()
    except ValueError as err:
        raise HFCheckpointError(f"{source}: {err}") from None
    return args


def _moe_args(fields: ConfigFields) -> dict[str, Any]:
    """The Qwen3-MoE fields of an HF config (v5 spells num_experts num_local_experts)."""
    return {
        "num_experts": fields.int("num_experts", fields.int("num_local_experts", None)),
        "num_experts_per_tok": fields.int("num_experts_per_tok"),
        "moe_intermediate_size": fields.int("moe_intermediate_size"),
        "norm_topk_prob": fields.bool("norm_topk_prob", False),
        "decoder_sparse_step": fields.int("decoder_sparse_step", 1),
        "mlp_only_layers": fields.ints("mlp_only_layers"),
        "router_aux_loss_coef": fields.float("router_aux_loss_coef", 0.001, zero_ok=True),
    }


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json transformers needs to rebuild ``args`` (v4 and v5 field spellings)."""
    common = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.initializer_range,
        "rms_norm_eps": args.rms_norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }
    if args.hybrid:
        return {**common, **qwen3_5_config(args)}
    moe = {
        "num_experts": args.num_experts,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
    }
    return {
        **(moe if args.moe else {}),
        "architectures": [_ARCHITECTURES[args.model_type]],
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.initializer_range,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": not args.qk_norm,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_hidden_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def read_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs of the HF checkpoint directory ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise HFCheckpointError(f"{config_path}: not found; an HF checkpoint needs a config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{config_path}: not a JSON object but {type(config).__name__}")
    return args_from_hf_config(config, str(config_path))
