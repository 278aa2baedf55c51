"""A LoRA run's adapters over its base, for ``python -m autopar.generate --generate.adapters
PATH``: read from the run's DCP checkpoint (which holds the trained adapters only; rank and
alpha come from the job's ``[lora]`` section) or from its exported peft adapter folder
(``adapter_config.json`` says both), then merged into the base's weights
(``W + alpha / rank * B @ A``), so decoding runs the plain model at the base's speed. In fp32
the merged model's logits are the adapted model's up to the order of two sums.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from autopar.config import ConfigError, JobConfig
from autopar.models.family import family_of
from autopar.models.hf_names import MTP_PREFIX
from autopar.models.qwen import Qwen
from autopar.training.checkpointing.adapters import (
    ADAPTER_CONFIG,
    load_adapter,
    low_rank_update,
    saved_adapters,
)

FIX = (
    "give a LoRA run's checkpoint step folder (<dump_folder>/checkpoint/step-N, with the run's "
    "--job.config) or its exported adapter folder (<dump_folder>/hf/step-N)"
)


def read_adapters(path: str, job: JobConfig) -> tuple[dict[str, torch.Tensor], float]:
    """The adapters at ``path`` under our names and their scaling alpha / rank; one line for
    a path that holds none, or a checkpoint whose job does not say their rank and alpha."""
    folder = Path(path)
    where = f"generate.adapters={path}"
    if (folder / ADAPTER_CONFIG).is_file():
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        return load_adapter(folder), config["lora_alpha"] / config["r"]
    if not (folder / ".metadata").is_file():
        raise ConfigError(f"{where} holds neither {ADAPTER_CONFIG} nor a DCP checkpoint; {FIX}")
    adapters = saved_adapters(folder)
    if not adapters:
        raise ConfigError(
            f"{where} is a checkpoint without LoRA adapters (a full run's weights); load it with "
            "--checkpoint.initial_load_path instead"
        )
    lora = job.lora
    if not lora.enable:
        raise ConfigError(
            f"{where} is a LoRA run's checkpoint, whose rank and alpha its job's [lora] section says; "
            "pass that run's --job.config (lora.enable = true)"
        )
    ranks = {a.shape[-2] for n, a in adapters.items() if n.endswith(("lora_A.weight", "_A"))}
    if ranks != {lora.rank}:
        raise ConfigError(
            f"{where} holds adapters of rank {sorted(ranks)[0]}, and lora.rank = {lora.rank}; "
            "pass the run's own --job.config (or --lora.rank it trained with)"
        )
    return adapters, lora.alpha / lora.rank


def split_fused(adapters: Mapping[str, torch.Tensor], model: Qwen) -> dict[str, torch.Tensor]:
    """``adapters`` with peft's one adapter on an HF fused linear (``in_proj_qkv``) as ours on
    its pieces: the shared A for each, B's rows cut at the pieces' output sizes (a model
    without the pieces keeps the fused name, which then adapts nothing and is refused)."""
    weights = dict(model.named_parameters())
    split: dict[str, torch.Tensor] = {}
    for name, tensor in adapters.items():
        for hf, pieces in family_of(model.args).fused_linears.items():
            names = [name.replace(f"{hf}.lora_", f"{piece}.lora_") for piece in pieces]
            if f".{hf}.lora_" in f".{name}" and all(_weight_name(n) in weights for n in names):
                if name.endswith("lora_A.weight"):
                    split.update(dict.fromkeys(names, tensor))
                else:
                    sizes = [weights[_weight_name(n)].shape[0] for n in names]
                    split.update(zip(names, tensor.split(sizes)))
                break
        else:
            split[name] = tensor
    return split


def _weight_name(adapter: str) -> str:
    """The weight a linear's adapter ``adapter`` updates."""
    return adapter.rpartition(".lora_")[0] + ".weight"


def merge_adapters(
    model: Qwen, adapters: Mapping[str, torch.Tensor], scaling: float, path: str, job: JobConfig
) -> None:
    """Add ``adapters`` (``read_adapters``' of ``path``) into ``model``'s weights, in fp32; one
    line when an adapter has no weight of its shape here (trained on another base)."""
    adapters = split_fused({n: t.float() for n, t in adapters.items()}, model)
    merged: set[str] = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            try:
                update = low_rank_update(name, adapters)
            except RuntimeError:  # B @ A of mismatched ranks
                update = None
            if update is None:
                continue
            if update.shape != param.shape:
                raise ConfigError(
                    f"generate.adapters={path}: the adapters of {name} make {tuple(update.shape)}, and the "
                    f"base's weight is {tuple(param.shape)}; load the base that run trained on "
                    "(checkpoint.initial_load_path, model.flavor)"
                )
            param += scaling * update.to(param.dtype)
            merged |= {a for a in adapters if a.startswith(name.rpartition(".")[0] + ".lora")}
    has_head = any(n.startswith(MTP_PREFIX) for n, _ in model.named_parameters())
    left = sorted(a for a in adapters.keys() - merged if has_head or not a.startswith(MTP_PREFIX))
    if left:
        raise ConfigError(
            f"generate.adapters={path}: {left[0]} adapts no weight of {job.model.name}/{job.model.flavor}; "
            "load the base that run trained on (checkpoint.initial_load_path, model.name, model.flavor)"
        )
