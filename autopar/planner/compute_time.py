"""Seconds of a rank's own work in a step: its model FLOPs at their rates, what
checkpointing recomputes, the memory-bound work beside them (the blocks' elementwise passes,
the mixed-precision recipe's and FP8's casts, AdamW's traffic, ``planner/measured.py``), and
which pipeline rank holds the most of it.

A mixture of experts under TP runs whole on every TP rank, so its FLOPs count tp times. A
hybrid model's Gated DeltaNets under CP compute their delta-rule maps first
(``planner/hybrid_cp.py``): the kernel's FLOPs with dk + dv state columns and no outputs,
plus the chain's small products, which every CP rank repeats; these are overhead beside the
model FLOPs MFU counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.models.family import family_of
from autopar.parallel.activation_checkpoint import checkpointed_layers, per_op
from autopar.parallel.float8 import eligible
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import (
    SCHEDULE_STYLES,
    schedule_name,
    stage_modules,
)
from autopar.parallel.pipelining.split import StageStyle, stage_ids
from autopar.planner.block_bytes import (
    Sizes,
    state_passing,
)
from autopar.planner.comm_time import whole_gathers
from autopar.planner.devices import DeviceSpec
from autopar.planner.hybrid_cp import chain_flops, map_flops_per_token
from autopar.planner.measured import (
    FORWARD_PASS_SHARE,
    block_memory_seconds,
    cast_seconds,
    checkpoint_machinery_seconds,
    compute_dtype,
    forward_op_share,
    optimizer_seconds,
)
from autopar.planner.params import meta_model, rank_params
from autopar.planner.rates import Rates, elementwise_bytes_per_s
from autopar.planner.step import Step
from autopar.planner.weight_bytes import micro_steps
from autopar.training.metrics.flops import block_matmul_params, delta_rule_flops, flops_per_token
from autopar.training.objectives.dpo.job import runs_reference_forward

FP8_CAST_BYTES = 7
"""torchao's dynamic scaling, per element of an FP8 linear's input, output gradient and weight
and per micro-batch: the bf16 tensor read for its absolute maximum and again for the cast, its
float8 copy written (5 bytes), and a transposed float8 copy for the other GEMM (2 more)."""


def compute_seconds(step: Step, memory_bound: float, overhead: float) -> tuple[float, float, float]:
    """(compute, recompute, share of blocks fully recomputed). Full blocks rerun their
    forward: its FLOPs, its ops' dispatch (``forward_op_share``) and its elementwise passes
    (``FORWARD_PASS_SHARE``). Per-op AC reruns the forward's ops it did not keep (not its
    GEMMs, attention or collectives): the same elementwise passes and dispatch, eager; nothing
    a compiled step does not rerun anyway.
    ``memory_bound`` and ``overhead``: the step's blocks'."""
    args, job, dims, device = step.args, step.job, step.dims, step.device
    seq, world, rate, z = job.training.seq_len, dims.world_size, step.rate, step.z
    compute = (
        flops_per_token(args, seq, job.lora.enable, reference=runs_reference_forward(job))
        * step.tokens
        / world
        / rate
        * step.imbalance
    )
    if job.lora.enable and job.float8.enable and not job.compile.enable:
        # torchao's eager backward forms the frozen FP8 weights' gradients and drops them
        # (a compiled graph drops the GEMM itself)
        compute += 2 * fp8_linear_numel(args, tuple(job.float8.filter_fqns))[0] * step.tokens / world / rate
    ac = job.activation_checkpoint
    op = per_op(ac)
    recompute = 0.0
    ids = [str(i) for i in range(args.num_hidden_layers)]
    share = len(checkpointed_layers(ac, ids)) / len(ids) if ac.mode != "none" and not op else 0.0
    passes = step.layers * step.micro_batches  # this rank's block forwards and backwards
    if op and not job.compile.enable:
        # every forward op it did not keep runs again: all but the GEMMs, attention and
        # collectives, so the forward's elementwise passes and their dispatch. A compiled
        # graph's backward reruns those already (inductor's partitioner keeps GEMM outputs and
        # recomputes pointwise work), which its timed step includes: measured on an H100 and
        # this CPU, compiled per-op checkpointing runs within 2% of no checkpointing
        recompute = FORWARD_PASS_SHARE * memory_bound + forward_op_share(args) * overhead
        recompute += checkpoint_machinery_seconds(args, job, device, passes, "op")
    elif share:
        recompute = share * (
            block_forward_flops(args, seq) * step.tokens / world / rate * step.imbalance
            + forward_op_share(args) * overhead
            + FORWARD_PASS_SHARE * memory_bound
            + checkpoint_machinery_seconds(args, job, device, passes, "full")
        )
    if dims.tp > 1 and step.moe_layers:
        # every TP rank runs a mixture of experts on the whole sequence (its shared expert
        # too): tp times its FLOPs
        shared = 3 * args.hidden_size * z.shared_inter + (args.hidden_size if z.shared_inter else 0)
        moe_fwd = 2 * (
            args.hidden_size * args.num_experts + 3 * z.top_k * args.hidden_size * z.moe_inter + shared
        )
        compute += (dims.tp - 1) * 3 * moe_fwd * step.moe_layers * step.tokens / world / rate
        recompute += (dims.tp - 1) * share * moe_fwd * step.moe_layers * step.tokens / world / rate
    return compute, recompute, share


def block_elementwise_seconds(args: ModelArgs, job: JobConfig, device: DeviceSpec, z: Sizes) -> list[float]:
    """Each block's elementwise seconds per micro-batch of ``z``, at the rate the probe's model
    steps give for its tokens."""
    return block_memory_seconds(args, job, device, z, elementwise_bytes_per_s(args, job, device, z.tokens))


def recipe_cast_seconds(step: Step) -> float:
    """The mixed-precision recipe's casts per step: without FSDP every forward casts the
    rank's weights and every backward their gradients, per micro-batch; FSDP2 casts each
    shard before its gather and each whole gradient before its reduce-scatter. LoRA's frozen
    weights are stored in the compute dtype, and its adapters are too few to count."""
    args, job, dims, device = step.args, step.job, step.dims, step.device
    if job.lora.enable:
        return 0.0
    params, fsdp = rank_params(args, job, dims), dims.dp_shard * dims.cp
    if fsdp == 1:
        return cast_seconds(job, device, 2 * params * step.micro_batches)
    gathers = whole_gathers(step)
    return cast_seconds(job, device, params / fsdp * gathers + params * micro_steps(job, dims))


@functools.lru_cache(maxsize=16)
def fp8_linear_numel(args: ModelArgs, filter_fqns: tuple[str, ...]) -> tuple[int, int]:
    """(weights, input plus output features) of the linears FP8 converts
    (``parallel.float8.eligible``); cached, as the planner asks once per candidate plan."""
    keep = eligible(list(filter_fqns), family_of(args).high_precision)
    linears = [m for fqn, m in meta_model(args).named_modules() if keep(m, fqn)]
    return sum(m.weight.numel() for m in linears), sum(m.in_features + m.out_features for m in linears)


def float8_cast_seconds(step: Step) -> float:
    """FP8's dynamic scaling around this rank's GEMMs per step (``FP8_CAST_BYTES`` per element
    of each converted linear's input, output gradient and weight, per micro-batch, TP-sharded),
    at the memory bandwidth; none where the GEMMs do not run in float8."""
    args, job, dims, device = step.args, step.job, step.dims, step.device
    if compute_dtype(job, device) != "float8":
        return 0.0
    weights, features = fp8_linear_numel(args, tuple(job.float8.filter_fqns))
    elements = (features * step.z.tokens + weights) / dims.tp * step.layers / args.num_hidden_layers
    return FP8_CAST_BYTES * elements * step.micro_batches / device.hbm_bytes_per_s


def state_passing_seconds(step: Step, share: float) -> tuple[float, float]:
    """(compute, recompute) of the Gated DeltaNets' CP maps: the map pass over every token
    (the delta-rule kernel itself, at the recurrence's rate) and the chain of small matmuls
    every CP rank runs (at the GEMMs'), forward and backward (3x the forward), and the
    forward again where blocks are fully recomputed."""
    passing = state_passing(step.z)
    if passing is None or not step.linear_layers:
        return 0.0, 0.0
    args = step.args
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    per_token = map_flops_per_token(args.linear_num_value_heads, dk, dv) * _linear_layers(args)
    chain = chain_flops(passing.cp_ranges, passing.value_heads, dk, dv) * passing.batch
    forward = (
        per_token * step.tokens / step.dims.world_size / step.rates.recurrence
        + chain * step.linear_layers * step.micro_batches / step.rates.gemm
    )
    return 3 * forward, share * forward


@functools.lru_cache(maxsize=64)
def moe_layer_count(args: ModelArgs) -> int:
    return sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))


@functools.lru_cache(maxsize=64)
def _linear_layers(args: ModelArgs) -> int:
    return sum(args.mixer(i) == "linear_attention" for i in range(args.num_hidden_layers))


def device_optimizer_seconds(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec
) -> float:
    """AdamW on the device over this rank's shard of its stage (none with CPU offload, whose
    step is ``host_optimizer``; LoRA's adapters are too few to count)."""
    if job.training.enable_cpu_offload or job.lora.enable:
        return 0.0
    return optimizer_seconds(device, rank_params(args, job, dims) / (dims.dp_shard * dims.cp))


@dataclass(frozen=True)
class StageRank:
    """The pipeline rank with the most work: its blocks and its share of the model's FLOP time."""

    blocks: tuple[int, ...]
    share: float


def busiest_stage_rank(
    args: ModelArgs, job: JobConfig, pp: int, rates: Rates, work: list[float]
) -> StageRank:
    """The rank of ``pp`` whose stages' ``work`` (``stage_work``) adds up to the most. An even
    split counts the embedding and the head as layers (``first/last_stage_less_layers``), a V
    schedule's rank pairs its first stage with its last, and a hybrid model's Gated DeltaNets
    take longer than its attention layers, so ranks may hold unequal work (ZBV's 4 layers
    over 2 ranks: 1 and 3)."""
    if pp == 1:
        return StageRank(tuple(range(args.num_hidden_layers)), 1.0)
    stages = tuple(tuple(names) for names in stage_modules(job.parallelism, args))
    style = SCHEDULE_STYLES[schedule_name(job.parallelism)].placement
    ranks = _stage_ranks(args, stages, pp, style, job.training.seq_len, rates)
    return max(((sum(work[s] for s in ids), rank) for ids, rank in ranks), key=lambda pair: pair[0])[1]


@functools.lru_cache(maxsize=4096)
def _stage_ranks(
    args: ModelArgs, stages: tuple[tuple[str, ...], ...], pp: int, style: StageStyle, seq: int, rates: Rates
) -> tuple[tuple[tuple[int, ...], StageRank], ...]:
    """Each pipeline rank's stage ids, blocks and share of the FLOP time: the same for every
    plan of one split and one set of rates (the search meets each thousands of times)."""
    flops = _flop_seconds(args, seq, rates)
    ranks = []
    for rank in range(pp):
        ids = stage_ids(rank, pp, len(stages), style)
        names = [n for s in ids for n in stages[s]]
        blocks = tuple(int(n.split(".")[1]) for n in names if n.startswith("layers."))
        share = sum(flops.get(n, 0.0) for n in names) / sum(flops.values())
        ranks.append((tuple(ids), StageRank(blocks, share)))
    return tuple(ranks)


def stage_work(
    args: ModelArgs, job: JobConfig, rates: Rates, block_memory: list[float], tokens: int
) -> list[float]:
    """Seconds of each pipeline stage's forward and backward over a micro-batch of ``tokens``:
    its blocks' FLOPs at their kinds' rates (and the head's) and their elementwise work
    (``block_memory``); dispatch and recompute left out (the same share of every block)."""
    stages = tuple(map(tuple, stage_modules(job.parallelism, args)))
    return [
        seconds * tokens + sum(block_memory[b] for b in blocks)
        for seconds, blocks in _stage_flops(args, stages, job.training.seq_len, rates)
    ]


@functools.lru_cache(maxsize=256)
def _stage_flops(
    args: ModelArgs, stages: tuple[tuple[str, ...], ...], seq: int, rates: Rates
) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """Each stage's FLOP seconds per token and its blocks' indices: the same for every plan
    of one split and one set of rates (the search meets each thousands of times)."""
    flops = _flop_seconds(args, seq, rates)
    return tuple(
        (
            sum(flops.get(n, 0.0) for n in names),
            tuple(int(n.split(".")[1]) for n in names if n.startswith("layers.")),
        )
        for names in stages
    )


@functools.lru_cache(maxsize=256)
def _flop_seconds(args: ModelArgs, seq: int, rates: Rates) -> dict[str, float]:
    """Forward-and-backward seconds per token of each block and of the head at ``rates``, at
    ``seq`` tokens a sequence. Cached (the search asks for each of its plans): callers must
    not modify it."""
    flops = {
        f"layers.{i}": 3 * _block_forward_seconds(args, i, seq, rates) for i in range(args.num_hidden_layers)
    }
    return flops | {"lm_head": 6.0 * args.hidden_size * args.vocab_size / rates.gemm}


def _block_forward_seconds(args: ModelArgs, layer: int, seq: int, rates: Rates) -> float:
    """Forward seconds per token of block ``layer``: its projections at the GEMM rate, its
    mixer's FLOPs (as ``block_forward_flops`` counts them) at attention's or the recurrence's."""
    if args.mixer(layer) == "linear_attention":
        mixer = delta_rule_flops(args) / 3 / rates.recurrence
    else:
        mixer = 4 * args.num_attention_heads * args.head_dim * seq / rates.attention
    return 2 * block_matmul_params(args, layer) / rates.gemm + mixer


@functools.lru_cache(maxsize=64)
def block_forward_flops(args: ModelArgs, seq: int) -> float:
    """Forward FLOPs per token of every block, as ``flops_per_token`` counts them: the
    projections, the attention layers' scores and the Gated DeltaNets' recurrence."""
    mixers = [args.mixer(i) for i in range(args.num_hidden_layers)]
    linear = mixers.count("linear_attention")
    attention = 4 * args.num_attention_heads * args.head_dim * seq * (len(mixers) - linear)
    block_fwd = 2 * sum(block_matmul_params(args, i) for i in range(args.num_hidden_layers)) + attention
    return block_fwd + linear * delta_rule_flops(args) / 3 if linear else block_fwd
