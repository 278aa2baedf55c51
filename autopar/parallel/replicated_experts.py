"""Expert parallelism where every rank holds the same rows: generation's, whose ranks all decode
the same prompts (under tensor parallelism, whose mixtures see replicated inputs, or alone).

Each of the ``ep`` ranks holds ``num_experts / ep`` experts of every MoE layer (``Shard(0)``
DTensors over the mesh, as training's ``ExpertParallel`` lays them out, so the same checkpoint
loads). Training's all-to-all would have each rank send its copy of the rows to their experts'
ranks, which would compute every row ``ep`` times; here each rank already holds every row, so it
runs its own experts on their rows (1 / ep of the experts' work, none redundant) and one
all-reduce of the routed rows fills in the others' (each row computed on one rank, zeros on the
rest: the sum is that rank's result bit for bit, so every rank gets one device's rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from autopar.models.args import ModelArgs
from autopar.models.moe import Experts, run_experts
from autopar.parallel.expert_parallel import local


class ExpertsOnReplicatedRows(ParallelStyle):
    """Shard an ``Experts`` module's weights over the mesh; its callers hold the same rows on
    every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, Experts), (
            f"{type(self).__name__} applies to Experts, not {type(module).__name__}"
        )
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=False))
        module.__class__ = SplitExperts
        module.mesh = device_mesh
        return module


class SplitExperts(Experts):
    """``Experts`` split over a mesh whose ranks all hold the same rows."""

    mesh: DeviceMesh

    @torch.no_grad()
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, H): rows grouped by global expert, ``counts[e]`` for expert e."""
        weights = (local(self.gate_proj), local(self.up_proj), local(self.down_proj))
        per_rank = weights[0].shape[0]
        first = self.mesh.get_local_rank() * per_rank
        ends = [0, *counts.cumsum(0).tolist()]  # one host sync per layer
        start, stop = ends[first], ends[first + per_rank]
        out = x.new_zeros(x.shape[0], weights[2].shape[1])  # (N, H)
        out[start:stop] = run_experts(x[start:stop], counts[first : first + per_rank], *weights, self.kernel)
        dist.all_reduce(out, group=self.mesh.get_group())
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, split over {self.mesh.size()} ranks holding the same rows"


def split_experts(model: nn.Module, mesh: DeviceMesh, args: ModelArgs) -> None:
    """Split every mixture's experts of ``model`` (its MTP head's too) over ``mesh``."""
    plan = {
        f"layers.{i}.mlp.experts": ExpertsOnReplicatedRows()
        for i in model.layers
        if args.is_moe_layer(int(i))
    }
    if getattr(model, "mtp", None) is not None and args.moe:  # Qwen3.5's head: experts in every layer
        plan.update({f"mtp.layers.{i}.mlp.experts": ExpertsOnReplicatedRows() for i in model.mtp.layers})
    parallelize_module(model, mesh, plan)
