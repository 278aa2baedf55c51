"""LoRA adapters on disk: the HF PEFT adapter folder (``adapter_config.json`` and
``adapter_model.safetensors`` under peft's names, which ``peft.PeftModel.from_pretrained(base,
folder)`` loads), and the merged model.

Our adapter names are the model's (``layers.0.self_attn.q_proj.lora_A.weight``); peft prefixes
the HF name with ``base_model.model.`` and drops the adapter's name. Expert adapters are peft's
``target_parameters`` on transformers' fused experts, ``gate_up_proj`` then ``down_proj``: peft
nests one wrapper per parameter, so gate/up's adapters sit one ``base_layer.`` deeper, and it
lays each expert's adapters side by side in one linear (A: (E*r, in) expert-major, B: (out,
r*E) expert-minor), where ours are stacked (E, r, in) and (E, out, r).
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
from autopar.models.family import build_model, family_of
from autopar.models.hf import save_hf_like
from autopar.models.hf_layout import TEXT_PREFIX
from autopar.models.hf_names import MTP_PREFIX, to_hf_name
from autopar.training.checkpointing.dcp_state import read_model_tensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."

BaseTensors = Callable[[Mapping[str, torch.Size]], Mapping[str, torch.Tensor]]
"""{name: shape} -> the base model's full tensors of those names."""


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""peft's ``target_parameters`` for our expert adapters, in the order that nests them as
``_EXPERT_NAMES`` says."""
_EXPERT_NAMES = {
    "lora_gate_up_A": "base_layer.lora_A.weight",
    "lora_gate_up_B": "base_layer.lora_B.weight",
    "lora_down_A": "lora_A.weight",
    "lora_down_B": "lora_B.weight",
}
"""Our expert adapter -> its peft name under the experts module."""


def peft_name(name: str) -> str:
    """peft's name of our adapter ``name``; Qwen3.5's head (``mtp.*``) sits at the top of the
    HF model, outside its text prefix."""
    module, _, leaf = name.rpartition(".")
    prefix = "" if name.startswith(MTP_PREFIX) else TEXT_PREFIX
    return _PEFT_PREFIX + to_hf_name(
        f"{module}.{_EXPERT_NAMES[leaf]}" if leaf in _EXPERT_NAMES else name, prefix
    )


def our_name(peft: str) -> str:
    name = peft.removeprefix(_PEFT_PREFIX).removeprefix("model.")
    for ours, theirs in _EXPERT_NAMES.items():
        if name.endswith(f".mlp.experts.{theirs}"):
            return f"{name.removesuffix(theirs)}{ours}"
    return name


def to_peft_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Our adapter as peft stores it (expert adapters side by side in one linear)."""
    if name.endswith("_A") and tensor.dim() == 3:  # (E, r, in) -> (E*r, in)
        return tensor.flatten(0, 1)
    if name.endswith("_B") and tensor.dim() == 3:  # (E, out, r) -> (out, r*E), expert fastest
        return tensor.permute(1, 2, 0).flatten(1)
    return tensor


def from_peft_layout(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """``to_peft_layout``'s inverse, for adapters of rank ``rank``."""
    if name.endswith("_A") and ".lora_" in name:
        return tensor.unflatten(0, (-1, rank))
    if name.endswith("_B") and ".lora_" in name:
        return tensor.unflatten(1, (rank, -1)).permute(2, 0, 1)
    return tensor


def adapter_config(cfg: LoRA, base_model: str | None) -> dict[str, object]:
    """peft's ``LoraConfig`` for our adapters (its matching rule for ``target_modules`` is ours)."""
    experts = "experts" in cfg.target_modules
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(t for t in cfg.target_modules if t != "experts"),
        "target_parameters": EXPERT_PARAMETERS if experts else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def fuse_pieces(adapters: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """``adapters`` with the pieces of each HF fused linear (``in_proj_q/k/v``) as the one
    adapter peft puts on the fused linear (``in_proj_qkv``): their shared A, their Bs stacked
    in the fused rows' order."""
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in adapters.items():
        found = _fused_name(name, family_of(args).fused_linears)
        if found is None:
            plain[name] = tensor
        else:
            fused.setdefault(found[0], []).append((found[1], tensor))
    for name, parts in fused.items():
        parts.sort(key=lambda part: part[0])
        if name.endswith("lora_A.weight"):  # one A, shared: every piece holds it
            plain[name] = parts[0][1]
        else:
            plain[name] = torch.cat([t for _, t in parts], dim=0)
    return plain


def _fused_name(name: str, fused: Mapping[str, tuple[str, ...]]) -> tuple[str, int] | None:
    """(the fused linear's adapter name, the piece's index) of a piece's adapter ``name``."""
    for hf, pieces in fused.items():
        for index, piece in enumerate(pieces):
            marker = f".{piece}.lora_"
            if marker in f".{name}":
                return name.replace(f"{piece}.lora_", f"{hf}.lora_"), index
    return None


def save_adapter(
    adapters: Mapping[str, torch.Tensor],
    cfg: LoRA,
    path: str | Path,
    args: ModelArgs,
    base_model: str | None = None,
) -> None:
    """Write ``adapters`` (full tensors under our names) as a peft adapter folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapters = fuse_pieces(adapters, args)
    tensors = {peft_name(n): to_peft_layout(n, t.detach()).contiguous().cpu() for n, t in adapters.items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")


def load_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapters of a peft folder under our names, in our layout."""
    rank = json.loads((Path(path) / ADAPTER_CONFIG).read_text())["r"]
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    return {our_name(n): from_peft_layout(our_name(n), t, rank) for n, t in tensors.items()}


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
    source: str | Path | None = None,
) -> None:
    """Write base + alpha / rank * B @ A for every adapted linear as an HF folder, one
    safetensors shard in memory at a time, in the layout of ``source`` (the HF folder the
    base came from): a vision-language source's vision tower and MTP head come along."""
    with torch.device("meta"):
        layout = {n: (p.shape, dtype) for n, p in build_model(args).named_parameters()}
    scaling = cfg.alpha / cfg.rank

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        merged = {}
        for name, tensor in base({n: layout[n][0] for n in names}).items():
            tensor = tensor.float().cpu()
            update = low_rank_update(name, adapters)
            merged[name] = (tensor if update is None else tensor + scaling * update).to(dtype)
        return merged

    save_hf_like(layout, load, args, out_dir, source)


def low_rank_update(name: str, adapters: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """B @ A (unscaled) of the base parameter ``name``, or None if it has no adapters; for a
    stacked expert weight, one per expert (gate and up share A, each taking its rows of B)."""
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and f"{module}.lora_A.weight" in adapters:
        return adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"]
    if f"{module}.lora_gate_up_A" not in adapters:
        return None
    if leaf == "down_proj":
        return adapters[f"{module}.lora_down_B"] @ adapters[f"{module}.lora_down_A"]
    gate_b, up_b = adapters[f"{module}.lora_gate_up_B"].chunk(2, dim=1)
    return (gate_b if leaf == "gate_proj" else up_b) @ adapters[f"{module}.lora_gate_up_A"]
