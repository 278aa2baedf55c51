"""HF PEFT LoRA adapter folders: ``adapter_config.json`` and ``adapter_model.safetensors``
under peft's names, which ``peft.PeftModel.from_pretrained(base, folder)`` loads.

Adapters are named as our model names them (``layers.0.self_attn.q_proj.lora_A.weight``);
peft prefixes the HF name with ``base_model.model.`` and drops the adapter name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from autopar.models.hf import to_hf_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_name(name: str) -> str:
    return _PEFT_PREFIX + to_hf_name(name)


def our_name(peft: str) -> str:
    return peft.removeprefix(_PEFT_PREFIX).removeprefix("model.")


@dataclass(frozen=True)
class AdapterShape:
    """What peft needs to know of our adapters besides their tensors (``lora.*`` of the job)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]


def adapter_config(cfg: AdapterShape, base_model: str | None) -> dict[str, object]:
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
    adapters: Mapping[str, torch.Tensor], cfg: AdapterShape, path: str | Path, base_model: str | None = None
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
