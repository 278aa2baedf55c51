"""FSDP2 (and HSDP) as data: an ordered list of (module group, reshard_after_forward).

Each block is its own group so its parameters are gathered just before use and freed after.
With tied embeddings the embedding and head share one parameter, which must live in one
group: they are left to the root, whose parameters stay gathered from forward to backward.
"""

from __future__ import annotations

import warnings
from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

ReshardPolicy = Literal["default", "always", "never"]


def reshards_blocks(policy: str, pipelined: bool) -> bool:
    """Whether FSDP frees each block's gathered weights after its forward (and gathers them
    again for backward): ``default`` does except under pipelining, where every micro-batch
    would gather them again."""
    return {"always": True, "never": False, "default": not pipelined}[policy]


def fsdp_groups(model: nn.Module, policy: ReshardPolicy, pipelined: bool) -> list[tuple[list[str], bool]]:
    """[(module paths sharded together, reshard_after_forward)], root excluded.

    Blocks reshard as ``reshards_blocks`` says; the last group is never resharded by default
    because backward needs it first.
    """
    reshard = reshards_blocks(policy, pipelined)
    tied = (
        model.embed_tokens is not None
        and model.lm_head is not None
        and (model.embed_tokens.weight is model.lm_head.weight)
    )
    groups: list[tuple[list[str], bool]] = []
    if model.embed_tokens is not None and not tied:
        groups.append((["embed_tokens"], reshard))
    groups.extend(([f"layers.{i}"], reshard) for i in model.layers)
    tail = [name for name in ("norm", "lm_head") if getattr(model, name) is not None]
    if tail and not tied:
        groups.append((tail, policy == "always"))
    return groups


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    policy: ReshardPolicy = "default",
    pipelined: bool = False,
    expert_mesh: DeviceMesh | None = None,
    offload: bool = False,
    pin_memory: bool = False,
) -> None:
    """Shard ``model`` over ``mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP), casting
    gathered weights and reducing gradients as ``mp`` says (``plans/mixed_precision.py``).
    Under expert parallelism each MoE layer's experts are a group of their own, sharded over
    ``expert_mesh`` (the data ranks expert parallelism did not take). ``offload`` keeps the
    sharded weights, their gradients (and so the optimizer) in host memory, pinned when
    ``pin_memory`` (for asynchronous copies to and from a GPU).

    Gradients are summed, not averaged: the loss is already divided by the global token
    count, so averaging would divide twice.
    """
    # FSDP2 warns that an FSDP-wrapped embedding returns a view (in-place ops on it would skip
    # the pre-backward hook). Embedding outputs are always views; the model never writes
    # into them in place, so the warning says nothing about this model.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    groups = fsdp_groups(model, policy, pipelined)
    where = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    if expert_mesh is not None:
        blocks = {paths[0]: reshard for paths, reshard in groups if paths[0].startswith("layers.")}
        head = getattr(model, "mtp", None)  # Qwen3.5's multi-token-prediction head
        if head is not None:
            blocks.update(
                dict.fromkeys((f"mtp.layers.{i}" for i in head.layers), reshards_blocks(policy, pipelined))
            )
        for path, reshard in blocks.items():
            experts = getattr(model.get_submodule(path).mlp, "experts", None)
            if experts is not None:
                fully_shard(
                    experts,
                    mesh=expert_mesh,
                    mp_policy=mp,
                    reshard_after_forward=reshard,
                    offload_policy=where,
                )
    for paths, reshard in groups:
        modules = [model.get_submodule(p) for p in paths]
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard,
            offload_policy=where,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=not pipelined, offload_policy=where)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
