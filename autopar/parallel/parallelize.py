"""The one place that turns a job into model parts: build on meta, transform, materialize.

Transformations run in a fixed order, one log line each: TP -> CP -> SDPA backend -> EP ->
compute dtype (without FSDP) -> activation checkpointing -> compile -> FSDP. (CP acts on the
inputs and the attention call at run time, ``context_parallel.py``; of the modules it
changes only Gated DeltaNet's, which pass their states between ranks, ``state_passing.py``.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.models.hf_names import MTP_PREFIX
from autopar.parallel.activation_checkpoint import apply_ac, compiled_inside, regathers
from autopar.parallel.compile import apply_compile, compiles_blocks
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.delta_rule_kernel import apply_delta_rule_kernel
from autopar.parallel.expert_parallel import apply_ep, apply_expert_kernel
from autopar.parallel.float8 import apply_float8, resolve_backend
from autopar.parallel.fsdp import apply_fsdp
from autopar.parallel.lora import adapter_values, apply_lora, base_storage_dtype
from autopar.parallel.materialize import FullValue, materialize
from autopar.parallel.mesh import Meshes, ParallelDims
from autopar.parallel.mixed_precision import apply_compute_dtype, compute_dtype, fsdp_policy, store_frozen
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES, schedule_name, stage_modules
from autopar.parallel.pipelining.split import prune, stage_ids
from autopar.parallel.sdpa_backend import apply_attention_kernel, model_groups_kv, native_gqa
from autopar.parallel.state_passing import apply_state_passing
from autopar.parallel.tensor_parallel import apply_tp, keep_embedding_grad_sharded

logger = logging.getLogger("autopar")


def loss_parallel_enabled(job: JobConfig, dims: ParallelDims) -> bool:
    return dims.tp > 1 and not job.parallelism.disable_loss_parallel


def parallelize(
    model: nn.Module,
    args: ModelArgs,
    job: JobConfig,
    meshes: Meshes,
    device: torch.device,
    pipelined: bool = False,
    frozen: bool = False,
) -> nn.Module:
    """Apply every transformation the job asks for to one (meta-device) model part, in the
    order they compose: TP, kernels, EP, LoRA (following TP's and EP's placements), the compute dtype,
    activation checkpointing, compile, then FSDP around it all. A ``frozen`` part (a reference
    copy) trains nothing and keeps its weights in the compute dtype."""
    _tensor_parallel(model, args, job, meshes, device)
    cp_mesh = meshes.get("cp")
    if cp_mesh is not None:
        count = apply_state_passing(
            model, cp_mesh, job.parallelism.context_parallel_load_balancer == "headtail"
        )
        if count:
            logger.info("context parallel: %d Gated DeltaNet layers pass their states between ranks", count)
    dtype = compute_dtype(job, device)
    _kernels(model, args, job, device)
    ep_mesh = meshes.get("ep")
    if ep_mesh is not None:
        apply_ep(model, ep_mesh, args)
        logger.info(
            "applied expert parallel: degree %d (%d experts per rank)",
            meshes.dims.ep,
            args.num_experts // meshes.dims.ep,
        )
    if job.lora.enable:
        count = apply_lora(model, job.lora, dtype)
        logger.info(
            "applied LoRA: rank %d, alpha %g on %d modules; frozen weights in %s",
            job.lora.rank,
            job.lora.alpha,
            count,
            base_storage_dtype(job.lora, dtype),
        )
    _freeze(model, job, dtype if frozen else None)
    if meshes.get("fsdp") is None and dtype != torch.float32:
        apply_compute_dtype(model, dtype)
        logger.info("weights cast to %s in each block's forward (fp32 master weights)", dtype)
    compiled = compiles_blocks(job.compile)
    if job.activation_checkpoint.mode != "none":
        _checkpointing(model, job, meshes, compiled, pipelined)
    if compiled:
        apply_compile(model, job.compile, inside_checkpoints=compiled_inside(job.activation_checkpoint))
        logger.info("compiled each block with torch.compile (backend %s)", job.compile.backend)
    if meshes.get("fsdp") is not None:
        _fully_shard(model, job, meshes, device, pipelined, frozen)
    return model


def _freeze(model: nn.Module, job: JobConfig, stored_in: torch.dtype | None) -> None:
    """Freeze what trains nothing: all of a reference copy (``stored_in`` its weights'
    dtype), else what the multi-token-prediction settings leave untrained."""
    if stored_in is not None:
        model.requires_grad_(False)
        store_frozen(model, stored_in)
        return
    if job.mtp.only:
        count = freeze_all_but(model, MTP_PREFIX)  # the multi-token-prediction head's
        logger.info("mtp.only: %d weights outside %s* frozen; training the head alone", count, MTP_PREFIX)
    if job.mtp.enable and job.mtp.loss_scale == 0:
        count = freeze(model, MTP_PREFIX)  # untrained, and untouched by the optimizer's weight decay
        logger.info(
            "mtp.loss_scale=0: the head's %d weights frozen; its loss and acceptance are logged, not trained",
            count,
        )


def freeze(model: nn.Module, prefix: str) -> int:
    """Freeze every parameter whose name starts with ``prefix`` (before FSDP); how many."""
    frozen = 0
    for name, param in model.named_parameters():
        if name.startswith(prefix):
            param.requires_grad_(False)
            frozen += 1
    return frozen


def freeze_all_but(model: nn.Module, prefix: str) -> int:
    """Freeze every parameter whose name does not start with ``prefix`` (before FSDP, which
    keeps each weight's ``requires_grad``); how many were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        keep = name.startswith(prefix)
        param.requires_grad_(keep)
        frozen += not keep
    return frozen


def _tensor_parallel(
    model: nn.Module, args: ModelArgs, job: JobConfig, meshes: Meshes, device: torch.device
) -> None:
    tp_mesh = meshes.get("tp")
    if tp_mesh is None:
        return
    parallelism = job.parallelism
    loss_parallel = loss_parallel_enabled(job, meshes.dims)
    apply_tp(
        model,
        tp_mesh,
        args,
        parallelism.enable_sequence_parallel,
        loss_parallel,
        float8=job.float8.enable and resolve_backend(job.float8, device.type) == "torchao",
    )
    logger.info(
        "applied tensor parallel: degree %d, sequence parallel %s, loss parallel %s",
        meshes.dims.tp,
        parallelism.enable_sequence_parallel,
        loss_parallel,
    )


def _kernels(model: nn.Module, args: ModelArgs, job: JobConfig, device: torch.device) -> None:
    """The attention kernel (and how it gets grouped k/v heads) and the experts' kernel."""
    impl = resolve_impl(job.parallelism, device.type)
    native, gqa = native_gqa(job, device.type, impl), model_groups_kv(job, device.type, impl)
    apply_attention_kernel(model, gqa, job.training.sdpa_backend)
    if job.training.sdpa_backend != "auto":
        logger.info("attention pinned to the %s SDPA backend", job.training.sdpa_backend)
    if args.num_key_value_heads < args.num_attention_heads:
        logger.debug(
            "attention: grouped-query k/v heads %s",
            "passed to SDPA ungrouped (enable_gqa)"
            if native
            else "gathered grouped by context parallel, then repeated to every query head"
            if gqa
            else "repeated to every query head",
        )
    apply_expert_kernel(model, job.training.expert_kernel)
    kernel = apply_delta_rule_kernel(model, job.training.delta_rule_kernel, device.type)
    if args.hybrid and kernel != "autopar":
        logger.info("Gated DeltaNet: the %s delta-rule kernel", kernel)


def _checkpointing(model: nn.Module, job: JobConfig, meshes: Meshes, compiled: bool, pipelined: bool) -> None:
    """Activation checkpointing that recomputes twice under zero-bubble schedules, gathers
    CP's k/v (and under ``op_regather`` SP's inputs) again rather than keeping them, and
    replays LoRA's dropout masks."""
    twice = pipelined and SCHEDULE_STYLES[schedule_name(job.parallelism)].splits_backward
    regathered = [meshes.get("cp")] + ([meshes.get("tp")] if regathers(job.activation_checkpoint) else [])
    groups = frozenset(mesh.get_group().group_name for mesh in regathered if mesh is not None)
    dropout = job.lora.enable and job.lora.dropout > 0
    apply_ac(model, job.activation_checkpoint, compiled, twice, groups, random=dropout)
    logger.info(
        "applied activation checkpointing: %s (%s)",
        job.activation_checkpoint.mode,
        job.activation_checkpoint.selective_ac_option,
    )


def _fully_shard(
    model: nn.Module, job: JobConfig, meshes: Meshes, device: torch.device, pipelined: bool, frozen: bool
) -> None:
    """FSDP over the model part; a ``frozen`` one outside a pipeline (a reference copy, forward
    only: no backward follows) frees every group's gathered weights after its forward, the
    head's too, which a trained part keeps gathered for the backward that starts there."""
    dims = meshes.dims
    apply_fsdp(
        model,
        meshes.get("fsdp"),
        fsdp_policy(job, device),
        policy="always" if frozen and not pipelined else job.parallelism.fsdp_reshard_after_forward,
        pipelined=pipelined,
        expert_mesh=meshes.get("efsdp"),
        offload=job.training.enable_cpu_offload,
        pin_memory=device.type == "cuda",
    )
    kind = "HSDP" if dims.dp_replicate > 1 and dims.dp_shard * dims.cp > 1 else "FSDP2"
    logger.info(
        "applied %s: replicate %d x shard %d (cp %d)%s",
        kind,
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        ", weights, gradients and optimizer state in host memory" if job.training.enable_cpu_offload else "",
    )


@dataclass
class ModelParts:
    """The modules this rank runs: the whole model, or its pipeline stages ``stage_ids`` of
    ``num_stages``."""

    parts: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    args: ModelArgs


def parallelized_parts(
    args: ModelArgs, job: JobConfig, meshes: Meshes, device: torch.device, frozen: bool = False
) -> ModelParts:
    """The model parts this rank runs, parallelized on the meta device (no memory yet);
    ``frozen``: a reference copy's (see ``parallelize``)."""
    with torch.device("meta"):
        model = build_model(args)
    if job.float8.enable:
        count = apply_float8(model, job.float8, device.type)
        logger.info("converted %d linears to FP8 (%s)", count, resolve_backend(job.float8, device.type))
    pp_mesh = meshes.get("pp")
    if pp_mesh is not None:
        stages = stage_modules(job.parallelism, args)
        placement = SCHEDULE_STYLES[schedule_name(job.parallelism)].placement
        ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), len(stages), placement)
        parts = [prune(model, stages[i]) for i in ids]
        logger.info("pipeline stages %s of %d: %s", ids, len(stages), [stages[i] for i in ids])
    else:
        ids, stages, parts = [0], [[]], [model]
    for part in parts:
        parallelize(part, args, job, meshes, device, pipelined=pp_mesh is not None, frozen=frozen)
    return ModelParts(parts, ids, len(stages), args)


def materialize_parts(built: ModelParts, device: torch.device, values: FullValue) -> ModelParts:
    """Allocate every part on ``device``, filled with ``values``, in training mode."""
    for part in built.parts:
        materialize(part, device, values)
        keep_embedding_grad_sharded(part)
        part.train()
    return built


def build_parts(
    args: ModelArgs,
    job: JobConfig,
    meshes: Meshes,
    device: torch.device,
    values: FullValue,
    frozen: bool = False,
) -> ModelParts:
    """The model parts this rank runs, parallelized and filled with ``values`` (in host
    memory under CPU offload, where FSDP keeps the sharded weights); ``frozen``: a reference
    copy's (see ``parallelize``)."""
    storage = torch.device("cpu") if job.training.enable_cpu_offload else device
    if job.lora.enable:
        values = adapter_values(values, job.debug.seed, storage)
    return materialize_parts(parallelized_parts(args, job, meshes, device, frozen), storage, values)
