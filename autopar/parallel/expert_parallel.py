"""Expert parallelism as data: ``{"layers.N.mlp.experts": ExpertParallel()}`` per MoE layer.

Each of the ``ep`` ranks holds ``num_experts / ep`` experts of every MoE layer. The style
shards the stacked expert weights along the expert dim (``Shard(0)`` DTensors on the ep mesh,
so a checkpoint holds the global tensors and loads under any EP degree) and wraps the
experts' call, which receives this rank's token copies grouped by global expert:

1. dispatch: the per-expert counts are exchanged (all-to-all), so each rank learns how many
   rows every peer sends to each of its experts; the rows follow (autograd-aware all-to-all
   with those split sizes) and are regrouped from (source rank, expert) order to (expert,
   source rank) order;
2. compute: ``RoutedExperts.local_experts``, ``models.moe.run_experts`` with the module's kernel
   on this rank's weight shards (LoRA's routed experts add their adapters' shards);
3. combine: the inverse regrouping and the reverse all-to-all bring every row home, in the
   order it left, so the router's weighting and the sum over top-k run as on one device.

FSDP then shards each rank's expert weights over the data ranks EP did not take
(``efsdp``, see ``plans/mesh.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from autopar.config.errors import ConfigError
from autopar.config.sections import ActivationCheckpoint
from autopar.models.args import ModelArgs
from autopar.models.moe import ExpertKernel, Experts, run_experts
from autopar.parallel.activation_checkpoint import per_op
from autopar.parallel.torch_internals import funcol, is_fake


def check_ep(ep: int, ac: ActivationCheckpoint, compiled: bool) -> None:
    """Expert parallelism's limits with the other transformations."""
    if ep > 1 and compiled and per_op(ac):
        # measured (torch 2.13): the experts' own FSDP group records one more profiler range
        # when the block is recomputed; eager blocks run those ranges past the per-op
        # bookkeeping (plans/activation_checkpoint.py), compiled ones take only torch's own
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} with compile.enable=true and per-op activation "
            "checkpointing fails in backward; use --activation_checkpoint.mode full, a layer interval "
            "(--activation_checkpoint.selective_ac_option 2), or --compile.enable false"
        )


class ExpertParallel(ParallelStyle):
    """Shard an ``Experts`` module's weights over the mesh and route its rows by all-to-all."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, Experts), f"ExpertParallel applies to Experts, not {type(module).__name__}"
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__ = RoutedExperts
        module.mesh = device_mesh
        return module


class RoutedExperts(Experts):
    """``Experts`` whose weights are sharded over an expert-parallel mesh: each row travels to
    its expert's rank by all-to-all and back (what ``ExpertParallel`` makes of an ``Experts``)."""

    mesh: DeviceMesh

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return _routed_forward(self, self.mesh, x, counts)

    def local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received, grouped by local expert."""
        weights = (local(self.gate_proj), local(self.up_proj), local(self.down_proj))
        return run_experts(x, counts, *weights, self.kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ep={self.mesh.size()}"


def apply_expert_kernel(model: nn.Module, kernel: ExpertKernel) -> None:
    """Set every ``Experts``' kernel to the job's choice."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.kernel = kernel


def expert_plan(args: ModelArgs, layer_ids: list[str]) -> dict[str, ParallelStyle]:
    """The plan for the given layers (a pipeline stage holds a subset)."""
    return {f"layers.{i}.mlp.experts": ExpertParallel() for i in layer_ids if args.is_moe_layer(int(i))}


def apply_ep(model: nn.Module, mesh: DeviceMesh, args: ModelArgs) -> None:
    plan = expert_plan(args, list(model.layers.keys()))
    if getattr(model, "mtp", None) is not None and args.moe:  # Qwen3.5's head: experts in every layer
        plan.update({f"mtp.layers.{i}.mlp.experts": ExpertParallel() for i in model.mtp.layers})
    parallelize_module(model, mesh, plan)


def local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an expert-parallel weight (FSDP gathers it to a ``Shard(0)`` DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


@torch.compiler.disable  # split sizes known only at run time: compile traces around it
def _routed_forward(
    module: RoutedExperts, mesh: DeviceMesh, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Rows ``x`` grouped by global expert (``counts[e]`` for expert e) through their experts,
    wherever those live; the result in the rows' order."""
    group, ranks = mesh.get_group(), mesh.size()
    send_counts = counts.view(ranks, -1)  # (destination rank, its local expert)
    # (source rank, this rank's local expert); a functional collective, so that per-op
    # activation checkpointing keeps its result instead of exchanging again in backward
    recv_counts = funcol.all_to_all_single(send_counts.flatten(), None, None, group).view(ranks, -1)
    send_sizes, recv_sizes = _split_sizes(send_counts, recv_counts, x.shape[0])
    rows = funcol.all_to_all_single_autograd(x, recv_sizes, send_sizes, group)
    # received in (source, expert) blocks; the experts want (expert, source)
    local_experts = recv_counts.shape[1]
    block = torch.arange(recv_counts.numel(), device=x.device).repeat_interleave(
        recv_counts.flatten(), output_size=sum(recv_sizes)
    )
    source, expert = block // local_experts, block % local_experts
    order = (expert * ranks + source).argsort(stable=True)
    out = module.local_experts(rows[order], recv_counts.sum(0))
    home = out[order.argsort()]  # back to (source, expert) order; a gather saves no rows
    return funcol.all_to_all_single_autograd(home, send_sizes, recv_sizes, group)


def _split_sizes(
    send_counts: torch.Tensor, recv_counts: torch.Tensor, rows: int
) -> tuple[list[int], list[int]]:
    """Rows this rank sends to each peer and receives from each (one host sync). Fake tensors
    (the dry run) carry no counts: there routing is taken as balanced, ``rows / ep`` each way,
    which is what the planner assumes too."""
    if is_fake(send_counts):
        ranks = send_counts.shape[0]
        balanced = [rows // ranks + (r < rows % ranks) for r in range(ranks)]
        return balanced, balanced
    return send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
