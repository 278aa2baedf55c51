"""Peak memory per rank of a plan, by category, before anything is built.

Parameter, gradient and optimizer bytes are exact: every parameter's local shard is computed
from the tensor-parallel plan's own styles (``plans.tensor_parallel.tp_plan``) and FSDP2's
dim-0 sharding with padding. Activations count what autograd saves in this model's forward
(read off ``torch.autograd.graph.saved_tensors_hooks`` and checked against the dry run):

per token of a block, with ``c`` the compute dtype's bytes and heads/intermediate per TP rank,
- each RMSNorm: its float32 input, the normalized ``c`` copy and a float32 rsqrt per row
  (sharded along the sequence under sequence parallel); each sublayer's linear input ``c*h``
  (gathered over the sequence under SP);
- Qwen3's q/k norms the same per head; attention saves q, k and v (with as many heads as
  SDPA is given: the k/v heads where the kernel takes them grouped, else expanded to every
  query head, ``plans.sdpa_backend.native_gqa``), its output and a float32 logsumexp;
- SwiGLU saves gate, silu(gate), up and their product, ``4*c*I``;
- an explicit attention mask (document masking: one per sequence; all-gather CP: one
  causal mask by global position) is saved by SDPA as an additive ``c`` copy per block;
  checkpointed blocks keep the boolean one as an input instead and rebuild the copy;
- a mixture of experts (``moe_bytes_no_ac``) saves, per routed row, its token's copy, the
  experts' SwiGLU saves and output, and a few indices, with routing taken as balanced (the
  load-balancing loss's aim; real routing on CPU ranks stays within the same 10%); experts
  are split over ``ep`` ranks before FSDP shards them over the data ranks left.

Blocks of each kind (``ModelArgs.layer_kind``: token mixer and feed-forward) are sized
separately, their parameters from the first block of the kind and their saves by
``planner/block_bytes.py``, which also says what Qwen3.5's blocks (Gated DeltaNet, gated
attention, zero-centred norms, the shared expert) save.

Under LoRA the frozen base is stored in its own dtype and only the adapters have fp32
weights, gradients and AdamW state; frozen norms and heads save no normalized copy or input
for a weight gradient, a linear keeps its input only where an adapter takes it, and each
adapter saves its rank-wide A output (``lora_bytes_no_ac``).

Selective per-op checkpointing keeps the outputs of matmuls, attention and collectives
(``plans.activation_checkpoint.SAVED_OPS``; context parallel's k/v all-gathers excepted:
backward gathers again); full checkpointing keeps each block's input and
recomputes one block at a time in backward. The peak is the largest of the moments met while
walking this rank's step in the schedule's own order (``pipelining.schedule.rank_actions``,
read off torch's schedule; without pipelining one forward then one backward): each forward
adds a micro-batch's saves, through the loss the logits and the float32 log-softmax until
that micro-batch's backward, which adds their gradients over the vocabulary (vocab-sharded
under loss parallel; the chunked loss keeps the logits' gradient in the compute dtype
instead, one chunk's float32 at a time); each block backward adds one recomputed block, the
gradients inside it and FSDP's gradient buffers; the embedding's backward, which ends a
stage's, adds every fresh gradient and, under TP or FSDP, one over the whole vocabulary;
zero-bubble input steps keep the gradients at every weight's output until their weight
step; and under pipelining with FSDP, gradients stay unsharded in float32 from a stage's
first backward to its last micro-batch (torch turns gradient sync off in between). CPU
offload moves the weights, their gradients and the optimizer state to ``Memory.host``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import LayerKind, ModelArgs
from autopar.models.family import build_model
from autopar.models.moe import Experts
from autopar.models.qwen import Qwen
from autopar.models.qwen3_5.mtp import head_layer_args
from autopar.parallel.activation_checkpoint import checkpointed_layers
from autopar.parallel.delta_rule_kernel import SEGMENTS, resolve_delta_rule_kernel
from autopar.parallel.fsdp import reshards_blocks
from autopar.parallel.lora import ADAPTER_PLACEMENTS, base_storage_dtype, targeted
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.mixed_precision import compute_dtype
from autopar.parallel.parallelize import loss_parallel_enabled
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES, rank_actions, schedule_name, stage_modules
from autopar.parallel.pipelining.split import stage_ids
from autopar.parallel.sdpa_backend import native_gqa
from autopar.parallel.tensor_parallel import HeadShardedParams, tp_plan
from autopar.planner.block_bytes import (
    FP32,
    INPUTS,
    Sizes,
    block_backward_transient_bytes,
    block_bytes_no_ac,
    block_bytes_op_ac,
    block_weight_output_grad_bytes,
    chain_backward_bytes,
    formed_weight_grads,
    op_only_bytes,
)

GIB = 2**30


@dataclass(frozen=True)
class Memory:
    """Predicted peak bytes of one rank, by category (keys as in the dry run's breakdown)."""

    role: str
    parts: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)  # CPU offload: bytes in host memory

    @property
    def peak(self) -> float:
        return sum(self.parts.values())

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.parts.items()}


@functools.lru_cache(maxsize=16)
def meta_model(args: ModelArgs) -> Qwen:
    """The model built on meta (no memory), for its module names and shapes. Cached per
    model: callers must not modify it."""
    with torch.device("meta"):
        return build_model(args)


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
def _key_counts(args: ModelArgs, modules: tuple[str, ...]) -> tuple[tuple[ModuleKey, int], ...]:
    """How many of ``modules`` are of each ``module_key``: the search sums the same stages'
    modules for thousands of plans, so each list is walked once."""
    counts: dict[ModuleKey, int] = {}
    for module in modules:
        key = module_key(args, module)
        counts[key] = counts.get(key, 0) + 1
    return tuple(counts.items())


def _total(numel: dict[ModuleKey, int], args: ModelArgs, modules: list[str]) -> int:
    """Elements of ``modules`` given the elements of one module of each kind."""
    return sum(numel.get(key, 0) * count for key, count in _key_counts(args, tuple(modules)))


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
    shards included when ``sharded``; LoRA's adapters not included (``adapters_numel``)."""
    fsdp = dims.dp_shard * dims.cp if (sharded and dims.fsdp_enabled) else 1
    sequence_parallel = job.parallelism.enable_sequence_parallel
    numel = module_numel(args, dims.tp, fsdp, sequence_parallel, loss_parallel_enabled(job, dims), dims.ep)
    return _total(numel, args, modules)


def _adapter_tp_dims(base_dim: int | None) -> tuple[int | None, ...]:
    """The TP dims of (A, B) beside a base weight split along ``base_dim`` (``ADAPTER_PLACEMENTS``)."""
    base = Replicate() if base_dim is None else Shard(base_dim)
    return tuple(p.dim if isinstance(p, Shard) else None for p in ADAPTER_PLACEMENTS[base])


@functools.lru_cache(maxsize=64)
def _adapted(
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
    for key, _, fan_in, fan_out, dim in _adapted(args, targets):
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


def adapters_numel(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], sharded: bool = True
) -> int:
    """``modules_numel`` of LoRA's adapters (0 without LoRA)."""
    if not job.lora.enable:
        return 0
    fsdp = dims.dp_shard * dims.cp if (sharded and dims.fsdp_enabled) else 1
    numel = adapter_numel(args, tuple(job.lora.target_modules), job.lora.rank, dims.tp, fsdp, dims.ep)
    return _total(numel, args, modules)


def trained_numel(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], sharded: bool = True
) -> int:
    """Elements with gradients and optimizer state: the adapters under LoRA, else every one."""
    if job.lora.enable:
        return adapters_numel(args, job, dims, modules, sharded)
    return modules_numel(args, job, dims, modules, sharded)


@dataclass(frozen=True)
class HeadBytes:
    """The final norm, head and loss of one micro-batch: what stays saved from its forward to
    its backward, and what exists beside that only while the loss runs forward and backward."""

    saved: float
    forward: float
    backward: float


def head_bytes(z: Sizes, vocab: int, tp_loss_parallel: int, chunk_tokens: int = 0) -> HeadBytes:
    """Saved: the final norm's saves, the head's gathered input, the logits (c, alive until
    the loss's backward) and the loss's float32 log-softmax output. Backward: the float32
    gradients of nll and log-softmax (under loss parallel, vocab-sharded, and three: torch's
    fused backward keeps its one-hot target, the sum with softmax and the product alive at
    once). The chunked loss saves the logits and their gradient (c, vocab-sharded under loss
    parallel too), computed in forward beside one chunk's float32 log-probabilities, their
    exponent and the masked gradient;
    its backward scales the gradient into a third c copy."""
    t = z.tokens
    logits = z.dtype_bytes * (vocab // tp_loss_parallel) * t
    fp32_logits = logits * FP32 // z.dtype_bytes
    weighted = not z.frozen or z.head_adapted  # a frozen head needs no input for its gradient
    norm = (FP32 + (0 if z.frozen else z.dtype_bytes)) * z.hidden * t / z.sp_shards + FP32 * t / z.sp_shards
    kept = norm + (z.dtype_bytes * z.hidden * t if weighted else 0) + logits
    if chunk_tokens:
        chunk = (3 * FP32 + z.dtype_bytes) * (vocab // tp_loss_parallel) * min(chunk_tokens, t)
        return HeadBytes(kept + logits, chunk, logits)
    gradients = 3 if tp_loss_parallel > 1 else 2
    return HeadBytes(kept + fp32_logits, 0.0, gradients * fp32_logits)


def with_mtp_head(args: ModelArgs, z: Sizes, head: HeadBytes) -> HeadBytes:
    """``head`` with Qwen3.5's multi-token-prediction head beside it (as is without one): its
    forward saves, from the trunk's output to its loss, what the main output does once more
    (a final norm, the output head's input, a second vocabulary-wide logits and their loss),
    its layers' saves as a full-attention block's without checkpointing (the head's layer
    is not recomputed), its two pre-fc norms' and ``fc``'s input (2H, gathered under SP).
    Whichever loss runs its backward first does so beside the other's saves: the backward's
    own temporaries are one loss's (dry run, Qwen3.5-2B shapes at 4096 tokens: measured
    +6.4 GiB of activations with the head, backward temporaries unchanged)."""
    layers = args.mtp_num_hidden_layers
    if not layers:
        return head
    t, h, c = z.tokens, z.hidden, z.dtype_bytes
    kind = head_layer_args(args).layer_kind(0)
    norms = 2 * ((FP32 + (0 if z.frozen else c)) * h * t / z.sp_shards + FP32 * t / z.sp_shards)
    own = layers * block_bytes_no_ac(z, kind, args.qk_norm) + norms + c * 2 * h * t
    return HeadBytes(2 * head.saved + own, head.forward, head.backward)


def sizes(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    micro_batch: int,
    cp_impl: str,
    c: int,
    device_type: str = "cuda",
) -> Sizes:
    seq = job.training.seq_len // dims.cp
    sequence_parallel = dims.tp > 1 and job.parallelism.enable_sequence_parallel
    kv_seq_factor = dims.cp if (dims.cp > 1 and cp_impl == "allgather") else 1
    # a query row per local token over every key: per sequence under document masking, one
    # shared causal one under all-gather CP
    mask = seq * seq * kv_seq_factor * (micro_batch if job.training.document_masking else kv_seq_factor > 1)
    return Sizes(
        tokens=micro_batch * seq,
        seq=seq,
        dtype_bytes=c,
        hidden=args.hidden_size,
        q_heads=args.num_attention_heads // dims.tp,
        kv_heads=args.num_key_value_heads // dims.tp,
        sdpa_kv_heads=(
            args.num_key_value_heads if native_gqa(job, device_type, cp_impl) else args.num_attention_heads
        )
        // dims.tp,
        head_dim=args.head_dim,
        ffn=args.intermediate_size // dims.tp,
        sp_shards=dims.tp if sequence_parallel else 1,
        kv_seq_factor=kv_seq_factor,
        mask=mask,
        experts=args.num_experts,
        top_k=args.num_experts_per_tok if args.moe else 0,
        moe_inter=args.moe_intermediate_size,
        norm_topk=args.norm_topk_prob,
        ep=dims.ep,
        **_hybrid_sizes(args, job, dims, device_type),
        **_context_ranges(job, dims),
        **_lora_sizes(args, job, dims),
    )


def _hybrid_sizes(args: ModelArgs, job: JobConfig, dims: ParallelDims, device_type: str) -> dict[str, object]:
    """``Sizes``' Qwen3.5 fields: TP splits the Gated DeltaNet by head, as attention."""
    if not args.hybrid:
        return {}
    kernel = resolve_delta_rule_kernel(job.training.delta_rule_kernel, device_type)
    return {
        "rotary_dim": args.rotary_dim,
        "shared_inter": args.shared_expert_intermediate_size,
        "linear_key_heads": args.linear_num_key_heads // dims.tp,
        "linear_value_heads": args.linear_num_value_heads // dims.tp,
        "linear_key_dim": args.linear_key_head_dim,
        "linear_value_dim": args.linear_value_head_dim,
        "conv_width": args.linear_conv_kernel_dim,
        "documents": job.training.document_masking,
        "fla": kernel == "fla",
        "delta_rule_segment": SEGMENTS.get(kernel, 0),
    }


def _context_ranges(job: JobConfig, dims: ParallelDims) -> dict[str, int]:
    """``Sizes``' CP ranges: each rank holds two token ranges of a sequence under the
    head-tail load balancer (``parallel.context_parallel.shard_sequence``), else one."""
    if dims.cp == 1:
        return {}
    ranges = 2 if job.parallelism.context_parallel_load_balancer == "headtail" else 1
    return {"ranges": ranges, "cp_ranges": dims.cp * ranges}


def _lora_sizes(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> dict[str, object]:
    """``Sizes``' LoRA fields: the adapted linears of the first block of each kind."""
    cfg = job.lora
    if not cfg.enable:
        return {}
    targets = tuple(cfg.target_modules)
    return {
        "frozen": True,
        "rank": cfg.rank,
        "dropout": cfg.dropout > 0,
        "adapted": _adapted_linears(args, targets, dims.tp),
        "kept_inputs": {} if cfg.dropout > 0 else _adapted_inputs(args, targets),
        "head_adapted": any(key == "lm_head" for key, *_ in _adapted(args, targets)),
        "experts_adapted": experts_adapted(args, targets),
    }


def _adapted_inputs(args: ModelArgs, targets: tuple[str, ...]) -> dict[LayerKind, frozenset[str]]:
    """Per kind of block, the ``INPUTS`` some adapted linear takes."""
    inputs: dict[LayerKind, set[str]] = {}
    for key, name, *_ in _adapted(args, targets):
        if is_block_kind(key) and name in INPUTS:
            inputs.setdefault(key, set()).add(INPUTS[name])
    return {k: frozenset(v) for k, v in inputs.items()}


def _adapted_linears(
    args: ModelArgs, targets: tuple[str, ...], tp: int
) -> dict[LayerKind, tuple[tuple[int, int], ...]]:
    """Per kind of block, the (in, out) features per TP rank of each adapted linear."""
    adapted: dict[LayerKind, list[tuple[int, int]]] = {}
    for key, _, fan_in, fan_out, dim in _adapted(args, targets):
        if is_block_kind(key):
            local = (-(-fan_in // tp) if dim == 1 else fan_in, -(-fan_out // tp) if dim == 0 else fan_out)
            adapted.setdefault(key, []).append(local)
    return {k: tuple(v) for k, v in adapted.items()}


def predict(
    args: ModelArgs,
    job: JobConfig,
    world_size: int,
    cp_impl: str = "ring",
    device_type: str = "cuda",
) -> list[Memory]:
    """Predicted peak of one rank per role (as ``dry_run.role_ranks``) on ``device_type``,
    whose default compute dtype differs. ``cp_impl``: ``ring`` (CUDA) or ``allgather`` (what
    CPU runs)."""
    return predict_dims(args, job, ParallelDims.resolve(job.parallelism, world_size), cp_impl, device_type)


def predict_dims(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, cp_impl: str = "ring", device_type: str = "cuda"
) -> list[Memory]:
    """``predict`` for resolved degrees (the planner's inner loop)."""
    if job.training.sdpa_backend == "math":
        raise ConfigError(
            "training.sdpa_backend='math' saves a seq_len x seq_len attention matrix per head, which "
            "the planner does not model (it models flash, efficient and cudnn, which save none); "
            "plan with sdpa_backend auto, then pin math"
        )
    compute_bytes = compute_dtype(job, torch.device(device_type)).itemsize
    head = ["mtp"] if args.mtp_num_hidden_layers else []  # Qwen3.5's multi-token-prediction head
    if dims.pp == 1:
        stages = [
            [
                "embed_tokens",
                *(f"layers.{i}" for i in range(args.num_hidden_layers)),
                "norm",
                *head,
                "lm_head",
            ]
        ]
        roles = {0: "all ranks"}
    else:
        stages = stage_modules(job.parallelism, args)
        stages = [*stages[:-1], [*stages[-1], *head]]  # the head goes with lm_head (``BESIDE_HEAD``)
        roles = {0: "first stage", dims.pp // 2: "middle stage", dims.pp - 1: "last stage"}
    return [
        _predict_stage_rank(args, job, dims, stages, rank_stage, role, cp_impl, compute_bytes, device_type)
        for rank_stage, role in sorted(roles.items())
    ]


def _rank_stage_ids(job: JobConfig, dims: ParallelDims, num_stages: int, pp_rank: int) -> list[int]:
    placement = SCHEDULE_STYLES[schedule_name(job.parallelism)].placement
    return stage_ids(pp_rank, dims.pp, num_stages, placement)


def _predict_stage_rank(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    stages: list[list[str]],
    pp_rank: int,
    role: str,
    cp_impl: str,
    c: int,
    device_type: str,
) -> Memory:
    """One pipeline rank's peak: its weights and optimizer state, then the largest moment of
    its step, walked in the schedule's own order."""
    ids = _rank_stage_ids(job, dims, len(stages), pp_rank) if dims.pp > 1 else [0]
    modules = [m for i in ids for m in stages[i]]
    stored = _stored_bytes(job, device_type)
    micro = (
        job.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else job.training.local_batch_size
    )
    z = sizes(args, job, dims, micro, cp_impl, c, device_type)
    # sharded gradients outlive a backward only when micro-steps accumulate into them, or
    # when a pipeline without FSDP keeps them whole across micro-batches
    accumulating = micro_steps(job, dims) > 1 or (dims.pp > 1 and not uses_fsdp(job, dims))
    # without micro-steps, the walk is the whole step: a stage's gradients land at its first
    # backward and are held from there
    in_walk = accumulating and micro_steps(job, dims) == 1
    static, host = _weights_and_optimizer(args, job, dims, modules, stored, accumulating and not in_walk)
    costs = _stage_costs(
        args, job, dims, stages, ids, z, c, stored, micro, accumulating or bool(host), in_walk
    )
    actions = (
        rank_actions(schedule_name(job.parallelism), dims.pp, len(stages), costs.n_micro, pp_rank)
        if dims.pp > 1
        else (("F", 0, 0), ("B", 0, 0))
    )
    peak = _walk_schedule(actions, costs)
    moment = dict(zip(("gathered_params", "activations", "gradient_buffers"), peak, strict=True))
    return Memory(role, {**static, **{k: v for k, v in moment.items() if v}}, host)


def _weights_and_optimizer(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], stored: int, accumulating: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """(device bytes, host bytes) of the rank's weights, optimizer state and the gradients
    that outlive a backward. CPU offload keeps the master weights, the step's gradients
    (each shard lands there as its reduce-scatter ends) and the optimizer state in host memory."""
    numel = modules_numel(args, job, dims, modules)
    trained = trained_numel(args, job, dims, modules)
    static = {
        "params": stored * numel + (FP32 * trained if job.lora.enable else 0.0),
        "optimizer": 2 * FP32 * trained,
        "grads": _landing_grads(args, job, dims, modules) if accumulating else 0.0,
    }
    reference = _reference_bytes(args, job, dims, modules)
    if reference:  # a DPO job's frozen copy, kept where the weights are (the host under offload)
        static["reference"] = reference
    if job.training.enable_cpu_offload:
        return {}, {**static, "grads": FP32 * trained}
    return static, {}


def _reference_bytes(args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str]) -> float:
    """A DPO job's frozen reference copy (``dpo.reference = "copy"``): the model's weights
    stored as the policy's full weights are, sharded alike, with no gradients or optimizer
    state; its forward runs before the policy's, so its activations are gone by the peak.
    ``adapters_off`` and ``precomputed`` hold none."""
    if job.training.dataset_format != "preference" or job.dpo.reference != "copy":
        return 0.0
    return FP32 * modules_numel(args, job, dims, modules)


@dataclass
class _StageCosts:
    """What one rank's step allocates and frees, by stage id (``int`` keys) and by kind of
    block (``ModelArgs.layer_kind`` keys)."""

    n_micro: int
    gathered: float  # weights gathered (or cast) for the whole step
    saved: dict[int, float]  # what a micro-batch's forward leaves saved in the stage
    pending: dict[int, float]  # a zero-bubble input step's gradients awaiting its weight step
    stage_kinds: dict[int, list[LayerKind]]  # in a fixed order
    heads: set[int]  # stages computing the loss
    embeds: set[int]  # stages ending with the embedding's backward
    head: HeadBytes
    recompute: dict[LayerKind, float]  # what a block's backward rebuilds
    transient: dict[LayerKind, float]  # a block backward's own temporaries
    chain: dict[int, tuple[LayerKind, float, float]]  # by stage: see ``_chain_moments``
    block_gathered: dict[LayerKind, float]  # weights alive during a block's backward
    block_activations: dict[LayerKind, float]  # activations alive at the end of a block's backward
    block_buffers: dict[LayerKind, float]  # the float32 gradient a block's reduce-scatter takes
    unsynced_grads: dict[int, _Unsynced]
    syncs_at_end: bool  # a multi-stage schedule syncs them after its last backward
    embedding_gathered: float
    embedding_grads: float
    embedding_first_grads: float  # the same in the step's first backward (no ``.grad`` yet)
    # gradients that land as each stage's (first) backward ends: sharded without accumulation
    # or offload, or held from then on by a pipeline without FSDP
    stage_grads: dict[int, float]
    block_grads: dict[LayerKind, float]
    first_block: dict[int, LayerKind | None]  # kind of each stage's first block: its backward's last
    before_first: dict[int, float]  # what the stage's later blocks save, freed by then


def _stage_costs(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    stages: list[list[str]],
    ids: list[int],
    z: Sizes,
    c: int,
    stored: int,
    micro: int,
    grads_held: bool,
    held_in_walk: bool,
) -> _StageCosts:
    """The sizes the schedule walk adds and removes on this rank (``grads_held``: gradients kept
    across backwards, accumulating or in host memory; ``held_in_walk``: landing in the walk)."""
    modules = [m for i in ids for m in stages[i]]
    kind_of = {m: args.layer_kind(int(m.split(".")[1])) for m in modules if m.startswith("layers.")}
    kinds = sorted(set(kind_of.values()))
    blocks = {i: [kind_of[m] for m in stages[i] if m in kind_of] for i in ids}  # their kinds, in order
    saves = _checkpointing_saves(args, job, dims, stages, ids, z, kind_of)
    casts = _casts_per_micro_batch(args, job, dims, stages, ids, kind_of, c, stored)
    # casts saved per micro-batch leave the step's one copy for each forward's saves
    gathered = _gathered_bytes(args, job, dims, modules, c, stored) - sum(casts.values())
    if uses_fsdp(job, dims) and kind_of:
        block_gathered, block_buffers = _fsdp_block_bytes(args, job, dims, modules, kind_of, gathered, c)
        block_activations = saves.ended
    else:
        block_gathered = dict.fromkeys(kinds, gathered)
        block_activations, block_buffers = saves.recompute, dict.fromkeys(kinds, 0.0)
    n_micro, unsynced = job.training.local_batch_size // micro, _syncs_last(job, dims, micro)
    embedding_gathered, embedding_grads = _embedding_backward_bytes(
        args, job, dims, c, stored, not unsynced, grads_held
    )
    shards = dims.tp if loss_parallel_enabled(job, dims) else 1
    fresh = held_in_walk or not (grads_held or unsynced)  # gradients land as they are kept
    return _StageCosts(
        n_micro=n_micro,
        gathered=gathered,
        saved={i: saves.saved[i] + casts[i] for i in ids},
        pending={i: sum(block_weight_output_grad_bytes(z, k, args.qk_norm) for k in blocks[i]) for i in ids},
        stage_kinds={i: sorted(set(blocks[i])) for i in ids},
        heads={i for i in ids if "lm_head" in stages[i]},
        embeds={i for i in ids if "embed_tokens" in stages[i]},
        head=with_mtp_head(args, z, head_bytes(z, args.vocab_size, shards, job.training.loss_chunk_tokens)),
        recompute=saves.recompute,
        transient={k: block_backward_transient_bytes(z, k) for k in kinds},
        chain=_chain_moments(args, job, dims, z, stages, kind_of, saves, block_buffers),
        block_gathered=block_gathered,
        block_activations=block_activations,
        block_buffers=block_buffers,
        unsynced_grads=_unsynced_grads(args, job, dims, stages, ids, c) if unsynced else {},
        syncs_at_end=unsynced and SCHEDULE_STYLES[schedule_name(job.parallelism)].stages_per_rank != 1,
        embedding_gathered=embedding_gathered,
        embedding_grads=embedding_grads,
        embedding_first_grads=embedding_grads - (_embedding_grad(args, job, dims) if held_in_walk else 0.0),
        stage_grads={i: _landing_grads(args, job, dims, stages[i]) if fresh else 0.0 for i in ids},
        block_grads={kind_of[m]: _landing_grads(args, job, dims, [m]) for m in kind_of},
        first_block={i: next(iter(blocks[i]), None) for i in ids},
        before_first=saves.before_first,
    )


def _chain_moments(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    z: Sizes,
    stages: list[list[str]],
    kind_of: dict[str, LayerKind],
    saves: _Saves,
    block_buffers: dict[LayerKind, float],
) -> dict[int, tuple[LayerKind, float, float]]:
    """By stage with a Gated DeltaNet under CP (``hybrid_cp``), the moment of its last such
    block's chain backward, late in the block's: (its kind, the activations beside the
    stage's saves, the float32 buffer held). The blocks after it have freed their saves; the
    block's own rebuilds and chain temporaries, less what its backward freed by then, sit
    beside the weight gradients it formed so far (under FSDP, reduced at the block's end) and
    the last reduce-scatter's input, which FSDP holds until the block's ends: the block
    after it's, or under EP its own experts' group's (dry run, Qwen3.5-9B at 4 layers, CP 8:
    -15% without these, the stage's peak then)."""
    moments = {}
    for i in saves.blocks:
        blocks = [m for m in stages[i] if m in kind_of]
        passing = [j for j, m in enumerate(blocks) if chain_backward_bytes(z, kind_of[m]) is not None]
        if not passing:
            continue
        last, fsdp = passing[-1], uses_fsdp(job, dims)
        kind = kind_of[blocks[last]]
        held = block_buffers[kind_of[blocks[last + 1]]] if last + 1 < len(blocks) else 0.0
        if fsdp and kind[1] == "moe" and dims.ep > 1:
            held = FP32 * layer_expert_numel(args, dims.ep)
        formed = formed_weight_grads(z, kind) if fsdp else 0.0
        beside = (
            saves.recompute[kind] + chain_backward_bytes(z, kind) + formed - sum(saves.blocks[i][last + 1 :])
        )
        moments[i] = (kind, beside, held)
    return moments


@dataclass
class _Saves:
    """What activation checkpointing leaves saved and rebuilds (see ``_checkpointing_saves``)."""

    saved: dict[int, float]  # by stage: a micro-batch's forward
    recompute: dict[LayerKind, float]  # by kind of block: what its backward rebuilds
    ended: dict[LayerKind, float]  # by kind of block: activations its backward leaves changed
    before_first: dict[int, float]  # by stage: its blocks' saves but the first block's
    blocks: dict[int, list[float]]  # by stage: each block's saves, in order


def _checkpointing_saves(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    stages: list[list[str]],
    ids: list[int],
    z: Sizes,
    kind_of: dict[str, LayerKind],
) -> _Saves:
    """Under the job's activation checkpointing: what a micro-batch's forward leaves saved in
    each stage, what a block's backward rebuilds, and (per kind of block) the activations
    that block's backward leaves changed at its end: the rebuilt ones still alive (full AC),
    those per-op AC rebuilt alive and those it kept used up, or its own freed (no AC)."""
    ac = job.activation_checkpoint
    op = ac.mode == "selective" and ac.selective_ac_option == "op"
    layers = [m.split(".")[1] for m in kind_of]
    full = set() if op else set(checkpointed_layers(ac, layers))
    kinds = sorted(set(kind_of.values()))
    no_ac = {k: block_bytes_no_ac(z, k, args.qk_norm) for k in kinds}
    per_block = {k: block_bytes_op_ac(z, dims.tp, k) if op else no_ac[k] for k in kinds}
    # a checkpointed block's inputs stay alive: the hidden states, and the boolean mask (under
    # CP with packed documents, the model's own (B, 1, S_local, S_local) one too, which CP's
    # replaces in attention; dry run, Qwen3-0.6B CP 2 at 16K tokens, full AC: +64 MiB)
    block_input = z.dtype_bytes * z.hidden * z.tokens / z.sp_shards
    local_mask = z.tokens * z.seq if dims.cp > 1 and job.training.document_masking else 0
    held_mask = z.mask + local_mask if (op or full) else 0.0
    blocks = {
        i: [
            block_input if m.split(".")[1] in full else per_block[kind_of[m]]
            for m in stages[i]
            if m in kind_of
        ]
        for i in ids
    }
    # a stage keeps its blocks' saves, and under pipelining the activation it received and
    # the one it sent (kept for backward); with Qwen3.5's head trained, each beside the next
    # tokens' embeddings (``mtp_pipeline``)
    hop = block_input * (2 if job.mtp.enable and args.mtp_num_hidden_layers else 1)
    saved = {i: sum(blocks[i]) + hop * ((i > 0) + (i < len(stages) - 1)) + held_mask for i in ids}
    # what a block's backward rebuilds: all of it (full/every-k) or what per-op AC dropped
    recompute = {
        k: no_ac[k] - per_block[k] + op_only_bytes(z, k) if op else (no_ac[k] if full else 0.0) for k in kinds
    }
    ended = {
        k: recompute[k] if full else (recompute[k] - per_block[k] if op else -per_block[k]) for k in kinds
    }
    return _Saves(saved, recompute, ended, {i: sum(blocks[i][1:]) for i in ids}, blocks)


def _syncs_last(job: JobConfig, dims: ParallelDims, micro: int) -> bool:
    """Whether gradients stay unsharded in float32 from a stage's first backward on: torch's
    pipeline stage turns FSDP's gradient sync off for every micro-batch but the last, and a
    schedule with several stages per rank reduces them all after its last backward, even for
    one micro-batch (dry run, Qwen3-8B FSDP 4 x Interleaved1F1B pp 2, one micro-batch, first
    stage: -16% before)."""
    if dims.pp == 1 or not uses_fsdp(job, dims):
        return False
    several_stages = SCHEDULE_STYLES[schedule_name(job.parallelism)].stages_per_rank != 1
    return several_stages or job.training.local_batch_size // micro > 1


def _casts_per_micro_batch(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    stages: list[list[str]],
    ids: list[int],
    kind_of: dict[str, LayerKind],
    c: int,
    stored: int,
) -> dict[int, float]:
    """By stage: the compute-dtype weight casts each micro-batch's forward leaves saved, when
    a pipeline without FSDP casts its weights anew in every forward. Autograd keeps a cast
    until that micro-batch's backward (a zero-bubble weight step: the input step keeps the
    graph), unless the block is checkpointed, whose backward casts again (an untied
    embedding's lookup needs no weight in backward). Dry run, Qwen3-8B TP 4 x Interleaved1F1B
    pp 2 without FSDP: +33% before these were counted (as one copy) with the gradients below."""
    if dims.pp == 1 or uses_fsdp(job, dims) or c >= stored:
        return dict.fromkeys(ids, 0.0)
    layers = [m.split(".")[1] for m in kind_of]
    checkpointed = {f"layers.{i}" for i in checkpointed_layers(job.activation_checkpoint, layers)}
    untied_embedding = set() if args.tie_word_embeddings else {"embed_tokens"}
    return {
        i: c
        * modules_numel(
            args, job, dims, [m for m in stages[i] if m not in checkpointed | untied_embedding], sharded=False
        )
        for i in ids
    }


def _fsdp_block_bytes(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    modules: list[str],
    kind_of: dict[str, LayerKind],
    gathered: float,
    c: int,
) -> tuple[dict[LayerKind, float], dict[LayerKind, float]]:
    """Per kind of block under FSDP, at the end of its backward: the weights alive (its own
    gathered copy and the block before it, which backward prefetches, unless every block
    stays gathered) and the float32 gradient its reduce-scatter takes."""
    one_of_kind = {k: m for m, k in kind_of.items()}  # every block of a kind is the same size
    block = {k: _gathered_numel(args, job, dims, [m], c) for k, m in one_of_kind.items()}
    # the largest block preceding each kind (its own size where the kind comes only first)
    order = list(kind_of)
    prefetched = {
        k: max((block[kind_of[a]] for a, b in itertools.pairwise(order) if kind_of[b] == k), default=block[k])
        for k in one_of_kind
    }
    kept = _keeps_blocks(job, dims)
    head_group = _head_group_bytes(args, job, dims, modules, c)
    block_gathered = {
        k: gathered if kept else gathered - head_group + c * (block[k] + prefetched[k]) for k in one_of_kind
    }
    block_buffers = {
        k: FP32 * trained_numel(args, job, dims, [m], sharded=False) for k, m in one_of_kind.items()
    }
    return block_gathered, block_buffers


@dataclass(frozen=True)
class _Unsynced:
    """A stage's gradients held unsharded across micro-batches, until its last syncs them."""

    grads: float  # all of them, in float32
    largest: float  # its largest module's, in the compute dtype, before it joins them
    sync: float  # the largest group's reduce-scatter: float32 input, output and its division


def _unsynced_grads(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, stages: list[list[str]], ids: list[int], c: int
) -> dict[int, _Unsynced]:
    out = {}
    for i in ids:
        kinds_here = {module_key(args, m): m for m in stages[i]}.values()
        largest = max(kinds_here, key=lambda m: trained_numel(args, job, dims, [m], sharded=False))
        whole = trained_numel(args, job, dims, [largest], sharded=False)
        out[i] = _Unsynced(
            grads=FP32 * trained_numel(args, job, dims, stages[i], sharded=False),
            largest=c * whole,
            sync=FP32 * (whole + 2 * trained_numel(args, job, dims, [largest])),
        )
    return out


class _Peak:
    """The largest moment seen: (gathered params, activations, gradient buffers)."""

    def __init__(self) -> None:
        self.moment, self.total = (0.0, 0.0, 0.0), 0.0

    def consider(self, gathered: float, activations: float, buffers: float) -> None:
        total = gathered + activations + buffers
        if total > self.total:
            self.moment, self.total = (gathered, activations, buffers), total


def _consider_block(peak: _Peak, k: _StageCosts, kind: LayerKind, alive: float, accumulated: float) -> None:
    """A block's backward: while it rebuilds and computes, then at its end (its reduce-scatter)."""
    peak.consider(k.block_gathered[kind], alive + k.recompute[kind] + k.transient[kind], accumulated)
    peak.consider(
        k.block_gathered[kind], alive + k.block_activations[kind], accumulated + k.block_buffers[kind]
    )


def _walk_schedule(actions: tuple[tuple[str, int, int], ...], k: _StageCosts) -> tuple[float, float, float]:
    """The peak moment of a rank's step: its forwards (F), backwards (B), or zero-bubble
    input (I) and weight (W) steps, in the schedule's order."""
    peak = _Peak()
    alive, accumulated = 0.0, 0.0
    unsynced = dict(k.unsynced_grads)
    backward_done: set[int] = set()
    for kind, stage, _ in actions:
        if kind == "F":
            alive += k.saved[stage]
            if stage in k.heads:  # the loss runs at the end of the forward, its saves kept
                alive += k.head.saved
                peak.consider(k.gathered, alive + k.head.forward, accumulated)
        elif kind == "I":
            # a zero-bubble input step keeps the gradient at every weight's output until
            # the stage's weight step uses it
            alive += k.pending[stage]
        if kind in ("B", "I"):  # the loss's backward, then each block's
            if stage in k.heads:
                peak.consider(k.gathered, alive + k.head.backward, accumulated)
                alive -= k.head.saved
            for b in k.stage_kinds[stage]:
                _consider_block(peak, k, b, alive, accumulated)
            if stage in k.chain:  # a Gated DeltaNet's CP chain backward
                block, beside, buffer = k.chain[stage]
                peak.consider(k.block_gathered[block], alive + beside, accumulated + buffer)
            first = k.first_block[stage]
            if kind == "B" and k.stage_grads[stage] and first is not None and stage not in backward_done:
                # its first block's backward, last: the later blocks' gradients have landed
                landed = accumulated + k.stage_grads[stage] - k.block_grads[first]
                _consider_block(peak, k, first, alive - k.before_first[stage], landed)
        if kind in ("B", "W"):
            alive -= k.saved[stage] + (k.pending[stage] if kind == "W" else 0.0)
            if stage not in backward_done:
                accumulated += k.stage_grads[stage]
            if stage in unsynced:
                held = unsynced.pop(stage)
                accumulated += held.grads
                peak.consider(k.gathered, alive, accumulated + held.largest)
            if stage in k.embeds:  # the embedding's backward ends the stage's
                grads = k.embedding_grads if stage in backward_done else k.embedding_first_grads
                peak.consider(k.gathered + k.embedding_gathered, alive, accumulated + grads)
            backward_done.add(stage)
        peak.consider(k.gathered, alive, accumulated)
    if k.syncs_at_end:  # weights resharded, each group reduce-scattered in turn
        peak.consider(0.0, alive, accumulated + max(held.sync for held in k.unsynced_grads.values()))
    return peak.moment


def _stored_bytes(job: JobConfig, device_type: str) -> int:
    """Bytes per element of a weight as stored: float32 masters, or LoRA's frozen base in its
    own dtype."""
    if not job.lora.enable:
        return FP32
    return base_storage_dtype(job.lora, compute_dtype(job, torch.device(device_type))).itemsize


def uses_fsdp(job: JobConfig, dims: ParallelDims) -> bool:
    """Whether FSDP wraps the model: over data ranks, or over one for CPU offload."""
    return dims.fsdp_enabled or job.training.enable_cpu_offload


def micro_steps(job: JobConfig, dims: ParallelDims) -> int:
    training = job.training
    if training.global_batch_size <= 0:
        return 1
    return training.global_batch_size // (training.local_batch_size * dims.dp)


def _gathered_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int, stored: int
) -> float:
    """Compute-dtype copies of parameters alive at the peak: FSDP's unsharded head (its group
    is not resharded after forward), or every block when nothing reshards (pipelining);
    without FSDP, the compute-dtype casts of weights ``stored`` wider, which autograd keeps
    for backward (not an untied embedding's: the lookup's backward needs only the tokens)."""
    if not uses_fsdp(job, dims):
        if not args.tie_word_embeddings:
            modules = [m for m in modules if m != "embed_tokens"]
        return modules_numel(args, job, dims, modules, sharded=False) * c if c < stored else 0.0
    if _keeps_blocks(job, dims):
        return _gathered_numel(args, job, dims, modules, c) * c
    return _head_group_bytes(args, job, dims, modules, c)


def layer_expert_numel(args: ModelArgs, ep: int) -> int:
    """Elements of one MoE layer's experts on one of ``ep`` ranks (before FSDP shards them)."""
    return 3 * (args.num_experts // ep) * args.moe_intermediate_size * args.hidden_size


def _gathered_numel(args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int) -> int:
    """Elements of the unsharded copies FSDP makes of ``modules``. Experts whose FSDP group
    is a single rank (expert parallelism took every data rank) and compute in their own
    float32 have none: FSDP uses the sharded weights in place (measured), unless they are in
    host memory."""
    numel = modules_numel(args, job, dims, modules, sharded=False)
    in_place = c == FP32 and not job.training.enable_cpu_offload
    if in_place and dims.ep > 1 and dims.ep == dims.dp_shard * dims.cp:
        moe_layers = sum(
            n for key, n in _key_counts(args, tuple(modules)) if is_block_kind(key) and key[1] == "moe"
        )
        numel -= moe_layers * layer_expert_numel(args, dims.ep)
    return numel


def _embedding_backward_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, c: int, stored: int, synced: bool, held: bool
) -> tuple[float, float]:
    """(gathered weights, gradient temporaries) the embedding's backward adds. Its gradient
    covers the whole vocabulary: under TP every rank sees every token's output gradient, so
    the vocabulary-sharded lookup computes the whole (replicated) gradient, and under FSDP it
    is the unsharded weight's. Without FSDP it is computed in the compute dtype, cast to the
    stored float32 (a temporary where ``held`` gradients accumulate it, else the ``.grad``
    itself); when FSDP syncs, it copies its TP shard into a float32 reduce-scatter buffer (and
    gathers the embedding again, unless it is tied to the head, whose group stays gathered).
    Under TP without FSDP the float32 cast is always a temporary: the ``.grad`` keeps a copy of
    the rank's rows (``parallel.tensor_parallel.keep_embedding_grad_sharded``)."""
    if job.lora.enable:
        return 0.0, 0.0  # frozen
    whole = args.vocab_size * args.hidden_size
    if not uses_fsdp(job, dims):
        cast = c * whole if c < stored else 0.0
        if dims.tp == 1:
            return 0.0, cast + (FP32 * whole if held else 0.0)
        # the rows are copied out once the compute-dtype gradient is freed: counted with the
        # landed gradients, they are not there yet where nothing was held before; where they
        # were, the copy and its sum with them (out of place) sit beside the whole float32 cast
        rows = FP32 * modules_numel(args, job, dims, ["embed_tokens"])
        if held:
            return 0.0, FP32 * whole + max(cast, 2 * rows)
        return 0.0, cast + FP32 * whole - rows
    shard = modules_numel(args, job, dims, ["embed_tokens"], sharded=False)
    regathered = 0.0 if (args.tie_word_embeddings or _keeps_blocks(job, dims)) else c * shard
    return regathered, c * whole + (FP32 * shard if synced else 0.0)


def _embedding_grad(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> float:
    """The whole embedding's float32 gradient, where it becomes the ``.grad``. Where gradients
    are held, the embedding's backward casts its gradient to float32 and adds it in; in a
    step's first backward that cast becomes the ``.grad`` itself, so it is no temporary beside
    it (dry run, Qwen3-8B 1F1B pp 4 without FSDP, first stage: the peak is the first
    micro-batch's embedding backward). Under TP the ``.grad`` is a copy of the rank's rows,
    made once the cast is done with."""
    if job.lora.enable:
        return 0.0
    if dims.tp > 1:
        return FP32 * modules_numel(args, job, dims, ["embed_tokens"])
    return FP32 * args.vocab_size * args.hidden_size


def _landing_grads(args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str]) -> float:
    """The float32 gradients ``modules`` keep once their backward ends, sharded as stored."""
    return FP32 * trained_numel(args, job, dims, modules)


def _keeps_blocks(job: JobConfig, dims: ParallelDims) -> bool:
    """Whether FSDP keeps every block gathered between forward and backward."""
    return not reshards_blocks(job.parallelism.fsdp_reshard_after_forward, dims.pp > 1)


def _head_group_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int
) -> float:
    """The last FSDP group (norm and head, with a tied embedding), never resharded after forward."""
    head = (
        ["norm", "lm_head", "mtp", "embed_tokens"] if args.tie_word_embeddings else ["norm", "lm_head", "mtp"]
    )
    kept = [m for m in modules if m in head] if "lm_head" in modules else []
    return modules_numel(args, job, dims, kept, sharded=False) * c
