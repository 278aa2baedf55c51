"""Predicted time of one optimizer step of a plan: compute, recompute, exposed communication
and pipeline bubble.

The parts: the rates compute runs at (``planner/rates.py``), the rank's compute, recompute and
memory-bound work (``planner/compute_time.py``), its collectives (``planner/comm_time.py``)
and the pipeline's sends and bubble (``planner/pipeline_time.py``).

What overlaps: FSDP's all-gathers and reduce-scatters (and HSDP's all-reduce) run on their own
stream behind compute, so only what exceeds compute plus the first all-gather is exposed; a
pipeline's asynchronous sends travel while the next micro-batch computes; context-parallel
k/v exchange hides behind attention; TP collectives and expert parallelism's all-to-alls sit
on the critical path. On a measured CPU nothing overlaps: gloo's threads take the cores
compute needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.mesh import ParallelDims
from autopar.planner.activations import sizes
from autopar.planner.comm_time import data_parallel_comm, model_parallel_comm, overlaps
from autopar.planner.compute_time import (
    block_elementwise_seconds,
    busiest_stage_rank,
    compute_seconds,
    device_optimizer_seconds,
    float8_cast_seconds,
    moe_layer_count,
    recipe_cast_seconds,
    stage_work,
    state_passing_seconds,
)
from autopar.planner.devices import DeviceSpec
from autopar.planner.measured import (
    compute_dtype,
    overhead_seconds,
)
from autopar.planner.pipeline_time import pipeline_bubble, pipeline_send_seconds
from autopar.planner.rates import blended_rate, compute_rates
from autopar.planner.step import Step
from autopar.planner.weight_bytes import micro_batch, micro_steps


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


@dataclass(frozen=True)
class Busy:
    """A rank's own work in a step, before what communication and the bubble add to it."""

    step: Step
    compute: float
    recompute: float  # once; a split backward runs it twice (``Step.recomputes``)
    memory_bound: float  # the blocks' elementwise work and the casts; AdamW's comes after
    overhead: float
    share: float  # of blocks fully recomputed
    n_micro: int  # micro-batches per pipeline flush
    work: list[float]  # each pipeline stage's (``stage_work``)


def busy_time(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int
) -> Busy:
    """The compute, recompute, elementwise work and dispatch of the busiest rank's step."""
    c = 4 if compute_dtype(job, device) == "float32" else 2
    pipelined = dims.pp > 1
    micro = micro_batch(job, dims)
    n_micro = job.training.local_batch_size // micro if pipelined else 1
    cp_impl = resolve_impl(job.parallelism, device.device_type)
    z = sizes(args, job, dims, micro, cp_impl, c, device.device_type)
    rates = compute_rates(job, device, args, dims, micro)
    block_memory = block_elementwise_seconds(args, job, device, z)
    work = stage_work(args, job, rates, block_memory, z.tokens) if pipelined else []
    busiest = busiest_stage_rank(args, job, dims.pp, rates, work)
    step = Step(
        tokens=tokens_per_step(job, dims),
        micro_batches=n_micro * micro_steps(job, dims),  # micro-batches this rank runs per step
        layers=len(busiest.blocks),
        imbalance=busiest.share * dims.pp,
        linear_layers=sum(args.mixer(i) == "linear_attention" for i in busiest.blocks),
        moe_layers=moe_layer_count(args),
        rate=blended_rate(args, job, rates),
        rates=rates,
        z=z,
        cp_impl=cp_impl,
        args=args,
        job=job,
        dims=dims,
        device=device,
        gpus_per_node=gpus_per_node,
    )
    memory_bound = sum(block_memory[i] for i in busiest.blocks) * step.micro_batches
    memory_bound += recipe_cast_seconds(step)
    memory_bound += float8_cast_seconds(step)
    overhead = overhead_seconds(args, job, device, step.layers * step.micro_batches, dims.tp, dims.cp)
    compute, recompute, share = compute_seconds(step, memory_bound, overhead)
    maps_compute, maps_recompute = state_passing_seconds(step, share)
    return Busy(
        step, compute + maps_compute, recompute + maps_recompute, memory_bound, overhead, share, n_micro, work
    )


def step_seconds_lower_bound(busy: Busy) -> float:
    """No more than ``predict_time``'s total for the plan ``busy`` is of: its own work, AdamW's
    traffic and the collectives on the critical path (TP's, EP's, CP's unhidden), without
    what the data-parallel traffic leaves exposed, the bubble and a host optimizer, each zero
    or more. What the search prunes by (``planner/prune.py``)."""
    step = busy.step
    comm, cp_exposed = model_parallel_comm(step, busy.share)
    optimizer = device_optimizer_seconds(step.args, step.job, step.dims, step.device)
    own = busy.compute + busy.recompute * busy.step.recomputes + busy.memory_bound + optimizer + busy.overhead
    return own + comm.get("tp", 0.0) + comm.get("ep", 0.0) + cp_exposed


def predict_time(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int
) -> StepTime:
    """Predicted step time of ``job`` under ``dims`` on ``device``: compute and recompute,
    the communication left exposed beside them, and the pipeline's bubble."""
    return finish_time(busy_time(args, job, dims, device, gpus_per_node))


def finish_time(busy: Busy) -> StepTime:
    """``predict_time`` from the rank's own work: the communication it leaves exposed and the
    pipeline's bubble added."""
    step, compute, recompute, memory_bound = busy.step, busy.compute, busy.recompute, busy.memory_bound
    device, pipelined = step.device, step.dims.pp > 1
    comm, cp_exposed = model_parallel_comm(step, busy.share)
    data_comm, host_optimizer = data_parallel_comm(step)
    comm |= data_comm
    first_gather = comm.get("fsdp", 0.0) / max(1.0, step.layers * step.micro_batches * 3)
    if pipelined:
        comm["pp"] = pipeline_send_seconds(step)
    # a pipeline's sends are asynchronous: in the steady state a micro-batch's activations
    # travel while the next one computes (the warm-up's wait is in the bubble)
    background = sum(comm.get(dim, 0.0) for dim in ("fsdp", "dp_replicate", "host", "pp"))
    exposed = (
        comm.get("tp", 0.0)
        + comm.get("ep", 0.0)
        + cp_exposed
        + (max(0.0, background - compute - recompute) if overlaps(device) else background)
        + first_gather
    )
    recompute *= step.recomputes
    bubble = 0.0
    if pipelined:
        work = compute + recompute + memory_bound + busy.overhead
        bubble, played = pipeline_bubble(step, busy.n_micro, work, busy.work)
        if played and not overlaps(device):
            exposed -= comm["pp"]  # the hops on the critical path are in the played step; the rest hide
    memory_bound += device_optimizer_seconds(step.args, step.job, step.dims, device)  # after the flush
    return StepTime(compute, recompute, exposed, bubble, comm, host_optimizer, memory_bound, busy.overhead)
