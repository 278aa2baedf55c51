"""Seconds of a step's collectives, by mesh dimension.

Communication is each collective's bytes per rank over the link its mesh dimension uses
(NVLink when the group fits in a node, the network otherwise) at ``COMM_EFFICIENCY`` of the
link, or at the bus bandwidth a device profile measured. That figure is an assumption until
a multi-GPU run calibrates it; every real run's ``plan.json`` records prediction beside
measurement for that purpose. TP collectives and expert parallelism's all-to-alls (every
routed row out and back, forward and backward) sit on the critical path; context-parallel
k/v exchange hides behind attention on GPUs; under a pipeline FSDP gathers a stage's weights
once per schedule step and reduces its gradients after the last micro-batch, as torch's
schedules drive it (``rank_stage_gathers``).

Context parallelism in a hybrid model (``planner/hybrid_cp.py``): the attention layers pass
k/v as above; each Gated DeltaNet all-gathers its ranges' delta-rule maps forward (again
where checkpointing recomputes it) and reduce-scatters their gradients backward, on the
critical path (the chain waits for them).
"""

from __future__ import annotations

from autopar.config.sections import JobConfig
from autopar.parallel.activation_checkpoint import per_op
from autopar.parallel.fsdp import reshards_blocks
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import (
    num_stages,
    rank_stage_gathers,
    schedule_name,
)
from autopar.planner.block_bytes import (
    FP32,
    state_passing,
)
from autopar.planner.devices import DeviceSpec
from autopar.planner.params import rank_expert_params, rank_params
from autopar.planner.step import Step
from autopar.planner.weight_bytes import micro_steps

COMM_EFFICIENCY = 0.7


HOST_ADAM_PARAMS_PER_S = 1.8e9
"""CPU offload's optimizer step: torch 2.13's fused AdamW on this project's two-core CI
machine (float32). A GPU host's CPU has more cores and memory bandwidth, so the prediction
errs slow until a GPU host measures it."""


DDP_BUCKET_BYTES = 25 * 2**20
"""The replicas' all-reduce runs in buckets of this size (DDP's default)."""


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


def group_spans(dims: ParallelDims) -> dict[str, int]:
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


def overlaps(device: DeviceSpec) -> bool:
    """Whether data-parallel traffic and CP's k/v exchange run beside compute: on GPUs (their
    own streams and copy engines), not on a measured CPU, where gloo's threads take the cores
    compute needs."""
    return device.device_type != "cpu"


def model_parallel_comm(step: Step, share: float) -> tuple[dict[str, float], float]:
    """Seconds of TP's, CP's and EP's collectives, and how much of CP's attention does not hide."""
    dims, z = step.dims, step.z
    comm: dict[str, float] = {}
    if dims.tp > 1:
        comm["tp"] = _tensor_parallel_seconds(step, share)
    cp_exposed = 0.0
    if dims.cp > 1:
        comm["cp"], cp_exposed = _context_parallel_seconds(step, share)
    if dims.ep > 1 and step.moe_layers:
        # all-to-all of every routed row out and back, in forward, backward and recompute
        c, rows = z.dtype_bytes, z.top_k * z.tokens
        transfers = (4 + 2 * share) * step.moe_layers / dims.pp * step.micro_batches  # this rank's stage
        moved = transfers * (dims.ep - 1) / dims.ep * c * rows * z.hidden
        comm["ep"] = moved / link(step, "ep", "all_to_all", dims.ep, c * rows * z.hidden)
    return comm, cp_exposed


def link(step: Step, dim: str, op: str, group: int, message: float | None = None) -> float:
    """``link_bytes_per_s`` of ``op`` over mesh dimension ``dim``'s group of ``group`` ranks."""
    span = group_spans(step.dims)[dim]
    return link_bytes_per_s(span, step.gpus_per_node, step.device, op, group, message)


def _tensor_parallel_seconds(step: Step, share: float) -> float:
    """TP's collectives under SP: an all-gather before attention and the MLP and a
    reduce-scatter after, forward, their mirror images backward and again where blocks
    recompute (per-op checkpointing keeps collectives' outputs); plus the embedding's and the
    head's. Without SP an all-reduce stands for each pair. Each at its own measured rate:
    gloo's reduce-scatter runs at half its all-gather's on this CPU."""
    z, tp = step.z, step.dims.tp
    message = z.dtype_bytes * z.hidden * z.tokens
    per_collective = (tp - 1) / tp * message
    pairs = ((4 + 2 * share) * step.layers + 2) * step.micro_batches
    if step.job.parallelism.enable_sequence_parallel:
        gather, scatter = (link(step, "tp", op, tp, message) for op in ("all_gather", "reduce_scatter"))
        # ``op_regather``: each block's two input gathers again, in each recompute of it
        again = 2 * step.layers * step.micro_batches * step.recomputes if z.regather else 0
        return (pairs * (1 / gather + 1 / scatter) + again / gather) * per_collective
    return pairs * 2 * per_collective / link(step, "tp", "all_reduce", tp, message)


def _context_parallel_seconds(step: Step, share: float) -> tuple[float, float]:
    """(CP's traffic, what of it attention does not hide), by implementation: all-gather CP
    gathers grouped k/v heads, reduce-scatters their gradients and gathers again where blocks
    recompute, with attention waiting, at the rates the probe timed its own gather and that
    gather's backward at (``_as_cp_runs``); ring attention passes k/v as SDPA gets them forward and
    k/v and their gradients backward, behind attention on GPUs. A hybrid model's Gated
    DeltaNets add their maps' exchange, on the critical path."""
    z, cp = step.z, step.dims.cp
    attention_layers = step.layers - step.linear_layers
    if step.cp_impl == "allgather":
        kv = 2 * z.dtype_bytes * z.kv_heads * z.head_dim * z.tokens

        def seconds(op: str, times: float) -> float:
            moved = times * (cp - 1) * kv * attention_layers * step.micro_batches
            return moved / link(step, "cp", _as_cp_runs(step.device, op), cp, kv * cp)

        comm = seconds("all_gather", 1 + _gathers_again(step.job, share)) + seconds("reduce_scatter", 1)
        exposed = comm
    else:
        kv = 2 * z.dtype_bytes * z.sdpa_kv_heads * z.head_dim * z.tokens
        cp_bytes = 3 * (cp - 1) * kv * attention_layers * step.micro_batches
        comm = cp_bytes / link(step, "cp", "send_recv", 2, kv)
        attention_flops = (
            12 * z.q_heads * z.head_dim * step.job.training.seq_len * z.tokens * attention_layers
        )
        attention = attention_flops * step.micro_batches / step.rate
        exposed = max(0.0, comm - attention) if overlaps(step.device) else comm
    maps = _state_passing_bytes(step, share) / link(step, "cp", "all_gather", cp)
    return comm + maps, exposed + maps


def _as_cp_runs(device: DeviceSpec, op: str) -> str:
    """All-gather CP's own k/v gather (``seq_all_gather``) or its backward where the probe timed
    them (``profile.COLLECTIVES``), else the plain collective."""
    profile = device.profile
    measured = profile is not None and any(c.op == f"seq_{op}" for c in profile.collectives)
    return f"seq_{op}" if measured else op


def _gathers_again(job: JobConfig, share: float) -> float:
    """How many more times a block's forward collectives run in its backward: the share of
    blocks fully recomputed, or every block under per-op checkpointing (CP's all-gathers are
    not kept, ``parallel.activation_checkpoint``)."""
    ac = job.activation_checkpoint
    return 1.0 if per_op(ac) else share


def _state_passing_bytes(step: Step, share: float) -> float:
    """Bytes a rank moves for the Gated DeltaNets' CP per step: each layer's maps all-gathered
    forward (and in recompute) and their gradients reduce-scattered back."""
    passing = state_passing(step.z)
    if passing is None or not step.linear_layers:
        return 0.0
    collectives = 2 + _gathers_again(step.job, share)
    return collectives * passing.received_bytes() * step.linear_layers * step.micro_batches


def data_parallel_comm(step: Step) -> tuple[dict[str, float], float]:
    """Seconds of FSDP's gathers and reduce-scatters, the replicas' all-reduce and CPU
    offload's copies, and of AdamW on the host."""
    args, job, dims, c = step.args, step.job, step.dims, step.z.dtype_bytes
    comm: dict[str, float] = {}
    fsdp = dims.dp_shard * dims.cp
    unsharded = rank_params(args, job, dims)
    gathers = whole_gathers(step)
    reductions = micro_steps(job, dims)  # a pipeline syncs gradients after its last micro-batch
    if fsdp > 1:
        # each weight moves over its own FSDP group: experts' over the data ranks EP left
        experts = rank_expert_params(args, dims)
        efsdp = fsdp // dims.ep
        moved = (fsdp - 1) / fsdp * (unsharded - experts) + (efsdp - 1) / efsdp * experts
        # each gather, and each float32 gradient's reduce-scatter (LoRA's adapters': negligible),
        # one block's weights at a time
        block = unsharded / max(1.0, step.layers)
        gather = link(step, "fsdp", "all_gather", fsdp, c * block)
        scatter = link(step, "fsdp", "reduce_scatter", fsdp, FP32 * block)
        reduced = 0 if job.lora.enable else FP32 * reductions
        comm["fsdp"] = moved * c * gathers / gather + moved * reduced / scatter + fsdp_calls_seconds(step)
    if dims.dp_replicate > 1 and not job.lora.enable:
        r = dims.dp_replicate
        moved = 2 * (r - 1) / r * 4 * unsharded / fsdp * reductions
        bucket = min(DDP_BUCKET_BYTES, FP32 * unsharded / fsdp)
        comm["dp_replicate"] = moved / link(step, "dp_replicate", "all_reduce", r, bucket)
    host_optimizer = 0.0
    if job.training.enable_cpu_offload:
        # each gather first copies the float32 shard to the GPU, each gradient shard comes
        # back (on FSDP's streams, beside compute); AdamW then steps on the host
        shard = unsharded / fsdp
        copies = gathers + step.micro_batches
        device = step.device
        host = device.host_bytes_per_s * (1.0 if device.profile is not None else COMM_EFFICIENCY)
        comm["host"] = FP32 * shard * copies / host
        host_optimizer = shard / HOST_ADAM_PARAMS_PER_S
    return comm, host_optimizer


def fsdp_calls_seconds(step: Step) -> float:
    """FSDP's own cost beyond its bytes (``DeviceProfile.fsdp_call_s``, where probed): each of
    the rank's FSDP units (its blocks and each stage's root) makes a call per whole gather and
    per gradient reduction (LoRA's adapters' too)."""
    profile = step.device.profile
    if profile is None or profile.fsdp_call_s is None:
        return 0.0
    dims = step.dims
    roots = num_stages(step.job.parallelism, step.args.num_hidden_layers) // dims.pp if dims.pp > 1 else 1
    calls = (step.layers + roots) * (whole_gathers(step) + micro_steps(step.job, dims))
    return calls * profile.fsdp_call_s


def whole_gathers(step: Step) -> float:
    """How many times a step gathers the rank's whole weights: each micro-batch's forward
    and backward when blocks reshard after forward, once per micro-step otherwise; a
    pipeline keeps its stages gathered across micro-batches, but a rank with more stages
    than torch keeps gathered at once gathers some again (``rank_stage_gathers``)."""
    job, dims = step.job, step.dims
    if reshards_blocks(job.parallelism.fsdp_reshard_after_forward, dims.pp > 1):
        return 2.0 * step.micro_batches
    if dims.pp == 1:
        return float(micro_steps(job, dims))
    name = schedule_name(job.parallelism)
    stages = num_stages(job.parallelism, step.args.num_hidden_layers)
    n_micro = job.training.local_batch_size // job.parallelism.pipeline_parallel_microbatch_size
    gathers = rank_stage_gathers(name, dims.pp, stages, n_micro, 0)
    return micro_steps(job, dims) * gathers / (stages // dims.pp)
