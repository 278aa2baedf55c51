"""AdamW over the model parts, and the learning rate as a pure function of the step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from autopar.config.sections import LRScheduler, Optimizer
from autopar.parallel.world import by_mesh


def build_optimizers(parts: Iterable[nn.Module], cfg: Optimizer) -> list[torch.optim.AdamW]:
    """One AdamW per model part (pipeline stages keep their own, so their state dicts are
    keyed by the part's parameter names)."""
    return [build_optimizer(part, cfg) for part in parts]


def build_optimizer(part: nn.Module, cfg: Optimizer) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm scales and biases are not decayed,
    as in Megatron-LM), so decay never pulls a norm scale toward zero. Parameters on another
    device mesh (expert weights) get groups of their own: one group's foreach update runs on
    one mesh."""
    params = [p for p in part.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    groups = [{"params": group, "weight_decay": cfg.weight_decay} for group in by_mesh(decay)]
    groups += [{"params": group, "weight_decay": 0.0} for group in by_mesh(no_decay)]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def follow_config(optimizers: Iterable[torch.optim.Optimizer], cfg: Optimizer) -> None:
    """Set every param group's hyperparameters from ``cfg`` after a resume (torch's
    ``load_state_dict`` puts back the saved groups' betas, eps, weight decay and kernel choice;
    the lr is set every step). A group decays as ``build_optimizer`` made it: matrices only.
    A step count moves where the kernel now keeps it (fused: beside the parameter; else the CPU)."""
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            decays = all(p.ndim >= 2 for p in group["params"])
            group.update(
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
                weight_decay=cfg.weight_decay if decays else 0.0,
                fused=impl == "fused",
                foreach=impl == "foreach",
            )
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if "step" in state:
                    device = p.device if group["fused"] or group.get("capturable") else torch.device("cpu")
                    state["step"] = state["step"].to(device=device, dtype=torch.float32)


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (1-based): linear warmup, an
    optional stable phase (WSD, when ``decay_ratio`` is set), then linear/sqrt/cosine decay
    to ``min_lr_factor`` at ``total_steps``. A warmup longer than the run is cut to the run
    (as torchtitan does; the trainer says so)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        return step / warmup
    if cfg.decay_ratio is None:
        decay_steps = total_steps - warmup
    else:
        decay_steps = max(1, round(total_steps * cfg.decay_ratio))
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
