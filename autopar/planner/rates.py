"""The rates a rank's compute runs at: FLOP/s of its GEMMs, attention and delta-rule
recurrence, and bytes/s of its elementwise work.

Compute is the step's model FLOPs (``metrics.flops_per_token``, the same count MFU uses) at the
GEMM rate: measured at the plan's shapes with a device profile, else ``GEMM_EFFICIENCY`` of the
preset's peak. The preset's figures (GEMM efficiency, seconds per op, the share of ops a
compiled graph keeps) are one least-squares fit to the eight single-GPU runs of the H100
sittings (BENCHMARKS.md: Qwen3-0.6B and 1.7B, eager and compiled, batch 2 and 4), each then
within 5%; large models, whose step is almost all GEMM, run near ``GEMM_EFFICIENCY``, small
ones lose more to the rest, as measured.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from autopar.config.sections import Compile, JobConfig, Training
from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import CHUNK as DELTA_RULE_CHUNK
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.delta_rule_kernel import resolve_delta_rule_kernel
from autopar.parallel.float8 import output_head_in_fp8
from autopar.parallel.mesh import ParallelDims
from autopar.planner.activations import sizes
from autopar.planner.devices import H100_MATMUL, DeviceSpec
from autopar.planner.measured import (
    cast_seconds,
    compute_dtype,
    memory_bound_seconds,
    overhead_seconds,
)
from autopar.planner.params import rank_params
from autopar.planner.profile import (
    DeviceProfile,
    ModelStepPoint,
    attention_flops,
    gemm_rate,
    gemm_shapes,
    log_interpolate,
    matmul_flops_per_s,
    recurrence_flops,
)
from autopar.training.metrics.flops import delta_rule_flops, flops_per_token
from autopar.training.objectives.dpo.job import runs_reference_forward

GEMM_EFFICIENCY = 0.614
"""The share of a GPU preset's bf16 peak its model FLOPs run at (the fit above)."""


FP8_GEMM_SCALE = 1.06
"""The factor on the H100's measured FP8-over-bf16 gain at a GEMM's shape
(``devices.H100_MATMUL``) that reproduces the compiled FP8 runs of Qwen3-1.7B on an H100
(39,573 and 39,214 tokens/s, with and without per-op checkpointing, 2026-11-27) beside their
casts (``FP8_CAST_BYTES``), attention and the head in bf16: its blocks' GEMMs then gain 1.63x
where the table gives 1.54x. One run fits it, so it also carries whatever else FP8 changes
in that step."""


PRESET_DELTA_RULE_CHUNK_SECONDS = 1.7e-3
"""Seconds a Gated DeltaNet layer's forward and backward spends per chunk of 64 tokens in our
delta-rule kernel on a GPU preset, whatever the heads: its custom ops run eager inside compiled
graphs and launch the same small kernels for every chunk, so on a GPU its time follows the
chunks, not its FLOPs. Measured on an H100 with torch 2.11: Qwen3.5-2B cut to 8 layers,
compiled, 2 x 4096 tokens, 10,783 tokens/s (BENCHMARKS.md). The Triton kernels
(``delta_rule_kernel = "triton"``, the default on CUDA, and ``"fla"``) are unmeasured and taken
at the GEMMs' rate until a probe times them."""


@dataclass(frozen=True)
class Rates:
    """FLOP/s of a plan's three kinds of compute on one rank: its GEMMs, its attention and a
    hybrid model's delta-rule recurrence."""

    gemm: float
    attention: float
    recurrence: float


def compute_rates(
    job: JobConfig, device: DeviceSpec, args: ModelArgs, dims: ParallelDims, micro: int = 1
) -> Rates:
    """With a measured profile, the rates measured at this plan's own per-rank shapes (a
    micro-batch of ``micro`` sequences, split by CP, weights and heads by TP) and dtype: the
    GEMMs' interpolated over their shapes, attention's and the recurrence's at their calls
    where the probe timed them, else the GEMMs'. Otherwise ``GEMM_EFFICIENCY`` of the
    preset's peak for all three (FP8 GEMMs ``preset_fp8_speedup`` faster; attention and the
    recurrence stay in bf16), but our delta-rule kernel's on a GPU, which follows its chunks
    (``PRESET_DELTA_RULE_CHUNK_SECONDS``)."""
    if device.profile is not None:
        return measured_rates(device.profile, job, device, args, dims, micro)
    rate = device.bf16_flops * GEMM_EFFICIENCY
    gemm = rate
    if job.float8.enable and device.fp8_flops is not None:
        gemm *= preset_fp8_speedup(
            args, job, gemm_shapes(args, micro * job.training.seq_len // dims.cp, dims.tp)
        )
    return Rates(gemm, rate, _unprobed_recurrence(job, device, args, dims, micro, rate))


def preset_fp8_speedup(args: ModelArgs, job: JobConfig, shapes: list[tuple[int, int, int, int]]) -> float:
    """FP8's gain over bf16 across a rank's GEMMs (``gemm_shapes``) on a preset. On the GEMMs FP8
    converts (the blocks' projections and dense MLPs; the vocabulary head only where the job
    converts it) ``FP8_GEMM_SCALE`` times the H100's measured gain at that shape, which grows
    with the GEMM (1.33x over Qwen3-0.6B's blocks at 8192 tokens, 1.54x over
    1.7B's, 1.6x over a 70B's under TP 4); routed experts (grouped weights, not linears) and
    an unconverted head run in bf16."""
    converted = [True, True, not args.num_experts, not args.num_experts, output_head_in_fp8(job.float8, args)]
    flops = [2.0 * m * n * k * c for m, n, k, c in shapes]
    seconds = 0.0
    for (m, n, k, _), flop, fp8 in zip(shapes, flops, converted, strict=True):
        gain = matmul_flops_per_s(H100_MATMUL, "float8", m, n, k) / matmul_flops_per_s(
            H100_MATMUL, "bfloat16", m, n, k
        )
        seconds += flop / (FP8_GEMM_SCALE * gain if fp8 else 1.0)
    return sum(flops) / seconds


def _unprobed_recurrence(
    job: JobConfig, device: DeviceSpec, args: ModelArgs, dims: ParallelDims, micro: int, gemm: float
) -> float:
    """The delta rule's FLOP/s where no probe timed it: on a GPU, our kernel's chunks at
    ``PRESET_DELTA_RULE_CHUNK_SECONDS`` each; else (the Triton kernels, ours or FLA's, and a
    CPU) the GEMMs' rate."""
    kernel = resolve_delta_rule_kernel(job.training.delta_rule_kernel, device.device_type)
    if not args.hybrid or kernel != "autopar" or device.device_type != "cuda":
        return gemm
    # one layer's forward and backward over one chunk of each of the micro-batch's sequences
    chunk_flops = delta_rule_flops(args) * DELTA_RULE_CHUNK * micro / dims.tp
    return min(gemm, chunk_flops / PRESET_DELTA_RULE_CHUNK_SECONDS)


def measured_rates(
    profile: DeviceProfile,
    job: JobConfig,
    device: DeviceSpec,
    args: ModelArgs,
    dims: ParallelDims,
    micro: int,
) -> Rates:
    """``compute_rates`` from a profile."""
    seq, dtype = job.training.seq_len, compute_dtype(job, device)
    tokens = micro * seq // dims.cp
    gemm = gemm_rate(profile.matmul, dtype, gemm_shapes(args, tokens, dims.tp))
    heads = max(1, args.num_attention_heads // dims.tp)
    rank_call = attention_flops(micro, heads, seq, args.head_dim) / dims.cp
    value_heads = max(1, args.linear_num_value_heads // dims.tp)
    rank_rule = recurrence_flops(tokens, value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
    cp = dims.cp if resolve_impl(job.parallelism, device.device_type) == "allgather" else 1
    return Rates(
        gemm,
        profile.attention_flops_per_s(dtype, rank_call, seq, cp) or gemm,
        profile.recurrence_flops_per_s(dtype, rank_rule, seq // dims.cp)
        or _unprobed_recurrence(job, device, args, dims, micro, gemm),
    )


def compute_rate(
    job: JobConfig, device: DeviceSpec, args: ModelArgs, dims: ParallelDims, micro: int = 1
) -> float:
    """Model FLOP/s one GPU sustains for this job: ``blended_rate`` of ``compute_rates``."""
    return blended_rate(args, job, compute_rates(job, device, args, dims, micro))


def blended_rate(args: ModelArgs, job: JobConfig, rates: Rates) -> float:
    """The model's FLOPs (``flops_per_token``) over the time its GEMMs, attention and
    recurrence take at ``rates``."""
    return _blended_rate(args, job.training.seq_len, job.lora.enable, runs_reference_forward(job), rates)


@functools.lru_cache(maxsize=256)
def _blended_rate(args: ModelArgs, seq: int, frozen: bool, reference: bool, rates: Rates) -> float:
    """``blended_rate`` of a job training ``frozen`` weights (LoRA) and running a preference
    step's ``reference`` forward, at ``seq`` tokens a sequence (cached: the search asks for
    each of its plans)."""
    total = flops_per_token(args, seq, frozen, reference=reference)
    attention_layers = sum(args.mixer(i) != "linear_attention" for i in range(args.num_hidden_layers))
    attention = 12 * attention_layers * args.num_attention_heads * args.head_dim * seq
    linear = args.num_hidden_layers - attention_layers
    recurrence = linear * delta_rule_flops(args) if args.hybrid else 0.0
    if reference:  # the reference's forward: a third of each again
        attention, recurrence = attention * 4 / 3, recurrence * 4 / 3
    gemms = total - attention - recurrence
    return total / (gemms / rates.gemm + attention / rates.attention + recurrence / rates.recurrence)


CALIBRATION_FLOOR = 0.01
"""The least share of the probe's model step left to the elementwise work, so a step its
GEMMs and attention already explain still gives a finite rate."""


def elementwise_bytes_per_s(args: ModelArgs, job: JobConfig, device: DeviceSpec, tokens: int) -> float:
    """The rate the model's elementwise work (everything beside its GEMMs, attention,
    recurrence, casts and dispatch) runs at over a micro-batch of ``tokens`` on a rank, in the
    bytes ``memory_bound_seconds`` counts: where the probe timed this model's step in the job's
    compute dtype (bf16 for FP8, whose elementwise work runs in bf16), compiled where the job
    compiles and the probe timed that, what that step took beyond those terms, interpolated
    between the batches it timed (on this CPU one sequence's step is a quarter of four's, where
    four's rate plus a micro-batch's dispatch said 8% more: its small tensors' cache hits hide
    the dispatch); else the device's memory
    bandwidth. A large elementwise product is the best case; a model's norms, rotary, gates,
    loss and small tensors run slower, by how much only its own step tells (on this CPU 2-4x,
    BENCHMARKS.md). An eager step stands in for a compiled one, with ``MEMORY_PASSES``' assumed
    ratio."""
    profile = device.profile
    if profile is None:
        return device.hbm_bytes_per_s
    dtype = compute_dtype(job, device)
    dtype = "bfloat16" if dtype == "float8" else dtype
    points = profile.model_step(args, dtype, job.compile.enable) or profile.model_step(args, dtype)
    if not points:
        return device.hbm_bytes_per_s
    t = job.training
    settings = (t.document_masking, t.mixed_precision_param, t.sdpa_backend)
    rates = [(p.batch * p.seq, _calibrated_bytes_per_s(args, device, p, *settings)) for p in points]
    return log_interpolate(rates, tokens)


@functools.lru_cache(maxsize=16)
def _calibrated_bytes_per_s(
    args: ModelArgs,
    device: DeviceSpec,
    point: ModelStepPoint,
    document_masking: bool,
    mixed_precision_param: str,
    sdpa_backend: str,
) -> float:
    """``elementwise_bytes_per_s`` from one timed step: one rank, eager or compiled as the
    step ran, no checkpointing, the job's attention as the plan's sizes count it."""
    training = dataclasses.replace(
        Training(),
        seq_len=point.seq,
        local_batch_size=point.batch,
        document_masking=document_masking,
        mixed_precision_param=mixed_precision_param,
        sdpa_backend=sdpa_backend,
    )
    job = JobConfig(training=training, compile=Compile(enable=point.compiled))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1)
    flops = flops_per_token(args, point.seq, False) * point.batch * point.seq
    itemised = flops / compute_rate(job, device, args, dims, point.batch)
    itemised += overhead_seconds(args, job, device, args.num_hidden_layers)
    itemised += cast_seconds(job, device, 2 * rank_params(args, job, dims))  # weights and gradients
    c = 4 if point.dtype == "float32" else 2
    z = sizes(args, job, dims, point.batch, "ring", c, device.device_type)
    at_bandwidth = memory_bound_seconds(args, job, device, z, args.num_hidden_layers)
    rest = max(point.seconds - itemised, CALIBRATION_FLOOR * point.seconds)
    return device.hbm_bytes_per_s * at_bandwidth / rest
