"""HF ``config.json`` beside our ``ModelArgs``, both ways, for every family."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from autopar.models.args import ROPE_TYPES, ModelArgs
from autopar.models.dtypes import dtype_name
from autopar.models.hf_fields import ConfigFields
from autopar.models.qwen3_5.hf import TEXT_TYPES, qwen3_5_args, qwen3_5_config, text_config

CONFIG_FILE = "config.json"
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_HEAD_DIM = {"qwen3": 128}
"""transformers' ``head_dim`` where config.json has none: Qwen3Config's own default; Qwen2 and
Qwen3-MoE take hidden_size / num_attention_heads."""
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


class HFCheckpointError(ValueError):
    """An HF checkpoint directory that does not describe a model autopar can load."""


def args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelArgs:
    """ModelArgs from an HF config dict; raises HFCheckpointError on what we cannot model.

    Fields absent or ``null`` take transformers' defaults (``ConfigFields``); the shape fields
    are required, and each size is bounded (``ModelArgs.check``) before anything is built."""
    model_type = config.get("model_type")
    if model_type in QWEN3_5_TYPES:
        if model_type in TEXT_TYPES and not isinstance(config.get("text_config"), Mapping):
            raise HFCheckpointError(
                f"{source}: model_type={model_type!r} is a vision-language config, whose text model's "
                "fields sit under 'text_config', which is missing; fix the file or re-download it"
            )
        return _checked(ModelArgs(**_hybrid_args(text_config(config), source)), source)
    if model_type not in _ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: model_type={model_type!r} is not supported; autopar loads "
            f"{sorted([*_ARCHITECTURES, *QWEN3_5_TYPES])} (Qwen2.5, Qwen3, Qwen3-MoE and Qwen3.5 / 3.6)"
        )
    fields = ConfigFields(config, source, HFCheckpointError)
    rope = _check_rope_and_activation(fields)
    _check_full_attention(fields)
    is_qwen3 = model_type in ("qwen3", "qwen3_moe")
    if is_qwen3 and fields.bool("attention_bias"):
        raise HFCheckpointError(
            f"{source}: attention_bias=true for qwen3 would put a bias on o_proj, "
            "which no released Qwen3 has and autopar does not model"
        )
    heads = fields.int("num_attention_heads")
    args = ModelArgs(
        vocab_size=fields.int("vocab_size"),
        hidden_size=fields.int("hidden_size"),
        intermediate_size=fields.int("intermediate_size"),
        num_hidden_layers=fields.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.int("num_key_value_heads", heads),
        head_dim=fields.int("head_dim", _HEAD_DIM.get(model_type)) or fields.int("hidden_size") // heads,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        attention_bias=not is_qwen3,
        qk_norm=is_qwen3,
        max_position_embeddings=fields.int("max_position_embeddings", 32768),
        initializer_range=fields.float("initializer_range", 0.02),
        **_rope_args(fields, rope),
        **(_moe_args(fields) if model_type == "qwen3_moe" else {}),
    )
    return _checked(args, source)


def _checked(args: ModelArgs, source: str) -> ModelArgs:
    try:
        args.check()
    except ValueError as err:
        raise HFCheckpointError(f"{source}: {err}") from None
    return args


def _check_rope_and_activation(fields: ConfigFields) -> ConfigFields:
    """Refuse what Qwen's attention and MLP do not do; returns the typed RoPE parameters:
    ``rope_scaling`` when given (v4 files; transformers lets it win), else ``rope_parameters``."""
    source = fields.source
    name = "rope_scaling" if fields.mapping("rope_scaling") else "rope_parameters"
    rope = ConfigFields(fields.mapping(name), f"{source} {name}", HFCheckpointError)
    rope_type = _rope_type(rope)
    if rope_type not in ROPE_TYPES:
        raise HFCheckpointError(
            f"{source}: {name} rope type {rope_type!r} is not supported; autopar computes "
            f"{list(ROPE_TYPES)}: remove {name} or set its type to 'yarn'"
        )
    if fields.bool("use_sliding_window"):
        raise HFCheckpointError(f"{source}: use_sliding_window=true is not supported")
    if fields.str("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act={fields.config['hidden_act']!r}; Qwen uses 'silu'")
    return rope


def _check_full_attention(fields: ConfigFields) -> None:
    """Refuse sliding-window layers, which transformers 5 runs where ``layer_types`` names them
    and ``sliding_window`` is set; autopar runs full attention in every Qwen2.5 / Qwen3 layer."""
    sliding = [t for t in fields.config.get("layer_types") or [] if t != "full_attention"]
    if sliding and fields.config.get("sliding_window") is not None:
        raise HFCheckpointError(
            f"{fields.source}: layer_types has {sliding[0]!r} layers with sliding_window="
            f"{fields.config['sliding_window']}; autopar runs full attention in every layer: set "
            "sliding_window to null or every layer type to 'full_attention'"
        )


def _rope_type(rope: ConfigFields) -> Any:
    """The RoPE type as transformers reads it (v5 ``rope_type``, v4 ``type``)."""
    return rope.config.get("rope_type") or rope.config.get("type") or "default"


def _rope_args(fields: ConfigFields, rope: ConfigFields) -> dict[str, Any]:
    """ModelArgs' RoPE fields, read as transformers reads them: ``rope_theta`` in the RoPE
    parameters, else at the top; YaRN's ``original_max_position_embeddings`` at the top, else
    in the parameters, else ``max_position_embeddings``; ``factor`` null: their ratio."""
    theta = rope.float("rope_theta", fields.float("rope_theta", 10000.0))
    if _rope_type(rope) == "default":
        return {"rope_theta": theta}
    longest = fields.int("max_position_embeddings", 32768)
    original = fields.int("original_max_position_embeddings", None) or rope.int(
        "original_max_position_embeddings", longest
    )
    attention = rope.float("attention_factor", None)
    mscale, mscale_all_dim = (
        rope.float("mscale", 0.0, zero_ok=True),
        rope.float("mscale_all_dim", 0.0, zero_ok=True),
    )
    factor = rope.float("factor", longest / original)
    if attention is None and mscale and mscale_all_dim:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return {
        "rope_theta": theta,
        "rope_type": "yarn",
        "rope_factor": factor,
        "rope_original_max_position_embeddings": original,
        "rope_attention_factor": attention or 0.0,
        "rope_beta_fast": rope.float("beta_fast", 32.0),
        "rope_beta_slow": rope.float("beta_slow", 1.0),
        "rope_truncate": rope.config.get("truncate", True) is True,  # null: no truncation, as transformers
    }


def _mscale(factor: float, mscale: float) -> float:
    """transformers' ``get_mscale``: YaRN's attention temperature at ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hybrid_args(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Qwen3.5 / 3.6 (dense or MoE, text-only or vision-language config) as ModelArgs fields;
    YaRN from ``rope_parameters`` as Qwen3.6's model card gives it for long inputs."""
    fields = ConfigFields(config, source, HFCheckpointError)
    rope = _check_rope_and_activation(fields)
    args = qwen3_5_args(fields, rope, moe=config.get("model_type") == "qwen3_5_moe_text")
    return {**args, **_rope_args(fields, rope)}


def _moe_args(fields: ConfigFields) -> dict[str, Any]:
    """The Qwen3-MoE fields of an HF config (v5 spells num_experts num_local_experts)."""
    experts = fields.int("num_experts", None) or fields.int("num_local_experts", None)
    if experts is None:
        raise HFCheckpointError(
            f"{fields.source}: required field 'num_experts' (or 'num_local_experts') is missing"
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": fields.int("num_experts_per_tok", 8),
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
        rope = {**_rope_parameters(args), "partial_rotary_factor": args.partial_rotary_factor}
        return {**common, **qwen3_5_config(args), "rope_parameters": rope}
    return {
        **(_moe_config(args) if args.moe else {}),
        "architectures": [_ARCHITECTURES[args.model_type]],
        "model_type": args.model_type,
        **common,
        "head_dim": args.head_dim,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_parameters(args) if args.rope_type == "yarn" else None,
        "rope_parameters": _rope_parameters(args),
        "attention_bias": not args.qk_norm,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_hidden_layers,
    }


def _moe_config(args: ModelArgs) -> dict[str, Any]:
    """A Qwen3-MoE's fields of config.json (v5 spells num_experts num_local_experts too)."""
    return {
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


def _rope_parameters(args: ModelArgs) -> dict[str, Any]:
    """HF ``rope_parameters`` of ``args`` (for YaRN also written as v4's ``rope_scaling``)."""
    params: dict[str, Any] = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.rope_type == "yarn":
        params.update(
            factor=args.rope_factor,
            original_max_position_embeddings=args.rope_original_max_position_embeddings,
            beta_fast=args.rope_beta_fast,
            beta_slow=args.rope_beta_slow,
            truncate=args.rope_truncate,
            **({"attention_factor": args.rope_attention_factor} if args.rope_attention_factor else {}),
        )
    return params


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
