"""LoRA adapters on disk: the HF PEFT adapter folder (``adapter_config.json`` and
``adapter_model.safetensors`` under peft's names, which ``peft.PeftModel.from_pretrained(base,
folder)`` loads), and the merged model.

Our adapter names are the model's (``layers.0.self_attn.q_proj.lora_A.weight``); peft prefixes
the HF name with ``base_model.model.`` and drops the adapter's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from autopar.config.sections import LoRA
from autopar.models.args import ModelArgs
from autopar.models.hf import save_hf_streaming, to_hf_name
from autopar.models.qwen import Qwen
from autopar.training.checkpoint import read_model_tensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."

BaseTensors = Callable[[Mapping[str, torch.Size]], Mapping[str, torch.Tensor]]
"""{name: shape} -> the base model's full tensors of those names."""


def peft_name(name: str) -> str:
    return _PEFT_PREFIX + to_hf_name(name)


def our_name(peft: str) -> str:
    return peft.removeprefix(_PEFT_PREFIX).removeprefix("model.")


def adapter_config(cfg: LoRA, base_model: str | None) -> dict[str, object]:
    """peft's ``LoraConfig`` for our adapters (its matching rule for ``target_modules`` is ours)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def save_adapter(
    adapters: Mapping[str, torch.Tensor], cfg: LoRA, path: str | Path, base_model: str | None = None
) -> None:
    """Write ``adapters`` (full tensors under our names) as a peft adapter folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(n): t.detach().contiguous().cpu() for n, t in adapters.items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")


def load_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapters of a peft folder under our names."""
    return {our_name(n): t for n, t in load_file(str(Path(path) / ADAPTER_WEIGHTS)).items()}


def saved_adapters(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA run's DCP checkpoint (full fp32 tensors under our names)."""
    metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    shapes = {
        k.removeprefix("model."): torch.Size(v.size)
        for k, v in metadata.items()
        if k.startswith("model.") and ".lora_" in k
    }
    return read_model_tensors(checkpoint_dir, shapes)


def export_merged(
    adapters: Mapping[str, torch.Tensor],
    base: BaseTensors,
    args: ModelArgs,
    cfg: LoRA,
    out_dir: str | Path,
    dtype: torch.dtype,
) -> None:
    """Write base + alpha / rank * B @ A for every adapted linear as a plain HF folder, one
    safetensors shard in memory at a time."""
    with torch.device("meta"):
        layout = {n: (p.shape, dtype) for n, p in Qwen(args).named_parameters()}
    scaling = cfg.alpha / cfg.rank

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        merged = {}
        for name, tensor in base({n: layout[n][0] for n in names}).items():
            tensor = tensor.float().cpu()
            module = name.removesuffix(".weight")
            if f"{module}.lora_A.weight" in adapters:
                tensor = (
                    tensor
                    + scaling * adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"]
                )
            merged[name] = tensor.to(dtype)
        return merged

    save_hf_streaming(layout, load, args, out_dir)
