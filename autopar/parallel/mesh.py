"""Parallel degrees, their rules, and the device meshes every plan uses.

All views come from one world mesh, unflattened two ways over the same ranks (rank order
pp, dp_replicate, dp_shard, cp, tp, tp fastest):

- ``dense`` = (pp, dp_replicate, fsdp, tp) for the model: FSDP shards parameters over
  ``fsdp`` = dp_shard x cp, since context-parallel ranks hold the same weights.
- ``batch`` = (pp, dp, cp, tp) for the data: ``dp`` ranks read different samples, ``cp``
  ranks different parts of one sequence; ``loss`` = dp x cp sums losses and token counts.
- ``experts`` = (pp, dp_replicate, efsdp, ep, tp) for a mixture of experts' expert weights:
  expert parallelism borrows its ``ep`` ranks from the fastest of the dp_shard x cp ranks,
  and FSDP shards each expert group over the ``efsdp`` ranks left (torchtitan's layout).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.config.errors import ConfigError
from autopar.config.sections import Parallelism
from autopar.models.args import ModelArgs
from autopar.parallel.torch_internals import flatten_mesh, unflatten_mesh
from autopar.parallel.world import backend_for, init_group


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees (no -1 left) for a world of ``world_size`` ranks."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int = 1

    @classmethod
    def resolve(cls, cfg: Parallelism, world_size: int, num_experts: int | None = None) -> ParallelDims:
        """Fill ``data_parallel_shard_degree=-1`` with the ranks left over; check the product.
        ``num_experts`` (the model's, when known; 0: no experts) narrows the expert degrees a
        refusal offers to those the model also accepts."""
        fixed = {
            "data_parallel_replicate_degree": cfg.data_parallel_replicate_degree,
            "context_parallel_degree": cfg.context_parallel_degree,
            "tensor_parallel_degree": cfg.tensor_parallel_degree,
            "pipeline_parallel_degree": cfg.pipeline_parallel_degree,
        }
        for name, value in fixed.items():
            if value < 1:
                raise ConfigError(f"parallelism.{name}={value} must be >= 1")
        others = 1
        for value in fixed.values():
            others *= value
        shard = cfg.data_parallel_shard_degree
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by the product of the other degrees "
                    f"({_product_text(fixed)} = {others}); data_parallel_shard_degree=-1 cannot fill it"
                )
            shard = world_size // others
        elif shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree={shard} must be >= 1, or -1 for the rest"
            )
        if shard * others != world_size:
            raise ConfigError(
                f"parallel degrees multiply to {shard * others} "
                f"(data_parallel_shard_degree={shard}, {_product_text(fixed)}), "
                f"but the world size is {world_size}; make the product equal the number of ranks"
            )
        return cls(
            dp_replicate=cfg.data_parallel_replicate_degree,
            dp_shard=shard,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            pp=cfg.pipeline_parallel_degree,
            ep=_expert_degree(cfg, shard, num_experts),
        )

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks reading different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded or replicated across data/context ranks."""
        return self.dp_replicate * self.dp_shard * self.cp > 1


def _expert_degree(cfg: Parallelism, dp_shard: int, num_experts: int | None) -> int:
    """``expert_parallel_degree``, which must divide the dp_shard x cp ranks it borrows."""
    ep, borrowed = cfg.expert_parallel_degree, dp_shard * cfg.context_parallel_degree
    if ep < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree={ep} must be >= 1")
    if borrowed % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} does not divide data_parallel_shard_degree x "
            f"context_parallel_degree = {dp_shard} x {cfg.context_parallel_degree} = {borrowed}, the "
            f"ranks it borrows; use one of {_listed(_expert_degrees(borrowed, num_experts))}"
        )
    return ep


def _expert_degrees(borrowed: int, num_experts: int | None) -> tuple[int, ...]:
    """The expert degrees that divide the ranks they borrow and the model's experts (1 alone
    for a model without experts; any divisor of the ranks while the model is unknown)."""
    if num_experts == 0:
        return (1,)
    return _degrees(borrowed, num_experts or borrowed)


def _product_text(degrees: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in degrees.items() if v != 1) or "all others 1"


@functools.lru_cache(maxsize=1024)
def _degrees(*sizes: int) -> tuple[int, ...]:
    """The degrees (up to 64) that divide every one of ``sizes``: what a refusal offers, so
    that each offered degree passes every rule of its kind, not only the one that refused.
    Cached: the planner meets the same refusals thousands of times."""
    return tuple(d for d in range(1, 65) if all(size % d == 0 for size in sizes))


def _listed(degrees: tuple[int, ...]) -> str:
    return ", ".join(str(d) for d in degrees)


def tp_split_sizes(args: ModelArgs) -> dict[str, int]:
    """Every size tensor parallelism splits (head counts, widths), by its field name."""
    return dict(_tp_split_sizes(args))


@functools.lru_cache(maxsize=64)
def _tp_split_sizes(args: ModelArgs) -> tuple[tuple[str, int], ...]:
    """``tp_split_sizes`` as pairs, once per model: the planner checks every candidate."""
    fields = ["num_attention_heads", "num_key_value_heads"]
    if args.hybrid:  # Gated DeltaNet layers are split by key and by value head
        fields += ["linear_num_key_heads", "linear_num_value_heads"]
    if args.has_dense_layers:
        fields.append("intermediate_size")
    fields.append("vocab_size")
    return tuple((field, getattr(args, field)) for field in fields)


def _seq_lens(seq_len: int, split: int, lowest: int) -> list[int]:
    """The multiples of ``split`` nearest ``seq_len`` (below it, above it) that are at least
    ``lowest`` (itself one): the sequence lengths a refusal offers."""
    below = seq_len // split * split
    above = max(below + split, lowest)
    return [below, above] if below >= lowest else [above]


def check_model_split(
    dims: ParallelDims,
    args: ModelArgs,
    seq_len: int,
    sequence_parallel: bool,
    head_tail: bool = True,
    seq_field: str = "training.seq_len",
) -> None:
    """Raise ConfigError when the model or sequence cannot be split by these degrees;
    ``seq_field`` names the setting ``seq_len`` came from."""
    tp = dims.tp
    if dims.ep > 1 and not args.moe:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={dims.ep} needs a mixture-of-experts model "
            "(model.num_experts > 0, e.g. --model.flavor debug-moe); set it to 1"
        )
    if dims.ep > 1 and args.num_experts % dims.ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={dims.ep} does not divide model.num_experts="
            f"{args.num_experts}; use one of {_listed(_expert_degrees(dims.dp_shard * dims.cp, args.num_experts))}"
        )
    sizes = tp_split_sizes(args)
    for field, value in sizes.items():
        if value % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree={tp} does not divide model.{field}={value}; "
                f"use one of {_listed(_degrees(*sizes.values()))}"
            )
    cp_chunks = (2 if head_tail else 1) * dims.cp if dims.cp > 1 else 1
    split = (tp if sequence_parallel else 1) * cp_chunks
    halo = args.linear_conv_kernel_dim - 1
    least = halo * cp_chunks if args.hybrid and dims.cp > 1 else 1  # see the halo rule below
    lowest = -(-least // split) * split  # the shortest sequence both rules accept
    if seq_len % split:
        parts = []
        if sequence_parallel and tp > 1:
            parts.append(f"tensor_parallel_degree={tp} (sequence parallel)")
        if dims.cp > 1 and head_tail:
            parts.append(f"2 x context_parallel_degree={dims.cp} (load-balanced chunks)")
        elif dims.cp > 1:
            parts.append(f"context_parallel_degree={dims.cp}")
        raise ConfigError(
            f"{seq_field}={seq_len} is not divisible by {split} = {' x '.join(parts)}; "
            f"use a multiple of {split}, e.g. {' or '.join(map(str, _seq_lens(seq_len, split, lowest)))}"
        )
    if seq_len < least:
        raise ConfigError(
            f"{seq_field}={seq_len} gives each of the {cp_chunks} context-parallel ranges "
            f"{seq_len // cp_chunks} tokens, fewer than the {halo} the Gated DeltaNet's convolution "
            f"reads from the range before; use a seq_len of at least {lowest}"
        )
    if dims.pp > args.num_hidden_layers:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} is more stages than "
            f"num_hidden_layers={args.num_hidden_layers}; use at most {args.num_hidden_layers}"
        )


MESH_NAMES = ("pp", "tp", "dp", "cp", "loss", "fsdp", "ep", "efsdp")
"""The mesh views a job asks for by name (see the module docstring)."""


@dataclass(frozen=True)
class Meshes:
    """The degrees of one job and its mesh views; one process has no mesh at all.

    ``get(name)`` is the single door: a mesh where that dimension spans more than one rank,
    else None, so code that needs a dimension asks for it and skips it when absent.
    """

    dims: ParallelDims
    views: Mapping[str, DeviceMesh]

    def get(self, name: str) -> DeviceMesh | None:
        if name not in MESH_NAMES:
            raise KeyError(f"unknown mesh {name!r}; one of {MESH_NAMES}")
        return self.views.get(name)


def build_meshes(dims: ParallelDims, device_type: str, always_fsdp: bool = False) -> Meshes:
    """Every mesh view of a job; called once, on every rank. ``always_fsdp`` (CPU offload,
    which FSDP implements) gives an ``fsdp`` view even where it spans one rank, and one
    process then a process group of its own; otherwise one process has no mesh at all."""
    if dims.world_size == 1 and not always_fsdp:
        return Meshes(dims, {})
    if not dist.is_initialized():  # one process: a group of one, in memory
        init_group(backend_for(torch.device(device_type)), store=dist.HashStore(), rank=0, world_size=1)
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = unflatten_mesh(
        world,
        (dims.pp, dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp),
        ("pp", "dp_replicate", "fsdp", "tp"),
    )
    batch = unflatten_mesh(world, (dims.pp, dims.dp, dims.cp, dims.tp), ("pp", "dp", "cp", "tp"))
    experts = unflatten_mesh(
        world,
        (dims.pp, dims.dp_replicate, dims.dp_shard * dims.cp // dims.ep, dims.ep, dims.tp),
        ("pp", "dp_replicate", "efsdp", "ep", "tp"),
    )
    views = {
        "pp": dense["pp"],
        "tp": dense["tp"],
        "dp": batch["dp"],
        "cp": batch["cp"],
        "loss": flatten_mesh(batch["dp", "cp"], "loss"),
        # HSDP: (replicate, shard) 2-D; FSDP: the shard dimension alone
        "fsdp": dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"],
        "ep": experts["ep"],
        "efsdp": experts["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else experts["efsdp"],
    }
    # expert weights are FSDP-sharded over efsdp whenever the others are over fsdp
    enabled = {"fsdp": dims.fsdp_enabled or always_fsdp, "efsdp": dims.fsdp_enabled and dims.ep > 1}
    return Meshes(dims, {k: v for k, v in views.items() if enabled.get(k, v.size() > 1)})
