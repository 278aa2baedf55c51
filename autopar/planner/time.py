"""Predicted time of one optimizer step of a plan: compute, recompute, exposed communication
and pipeline bubble.

Compute is the step's model FLOPs (``metrics.flops_per_token``, the same count MFU uses) at the
GEMM rate: measured at the plan's shapes with a device profile, else ``GEMM_EFFICIENCY`` of the
preset's peak. Beside it run the memory-bound work (the blocks' elementwise passes and AdamW's
traffic, the mixed-precision recipe's casts, ``planner/measured.py``) and each op's dispatch.
The preset's figures (GEMM efficiency, seconds per op, the share of ops a compiled graph keeps)
are one least-squares fit to the eight single-GPU runs of the H100 sittings (BENCHMARKS.md:
Qwen3-0.6B and 1.7B, eager and compiled, batch 2 and 4), each then within 5%; large models,
whose step is almost all GEMM, run near ``GEMM_EFFICIENCY``, small ones lose more to the rest,
as measured.
Communication is each collective's bytes per rank over the link its mesh dimension uses
(NVLink when the group fits in a node, the network otherwise) at ``COMM_EFFICIENCY`` of the
link. That figure is an assumption until a multi-GPU run calibrates it; every real run's
``plan.json`` records prediction beside measurement for that purpose.

What overlaps: FSDP's all-gathers and reduce-scatters (and HSDP's all-reduce) run on their own
stream behind compute, so only what exceeds compute plus the first all-gather is exposed; a
pipeline's asynchronous sends travel while the next micro-batch computes; context-parallel
k/v exchange hides behind attention; TP collectives and expert parallelism's all-to-alls
(every routed row out and back, forward and backward) sit on the critical path. Under a
pipeline FSDP gathers a stage's weights once per schedule step and reduces its gradients
after the last micro-batch, as torch's schedules drive it (``rank_stage_gathers``). A mixture of experts under TP runs whole on every TP rank, so its FLOPs
count tp times. The bubble is the schedule's idle fraction of the compute.

Context parallelism in a hybrid model (``planner/hybrid_cp.py``): the attention layers pass
k/v as above; each Gated DeltaNet all-gathers its ranges' delta-rule maps forward (again
where checkpointing recomputes it) and reduce-scatters their gradients backward, on the
critical path (the chain waits for them), and computes the maps first: the kernel's FLOPs
with dk + dv state columns and no outputs, plus the chain's small products, which every CP
rank repeats. These are overhead beside the model FLOPs MFU counts.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from autopar.config.sections import Compile, JobConfig, Training
from autopar.models.args import ModelArgs
from autopar.models.family import family_of
from autopar.models.qwen3_5.delta_rule import CHUNK as DELTA_RULE_CHUNK
from autopar.parallel.activation_checkpoint import checkpointed_layers
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.delta_rule_kernel import resolve_delta_rule_kernel
from autopar.parallel.float8 import eligible, output_head_in_fp8
from autopar.parallel.fsdp import reshards_blocks
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import (
    SCHEDULE_STYLES,
    num_stages,
    rank_actions,
    rank_stage_gathers,
    schedule_name,
    stage_modules,
)
from autopar.parallel.pipelining.split import stage_ids
from autopar.planner.block_bytes import FP32, Sizes, state_passing
from autopar.planner.devices import H100_MATMUL, DeviceSpec
from autopar.planner.hybrid_cp import chain_flops, map_flops_per_token
from autopar.planner.measured import (
    FORWARD_PASS_SHARE,
    block_memory_seconds,
    cast_seconds,
    checkpoint_machinery_seconds,
    compute_dtype,
    forward_op_share,
    memory_bound_seconds,
    optimizer_seconds,
    overhead_seconds,
)
from autopar.planner.memory import (
    layer_expert_numel,
    meta_model,
    micro_steps,
    modules_numel,
    sizes,
)
from autopar.planner.pipeline_sim import play
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
from autopar.training.metrics import block_matmul_params, delta_rule_flops, flops_per_token
from autopar.training.preference import runs_reference_forward

GEMM_EFFICIENCY = 0.614
"""The share of a GPU preset's bf16 peak its model FLOPs run at (the fit above)."""
FP8_GEMM_SCALE = 1.06
"""The factor on the H100's measured FP8-over-bf16 gain at a GEMM's shape
(``devices.H100_MATMUL``) that reproduces the compiled FP8 runs of Qwen3-1.7B on an H100
(39,573 and 39,214 tokens/s, with and without per-op checkpointing, 2026-11-27) beside their
casts (``FP8_CAST_BYTES``), attention and the head in bf16: its blocks' GEMMs then gain 1.63x
where the table gives 1.54x. One run fits it, so it also carries whatever else FP8 changes
in that step."""
FP8_CAST_BYTES = 7
"""torchao's dynamic scaling, per element of an FP8 linear's input, output gradient and weight
and per micro-batch: the bf16 tensor read for its absolute maximum and again for the cast, its
float8 copy written (5 bytes), and a transposed float8 copy for the other GEMM (2 more)."""
PRESET_DELTA_RULE_CHUNK_SECONDS = 1.7e-3
"""Seconds a Gated DeltaNet layer's forward and backward spends per chunk of 64 tokens in our
delta-rule kernel on a GPU preset, whatever the heads: its custom ops run eager inside compiled
graphs and launch the same small kernels for every chunk, so on a GPU its time follows the
chunks, not its FLOPs. Measured on an H100 with torch 2.11: Qwen3.5-2B cut to 8 layers,
compiled, 2 x 4096 tokens, 10,783 tokens/s (BENCHMARKS.md). The Triton kernels
(``delta_rule_kernel = "triton"``, the default on CUDA, and ``"fla"``) are unmeasured and taken
at the GEMMs' rate until a probe times them."""
COMM_EFFICIENCY = 0.7
HOST_ADAM_PARAMS_PER_S = 1.8e9
"""CPU offload's optimizer step: torch 2.13's fused AdamW on this project's two-core CI
machine (float32). A GPU host's CPU has more cores and memory bandwidth, so the prediction
errs slow until a GPU host measures it."""
DDP_BUCKET_BYTES = 25 * 2**20
"""The replicas' all-reduce runs in buckets of this size (DDP's default)."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one GPU, split by what the GPU waits for."""

    compute: float
    recompute: float
    exposed_comm: float
    bubble: float
    comm_by_dim: dict[str, float] = field(default_factory=dict)  # total (not only exposed) seconds
    host_optimizer: float = 0.0  # CPU offload: AdamW on the host, after backward
    memory_bound: float = 0.0  # elementwise work and the optimizer's traffic at the memory bandwidth
    overhead: float = 0.0  # each op's dispatch beside its compute

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.exposed_comm
            + self.bubble
            + self.host_optimizer
            + self.memory_bound
            + self.overhead
        )

    def split(self) -> dict[str, float]:
        """Each part's share of the step."""
        parts = {
            "compute": self.compute,
            "recompute": self.recompute,
            "exposed_comm": self.exposed_comm,
            "bubble": self.bubble,
            "host_optimizer": self.host_optimizer,
            "memory_bound": self.memory_bound,
            "overhead": self.overhead,
        }
        return {k: v / self.total for k, v in parts.items()}


def tokens_per_step(job: JobConfig, dims: ParallelDims) -> int:
    """Tokens of one optimizer step over all ranks."""
    return job.training.local_batch_size * dims.dp * micro_steps(job, dims) * job.training.seq_len


def link_bytes_per_s(
    span: int,
    gpus_per_node: int,
    device: DeviceSpec,
    op: str | None = None,
    group: int | None = None,
    message: float | None = None,
) -> float:
    """Bandwidth a collective over a group of ``span`` consecutive ranks reaches: with a
    measured profile, ``op``'s bus bandwidth over ``group`` ranks at ``message`` bytes within
    a node; otherwise (and across nodes, which one machine's probe cannot see) the link's
    datasheet figure at ``COMM_EFFICIENCY``."""
    profile = device.profile
    if profile is not None and op is not None and span <= gpus_per_node:
        measured = profile.bus_bytes_per_s(op, group or span, message)
        if measured is not None:
            return measured
    link = device.intra_node_bytes_per_s if span <= gpus_per_node else device.inter_node_bytes_per_s
    return link * COMM_EFFICIENCY


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
    seq = job.training.seq_len
    total = flops_per_token(args, seq, job.lora.enable, reference=runs_reference_forward(job))
    attention_layers = sum(args.mixer(i) != "linear_attention" for i in range(args.num_hidden_layers))
    attention = 12 * attention_layers * args.num_attention_heads * args.head_dim * seq
    linear = args.num_hidden_layers - attention_layers
    recurrence = linear * delta_rule_flops(args) if args.hybrid else 0.0
    if runs_reference_forward(job):  # the reference's forward: a third of each again
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
    itemised += cast_seconds(job, device, 2 * _rank_params(args, job, dims))  # weights and gradients
    c = 4 if point.dtype == "float32" else 2
    z = sizes(args, job, dims, point.batch, "ring", c, device.device_type)
    at_bandwidth = memory_bound_seconds(args, job, device, z, args.num_hidden_layers)
    rest = max(point.seconds - itemised, CALIBRATION_FLOOR * point.seconds)
    return device.hbm_bytes_per_s * at_bandwidth / rest


def predict_time(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int
) -> StepTime:
    """Predicted step time of ``job`` under ``dims`` on ``device``: compute and recompute,
    the communication left exposed beside them, and the pipeline's bubble."""
    c = 4 if compute_dtype(job, device) == "float32" else 2
    pipelined = dims.pp > 1
    micro = job.parallelism.pipeline_parallel_microbatch_size if pipelined else job.training.local_batch_size
    n_micro = job.training.local_batch_size // micro if pipelined else 1
    cp_impl = resolve_impl(job.parallelism, device.device_type)
    z = sizes(args, job, dims, micro, cp_impl, c, device.device_type)
    rates = compute_rates(job, device, args, dims, micro)
    block_memory = _block_memory(args, job, device, z)
    work = stage_work(args, job, rates, block_memory, z.tokens) if pipelined else []
    busiest = busiest_stage_rank(args, job, dims.pp, rates, work)
    step = _Step(
        tokens=tokens_per_step(job, dims),
        micro_batches=n_micro * micro_steps(job, dims),  # micro-batches this rank runs per step
        layers=len(busiest.blocks),
        imbalance=busiest.share * dims.pp,
        linear_layers=sum(args.mixer(i) == "linear_attention" for i in busiest.blocks),
        moe_layers=sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers)),
        rate=blended_rate(args, job, rates),
        rates=rates,
        z=z,
        cp_impl=cp_impl,
    )
    memory_bound = sum(block_memory[i] for i in busiest.blocks) * step.micro_batches
    memory_bound += _cast_seconds(args, job, dims, device, step)
    memory_bound += _float8_cast_seconds(args, job, dims, device, step)
    overhead = overhead_seconds(args, job, device, step.layers * step.micro_batches, dims.tp, dims.cp)
    compute, recompute, share = _compute_seconds(args, job, dims, device, step, memory_bound, overhead)
    maps_compute, maps_recompute = _state_passing_seconds(args, dims, step, share)
    compute, recompute = compute + maps_compute, recompute + maps_recompute
    comm, cp_exposed = _model_parallel_comm(args, job, dims, device, gpus_per_node, step, share)
    data_comm, host_optimizer = _data_parallel_comm(args, job, dims, device, gpus_per_node, step)
    comm |= data_comm
    first_gather = comm.get("fsdp", 0.0) / max(1.0, step.layers * step.micro_batches * 3)
    if pipelined:
        comm["pp"] = _pipeline_send_seconds(args, job, dims, device, gpus_per_node, step)
    # a pipeline's sends are asynchronous: in the steady state a micro-batch's activations
    # travel while the next one computes (the warm-up's wait is in the bubble)
    background = sum(comm.get(dim, 0.0) for dim in ("fsdp", "dp_replicate", "host", "pp"))
    exposed = (
        comm.get("tp", 0.0)
        + comm.get("ep", 0.0)
        + cp_exposed
        + (max(0.0, background - compute - recompute) if _overlaps(device) else background)
        + first_gather
    )
    if pipelined and SCHEDULE_STYLES[schedule_name(job.parallelism)].splits_backward:
        recompute *= 2  # the input- and weight-gradient passes each recompute what was dropped
    bubble = 0.0
    if pipelined:
        busy = compute + recompute + memory_bound + overhead
        bubble, played = _pipeline_bubble(args, job, dims, device, gpus_per_node, step, n_micro, busy, work)
        if played and not _overlaps(device):
            exposed -= comm["pp"]  # the hops on the critical path are in the played step; the rest hide
    memory_bound += _optimizer_seconds(args, job, dims, device)  # after the flush
    return StepTime(compute, recompute, exposed, bubble, comm, host_optimizer, memory_bound, overhead)


def _block_memory(args: ModelArgs, job: JobConfig, device: DeviceSpec, z: Sizes) -> list[float]:
    """Each block's elementwise seconds per micro-batch of ``z``, at the rate the probe's model
    steps give for its tokens."""
    return block_memory_seconds(args, job, device, z, elementwise_bytes_per_s(args, job, device, z.tokens))


def _activation_bytes(step: _Step) -> float:
    """A stage's output as it sends it: under sequence parallelism each TP rank its shard."""
    return step.z.dtype_bytes * step.z.hidden * step.z.tokens / step.z.sp_shards


def _hop_seconds(dims: ParallelDims, device: DeviceSpec, gpus_per_node: int, step: _Step) -> float:
    """One stage's output (or its gradient) sent to the next pipeline rank."""
    activation = _activation_bytes(step)
    return activation / link_bytes_per_s(
        _spans(dims)["pp"], gpus_per_node, device, "send_recv", 2, activation
    )


def _pipeline_send_seconds(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int, step: _Step
) -> float:
    """Seconds of a rank's stage-to-stage sends per step: each stage's output forward and its
    gradient back, per micro-batch."""
    stages_per_rank = num_stages(job.parallelism, args.num_hidden_layers) // dims.pp
    return 2 * step.micro_batches * stages_per_rank * _hop_seconds(dims, device, gpus_per_node, step)


def _pipeline_bubble(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    device: DeviceSpec,
    gpus_per_node: int,
    step: _Step,
    n_micro: int,
    busy: float,
    work: list[float],
) -> tuple[float, bool]:
    """(the busiest rank's idle seconds per step beyond its ``busy`` work, whether the step
    was played out): ``_played_step``, else (an order that cannot finish) the closed form
    ``bubble_fraction``."""
    hop = _hop_seconds(dims, device, gpus_per_node, step)
    accumulation = micro_steps(job, dims)
    played = _played_step(args, job, dims.pp, n_micro, busy / accumulation, work, hop)
    if played is not None:
        return max(0.0, played * accumulation - busy), True
    stages_per_rank = num_stages(job.parallelism, args.num_hidden_layers) // dims.pp
    return busy * bubble_fraction(schedule_name(job.parallelism), dims.pp, n_micro, stages_per_rank), False


def _played_step(
    args: ModelArgs,
    job: JobConfig,
    pp: int,
    n_micro: int,
    busy: float,
    work: list[float],
    hop: float,
) -> float | None:
    """Seconds of one schedule step played out (``planner.pipeline_sim``): each stage's
    actions sized by their ``work`` (``stage_work``) so that the busiest rank's add up to
    ``busy`` (its compute, recompute, elementwise work and dispatch over the step's micro-batches), a
    backward twice its forward, a zero-bubble input or weight gradient half a backward.
    None where the order cannot finish (the closed form stands in)."""
    name = schedule_name(job.parallelism)
    stages = stage_modules(job.parallelism, args)
    style = SCHEDULE_STYLES[name].placement
    owned = {r: stage_ids(r, pp, len(stages), style) for r in range(pp)}
    busiest = max(sum(work[s] for s in ids) for ids in owned.values())
    scale = busy / (busiest * n_micro) if busiest else 0.0
    seconds = {}
    for s, w in enumerate(work):
        fwd = scale * w / 3
        seconds |= {("F", s): fwd, ("B", s): 2 * fwd, ("I", s): fwd, ("W", s): fwd}
    orders = [rank_actions(name, pp, len(stages), n_micro, r) for r in range(pp)]
    stage_rank = {s: r for r, ids in owned.items() for s in ids}
    finish = play(orders, seconds, stage_rank, hop)
    return max(finish) if finish is not None else None


def _optimizer_seconds(args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec) -> float:
    """AdamW on the device over this rank's shard of its stage (none with CPU offload, whose
    step is ``host_optimizer``; LoRA's adapters are too few to count)."""
    if job.training.enable_cpu_offload or job.lora.enable:
        return 0.0
    return optimizer_seconds(device, _rank_params(args, job, dims) / (dims.dp_shard * dims.cp))


@dataclass(frozen=True)
class _Step:
    """What every part of ``predict_time`` reads of one rank's step."""

    tokens: int  # of the whole step, all ranks
    micro_batches: int  # this rank runs
    layers: float  # blocks of the busiest pipeline rank
    imbalance: float  # that rank's share of the model's FLOPs over an even share (1 unpipelined)
    linear_layers: float  # of them, Gated DeltaNets
    moe_layers: int  # of the whole model
    rate: float  # FLOP/s of the model's FLOPs, blended over its kinds
    rates: Rates
    z: Sizes
    cp_impl: str  # ring or allgather


@functools.lru_cache(maxsize=16)
def _fp8_linears(args: ModelArgs, filter_fqns: tuple[str, ...]) -> tuple[int, int]:
    """(weights, input plus output features) of the linears FP8 converts
    (``parallel.float8.eligible``); cached, as the planner asks once per candidate plan."""
    keep = eligible(list(filter_fqns), family_of(args).high_precision)
    linears = [m for fqn, m in meta_model(args).named_modules() if keep(m, fqn)]
    return sum(m.weight.numel() for m in linears), sum(m.in_features + m.out_features for m in linears)


def _cast_seconds(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, step: _Step
) -> float:
    """The mixed-precision recipe's casts per step: without FSDP every forward casts the
    rank's weights and every backward their gradients, per micro-batch; FSDP2 casts each
    shard before its gather and each whole gradient before its reduce-scatter. LoRA's frozen
    weights are stored in the compute dtype, and its adapters are too few to count."""
    if job.lora.enable:
        return 0.0
    params, fsdp = _rank_params(args, job, dims), dims.dp_shard * dims.cp
    if fsdp == 1:
        return cast_seconds(job, device, 2 * params * step.micro_batches)
    gathers = _whole_gathers(job, dims, step, args.num_hidden_layers)
    return cast_seconds(job, device, params / fsdp * gathers + params * micro_steps(job, dims))


def _float8_cast_seconds(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, step: _Step
) -> float:
    """FP8's dynamic scaling around this rank's GEMMs per step (``FP8_CAST_BYTES`` per element
    of each converted linear's input, output gradient and weight, per micro-batch, TP-sharded),
    at the memory bandwidth; none where the GEMMs do not run in float8."""
    if compute_dtype(job, device) != "float8":
        return 0.0
    weights, features = _fp8_linears(args, tuple(job.float8.filter_fqns))
    elements = (features * step.z.tokens + weights) / dims.tp * step.layers / args.num_hidden_layers
    return FP8_CAST_BYTES * elements * step.micro_batches / device.hbm_bytes_per_s


def _compute_seconds(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    device: DeviceSpec,
    step: _Step,
    memory_bound: float,
    overhead: float,
) -> tuple[float, float, float]:
    """(compute, recompute, share of blocks fully recomputed). Full blocks rerun their
    forward: its FLOPs, its ops' dispatch (``forward_op_share``) and its elementwise passes
    (``FORWARD_PASS_SHARE``). Per-op AC reruns the forward's ops it did not keep (not its
    GEMMs, attention or collectives): the same elementwise passes and dispatch, eager; nothing
    a compiled step does not rerun anyway.
    ``memory_bound`` and ``overhead``: the step's blocks'."""
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
        compute += 2 * _fp8_linears(args, tuple(job.float8.filter_fqns))[0] * step.tokens / world / rate
    ac = job.activation_checkpoint
    op = ac.mode == "selective" and ac.selective_ac_option == "op"
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
    stages = stage_modules(job.parallelism, args)
    style = SCHEDULE_STYLES[schedule_name(job.parallelism)].placement
    flops = _flop_seconds(args, job, rates)

    def rank_of(rank: int) -> tuple[float, StageRank]:
        ids = stage_ids(rank, pp, len(stages), style)
        names = [n for s in ids for n in stages[s]]
        blocks = tuple(int(n.split(".")[1]) for n in names if n.startswith("layers."))
        share = sum(flops.get(n, 0.0) for n in names) / sum(flops.values())
        return sum(work[s] for s in ids), StageRank(blocks, share)

    return max((rank_of(r) for r in range(pp)), key=lambda pair: pair[0])[1]


def stage_work(
    args: ModelArgs, job: JobConfig, rates: Rates, block_memory: list[float], tokens: int
) -> list[float]:
    """Seconds of each pipeline stage's forward and backward over a micro-batch of ``tokens``:
    its blocks' FLOPs at their kinds' rates (and the head's) and their elementwise work
    (``block_memory``); dispatch and recompute left out (the same share of every block)."""
    flops = _flop_seconds(args, job, rates)
    memory = {f"layers.{i}": m for i, m in enumerate(block_memory)}
    return [
        sum(flops.get(n, 0.0) * tokens + memory.get(n, 0.0) for n in names)
        for names in stage_modules(job.parallelism, args)
    ]


def _flop_seconds(args: ModelArgs, job: JobConfig, rates: Rates) -> dict[str, float]:
    """Forward-and-backward seconds per token of each block and of the head at ``rates``."""
    seq = job.training.seq_len
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


def block_forward_flops(args: ModelArgs, seq: int) -> float:
    """Forward FLOPs per token of every block, as ``flops_per_token`` counts them: the
    projections, the attention layers' scores and the Gated DeltaNets' recurrence."""
    mixers = [args.mixer(i) for i in range(args.num_hidden_layers)]
    linear = mixers.count("linear_attention")
    attention = 4 * args.num_attention_heads * args.head_dim * seq * (len(mixers) - linear)
    block_fwd = 2 * sum(block_matmul_params(args, i) for i in range(args.num_hidden_layers)) + attention
    return block_fwd + linear * delta_rule_flops(args) / 3 if linear else block_fwd


def _model_parallel_comm(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    device: DeviceSpec,
    gpus_per_node: int,
    step: _Step,
    share: float,
) -> tuple[dict[str, float], float]:
    """Seconds of TP's, CP's and EP's collectives, and how much of CP's attention does not hide."""
    c, z, spans = step.z.dtype_bytes, step.z, _spans(dims)
    comm: dict[str, float] = {}
    if dims.tp > 1:
        comm["tp"] = _tensor_parallel_seconds(job, dims, device, gpus_per_node, step, share)
    cp_exposed = 0.0
    if dims.cp > 1:
        comm["cp"], cp_exposed = _context_parallel_seconds(job, dims, device, gpus_per_node, step, share)
    if dims.ep > 1 and step.moe_layers:
        # all-to-all of every routed row out and back, in forward, backward and recompute
        rows = z.top_k * z.tokens
        transfers = (4 + 2 * share) * step.moe_layers / dims.pp * step.micro_batches  # this rank's stage
        moved = transfers * (dims.ep - 1) / dims.ep * c * rows * z.hidden
        rate = link_bytes_per_s(
            spans["ep"], gpus_per_node, device, "all_to_all", dims.ep, c * rows * z.hidden
        )
        comm["ep"] = moved / rate
    return comm, cp_exposed


def _tensor_parallel_seconds(
    job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int, step: _Step, share: float
) -> float:
    """TP's collectives under SP: an all-gather before attention and the MLP and a
    reduce-scatter after, forward, their mirror images backward and again where blocks
    recompute (per-op checkpointing keeps collectives' outputs); plus the embedding's and the
    head's. Without SP an all-reduce stands for each pair. Each at its own measured rate:
    gloo's reduce-scatter runs at half its all-gather's on this CPU."""
    z = step.z
    message = z.dtype_bytes * z.hidden * z.tokens
    per_collective = (dims.tp - 1) / dims.tp * message
    pairs = ((4 + 2 * share) * step.layers + 2) * step.micro_batches

    def rate(op: str) -> float:
        return link_bytes_per_s(_spans(dims)["tp"], gpus_per_node, device, op, dims.tp, message)

    if job.parallelism.enable_sequence_parallel:
        return pairs * per_collective * (1 / rate("all_gather") + 1 / rate("reduce_scatter"))
    return pairs * 2 * per_collective / rate("all_reduce")


def _context_parallel_seconds(
    job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int, step: _Step, share: float
) -> tuple[float, float]:
    """(CP's traffic, what of it attention does not hide), by implementation: all-gather CP
    gathers grouped k/v heads, reduce-scatters their gradients and gathers again where blocks
    recompute, with attention waiting, at the rates the probe timed its own gather and that
    gather's backward at (``_as_cp_runs``); ring attention passes k/v as SDPA gets them forward and
    k/v and their gradients backward, behind attention on GPUs. A hybrid model's Gated
    DeltaNets add their maps' exchange, on the critical path."""
    z, span = step.z, _spans(dims)["cp"]
    attention_layers = step.layers - step.linear_layers
    if step.cp_impl == "allgather":
        kv = 2 * z.dtype_bytes * z.kv_heads * z.head_dim * z.tokens

        def seconds(op: str, times: float) -> float:
            moved = times * (dims.cp - 1) * kv * attention_layers * step.micro_batches
            return moved / link_bytes_per_s(span, gpus_per_node, device, op, dims.cp, kv * dims.cp)

        gather, scatter = (_as_cp_runs(device, op) for op in ("all_gather", "reduce_scatter"))
        comm = seconds(gather, 1 + _gathers_again(job, share)) + seconds(scatter, 1)
        exposed = comm
    else:
        kv = 2 * z.dtype_bytes * z.sdpa_kv_heads * z.head_dim * z.tokens
        cp_bytes = 3 * (dims.cp - 1) * kv * attention_layers * step.micro_batches
        comm = cp_bytes / link_bytes_per_s(span, gpus_per_node, device, "send_recv", 2, kv)
        attention_flops = 12 * z.q_heads * z.head_dim * job.training.seq_len * z.tokens * attention_layers
        attention = attention_flops * step.micro_batches / step.rate
        exposed = max(0.0, comm - attention) if _overlaps(device) else comm
    maps = _state_passing_bytes(job, step, share) / link_bytes_per_s(
        span, gpus_per_node, device, "all_gather", dims.cp
    )
    return comm + maps, exposed + maps


def _as_cp_runs(device: DeviceSpec, op: str) -> str:
    """All-gather CP's own k/v gather (``seq_all_gather``) or its backward where the probe timed
    them (``profile.COLLECTIVES``), else the plain collective."""
    profile = device.profile
    measured = profile is not None and any(c.op == f"seq_{op}" for c in profile.collectives)
    return f"seq_{op}" if measured else op


def _overlaps(device: DeviceSpec) -> bool:
    """Whether data-parallel traffic and CP's k/v exchange run beside compute: on GPUs (their
    own streams and copy engines), not on a measured CPU, where gloo's threads take the cores
    compute needs."""
    return device.device_type != "cpu"


def _linear_layers(args: ModelArgs) -> int:
    return sum(args.mixer(i) == "linear_attention" for i in range(args.num_hidden_layers))


def _gathers_again(job: JobConfig, share: float) -> float:
    """How many more times a block's forward collectives run in its backward: the share of
    blocks fully recomputed, or every block under per-op checkpointing (CP's all-gathers are
    not kept, ``parallel.activation_checkpoint``)."""
    ac = job.activation_checkpoint
    return 1.0 if ac.mode == "selective" and ac.selective_ac_option == "op" else share


def _state_passing_bytes(job: JobConfig, step: _Step, share: float) -> float:
    """Bytes a rank moves for the Gated DeltaNets' CP per step: each layer's maps all-gathered
    forward (and in recompute) and their gradients reduce-scattered back."""
    passing = state_passing(step.z)
    if passing is None or not step.linear_layers:
        return 0.0
    collectives = 2 + _gathers_again(job, share)
    return collectives * passing.received_bytes() * step.linear_layers * step.micro_batches


def _state_passing_seconds(
    args: ModelArgs, dims: ParallelDims, step: _Step, share: float
) -> tuple[float, float]:
    """(compute, recompute) of the Gated DeltaNets' CP maps: the map pass over every token
    (the delta-rule kernel itself, at the recurrence's rate) and the chain of small matmuls
    every CP rank runs (at the GEMMs'), forward and backward (3x the forward), and the
    forward again where blocks are fully recomputed."""
    passing = state_passing(step.z)
    if passing is None or not step.linear_layers:
        return 0.0, 0.0
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    per_token = map_flops_per_token(args.linear_num_value_heads, dk, dv) * _linear_layers(args)
    chain = chain_flops(passing.cp_ranges, passing.value_heads, dk, dv) * passing.batch
    forward = (
        per_token * step.tokens / dims.world_size / step.rates.recurrence
        + chain * step.linear_layers * step.micro_batches / step.rates.gemm
    )
    return 3 * forward, share * forward


def _data_parallel_comm(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int, step: _Step
) -> tuple[dict[str, float], float]:
    """Seconds of FSDP's gathers and reduce-scatters, the replicas' all-reduce and CPU
    offload's copies, and of AdamW on the host."""
    c, spans = step.z.dtype_bytes, _spans(dims)
    comm: dict[str, float] = {}
    fsdp = dims.dp_shard * dims.cp
    unsharded = _rank_params(args, job, dims)
    gathers = _whole_gathers(job, dims, step, args.num_hidden_layers)
    reductions = micro_steps(job, dims)  # a pipeline syncs gradients after its last micro-batch
    if fsdp > 1:
        # each weight moves over its own FSDP group: experts' over the data ranks EP left
        experts = _rank_expert_params(args, dims)
        efsdp = fsdp // dims.ep
        moved = (fsdp - 1) / fsdp * (unsharded - experts) + (efsdp - 1) / efsdp * experts
        # each gather, and each float32 gradient's reduce-scatter (LoRA's adapters': negligible),
        # one block's weights at a time
        block = unsharded / max(1.0, step.layers)
        gather = link_bytes_per_s(spans["fsdp"], gpus_per_node, device, "all_gather", fsdp, c * block)
        scatter = link_bytes_per_s(spans["fsdp"], gpus_per_node, device, "reduce_scatter", fsdp, FP32 * block)
        reduced = 0 if job.lora.enable else FP32 * reductions
        comm["fsdp"] = moved * c * gathers / gather + moved * reduced / scatter
    if dims.dp_replicate > 1 and not job.lora.enable:
        r = dims.dp_replicate
        moved = 2 * (r - 1) / r * 4 * unsharded / fsdp * reductions
        bucket = min(DDP_BUCKET_BYTES, FP32 * unsharded / fsdp)
        rate = link_bytes_per_s(spans["dp_replicate"], gpus_per_node, device, "all_reduce", r, bucket)
        comm["dp_replicate"] = moved / rate
    host_optimizer = 0.0
    if job.training.enable_cpu_offload:
        # each gather first copies the float32 shard to the GPU, each gradient shard comes
        # back (on FSDP's streams, beside compute); AdamW then steps on the host
        shard = unsharded / fsdp
        copies = gathers + step.micro_batches
        host = device.host_bytes_per_s * (1.0 if device.profile is not None else COMM_EFFICIENCY)
        comm["host"] = FP32 * shard * copies / host
        host_optimizer = shard / HOST_ADAM_PARAMS_PER_S
    return comm, host_optimizer


def _whole_gathers(job: JobConfig, dims: ParallelDims, step: _Step, num_layers: int) -> float:
    """How many times a step gathers the rank's whole weights: each micro-batch's forward
    and backward when blocks reshard after forward, once per micro-step otherwise; a
    pipeline keeps its stages gathered across micro-batches, but a rank with more stages
    than torch keeps gathered at once gathers some again (``rank_stage_gathers``)."""
    if reshards_blocks(job.parallelism.fsdp_reshard_after_forward, dims.pp > 1):
        return 2.0 * step.micro_batches
    if dims.pp == 1:
        return float(micro_steps(job, dims))
    name = schedule_name(job.parallelism)
    stages = num_stages(job.parallelism, num_layers)
    n_micro = job.training.local_batch_size // job.parallelism.pipeline_parallel_microbatch_size
    gathers = rank_stage_gathers(name, dims.pp, stages, n_micro, 0)
    return micro_steps(job, dims) * gathers / (stages // dims.pp)


def bubble_fraction(schedule: str, pp: int, n_micro: int, stages_per_rank: int) -> float:
    """Idle time of a rank relative to its busy time: (pp - 1) warm-up/cool-down slots over
    the micro-batches, each slot a 1/v stage for interleaved and V schedules; zero-bubble
    schedules fill two thirds of each slot with deferred weight gradients."""
    loops = 1 if schedule in ("GPipe", "1F1B") else stages_per_rank
    fraction = (pp - 1) / (n_micro * loops)
    return fraction / 3 if schedule in ZERO_BUBBLE else fraction


def _rank_params(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> int:
    """Parameters of this rank's stage (TP-sharded, not FSDP-sharded), the busiest stage."""
    layers = -(-args.num_hidden_layers // dims.pp)
    modules = [f"layers.{i}" for i in range(layers)] + ["embed_tokens", "norm", "lm_head"]
    return modules_numel(args, job, dims, modules, sharded=False)


def _rank_expert_params(args: ModelArgs, dims: ParallelDims) -> int:
    """Expert weights of the busiest stage on one rank (split over EP, not FSDP-sharded)."""
    layers = sum(args.is_moe_layer(i) for i in range(-(-args.num_hidden_layers // dims.pp)))
    return layers * layer_expert_numel(args, dims.ep)


def _spans(dims: ParallelDims) -> dict[str, int]:
    """Consecutive ranks each mesh dimension's group spans (rank order pp, dp_replicate,
    dp_shard, cp, tp, tp fastest; expert parallelism takes the fastest data ranks, just
    outside tp): a group is inside a node when its span fits in one."""
    tp = dims.tp
    cp = dims.cp * tp
    fsdp = dims.dp_shard * cp
    spans = {
        "tp": tp,
        "cp": cp,
        "fsdp": fsdp,
        "dp_replicate": dims.dp_replicate * fsdp,
        "pp": dims.world_size,
    }
    return {**spans, "ep": dims.ep * tp}
