"""HF safetensors in and out: a name-mapping adapter between HF Qwen checkpoints and ``Qwen``.

Our parameter names are HF's without the ``model.`` prefix, so the mapping is a prefix.
Tied embeddings: HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is true, and we
do the same; on load a tied checkpoint that does carry one is accepted only if it equals the
embedding, so a silently untied checkpoint cannot load as tied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from autopar.models.args import ModelArgs
from autopar.models.qwen import Qwen, canonical_name

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFCheckpointError(ValueError):
    """An HF checkpoint directory that does not describe a model autopar can load."""


def to_hf_name(name: str) -> str:
    name = canonical_name(name)
    return name if name == "lm_head.weight" else f"model.{name}"


def from_hf_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelArgs:
    """ModelArgs from an HF config dict; raises HFCheckpointError on what we cannot model."""
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: model_type={model_type!r} is not supported; autopar loads "
            f"{sorted(_ARCHITECTURES)} (Qwen2.5 and Qwen3 dense)"
        )
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise HFCheckpointError(f"{source}: rope type {rope_type!r} is not supported; only 'default'")
    if config.get("use_sliding_window"):
        raise HFCheckpointError(f"{source}: use_sliding_window=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act={config['hidden_act']!r}; Qwen uses 'silu'")
    is_qwen3 = model_type == "qwen3"
    if is_qwen3 and config.get("attention_bias"):
        raise HFCheckpointError(
            f"{source}: attention_bias=true for qwen3 would put a bias on o_proj, "
            "which no released Qwen3 has and autopar does not model"
        )
    try:
        heads = config["num_attention_heads"]
        return ModelArgs(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=not is_qwen3,
            qk_norm=is_qwen3,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            initializer_range=config.get("initializer_range", 0.02),
        )
    except KeyError as missing:
        raise HFCheckpointError(f"{source}: required field {missing} is missing") from None


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json transformers needs to rebuild ``args`` (v4 and v5 field spellings)."""
    return {
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
        "attention_bias": False if args.qk_norm else True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_hidden_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
    }


def read_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs of the HF checkpoint directory ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise HFCheckpointError(f"{config_path}: not found; an HF checkpoint needs a config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({err})") from None
    return args_from_hf_config(config, str(config_path))


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise HFCheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def read_hf_tensors(path: str | Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under our names, checked against the model ``args``."""
    path = Path(path)
    files = _tensor_files(path)
    expected = {to_hf_name(n): tuple(p.shape) for n, p in _meta_params(args).items()}
    missing = sorted(set(expected) - set(files))
    extra = sorted(set(files) - set(expected) - {"lm_head.weight"})
    if missing:
        raise HFCheckpointError(
            f"{path}: {len(missing)} tensor(s) missing from the checkpoint, first {missing[0]!r}"
        )
    if extra:
        raise HFCheckpointError(
            f"{path}: {len(extra)} unexpected tensor(s) in {files[extra[0]].name}, first "
            f"{extra[0]!r}; the config.json does not describe these weights"
        )
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for hf_name, file in files.items():
        by_file.setdefault(file, []).append(hf_name)
    for file, names in by_file.items():
        if not file.is_file():
            raise HFCheckpointError(f"{file}: listed in {INDEX_FILE} but not found")
        with safe_open(file, framework="pt") as f:
            for hf_name in names:
                tensors[hf_name] = f.get_tensor(hf_name)
    for hf_name, shape in expected.items():
        found = tuple(tensors[hf_name].shape)
        if found != shape:
            raise HFCheckpointError(
                f"{files[hf_name]}: tensor {hf_name!r} has shape {list(found)}, the config "
                f"expects {list(shape)}"
            )
    if args.tie_word_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        if not torch.equal(head, tensors["model.embed_tokens.weight"]):
            raise HFCheckpointError(
                f"{files['lm_head.weight']}: tie_word_embeddings=true but lm_head.weight "
                "differs from model.embed_tokens.weight; set tie_word_embeddings=false"
            )
    return {from_hf_name(n): t for n, t in tensors.items()}


def _meta_params(args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(Qwen(args).named_parameters())


def from_hf(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Qwen:
    """Load an HF Qwen2.5 / Qwen3 checkpoint directory as a ``Qwen`` module.

    ``dtype=None`` keeps the checkpoint's dtype.
    """
    args = read_hf_config(path)
    tensors = read_hf_tensors(path, args)
    if dtype is None:
        dtype = tensors["embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = Qwen(args)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model


def hf_state_dict(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full state dict under HF names, without ``lm_head.weight`` when tied."""
    out = {}
    for name, tensor in state.items():
        hf_name = to_hf_name(name)
        if hf_name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        out[hf_name] = tensor.detach().contiguous()
    return out


def save_hf(
    state: Mapping[str, torch.Tensor],
    args: ModelArgs,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json and safetensors (sharded with an index past ``max_shard_bytes``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(state, args)
    dtype = tensors["model.embed_tokens.weight"].dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config_from_args(args, dtype)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def to_hf(model: Qwen, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a single-device ``model`` as an HF checkpoint that ``from_pretrained`` loads."""
    state = {
        name: (p if dtype is None else p.to(dtype)) for name, p in model.named_parameters()
    }
    save_hf(state, model.args, path)
