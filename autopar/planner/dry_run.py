"""A launch at real scale with no GPUs: this job's real parallelized model, one training step,
under torch's fake process group and fake tensors, its memory measured by torch's
FSDPMemTracker or, where that cannot follow the rank (several pipeline stages, no FSDP), by
``PeakTracker``.

One rank of each distinct role runs (the first, a middle and the last pipeline stage; every
other rank holds the same shapes as one of these). What runs is ``autopar.training.step.TrainStep``,
the trainer's own step, on synthetic token batches, after the optimizer state is made
(``create_optimizer_state``); an RL job that samples measures its rollout moment too
(``measure_rollout``). Nothing is allocated and nothing touches the disk except ``dry_run.json``.

Differences from the GPU run, stated rather than hidden:

- Compute dtype ``auto`` becomes bfloat16 (what the GPU would use). The tracker watches the
  forward and backward, where the peak is; it misattributes the optimizer step's
  temporaries, which CUDA's fused AdamW does not have.
- Compiled blocks compile with ``SAVES_AS_INDUCTOR``: inductor's decompositions and
  partitioner, so they save for backward what inductor's graphs save, but each decomposed op
  then runs on its own, so a block's temporaries are the decomposition's (float32 upcasts
  inductor fuses away: where a compiled block's backward is the peak, as under full AC with a
  small vocabulary, it measures up to ~12% above inductor's). Trackers then watch the compiled
  graphs' ops, not their tracing; FSDP's memory tracker, whose module hooks cannot run inside a
  compiled block, gives way to ``PeakTracker``. A compiled token loss runs as
  ``InductorCrossEntropy``, which allocates what inductor's fused cross-entropy allocates.
- Attention takes the CPU flash kernel whichever CUDA kernel the job pins: it saves what
  they save (the output and a float32 logsumexp, no S x S matrix), and its k/v heads come
  grouped or expanded as the CUDA kernel would take them. Context parallelism takes the
  CPU all-gather implementation; ``memory.predict`` is told so (``cp_impl``).
- The allocator's rounding, the CUDA context and NCCL buffers are not simulated; the planner
  names them as a separate allowance.
- A mixture of experts runs its grouped-GEMM kernel, and under expert parallelism routing is
  taken as balanced (fake tensors carry no routing counts): each rank sends every peer the
  same number of rows, as the planner assumes.
- DTensor's shape propagation, which reruns ops on whole (unsharded) fakes in the active fake
  mode, is hidden from the trackers: a real run never allocates those.

``measure_jobs`` measures real runs the same way (what ``tests/test_planner_live.py`` checks
the planner against on CPU ranks).
"""

from __future__ import annotations

import copy
import json
import logging
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from autopar.config.sections import JobConfig
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.models.dtypes import DTYPES
from autopar.models.generation.sampling import Sampling, filtered_logits, token_logps
from autopar.models.generation.state import Decoder
from autopar.parallel.compile import compiles_blocks
from autopar.parallel.delta_rule_kernel import apply_delta_rule_kernel, resolve_delta_rule_kernel
from autopar.parallel.mesh import Meshes, ParallelDims, build_meshes
from autopar.parallel.parallelize import (
    ModelParts,
    loss_parallel_enabled,
    materialize_parts,
    parallelized_parts,
)
from autopar.parallel.pipelining.schedule import StageIO
from autopar.parallel.sdpa_backend import apply_attention_kernel, model_groups_kv, native_gqa
from autopar.parallel.torch_internals import (
    FakeTensorMode,
    FSDPMemTracker,
    TorchDispatchMode,
    active_fake_mode,
    fake_store,
    forget_compiled_graphs,
    forget_sharding_caches,
    fsdp_weights_gathered,
    sharding_propagation_untracked,
    static_shapes,
    tree_flatten,
)
from autopar.parallel.world import World, init_world
from autopar.planner.memory import predict
from autopar.planner.rollout_bytes import rollout_rows, samples_live
from autopar.training.objectives.base import Objective
from autopar.training.objectives.build import copies_reference, packs_documents
from autopar.training.objectives.dpo.job import is_preference, reference_pass
from autopar.training.objectives.dpo.objective import Preference, ReferenceLogps, losses_of
from autopar.training.objectives.language_model import LanguageModel
from autopar.training.objectives.mtp.loss import MTPTraining
from autopar.training.objectives.rl.engine import Rollouts, sequence_split
from autopar.training.objectives.rl.job import is_rl
from autopar.training.objectives.rl.loss import CHANNELS, PolicyLoss
from autopar.training.objectives.rl.objective import PolicyGradient
from autopar.training.plan_runner import PlanRunner
from autopar.training.preflight import check_job
from autopar.training.step import TrainStep
from autopar.training.train_context import fuses_token_loss
from autopar.training.trainer import Trainer

GIB = 2**30
logger = logging.getLogger("autopar")

# tracker category -> our breakdown name
_CATEGORIES = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "gathered_params",
    "Buffer": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "gathered_grads",
    "Activation": "activations",
    "Temp": "backward_temps",
    "All Gather": "gathered_params",
    "Reduce Scatter": "gathered_grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Inputs": "activations",
    "Other": "backward_temps",
}


HOST_CATEGORIES = ("params", "optimizer", "grads")
"""What CPU offload keeps in host memory: sharded weights, their gradients, optimizer state."""


@dataclass(frozen=True)
class RankMemory:
    rank: int
    role: str
    measured_peak_gib: float
    breakdown_gib: dict[str, float]
    predicted_peak_gib: float | None = None


def role_ranks(dims: ParallelDims) -> dict[int, str]:
    """One rank per distinct role: pipeline stage 0, a middle stage and the last stage (the
    pipeline dimension is the outermost, so stage s starts at rank s * world / pp)."""
    per_stage = dims.world_size // dims.pp
    if dims.pp == 1:
        return {0: "all ranks"}
    stages = {0: "first stage", dims.pp // 2: "middle stage", dims.pp - 1: "last stage"}
    return {stage * per_stage: role for stage, role in sorted(stages.items())}


def dry_run_job(job: JobConfig) -> JobConfig:
    """The job as the fake run executes it (see the module docstring for why)."""
    job = copy.deepcopy(job)
    if job.training.mixed_precision_param == "auto":
        job.training.mixed_precision_param = "bfloat16"
    job.optimizer.implementation = "for-loop"
    fused = fuses_token_loss(job, loss_parallel=False)  # loss parallel (eager) is the plan's to say
    blocks = compiles_blocks(job.compile)
    job.compile.components = ["model"] * blocks + ["loss"] * fused
    job.compile.enable = blocks or fused
    job.compile.backend = SAVES_AS_INDUCTOR
    job.float8.enable = False
    job.training.expert_kernel = "grouped"  # the per-expert loop needs real routing counts
    return job


SAVES_AS_INDUCTOR = "aot_eager_decomp_partition"
"""The backend a compiled block runs with on fake tensors: inductor's decompositions and its
partitioner (what a block saves for backward), each op then run eagerly (no kernel to write)."""


def _batches(job: JobConfig, dims: ParallelDims) -> list[Batch]:
    training = job.training
    global_batch = training.global_batch(dims.dp)
    micro_steps = min(2, global_batch // (training.local_batch_size * dims.dp))
    shape = (training.local_batch_size, training.seq_len)
    tokens = torch.zeros(shape, dtype=torch.long)
    if is_rl(job):  # at their largest: a completion per row, every position a learned token
        columns = torch.zeros(*shape, len(CHANNELS))
        columns[..., CHANNELS.index("completion")] = torch.arange(shape[0], dtype=torch.float32)[:, None]
        columns[..., CHANNELS.index("is_weight")] = 1.0
        return [Batch(tokens, columns, tokens)] * micro_steps
    # the masked attention path (preference pairs are documents too)
    documents = tokens if packs_documents(job) else None
    return [Batch(tokens, tokens, documents)] * micro_steps


def _fake_objective(
    runner: PlanRunner, job: JobConfig, copy: ModelParts | None
) -> tuple[Objective, list[torch.nn.Module]]:
    """The job's objective as the trainer builds it, with fake weights; for DPO the
    trainer's reference: a frozen ``copy`` (parallelized on meta), or the policy's LoRA base,
    or a table (a few bytes per pair, nothing to build). RL's policy loss is built on rollouts
    that sample nothing: its reference pass and sampling run outside the step measured.
    Returns the copy's parts too."""
    parts: list[torch.nn.Module] = []
    if copy is not None:
        built = materialize_parts(copy, torch.device("cpu"), _fake_values)
        parts = built.parts
    if is_rl(job):
        rollouts = Rollouts(job, runner, [], [], str, set(), 0)
        return PolicyGradient(runner, PolicyLoss.of(job.rl, job.training.loss_chunk_tokens), rollouts), parts
    if not is_preference(job):
        return LanguageModel(runner, MTPTraining.of(job)), []
    pairs = job.training.local_batch_size
    if copy is not None:
        io = _stage_io(job, runner.meshes, built) if runner.pipeline is not None else None
        reference: ReferenceLogps = reference_pass(runner, job, parts, io)
    elif job.dpo.reference == "adapters_off":
        reference = reference_pass(runner, job, None)
    else:
        reference = lambda batches: [torch.zeros(2 * pairs) for _ in batches]  # noqa: E731
    return Preference(runner, losses_of(job.dpo), reference, pairs), parts


def _local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def _fake_values(name: str, shape: torch.Size) -> torch.Tensor:
    return torch.empty(shape)


def _stage_io(job: JobConfig, meshes: Meshes, built: ModelParts) -> list[StageIO]:
    """Example tensors of each pipeline stage, which the fake process group cannot exchange:
    token ids into the first stage, hidden states between stages (sequence-sharded under CP
    and SP; in the compute dtype under every plan; stacked with the next tokens' embeddings
    when Qwen3.5's head trains, whose logits the last stage also returns). Built from shapes,
    not by running a stage: a forward before the first step would make FSDP re-register its
    parameters."""
    dims = meshes.dims
    micro = job.parallelism.pipeline_parallel_microbatch_size
    seq = job.training.seq_len // dims.cp
    sp = dims.tp if dims.tp > 1 and job.parallelism.enable_sequence_parallel else 1
    compute = DTYPES[job.training.mixed_precision_param]
    head = job.mtp.enable  # Qwen3.5's head: its logits too, and the next tokens' embeddings ride along
    io = []
    for part, sid in zip(built.parts, built.stage_ids, strict=True):
        hidden = torch.empty(((1 + head) * micro, seq // sp, part.args.hidden_size), dtype=compute)
        logits: torch.Tensor = torch.empty((micro, seq, part.args.vocab_size), dtype=compute)
        if loss_parallel_enabled(job, dims):
            local = torch.empty((micro, seq, part.args.vocab_size // dims.tp), dtype=compute)
            logits = DTensor.from_local(local, meshes.get("tp"), [Shard(2)], run_check=False)
        first, last = sid == 0, sid == built.num_stages - 1
        # a received activation requires grad, or zero-bubble schedules find no path
        # from it to the weights and skip their gradients
        received = hidden.detach().requires_grad_()
        sent = (logits if last else hidden).requires_grad_()  # what a stage sends is differentiable
        if part.args.moe:  # every stage also passes on the routing statistics so far
            routing = torch.empty((micro, 2, part.args.num_experts))
            received, sent = (received, routing.requires_grad_()), (sent, routing)
        if head and last:  # (logits[, routing], the head's logits)
            sent = (*(sent if isinstance(sent, tuple) else (sent,)), logits.detach().clone().requires_grad_())
        io.append(
            {
                "input_args": torch.zeros((micro, seq), dtype=torch.long) if first else received,
                "output_args": sent,
                "input_grads": None if first else _empty_grads(received),
                # the last stage's too: torch >= 2.15 wants both grads of a stage with DTensors
                "output_grads": _empty_grads(sent),
            }
        )
    return io


def _empty_grads(values: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tuple(map(torch.empty_like, values)) if isinstance(values, tuple) else torch.empty_like(values)


class PeakTracker(TorchDispatchMode):
    """Live bytes by category and their peak, counted per storage as ops create them.

    For ranks torch's MemTracker cannot follow: it raises when a pipeline stage runs once per
    micro-batch, and its module hooks keep a stage's autograd graph alive after the
    zero-bubble weight step (a Qwen3-8B ZBV stage: 19.6 GiB tracked, 13.5 GiB live). Without
    module hooks it cannot tell what the step creates apart (activations, gathered weights,
    gradients, temporaries), so those are one category, ``step_tensors``."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        follow_resizes: bool = False,
    ) -> None:
        super().__init__()
        # per storage its [category, bytes]. FSDP frees and refills its gathered weights by
        # resizing their storages; ``follow_resizes`` counts that (a compiled block saves the
        # gathered weights, so their storages outlive the step). Without it, a storage counts
        # from its first fill to its end: eager pipelines are measured so, and the planner's
        # pipeline walk agrees with that count (following resizes, four of the design grid's
        # FSDP pipelines measure 12-25% below their predictions)
        self._follow_resizes = follow_resizes
        self._live: weakref.WeakKeyDictionary[torch.UntypedStorage, list] = weakref.WeakKeyDictionary()
        self._current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._fake_mode: object = None
        self._resize = torch.UntypedStorage.resize_
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                self._add(t, "params")
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for t in state.values():
                    self._add(t, "optimizer")

    def _add(self, t: object, category: str) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage in self._live:
            return
        record = [category, storage.nbytes()]
        self._live[storage] = record
        weakref.finalize(storage, self._free, record)
        self._grow(category, record[1])

    def _grow(self, category: str, size: int) -> None:
        self._current[category] = self._current.get(category, 0) + size
        if sum(self._current.values()) > sum(self.peak.values()):
            self.peak = dict(self._current)

    def _free(self, record: list) -> None:
        self._current[record[0]] -= record[1]

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        """``UntypedStorage.resize_`` while tracking (no dispatch mode sees it), as torch's
        MemTracker patches it."""
        self._resize(storage, size)
        record = self._live.get(storage)
        if record is None and size > 0:  # FSDP refilling a storage it made before tracking
            record = self._live[storage] = ["step_tensors", 0]
            weakref.finalize(storage, self._free, record)
        if record is not None and record[1] != storage.nbytes():
            self._current[record[0]] -= record[1]
            record[1] = storage.nbytes()
            self._grow(record[0], record[1])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles a block only when every active mode says this; the tracker then
        watches the compiled graph's ops run, not its tracing."""
        return True

    def __enter__(self) -> PeakTracker:
        self._fake_mode = active_fake_mode()
        if self._follow_resizes:
            tracker = self
            torch.UntypedStorage.resize_ = lambda storage, size: tracker._resized(storage, size)  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._follow_resizes:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops through this mode
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            return args[0]  # the fake kernel copies; a real wait returns its input
        out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops under a fake mode of its own: not memory
        if active_fake_mode() is self._fake_mode:
            for t in tree_flatten(out)[0]:
                self._add(t, "step_tensors")
        return out


class InductorCrossEntropy(torch.autograd.Function):
    """What inductor's compiled ``token_loss_sum`` allocates, for fake tensors (no value is
    computed): its forward keeps the logits and each row's float32 maximum and log-sum-exp, its
    backward writes a float32 row buffer and the logits' gradient in their own dtype; no float32
    copy of the logits exists (its generated code: ``tests/test_planner.py`` reads it)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = logits.numel() // logits.shape[-1]
        statistics = [logits.new_empty(rows, dtype=torch.float32) for _ in range(2)]
        ctx.save_for_backward(logits, labels, *statistics)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, _, row_max, _ = ctx.saved_tensors
        torch.empty_like(row_max)  # the row buffer, freed as the gradient is written
        return torch.empty_like(logits), None


def measure_rank(job: JobConfig, args: ModelArgs, world_size: int, rank: int) -> dict[str, int]:
    """``measure_step`` of ``rank`` under a fake process group of its own, destroyed after."""
    job = dry_run_job(job)
    gqa = model_groups_kv(job, "cuda", "allgather")
    job.training.sdpa_backend = "auto"  # CPU's flash kernel, with CUDA's choice of k/v heads
    dims = ParallelDims.resolve(job.parallelism, world_size)
    fused = fuses_token_loss(job, loss_parallel_enabled(job, dims))
    job.compile.components = [c for c in job.compile.components if c != "loss"]  # stood in for
    job.compile.enable = compiles_blocks(job.compile)
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    forget_compiled_graphs()
    try:
        world = World(rank=rank, size=world_size, local_rank=rank, device=torch.device("cpu"))
        meshes = build_meshes(dims, "cpu", always_fsdp=job.training.enable_cpu_offload)
        # parallelizing on meta allocates nothing; FSDP builds meshes of its own from real
        # rank lists, so only materializing and the step run under fake tensors
        built = parallelized_parts(args, job, meshes, world.device)
        copied = copies_reference(job)
        plain = replace(job, lora=replace(job.lora, enable=False))  # a DPO or RL job's frozen reference
        reference_built = (
            parallelized_parts(args, plain, meshes, world.device, frozen=True) if copied else None
        )
        cuda_delta_rule = resolve_delta_rule_kernel(job.training.delta_rule_kernel, "cuda")
        for part in built.parts:
            apply_attention_kernel(part, gqa)
            apply_delta_rule_kernel(part, cuda_delta_rule, "cuda")  # CUDA's kernel; its fake runs here
        # a graph per shape, as a job compiling its one shape gets: dry runs of other shapes
        # earlier in the process would otherwise make it dynamic, which saves differently
        with FakeTensorMode(allow_non_fake_inputs=True), static_shapes():
            parts = materialize_parts(built, world.device, _fake_values)
            io = _stage_io(job, meshes, parts) if dims.pp > 1 else None
            # the schedule's warm-up vote on static metadata moves no data under the fake
            # group; every stage has static shapes here (``_stage_io``, which the runner assumes)
            runner = PlanRunner(job, world, meshes, parts, io)
            if fused:
                runner.context.loss_fn = InductorCrossEntropy.apply
            if runner.context.context_parallel is not None:  # CUDA's k/v heads after the gather too
                runner.context.context_parallel.expand_kv = not native_gqa(job, "cuda", "allgather")
            objective, reference = _fake_objective(runner, job, reference_built)
            step = TrainStep(runner, objective)
            batches = _batches(job, dims)
            create_optimizer_state(step, job.optimizer.lr)
            # FSDP's memory tracker leaves hooks that refuse a later forward: the rollout first
            rollout = measure_rollout(runner, job, step.optimizers) if samples_live(job) else {}
            peak = max(tracked_step(step, batches, job.optimizer.lr), rollout, key=lambda p: sum(p.values()))
            if reference:
                peak["reference"] = sum(_local_bytes(p) for part in reference for p in part.parameters())
    finally:
        dist.destroy_process_group()
        forget_sharding_caches()  # keyed by meshes, which compare equal across fake groups
    return peak


def measure_step(step: TrainStep, batches: list[Batch], lr: float) -> dict[str, int]:
    """Peak bytes by category of this rank over the forward and backward of a second training
    step on ``batches`` (the first creates the optimizer state), fake or real alike."""
    step(batches, lr)
    return tracked_step(step, batches, lr)


def create_optimizer_state(step: TrainStep, lr: float) -> None:
    """The optimizer state a first step leaves, without running its micro-batches (a third
    of a dry run's time): every trained parameter given a zero gradient, then one update. On
    fake tensors the values do not matter; what a schedule allocates once and keeps (a
    pipeline's receive buffers) is then counted in the measured step, as a real step holds it."""
    for part in step.parts:
        for param in part.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    step.update(lr)


def tracked_step(step: TrainStep, batches: list[Batch], lr: float) -> dict[str, int]:
    """Peak bytes by category over one training step's forward and backward."""
    # a pipeline stage with Qwen3.5's head: FSDPMemTracker takes its second micro-batch's
    # forward for another step's and raises ("multiple iterative calls"; torch 2.13, seen here)
    head = step.pipeline is not None and step.job.mtp.enable
    # and its module hooks cannot run inside a compiled block ("Attempt to trace generator")
    hooks = not compiles_blocks(step.job.compile)
    if isinstance(step.parts[0], FSDPModule) and len(step.parts) == 1 and not head and hooks:
        tracker: FSDPMemTracker | PeakTracker = FSDPMemTracker(step.parts[0], step.optimizers[0])
    else:
        tracker = PeakTracker(step.parts, step.optimizers, follow_resizes=not hooks)
    # the tracker misreads optimizer-step temporaries on DTensors, so it watches the forward
    # and backward; the update's own peak (params, grads, state) is lower
    # DTensor's propagation runs each op once more on whole-tensor fakes a real run never
    # allocates: at the loss-parallel backward, two vocabulary-sized fp32 tensors at the peak
    with sharding_propagation_untracked((PeakTracker, FSDPMemTracker)), tracker:
        step.forward_backward(batches)
    step.update(lr)
    return tracker.peak if isinstance(tracker, PeakTracker) else _fsdp_peak(tracker)


@torch.no_grad()
def measure_rollout(
    runner: PlanRunner, job: JobConfig, optimizers: list[torch.optim.Optimizer]
) -> dict[str, int]:
    """Peak bytes by category of an RL rank's rollout moment, between optimizer steps: its
    weights gathered as sampling gathers them, and one decode step of every completion it
    samples at once, the decoding state allocated for whole rows (``seq_len + 1`` positions,
    as ``planner/rollout_bytes.py`` counts it) and the step's logits turned into the sampler's
    probabilities and log-probabilities. What the rollout adds is ``rollout``."""
    rows = rollout_rows(job, runner.dims)
    modules = [m for part in runner.parts for m in part.modules()]
    sampling = Sampling(job.rl.temperature, job.rl.top_k, job.rl.top_p)
    tracker = PeakTracker(runner.parts, optimizers)
    with sharding_propagation_untracked((PeakTracker,)), tracker, fsdp_weights_gathered(modules):
        split = sequence_split(job, runner.dims)
        decoder = Decoder(runner.parts[0], rows, job.training.seq_len + 1, multiple=split, static=True)
        tokens = torch.zeros(rows, dtype=torch.long, device=runner.device)
        logits = decoder.step(tokens, tokens)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        filtered_logits(logits, sampling).softmax(dim=-1)
        token_logps(logits, tokens, sampling)
    peak = dict(tracker.peak)
    peak["rollout"] = peak.pop("step_tensors", 0)
    return peak


def measure_jobs(jobs: list[JobConfig]) -> list[dict[str, int]]:
    """The real-run counterpart of ``measure_rank``: each job's trainer built on this rank's
    process group (or alone) with its own weights and data, one step measured by
    ``measure_step``. What the planner's predictions are checked against on real ranks."""
    peaks = []
    for job in jobs:
        world = init_world()
        trainer = Trainer(job, check_job(job, world.size), world)
        peaks.append(measure_step(trainer.train_step, trainer.loader.next_step(), job.optimizer.lr))
    return peaks


def _fsdp_peak(tracker: FSDPMemTracker) -> dict[str, int]:
    """The tracker's peak snapshot in our category names."""
    by_category: dict[str, int] = {}
    for device_peak in tracker.get_tracker_snapshot("peak").values():
        for key, value in device_peak.items():
            if key == "Total":
                continue
            name = _CATEGORIES[str(getattr(key, "value", key))]
            by_category[name] = by_category.get(name, 0) + value
    return by_category


def dry_run(job: JobConfig, args: ModelArgs, world_size: int) -> list[RankMemory]:
    """Measured peak memory of one rank per role."""
    dims = ParallelDims.resolve(job.parallelism, world_size)
    measured_job, measured_world = _tracked_world(job, dims)
    measured_ranks = role_ranks(ParallelDims.resolve(measured_job.parallelism, measured_world))
    out = []
    for (rank, role), measured_rank in zip(role_ranks(dims).items(), measured_ranks, strict=True):
        by_category = measure_rank(measured_job, args, measured_world, measured_rank)
        if job.training.enable_cpu_offload:  # these live in host memory, not on the device
            by_category = {k: v for k, v in by_category.items() if k not in HOST_CATEGORIES}
        breakdown = {k: v / GIB for k, v in sorted(by_category.items())}
        out.append(RankMemory(rank, role, sum(by_category.values()) / GIB, breakdown))
    return out


def _tracked_world(job: JobConfig, dims: ParallelDims) -> tuple[JobConfig, int]:
    """The job and world to measure. FSDP's tracker misses activations when the FSDP group is
    one rank (measured: 8B layers, CPU offload on one rank 9.3 GiB, the same rank of eight
    12.9 GiB); that happens only under CPU offload, which then is measured as one rank of a
    two-way shard instead: every tensor on the device keeps its size (the sharded ones that
    halve live in host memory)."""
    if not (job.training.enable_cpu_offload and dims.dp_shard * dims.cp == 1):
        return job, dims.world_size
    logger.info(
        "CPU offload on a one-rank FSDP group: measured as one rank of a two-way shard (same device tensors)"
    )
    doubled = copy.deepcopy(job)
    doubled.parallelism.data_parallel_shard_degree = 2
    doubled.training.global_batch_size *= 2 if doubled.training.global_batch_size > 0 else 1
    return doubled, dims.world_size * 2


def write_dry_run(path: Path, ranks: list[RankMemory]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ranks": [asdict(r) for r in ranks]}, indent=2) + "\n")


def compare(job: JobConfig, args: ModelArgs, world_size: int) -> list[RankMemory]:
    """Measured peak of each role beside the planner's prediction for the same dispatch."""
    predicted = predict(args, dry_run_job(job), world_size, cp_impl="allgather")
    return [
        replace(rank, predicted_peak_gib=memory.peak / GIB)
        for rank, memory in zip(dry_run(job, args, world_size), predicted, strict=True)
    ]


def title(job: JobConfig, world_size: int) -> str:
    """The plan a dry run measured, in one line above its table."""
    dims = ParallelDims.resolve(job.parallelism, world_size)
    training, parallelism = job.training, job.parallelism
    degrees = (
        f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp} cp={dims.cp} pp={dims.pp}"
    )
    if dims.ep > 1:
        degrees += f" ep={dims.ep}"
    if dims.pp > 1:
        degrees += f" ({parallelism.pipeline_parallel_schedule})"
    fused = fuses_token_loss(dry_run_job(job), loss_parallel_enabled(job, dims))
    parts = ["blocks"] * compiles_blocks(job.compile) + ["loss"] * fused
    compiled = f" | compiled: {' and '.join(parts)}" if parts else ""
    return (
        f"dry run: {job.model.name} {job.model.flavor if job.model.hf_assets_path is None else job.model.hf_assets_path} "
        f"on {world_size} GPUs | {degrees} | AC {job.activation_checkpoint.mode} | local batch "
        f"{training.local_batch_size} x {training.seq_len} tokens{compiled}"
    )


def report(ranks: list[RankMemory]) -> str:
    """A table: one row per role, measured and predicted peaks and the measured breakdown."""
    names = sorted({k for r in ranks for k, v in r.breakdown_gib.items() if v > 0})
    header = f"{'rank':>6} {'role':<13} {'measured':>9} {'predicted':>9}  " + "  ".join(names)
    rows = [header]
    for r in ranks:
        predicted = "-" if r.predicted_peak_gib is None else f"{r.predicted_peak_gib:.2f}"
        cells = "  ".join(f"{r.breakdown_gib.get(n, 0.0):>{len(n)}.2f}" for n in names)
        rows.append(f"{r.rank:>6} {r.role:<13} {r.measured_peak_gib:>9.2f} {predicted:>9}  {cells}")
    return "\n".join(rows) + "\n(GiB per rank; bf16 compute, no CUDA context/NCCL/allocator slack)"
