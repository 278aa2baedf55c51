"""Tensor (and sequence) parallelism as data: module path -> ParallelStyle.

Column-wise q/k/v/gate/up, row-wise o/down, so each block needs one all-reduce (TP) or one
all-gather + reduce-scatter pair (TP+SP) per sublayer. With sequence parallel the norms and
residual stream are sharded along the sequence; the Qwen3 per-head q/k norms see a tensor
whose head dim (2) is sharded, so they use ``SequenceParallel(sequence_dim=2)``: their weight
is replicated and its gradient summed over the heads each rank owns. Tied embeddings stay
tied because the embedding (row-wise) and the head (column-wise) both shard dim 0.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.weak import WeakIdKeyDictionary

from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.mtp import head_layer_args


class ReplicateParams(ParallelStyle):
    """Parameters become replicated DTensors and the module runs on the full local input.

    Used for the norms when TP runs without sequence parallel, so that every parameter of
    a TP model is a DTensor on the same mesh (gradient clipping and FSDP need that).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _on_local_inputs(module, device_mesh, Replicate())


def _on_local_inputs(module: nn.Module, device_mesh: DeviceMesh, placement: Placement) -> nn.Module:
    """``module`` with replicated DTensor parameters, taking its local tensor inputs as
    DTensors placed by ``placement`` and returning its output as a local tensor."""

    def to_dtensor(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [placement], run_check=False) if _is_local(x) else x for x in inputs
        )

    return distribute_module(
        module,
        device_mesh,
        input_fn=to_dtensor,
        output_fn=lambda _mod, out, _mesh: out.to_local(),
    )


def _is_local(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def _linear_styles(float8: bool, fp8_all_gather: bool) -> Styles:
    """(column-wise, row-wise, input-preparing) style classes. torchao's FP8 styles move
    FP8 bytes in the TP collectives (forward and backward); gloo cannot send float8
    tensors, so on CPU the collectives stay in high precision and only the matmuls are FP8."""
    if not (float8 and fp8_all_gather):
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


class HeadShardedParams(ParallelStyle):
    """A module whose parameters are all per head along dim 0 (Gated DeltaNet's convolution,
    decay and bias: ``DeltaRuleCore``) runs its ``compute`` on the rank's local heads: the
    parameters become ``Shard(0)`` DTensors and enter it as their local shards, beside the
    local head-sharded activations the column-wise projections give. The module becomes a
    subclass of its class that does so (``on_local_heads``), as its repr shows."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__ = on_local_heads(type(module))
        return module


@functools.cache
def on_local_heads(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` computing on the local shards of its head-sharded parameters (one subclass per
    class, so compiled blocks share guards)."""

    def forward(self: nn.Module, *inputs: Any) -> torch.Tensor:
        return self.compute(*inputs, *(p.to_local() for p in self.parameters(recurse=False)))

    return type(f"{cls.__name__}OnLocalHeads", (cls,), {"forward": forward, "__module__": __name__})


class HeadShardedNorm(ParallelStyle):
    """A norm over each head's dims applied to head-sharded inputs (all of them local tensors
    sharded along ``head_dim``): its weight is replicated and its gradient summed over the
    heads each rank owns. Unlike ``SequenceParallel``, every tensor input is sharded (Gated
    DeltaNet's norm also takes the gate z)."""

    def __init__(self, head_dim: int = 2) -> None:
        super().__init__()
        self.head_dim = head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _on_local_inputs(module, device_mesh, Shard(self.head_dim))


Styles = tuple[type, type, type]
"""(column-wise, row-wise, input-preparing) style classes."""


def _prepare_input(prepare: type, layouts: tuple, first_linear: str) -> ParallelStyle:
    desired = (Replicate(),) + (None,) * (len(layouts) - 1)
    extra = {"fwd_config_submodule_fqn": first_linear} if prepare is not PrepareModuleInput else {}
    return prepare(input_layouts=layouts, desired_input_layouts=desired, **extra)


def _attention(styles: Styles, residual: Placement, args: ModelArgs) -> dict[str, ParallelStyle]:
    """Softmax attention, plain or gated (whose q_proj holds [query | gate] per head, so
    column-wise shards keep each head's pair together)."""
    colwise, rowwise, prepare = styles
    plan = {
        "self_attn": _prepare_input(prepare, (residual, None, None), "q_proj"),  # x, positions, mask
        "self_attn.q_proj": colwise(),
        "self_attn.k_proj": colwise(),
        "self_attn.v_proj": colwise(),
        "self_attn.o_proj": rowwise(output_layouts=residual),
    }
    if args.qk_norm:
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _gated_deltanet(styles: Styles, residual: Placement, args: ModelArgs) -> dict[str, ParallelStyle]:
    """Gated DeltaNet by head: every projection column-wise (q and k by key head; v, z, a
    and b by value head, so each rank's value heads read its own key heads), the per-head
    core on local heads, the per-head norm replicated, out_proj row-wise."""
    colwise, rowwise, prepare = styles
    projections = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_a", "in_proj_b")
    return {
        "linear_attn": _prepare_input(prepare, (residual, None), "in_proj_q"),  # x, documents
        **{f"linear_attn.{name}": colwise() for name in projections},
        "linear_attn.core": HeadShardedParams(),
        "linear_attn.norm": HeadShardedNorm(head_dim=2),
        "linear_attn.out_proj": rowwise(output_layouts=residual),
    }


def _mlp(styles: Styles, residual: Placement) -> dict[str, ParallelStyle]:
    colwise, rowwise, prepare = styles
    return {
        "mlp": _prepare_input(prepare, (residual,), "gate_proj"),
        "mlp.gate_proj": colwise(),
        "mlp.up_proj": colwise(),
        "mlp.down_proj": rowwise(output_layouts=residual),
    }


def _moe(residual: Placement) -> dict[str, ParallelStyle]:
    """A mixture of experts (with its shared expert, if any) is not split by tensor
    parallelism: every TP rank runs it on the whole (gathered) sequence with the same
    weights (split over ranks by expert parallelism, if any), so its outputs and gradients
    agree across the TP group; its output then takes the residual's layout again."""
    return {
        "mlp": PrepareModuleInputOutput(
            input_layouts=(residual,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(), None),  # (output, routing statistics)
            desired_output_layouts=(residual, None),
            use_local_output=True,
        )
    }


MIXER_PLANS = {"attention": _attention, "gated_attention": _attention, "linear_attention": _gated_deltanet}
"""Each token mixer's plan (``ModelArgs.layer_kind``): a new kind of layer adds a row."""


def block_plan(
    args: ModelArgs,
    sequence_parallel: bool,
    float8: bool = False,
    fp8_all_gather: bool = False,
    layer: int = 0,
) -> dict[str, ParallelStyle]:
    """Styles for the modules of block ``layer``, keyed by path within the block: its norms,
    then its token mixer's and its feed-forward's plans."""
    styles = _linear_styles(float8, fp8_all_gather)
    residual = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else ReplicateParams()
    mixer, feed_forward = args.layer_kind(layer)
    return {
        "input_layernorm": norm,
        **MIXER_PLANS[mixer](styles, residual, args),
        "post_attention_layernorm": norm,
        **(_moe(residual) if feed_forward == "moe" else _mlp(styles, residual)),
    }


def top_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for the embedding, final norm and head. With loss parallel the head's output
    stays a vocab-sharded DTensor for ``loss_parallel()`` cross-entropy."""
    residual = Shard(1) if sequence_parallel else Replicate()
    return {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "norm": SequenceParallel() if sequence_parallel else ReplicateParams(),
        "lm_head": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def head_plan(
    args: ModelArgs,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
    fp8_all_gather: bool = False,
) -> dict[str, ParallelStyle]:
    """Qwen3.5's multi-token-prediction head (``mtp.*``; none without one): its norms as the
    model's, ``fc`` column-wise back to the residual's layout, its layers by the plan of a
    full-attention block. Under sequence parallel the document gate's ``keep`` (built whole)
    takes the sequence-sharded layout of the embeddings it multiplies. The head's logits go
    through the model's own ``lm_head`` (``top_plan``), or, detached (``mtp.detach``), through
    its weight laid out as ``lm_head`` lays it out: the states whole, the logits vocab-sharded
    under loss parallel, else gathered."""
    if not args.mtp_num_hidden_layers:
        return {}
    residual = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else ReplicateParams()
    plan: dict[str, ParallelStyle] = {
        "mtp.pre_fc_norm_embedding": norm,
        "mtp.pre_fc_norm_hidden": norm,
        "mtp.fc": ColwiseParallel(input_layouts=residual, output_layouts=residual),
        "mtp.norm": norm,
        "mtp.detached_output": PrepareModuleInputOutput(
            input_layouts=(residual, None),  # (states, the output head's weight)
            desired_input_layouts=(Replicate(), None),
            output_layouts=(Shard(-1),),
            desired_output_layouts=(Shard(-1) if loss_parallel else Replicate(),),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["mtp.next_gate"] = PrepareModuleInput(
            input_layouts=(Shard(1), Replicate()),  # (embeddings, keep)
            desired_input_layouts=(Shard(1), Shard(1)),
            use_local_output=True,
        )
    layer_args = head_layer_args(args)
    for i in range(args.mtp_num_hidden_layers):
        block = block_plan(layer_args, sequence_parallel, float8, fp8_all_gather, 0)
        plan.update({f"mtp.layers.{i}.{path}": style for path, style in block.items()})
    return plan


def tp_plan(
    args: ModelArgs,
    layer_ids: list[str],
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
    fp8_all_gather: bool = False,
) -> dict[str, ParallelStyle]:
    """The whole model's plan, for the given layers (a pipeline stage holds a subset), and
    the multi-token-prediction head's when the model has one."""
    plan = top_plan(sequence_parallel, loss_parallel)
    for i in layer_ids:
        block = block_plan(args, sequence_parallel, float8, fp8_all_gather, int(i))
        plan.update({f"layers.{i}.{path}": style for path, style in block.items()})
    return plan | head_plan(args, sequence_parallel, loss_parallel, float8, fp8_all_gather)


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    args: ModelArgs,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
) -> None:
    """Parallelize the parts ``model`` holds (parts set to None are skipped). ``float8``:
    the block linears are torchao Float8Linear and get its FP8 TP styles."""
    fp8_all_gather = float8 and mesh.device_type == "cuda"
    plan = tp_plan(args, list(model.layers.keys()), sequence_parallel, loss_parallel, float8, fp8_all_gather)
    present = {k: v for k, v in plan.items() if _resolves(model, k)}
    parallelize_module(model, mesh, present)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # parallelize_module gave the head its own DTensor parameter


def _resolves(model: nn.Module, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def keep_embedding_grad_sharded(model: nn.Module) -> None:
    """Make a TP-sharded embedding's gradient land in the weight's own placement. The
    vocabulary-parallel lookup's backward sees every token's output gradient, so DTensor
    computes the gradient replicated, whole on every rank. Kept so wherever gradients outlive
    the backward (accumulation, pipelines), it holds the whole vocabulary in float32 on each
    TP rank: the ``.grad`` without FSDP (2.9 GiB at Qwen3-32B), FSDP's unsharded accumulated
    gradient with it (4.7 GiB at Qwen3.5-27B: its float32 cast, beside the whole compute-dtype
    one). The hook keeps a copy of the rank's rows, not a view, so the whole gradient is
    freed. It goes on the weight the lookup reads, once, at the forward: FSDP's unsharded
    parameter (which exists from its first all-gather on and stays the same one), or without
    FSDP under mixed precision each forward's compute-dtype cast, whose backward then casts
    only the rows to float32."""
    embedding = getattr(model, "embed_tokens", None)
    if isinstance(embedding, nn.Module):
        embedding.register_forward_pre_hook(functools.partial(_hook_sharded_grad, WeakIdKeyDictionary()))


def _hook_sharded_grad(hooked: WeakIdKeyDictionary, module: nn.Module, args: object) -> None:
    """Once per weight: store its gradient in its own placement (``keep_embedding_grad_sharded``)."""
    weight = module.weight
    if weight in hooked or not isinstance(weight, DTensor) or not weight.requires_grad:
        return  # already, not TP-sharded, or frozen under LoRA
    if all(isinstance(p, Replicate) for p in weight.placements):
        return
    mesh, placements = weight.device_mesh, weight.placements

    def to_placement(grad: DTensor) -> DTensor:
        if grad.placements == placements:
            return grad
        rows = grad.redistribute(mesh, placements).to_local()  # DTensor copies the rows out
        if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size():
            rows = rows.clone()  # a view would keep the whole gradient alive
        return DTensor.from_local(rows, mesh, placements, run_check=False)

    hooked[weight] = weight.register_hook(to_placement)
