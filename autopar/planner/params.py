"""Elements of each module's parameters one rank keeps, before anything is built.

Exact: every parameter's local shard is computed from the tensor-parallel plan's own styles
(``plans.tensor_parallel.tp_plan``) and FSDP2's dim-0 sharding with padding; experts are split
over ``ep`` ranks before FSDP shards them over the data ranks left. Blocks of each kind
(``ModelArgs.layer_kind``: token mixer and feed-forward) have the same parameters, so each
kind is counted once, from its first block. Under LoRA only the adapters train
(``trained_numel``); each adapter's A and B are split as its base weight is
(``ADAPTER_PLACEMENTS``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autopar.config.sections import JobConfig
from autopar.models.args import LayerKind, ModelArgs
from autopar.models.family import build_model
from autopar.models.moe import Experts
from autopar.models.qwen import Qwen
from autopar.parallel.lora import ADAPTER_PLACEMENTS, targeted
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.parallelize import loss_parallel_enabled
from autopar.parallel.tensor_parallel import HeadShardedParams, tp_plan


@functools.lru_cache(maxsize=16)
def meta_model(args: ModelArgs) -> Qwen:
    """The model built on meta (no memory), for its module names and shapes. Cached per
    model: callers must not modify it."""
    with torch.device("meta"):
        return build_model(args)


@functools.lru_cache(maxsize=16)
def layer_kinds(args: ModelArgs) -> tuple[LayerKind, ...]:
    """Each block's kind (``ModelArgs.layer_kind``), in order."""
    return tuple(args.layer_kind(i) for i in range(args.num_hidden_layers))


def _first_blocks(args: ModelArgs) -> dict[LayerKind, str]:
    """The first block of each kind (``ModelArgs.layer_kind``): its layer id."""
    first: dict[LayerKind, str] = {}
    for i in range(args.num_hidden_layers):
        first.setdefault(module_key(args, f"layers.{i}"), str(i))
    return first


@functools.lru_cache(maxsize=16)
def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape (tied weights once), from the model built on meta.
    Cached per model: callers must not modify the result."""
    return {name: tuple(p.shape) for name, p in meta_model(args).named_parameters()}


def _tp_dim(style: object, module_path: str, param: str) -> int | None:
    """The dimension a TP style shards ``param`` along (None: replicated)."""
    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        if module_path == "embed_tokens":
            return 0
        return 1 if param == "weight" else None
    if isinstance(style, HeadShardedParams):  # every parameter per head along dim 0
        return 0
    return None


def local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements of one rank's shard: TP splits ``tp_dim``; FSDP2 then splits dim 0, padded."""
    dims = list(shape)
    if tp_dim is not None and tp > 1:
        dims[tp_dim] = math.ceil(dims[tp_dim] / tp)
    if fsdp > 1:
        dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


ModuleKey = LayerKind | str
"""A top-level module's kind: a block's ``ModelArgs.layer_kind``, else its own path."""


def module_key(args: ModelArgs, module: str) -> ModuleKey:
    """``module``'s kind: blocks of one kind have the same parameters and saves."""
    if not module.startswith("layers."):
        return module
    return args.layer_kind(int(module.split(".")[1]))


def is_block_kind(key: ModuleKey) -> bool:
    return isinstance(key, tuple)


@functools.lru_cache(maxsize=4096)
def key_counts(args: ModelArgs, modules: tuple[str, ...]) -> tuple[tuple[ModuleKey, int], ...]:
    """How many of ``modules`` are of each ``module_key``: the search sums the same stages'
    modules for thousands of plans, so each list is walked once."""
    counts: dict[ModuleKey, int] = {}
    for module in modules:
        key = module_key(args, module)
        counts[key] = counts.get(key, 0) + 1
    return tuple(counts.items())


@functools.lru_cache(maxsize=4096)
def one_of_each_key(args: ModelArgs, modules: tuple[str, ...]) -> tuple[str, ...]:
    """A module of each ``module_key`` among ``modules`` (the last of each), in the order of
    their keys' first appearance."""
    return tuple({module_key(args, m): m for m in modules}.values())


def numel_total(numel: dict[ModuleKey, int], args: ModelArgs, modules: list[str] | tuple[str, ...]) -> int:
    """Elements of ``modules`` given the elements of one module of each kind."""
    return sum(numel.get(key, 0) * count for key, count in key_counts(args, tuple(modules)))


@functools.lru_cache(maxsize=1024)
def module_numel(
    args: ModelArgs, tp: int, fsdp: int, sequence_parallel: bool, loss_parallel: bool, ep: int = 1
) -> dict[ModuleKey, int]:
    """Elements one rank keeps of each top-level module (any one block of each layer kind) under the TP plan's styles and FSDP2's dim-0 sharding over
    ``fsdp``. Experts are split over ``ep`` ranks first (``plans.expert_parallel``), and FSDP
    shards them over the ``fsdp / ep`` data ranks left."""
    first = _first_blocks(args)
    plan = tp_plan(args, list(first.values()), sequence_parallel, loss_parallel)
    numel: dict[ModuleKey, int] = {}
    for name, shape in param_shapes(args).items():
        key = module_key(
            args, ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        )
        if name.startswith("layers.") and name.split(".")[1] != first[key]:
            continue
        module_path, _, param = name.rpartition(".")
        if module_path.endswith(".mlp.experts"):  # not split by TP; stacked along dim 0
            count = local_numel((-(-shape[0] // ep), *shape[1:]), None, 1, max(1, fsdp // ep))
        else:
            tp_dim = _tp_dim(plan.get(module_path), module_path, param)
            count = local_numel(shape, tp_dim, tp, fsdp)
        numel[key] = numel.get(key, 0) + count
    return numel


def modules_numel(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], sharded: bool = True
) -> int:
    """Elements this rank keeps of ``modules`` (top-level paths such as ``layers.3``), FSDP
    shards included when ``sharded``; LoRA's adapters not included (``trained_numel`` counts them)."""
    fsdp = dims.dp_shard * dims.cp if (sharded and dims.fsdp_enabled) else 1
    sequence_parallel = job.parallelism.enable_sequence_parallel
    numel = module_numel(args, dims.tp, fsdp, sequence_parallel, loss_parallel_enabled(job, dims), dims.ep)
    return numel_total(numel, args, modules)


def _adapter_tp_dims(base_dim: int | None) -> tuple[int | None, ...]:
    """The TP dims of (A, B) beside a base weight split along ``base_dim`` (``ADAPTER_PLACEMENTS``)."""
    base = Replicate() if base_dim is None else Shard(base_dim)
    return tuple(p.dim if isinstance(p, Shard) else None for p in ADAPTER_PLACEMENTS[base])


@functools.lru_cache(maxsize=64)
def lora_linears(
    args: ModelArgs, targets: tuple[str, ...]
) -> tuple[tuple[ModuleKey, str, int, int, int | None], ...]:
    """Each linear LoRA adapts among the modules ``module_numel`` counts (the first block of
    each kind, and the modules outside blocks): its ``module_key``, its own name (``q_proj``),
    in and out features, and the dim the TP plan splits its weight along."""
    first = _first_blocks(args)
    plan = tp_plan(args, list(first.values()), False, False)  # (the split dims do not depend on SP)
    adapted = []
    for path, linear in targeted(meta_model(args), list(targets)):
        if not isinstance(linear, nn.Linear):
            continue  # experts: _expert_adapter_numel
        top = ".".join(path.split(".")[:2]) if path.startswith("layers.") else path.split(".")[0]
        key = module_key(args, top)
        if path.startswith("layers.") and path.split(".")[1] != first[key]:
            continue
        dim = _tp_dim(plan.get(path), path, "weight")
        adapted.append((key, path.rpartition(".")[2], linear.in_features, linear.out_features, dim))
    return tuple(adapted)


@functools.lru_cache(maxsize=256)
def adapter_numel(
    args: ModelArgs, targets: tuple[str, ...], rank: int, tp: int, fsdp: int, ep: int = 1
) -> dict[ModuleKey, int]:
    """Elements one rank keeps of each top-level module's LoRA adapters (A: rank x in, B:
    out x rank per adapted linear), split by TP as their base is and then by FSDP on dim 0;
    adapted experts' as the experts are (``_expert_adapter_numel``)."""
    numel: dict[ModuleKey, int] = {}
    for key, _, fan_in, fan_out, dim in lora_linears(args, targets):
        a_dim, b_dim = _adapter_tp_dims(dim)
        count = local_numel((rank, fan_in), a_dim, tp, fsdp) + local_numel((fan_out, rank), b_dim, tp, fsdp)
        numel[key] = numel.get(key, 0) + count
    if experts_adapted(args, targets):
        for kind in (k for k in _first_blocks(args) if k[1] == "moe"):
            numel[kind] = numel.get(kind, 0) + _expert_adapter_numel(args, rank, fsdp, ep)
    return numel


@functools.lru_cache(maxsize=64)
def experts_adapted(args: ModelArgs, targets: tuple[str, ...]) -> bool:
    """Whether LoRA adapts the mixtures' experts (``targets`` names ``experts``)."""
    return any(isinstance(m, Experts) for _, m in targeted(meta_model(args), list(targets)))


def _expert_adapter_numel(args: ModelArgs, rank: int, fsdp: int, ep: int) -> int:
    """One MoE layer's expert adapters on one rank (``lora.LoRAExperts``: gate/up's A and B,
    down's A and B, stacked over experts), split over ``ep`` and then FSDP as experts are."""
    hidden, inter = args.hidden_size, args.moe_intermediate_size
    shapes = ((rank, hidden), (2 * inter, rank), (rank, inter), (hidden, rank))
    experts = -(-args.num_experts // ep)
    return sum(local_numel((experts, *shape), None, 1, max(1, fsdp // ep)) for shape in shapes)


def trained_numel_key(job: JobConfig, dims: ParallelDims, sharded: bool = True) -> tuple:
    """What ``trained_numel`` reads of the job and the degrees, hashable (``numel_of_key``)."""
    fsdp = dims.dp_shard * dims.cp if (sharded and dims.fsdp_enabled) else 1
    if job.lora.enable:
        return ("adapters", tuple(job.lora.target_modules), job.lora.rank, dims.tp, fsdp, dims.ep)
    parallelism = job.parallelism
    return (
        "modules",
        dims.tp,
        fsdp,
        parallelism.enable_sequence_parallel,
        loss_parallel_enabled(job, dims),
        dims.ep,
    )


def numel_of_key(args: ModelArgs, key: tuple) -> dict[ModuleKey, int]:
    """The trained elements a rank keeps of one module of each kind, for a ``trained_numel_key``."""
    return adapter_numel(args, *key[1:]) if key[0] == "adapters" else module_numel(args, *key[1:])


def trained_numel(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], sharded: bool = True
) -> int:
    """Elements with gradients and optimizer state: the adapters under LoRA, else every one."""
    return numel_total(numel_of_key(args, trained_numel_key(job, dims, sharded)), args, modules)


def layer_expert_numel(args: ModelArgs, ep: int) -> int:
    """Elements of one MoE layer's experts on one of ``ep`` ranks (before FSDP shards them)."""
    return 3 * (args.num_experts // ep) * args.moe_intermediate_size * args.hidden_size


def uses_fsdp(job: JobConfig, dims: ParallelDims) -> bool:
    """Whether FSDP wraps the model: over data ranks, or over one for CPU offload."""
    return dims.fsdp_enabled or job.training.enable_cpu_offload


def rank_params(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> int:
    """Parameters of this rank's stage (TP-sharded, not FSDP-sharded), the busiest stage."""
    return modules_numel(
        args, job, dims, _first_stage_modules(-(-args.num_hidden_layers // dims.pp)), sharded=False
    )


@functools.lru_cache(maxsize=64)
def _first_stage_modules(layers: int) -> list[str]:
    """The first ``layers`` blocks and the modules outside them (read, never changed)."""
    return [f"layers.{i}" for i in range(layers)] + ["embed_tokens", "norm", "lm_head"]


def rank_expert_params(args: ModelArgs, dims: ParallelDims) -> int:
    """Expert weights of the busiest stage on one rank (split over EP, not FSDP-sharded)."""
    layers = sum(args.is_moe_layer(i) for i in range(-(-args.num_hidden_layers // dims.pp)))
    return layers * layer_expert_numel(args, dims.ep)


@dataclass(frozen=True, eq=False)
class RankStages:
    """A plan as one pipeline rank holds it: every stage's modules and the ids of its own."""

    args: ModelArgs
    job: JobConfig
    dims: ParallelDims
    stages: list[list[str]]
    ids: list[int]

    @functools.cached_property
    def modules(self) -> list[str]:
        """The top-level modules of the rank's stages, in order."""
        return [m for i in self.ids for m in self.stages[i]]

    @functools.cached_property
    def kind_of(self) -> dict[str, LayerKind]:
        """The kind (``ModelArgs.layer_kind``) of each of the rank's blocks, in order."""
        return block_kinds(self.args, tuple(self.modules))


@functools.lru_cache(maxsize=1024)
def block_kinds(args: ModelArgs, modules: tuple[str, ...]) -> dict[str, LayerKind]:
    """The kind of each block among ``modules``, in order (cached for the search, which
    prices the same stages for thousands of plans: read, never changed)."""
    return {m: args.layer_kind(int(m.split(".")[1])) for m in modules if m.startswith("layers.")}
