"""Every valid plan of a job on a cluster, ranked by predicted throughput among those that fit.

A plan is a ``PlanSettings``: the five parallel degrees (and the expert-parallel one of a
mixture of experts), the pipeline schedule and micro-batch size, the activation checkpointing
mode, the local batch and FSDP's reshard policy.
Settings the job pins are held; the rest are enumerated. Whether a plan can run at all is
decided by ``training.preflight.check_plan``, the rules the trainer itself enforces; its memory by
``planner.memory`` plus a runtime reserve, its speed by ``planner.time``.

The global batch is held when the job sets ``training.global_batch_size`` (the local batch and
gradient accumulation fill it); otherwise the local batch is free and the global batch is
local x data-parallel degree, as in the trainer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES
from autopar.planner.devices import DeviceSpec
from autopar.planner.memory import GIB, Memory, predict_dims
from autopar.planner.settings import PLAN_FIELDS, PlanSettings, setting_names
from autopar.planner.time import StepTime, predict_time, tokens_per_step
from autopar.training.metrics.flops import flops_per_token
from autopar.training.objectives.dpo.job import runs_reference_forward
from autopar.training.preflight import check_plan

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
AC_MODES = (("none", "op"), ("selective", "op"), ("selective", "2"), ("full", "op"))
LOCAL_BATCHES = (1, 2, 4, 8, 16)
MICRO_BATCHES = (1, 2)
STAGES_PER_RANK = (4, 8)
"""Stages per rank an interleaved schedule is also searched with, beyond its default 2."""
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
) -> Plan:
    """Memory of the most loaded rank and, when it fits, the step time of ``job``."""
    cp_impl = resolve_impl(job.parallelism, device_type)
    worst = max(predict_dims(args, job, dims, cp_impl, device_type), key=lambda m: m.peak)
    parts = dict(worst.parts, runtime=runtime_reserve(worst.peak, dims))
    memory = Memory(worst.role, parts, worst.host)
    fits = memory.peak <= device.memory_gib * GIB
    time, tokens_per_s, mfu = None, 0.0, 0.0
    if fits:
        time = predict_time(args, job, dims, device, gpus_per_node)
        tokens_per_s = tokens_per_step(job, dims) / time.total / dims.world_size
        mfu = (
            tokens_per_s
            * flops_per_token(
                args, job.training.seq_len, job.lora.enable, reference=runs_reference_forward(job)
            )
            / device.bf16_flops
        )
    return Plan(settings or PlanSettings.of(job), dims, memory, fits, time, tokens_per_s, mfu)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Space:
    """What the search may vary: the job's own plan, and which of its settings are pinned."""

    own: PlanSettings
    pins: set[str]  # PlanSettings field names
    first_less: int = 1  # the job's pipeline_parallel_first_stage_less_layers
    last_less: int = 1  # and last_stage_less_layers

    def options(self, name: str, values: list) -> list:
        """``values``, or the job's own value of a pinned setting."""
        return [getattr(self.own, name)] if name in self.pins else list(values)


def candidates(
    job: JobConfig, args: ModelArgs, world_size: int, gpus_per_node: int, pinned: set[str]
) -> Iterator[PlanSettings]:
    """Settings of every plan to try (validity not yet checked); the settings whose
    ``section.field`` is in ``pinned`` keep the job's value."""
    cfg = job.parallelism
    space = _Space(
        PlanSettings.of(job),
        setting_names(pinned),
        cfg.pipeline_parallel_first_stage_less_layers,
        cfg.pipeline_parallel_last_stage_less_layers,
    )
    global_batch = job.training.global_batch_size
    for tp in space.options("tp", [d for d in _divisors(world_size) if d <= gpus_per_node]):
        rest = world_size // tp if world_size % tp == 0 else 0
        for cp in space.options("cp", _context_degrees(args, rest)):
            rest_cp = rest // cp if rest % cp == 0 else 0
            pps = [d for d in _divisors(rest_cp) if d <= args.num_hidden_layers] if rest_cp else []
            for pp in space.options("pp", pps):
                if not rest_cp or rest_cp % pp:
                    continue
                yield from _data_parallel(space, args, rest_cp // pp, tp, cp, pp, gpus_per_node, global_batch)


def _context_degrees(args: ModelArgs, rest: int) -> list[int]:
    """Context-parallel degrees dividing the ranks TP leaves (up to 16)."""
    if not rest:
        return []
    return [d for d in _divisors(rest) if d <= 16]


def _data_parallel(
    space: _Space, args: ModelArgs, dp: int, tp: int, cp: int, pp: int, gpus_per_node: int, global_batch: int
) -> Iterator[PlanSettings]:
    """Every plan of these model-parallel degrees: its data-parallel split, local batch,
    schedule, checkpointing, resharding and expert degree."""
    replicates = _replicate_degrees(space, dp, tp * cp, gpus_per_node)
    locals_ = _local_batches(space, dp, global_batch)
    reshards = space.options("reshard", reshard_options(pp))
    pipelines = _pipeline_choices(space, args, pp)
    for replicate, local, (schedule, micro, per_stage), (mode, option), reshard in itertools.product(
        sorted(replicates), locals_, pipelines, _ac_choices(space), reshards
    ):
        if pp > 1 and local % micro:
            continue
        if pp > 1 and checkpointing_saves_nothing(schedule, mode, space.pins):
            continue
        for ep in _expert_degrees(space, args, dp // replicate * cp):
            yield PlanSettings(
                dp_replicate=replicate,
                dp_shard=dp // replicate,
                cp=cp,
                tp=tp,
                pp=pp,
                ep=ep,
                schedule=schedule,
                microbatch=micro,
                layers_per_stage=per_stage,
                reshard=reshard,
                ac_mode=mode,
                ac_option=option,
                local_batch=local,
            )


def _replicate_degrees(space: _Space, dp: int, model_parallel: int, gpus_per_node: int) -> set[int]:
    """FSDP over every data-parallel rank (1), or HSDP with each shard group filling a node."""
    replicates = {1}
    in_node = gpus_per_node // model_parallel if gpus_per_node % model_parallel == 0 else 0
    if in_node and dp % in_node == 0 and dp // in_node > 1:
        replicates.add(dp // in_node)
    replicates = set(space.options("dp_replicate", replicates))
    if "dp_shard" in space.pins and space.own.dp_shard != -1:
        replicates = {r for r in replicates if r * space.own.dp_shard == dp}
    return replicates


def _local_batches(space: _Space, dp: int, global_batch: int) -> list[int]:
    """Local batches that make the global batch (up to 64), or ``LOCAL_BATCHES`` when it is free."""
    if global_batch <= 0:
        return space.options("local_batch", LOCAL_BATCHES)
    fill = [b for b in _divisors(global_batch // dp) if b <= 64] if global_batch % dp == 0 else []
    return space.options("local_batch", fill)


def _pipeline_choices(space: _Space, args: ModelArgs, pp: int) -> list[tuple[str, int, int | None]]:
    """(schedule, micro-batch size, layers per stage): every searched one under pipelining,
    else the job's. A schedule that runs any number of stages per rank is also tried with
    ``STAGES_PER_RANK`` of them (a smaller bubble for more sends and in-flight activations)."""
    own = (space.own.schedule, space.own.microbatch, space.own.layers_per_stage)
    if pp == 1:
        return [own]
    choices = []
    for schedule, micro in itertools.product(
        space.options("schedule", SCHEDULES), space.options("microbatch", MICRO_BATCHES)
    ):
        splits: list[int | None] = [None]
        if SCHEDULE_STYLES[schedule].stages_per_rank is None:
            splits += _layers_per_stage(space, args, pp)
        for per_stage in space.options("layers_per_stage", splits):
            choices.append((schedule, micro, per_stage))
    return choices


def _layers_per_stage(space: _Space, args: ModelArgs, pp: int) -> list[int]:
    """Layers per stage that give ``pp`` ranks each ``STAGES_PER_RANK`` stages exactly, the
    embedding and head counted as the job's first- and last-stage layers."""
    units = args.num_hidden_layers + space.first_less + space.last_less
    found = []
    for per_rank in STAGES_PER_RANK:
        per_stage = -(-units // (pp * per_rank))
        if per_stage >= 1 and -(-units // per_stage) == pp * per_rank:
            found.append(per_stage)
    return found


def _ac_choices(space: _Space) -> list[tuple[str, str]]:
    """(mode, selective option) pairs of ``AC_MODES`` the pins allow, or the pinned pair."""
    own, pins = space.own, space.pins
    acs = [
        (mode, option)
        for mode, option in AC_MODES
        if own.ac_mode == mode or "ac_mode" not in pins
        if mode != "selective" or "ac_option" not in pins or own.ac_option == option
    ]
    if "ac_mode" in pins and not acs:  # a pinned every-k other than 2
        acs = [(own.ac_mode, own.ac_option)]
    return acs


def reshard_options(pp: int) -> list[str]:
    """FSDP resharding after forward: searched both ways without pipelining; a pipeline keeps
    its stages' weights gathered across micro-batches anyway."""
    return ["default", "never"] if pp == 1 else ["default"]


def checkpointing_saves_nothing(schedule: str, mode: str, pins: set[str]) -> bool:
    """Zero-bubble schedules with activation checkpointing, unless the job pins both (``pins``:
    the pinned ``PlanSettings`` fields): they train (and equal one device), but torch's split
    backward keeps every weight's output gradient from the input pass to the weight pass, which
    recomputes the blocks again, so checkpointing buys no memory and costs two recomputes (dry
    run, Qwen3-8B ZBV stage of one layer: 12.0 GiB with full AC, 9.3 GiB without)."""
    styles = {name.lower(): style for name, style in SCHEDULE_STYLES.items()}
    style = styles.get(schedule.lower())
    both_pinned = {"schedule", "ac_mode"} <= pins
    return style is not None and style.splits_backward and mode != "none" and not both_pinned


def _expert_degrees(space: _Space, args: ModelArgs, borrowable: int) -> list[int | None]:
    """Expert-parallel degrees to try: those dividing both the experts and the data x context
    ranks EP borrows from; for a dense model none (the setting stays out of its plans)."""
    if not args.moe:
        return [None]
    return space.options("ep", [d for d in _divisors(borrowable) if args.num_experts % d == 0])


RANK_WORDS = {"cuda": ("GPU", "GPUs"), "cpu": ("CPU process", "CPU processes")}
"""What a job's ranks are, in words (one, several), by device type."""


def search(
    job: JobConfig,
    args: ModelArgs,
    world_size: int,
    gpus_per_node: int,
    device: DeviceSpec,
    pinned: set[str] = frozenset(),
    device_type: str = "cuda",
) -> list[Plan]:
    """Every valid plan, best first (see ``rank``); ConfigError when none can run."""
    evaluated: list[Plan] = []
    first_error: ConfigError | None = None
    pins = ", ".join(f"{k}={v}" for k, v in PlanSettings.of(job).config().items() if k in pinned) or "none"
    for settings in candidates(job, args, world_size, gpus_per_node, pinned):
        candidate = settings.apply(job)
        try:
            dims = check_plan(candidate, args, world_size, device_type)
        except ConfigError as err:
            first_error = first_error or err
            continue
        evaluated.append(evaluate(args, candidate, dims, device, gpus_per_node, settings, device_type))
    if first_error is None and not evaluated:
        raise ConfigError(
            f"the pinned settings ({pins}) leave no parallel degrees that multiply to the world "
            f"size {world_size} (tensor parallelism stays within a node of {gpus_per_node}); "
            "change or unpin one"
        )
    if not evaluated:
        raise ConfigError(
            f"no plan runs this job on {world_size} {RANK_WORDS[device_type][1]} (pinned: {pins}): {first_error}"
        )
    return rank(evaluated)


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
