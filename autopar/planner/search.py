"""Every valid plan of a job on a cluster, ranked by predicted throughput among those that fit.

The candidates are ``planner/space.py``'s. Whether a plan can run at all is decided by
``training.preflight.check_plan``, the rules the trainer itself enforces; its memory by
``planner.memory`` plus a runtime reserve, its speed by ``planner.time``. Scored one by one,
or, where only the best few are asked for, best bound first until no candidate left can
reach them (``planner/prune.py``): the same first plans, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.mesh import ParallelDims
from autopar.planner.devices import DeviceSpec
from autopar.planner.memory import GIB, Memory, predict_dims, weights_floor
from autopar.planner.prune import best_first, tokens_per_s_bound
from autopar.planner.settings import PLAN_FIELDS, PlanSettings
from autopar.planner.space import candidates
from autopar.planner.time import Busy, StepTime, busy_time, finish_time, tokens_per_step
from autopar.training.metrics.flops import flops_per_token
from autopar.training.objectives.dpo.job import runs_reference_forward
from autopar.training.preflight import check_plan

RUNTIME_GIB = 0.5
"""CUDA context and library workspaces outside torch's allocator (not yet measured here)."""
NCCL_GIB_PER_GROUP = 0.25
"""NCCL's buffers per communicator a rank belongs to (not yet measured here)."""
ALLOCATOR_SLACK = 0.05
"""Fragmentation: the caching allocator reserves a few percent more than it hands out."""


@dataclass(frozen=True)
class Plan:
    """One evaluated plan: its settings, the worst rank's memory and (if it fits) its speed."""

    settings: PlanSettings
    dims: ParallelDims
    memory: Memory
    fits: bool
    time: StepTime | None
    tokens_per_s: float  # per GPU
    mfu: float  # fraction of the bf16 peak

    @property
    def peak_gib(self) -> float:
        return self.memory.peak / GIB

    @property
    def overrides(self) -> list[str]:
        """The command-line flags that run this plan (those that matter to it)."""
        s = self.settings
        unused = set()
        if self.dims.pp == 1:
            unused |= {"schedule", "microbatch", "layers_per_stage"}
        if s.ac_mode != "selective":
            unused.add("ac_option")
        return [f"--{key}={value}" for key, value in s.config(leave_out=unused).items()]

    @property
    def complexity(self) -> int:
        """How many non-default mechanisms the plan uses (fewer wins a tie)."""
        d = self.dims
        return (
            (d.tp > 1)
            + (d.cp > 1)
            + (d.pp > 1)
            + (d.dp_replicate > 1)
            + (d.ep > 1)
            + (self.settings.ac_mode != "none")
            + (self.settings.reshard != "default")
            + (self.settings.layers_per_stage is not None)
        )

    def describe(self) -> str:
        d, s = self.dims, self.settings
        text = f"dp_rep={d.dp_replicate} dp_shard={d.dp_shard} tp={d.tp} cp={d.cp} pp={d.pp}"
        if d.ep > 1:
            text += f" ep={d.ep}"
        if d.pp > 1:
            text += f" {s.schedule} mbs={s.microbatch}"
            if s.layers_per_stage is not None:
                text += f" layers_per_stage={s.layers_per_stage}"
        text += f" ac={s.ac} local_batch={s.local_batch}"
        return text if s.reshard == "default" else f"{text} reshard={s.reshard}"

    def to_json(self) -> dict:
        d = self.dims
        return {
            "degrees": {
                "dp_replicate": d.dp_replicate,
                "dp_shard": d.dp_shard,
                "tp": d.tp,
                "cp": d.cp,
                "pp": d.pp,
                "ep": d.ep,
            },
            "settings": self.settings.config(),
            "overrides": self.overrides,
            "fits": self.fits,
            "predicted_peak_gib": self.peak_gib,
            "breakdown_gib": self.memory.gib(),
            "host_gib": {k: v / GIB for k, v in self.memory.host.items()},
            "predicted_tokens_per_s": self.tokens_per_s,
            "predicted_mfu": self.mfu,
            "predicted_step_s": self.time.total if self.time else None,
            "time_split": self.time.split() if self.time else None,
        }


def runtime_reserve(allocated: float, dims: ParallelDims) -> float:
    """Bytes a rank needs beyond what torch allocates for tensors."""
    degrees = (dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp, dims.cp, dims.pp, dims.ep)
    groups = sum(n > 1 for n in degrees)
    return (RUNTIME_GIB + NCCL_GIB_PER_GROUP * groups) * GIB + ALLOCATOR_SLACK * allocated


def evaluate(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    device: DeviceSpec,
    gpus_per_node: int,
    settings: PlanSettings | None = None,
    device_type: str = "cuda",
    busy: Busy | None = None,
) -> Plan:
    """Memory of the most loaded rank and, when it fits, the step time of ``job`` (from
    ``busy``, its rank's own work, where the search already has it)."""
    cp_impl = resolve_impl(job.parallelism, device_type)
    worst = max(predict_dims(args, job, dims, cp_impl, device_type), key=lambda m: m.peak)
    parts = dict(worst.parts, runtime=runtime_reserve(worst.peak, dims))
    memory = Memory(worst.role, parts, worst.host)
    fits = memory.peak <= device.memory_gib * GIB
    time, tokens_per_s, mfu = None, 0.0, 0.0
    if fits:
        time = finish_time(busy or busy_time(args, job, dims, device, gpus_per_node))
        tokens_per_s = tokens_per_step(job, dims) / time.total / dims.world_size
        mfu = (
            tokens_per_s
            * flops_per_token(
                args, job.training.seq_len, job.lora.enable, reference=runs_reference_forward(job)
            )
            / device.bf16_flops
        )
    return Plan(settings or PlanSettings.of(job), dims, memory, fits, time, tokens_per_s, mfu)


RANK_WORDS = {"cuda": ("GPU", "GPUs"), "cpu": ("CPU process", "CPU processes")}
"""What a job's ranks are, in words (one, several), by device type."""


@dataclass(frozen=True)
class Searched:
    """A search's plans, best first (``rank``), and how many candidates it met, found valid
    and scored (the rest pruned by their bounds, ``planner/prune.py``)."""

    plans: list[Plan]
    candidates: int
    valid: int
    scored: int


def search(*args: Any, **kwargs: Any) -> list[Plan]:
    """Every valid plan, best first (see ``rank``); ConfigError when none can run. With
    ``keep``, the first ``keep`` of them (the same plans, order and predictions), found by
    bounds, and only such others as were scored on the way. ``search_counted``'s arguments;
    its plans without the counts."""
    return search_counted(*args, **kwargs).plans


def search_counted(
    job: JobConfig,
    args: ModelArgs,
    world_size: int,
    gpus_per_node: int,
    device: DeviceSpec,
    pinned: set[str] = frozenset(),
    device_type: str = "cuda",
    keep: int | None = None,
) -> Searched:
    """``search``, with its counts."""
    valid, candidates = valid_plans(job, args, world_size, gpus_per_node, pinned, device_type)

    if keep is None:
        plans = [evaluate(args, j, d, device, gpus_per_node, s, device_type) for s, j, d in valid]
    else:
        busies: dict[int, Busy] = {}
        scored: dict[int, Plan] = {}

        def bound(i: int) -> float:
            _, candidate, dims = valid[i]
            busies[i] = busy_time(args, candidate, dims, device, gpus_per_node)
            return tokens_per_s_bound(busies[i]) if group_bounds[keys[i]] > 0 else 0.0

        def group_bound(members: list[int]) -> float:
            settings, candidate, dims = valid[members[0]]
            floor = weights_floor(args, candidate, dims, device_type)
            if floor + runtime_reserve(floor, dims) > device.memory_gib * GIB:
                return 0.0  # none fits: the group is scored only if fewer than keep plans fit
            free = lightest(settings).apply(job)
            return tokens_per_s_bound(busy_time(args, free, dims, device, gpus_per_node))

        def tokens_per_s(i: int) -> float:
            settings, candidate, dims = valid[i]
            plan = evaluate(args, candidate, dims, device, gpus_per_node, settings, device_type, busies[i])
            scored[i] = plan
            return plan.tokens_per_s

        keys = [group_key(settings) for settings, _, _ in valid]  # each candidate's group
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        group_bounds = {key: group_bound(members) for key, members in groups.items()}
        bounded = [(group_bounds[key], members) for key, members in groups.items()]
        plans = [scored[i] for i in best_first(bounded, bound, tokens_per_s, keep, TIE)]
    return Searched(rank(plans), candidates, len(valid), len(plans))


def valid_plans(
    job: JobConfig, args: ModelArgs, world_size: int, gpus_per_node: int, pinned: set[str], device_type: str
) -> tuple[list[tuple[PlanSettings, JobConfig, ParallelDims]], int]:
    """Every candidate that passes the trainer's checks (its settings, job and degrees), in
    the search's order, and how many candidates there were; ConfigError when none passes."""
    valid = []
    count = 0
    first_error: ConfigError | None = None
    for settings in candidates(job, args, world_size, gpus_per_node, pinned):
        count += 1
        candidate = settings.apply(job)
        try:
            valid.append((settings, candidate, check_plan(candidate, args, world_size, device_type)))
        except ConfigError as err:
            first_error = first_error or err
    if valid:
        return valid, count
    pins = ", ".join(f"{k}={v}" for k, v in PlanSettings.of(job).config().items() if k in pinned) or "none"
    if first_error is None:
        raise ConfigError(
            f"the pinned settings ({pins}) leave no parallel degrees that multiply to the world "
            f"size {world_size} (tensor parallelism stays within a node of {gpus_per_node}); "
            "change or unpin one"
        )
    raise ConfigError(
        f"no plan runs this job on {world_size} {RANK_WORDS[device_type][1]} (pinned: {pins}): {first_error}"
    )


GROUP_FREE = frozenset({"ac_mode", "ac_option", "reshard"})
"""The settings a group's plans differ in (``lightest`` sets them)."""


def group_key(settings: PlanSettings) -> tuple:
    """What the plans of ``settings``' group share: the same for two plans exactly where
    their ``lightest`` is the same (a tuple: the search keys every candidate)."""
    return tuple(value for name, value in settings.__dict__.items() if name not in GROUP_FREE)


def lightest(settings: PlanSettings) -> PlanSettings:
    """The plan without activation checkpointing whose FSDP never reshards: its bound is at
    least that of the same plan under any checkpointing mode and resharding policy
    (``planner/prune.py``)."""
    return replace(settings, ac_mode="none", ac_option="op", reshard="never")


TIE = 0.01
"""Plans within this fraction of the best throughput count as tied; the simplest wins."""


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting plans by tokens/s, those tied with the best ordered simplest first; then the
    others by predicted peak."""
    fitting = sorted((p for p in plans if p.fits), key=lambda p: -p.tokens_per_s)
    others = sorted((p for p in plans if not p.fits), key=lambda p: p.memory.peak)
    if not fitting:
        return others
    best = fitting[0].tokens_per_s
    tied = [p for p in fitting if p.tokens_per_s >= best * (1 - TIE)]
    tied.sort(key=lambda p: (p.complexity, -p.tokens_per_s))
    return tied + fitting[len(tied) :] + others


def no_fit_message(best: Plan, device: DeviceSpec, world_size: int, pinned: set[str]) -> str:
    """One paragraph: the smallest predicted peak, its plan, what dominates it, and what would fit."""
    parts = best.memory.gib()
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    over = best.peak_gib - device.memory_gib
    weights = parts["params"] + parts["optimizer"] + parts["grads"]
    if weights > device.memory_gib * 0.5:
        one, more = RANK_WORDS["cpu" if device.name == "cpu" else "cuda"]
        fix = (
            f"the weights, gradients and Adam state alone take {weights:.1f} GiB per {one}: use more {more} "
            "(FSDP divides them by the data-parallel degree) or a device with more memory"
        )
    else:
        fix = (
            "activations dominate: a shorter training.seq_len, a smaller local batch, or leaving "
            "tensor/context parallelism and activation checkpointing free for the planner to use"
        )
    pins = ", ".join(sorted(k for k in pinned if k in PLAN_FIELDS))
    pinned_text = f" The job pins {pins}." if pins else ""
    return (
        f"No plan fits {world_size} x {device.name} ({device.memory_gib:.1f} GiB). The smallest predicted "
        f"peak is {best.peak_gib:.1f} GiB ({over:.1f} GiB over) with {best.describe()}; its largest parts are "
        + ", ".join(f"{k} {v:.1f} GiB" for k, v in largest)
        + f". To fit: {fix}.{pinned_text}"
    )


def pinned_fields(job: JobConfig, cli_keys: set[str], toml_keys: set[str]) -> set[str]:
    """The plan settings a job holds fixed: those given on the command line, and those its
    TOML sets when the TOML itself asks for ``auto`` (a TOML with a hand-made plan is only the
    starting point the planner is compared against). A shard degree of -1 pins nothing."""
    keys = set(cli_keys)
    if "parallelism.auto" in toml_keys and job.parallelism.auto:
        keys |= toml_keys
    if job.parallelism.data_parallel_shard_degree == -1:
        keys.discard("parallelism.data_parallel_shard_degree")
    return keys & set(PLAN_FIELDS)
