"""Peak memory per rank of a plan, by category, before anything is built.

The parts: the parameters each rank keeps (``planner/params.py``, exact from the plans' own
styles), the bytes of its weights, gradients and optimizer state at each moment
(``planner/weight_bytes.py``) and what each micro-batch's forward saves
(``planner/activations.py`` with ``planner/block_bytes.py``).

The peak is the largest of the moments met while walking this rank's step in the schedule's
own order (``pipelining.schedule.rank_actions``, read off torch's schedule; without
pipelining one forward then one backward): each forward adds a micro-batch's saves, through
the loss the logits and the float32 log-softmax until that micro-batch's backward, which
adds their gradients over the vocabulary (vocab-sharded under loss parallel; the chunked
loss keeps the logits' gradient in the compute dtype instead, one chunk's float32 at a
time); each block backward adds one recomputed block, the gradients inside it and FSDP's
gradient buffers; the embedding's backward, which ends a stage's, adds every fresh gradient
and, under TP or FSDP, one over the whole vocabulary; zero-bubble input steps keep the
gradients at every weight's output until their weight step; and under pipelining with FSDP,
gradients stay unsharded in float32 from a stage's first backward to its last micro-batch.
CPU offload moves the weights, their gradients and the optimizer state to ``Memory.host``.
An RL job that samples peaks at its rollout instead where that holds more
(``planner/rollout_bytes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import LayerKind, ModelArgs
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.mixed_precision import compute_dtype
from autopar.parallel.parallelize import loss_parallel_enabled
from autopar.parallel.pipelining.schedule import (
    SCHEDULE_STYLES,
    rank_actions,
    schedule_name,
    stage_modules,
)
from autopar.parallel.pipelining.split import stage_ids
from autopar.planner.activations import (
    HeadBytes,
    chain_moments,
    checkpointing_saves,
    head_bytes,
    policy_head_bytes,
    sizes,
    step_mask,
    with_mtp_head,
)
from autopar.planner.block_bytes import (
    Sizes,
    block_backward_transient_bytes,
    block_weight_output_grad_bytes,
)
from autopar.planner.params import RankStages, one_of_each_key, uses_fsdp
from autopar.planner.rollout_bytes import rollout_moment
from autopar.planner.weight_bytes import (
    Unsynced,
    casts_per_micro_batch,
    embedding_backward_bytes,
    embedding_grad,
    embedding_unsynced_grad,
    fsdp_block_bytes,
    gathered_bytes,
    landing_grads,
    micro_batch,
    micro_steps,
    stored_bytes,
    syncs_last,
    unsynced_grads,
    weights_and_optimizer,
)
from autopar.training.objectives.dpo.job import is_preference
from autopar.training.objectives.rl.job import is_rl
from autopar.training.train_context import fuses_token_loss

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
    stages, roles = _stages_and_roles(args, job, dims)
    return [
        _predict_stage_rank(args, job, dims, stages, rank_stage, role, cp_impl, compute_bytes, device_type)
        for rank_stage, role in sorted(roles.items())
    ]


def _stages_and_roles(
    args: ModelArgs, job: JobConfig, dims: ParallelDims
) -> tuple[list[list[str]], dict[int, str]]:
    """Every stage's modules, and the pipeline ranks predicted (one of each role)."""
    head = ["mtp"] if args.mtp_num_hidden_layers else []  # Qwen3.5's multi-token-prediction head
    if dims.pp == 1:
        stage = [
            "embed_tokens",
            *(f"layers.{i}" for i in range(args.num_hidden_layers)),
            "norm",
            *head,
            "lm_head",
        ]
        return [stage], {0: "all ranks"}
    stages = stage_modules(job.parallelism, args)
    stages = [*stages[:-1], [*stages[-1], *head]]  # the head goes with lm_head (``BESIDE_HEAD``)
    return stages, {0: "first stage", dims.pp // 2: "middle stage", dims.pp - 1: "last stage"}


def weights_floor(args: ModelArgs, job: JobConfig, dims: ParallelDims, device_type: str = "cuda") -> float:
    """Bytes no more than ``predict_dims``' worst peak: the first pipeline rank's weights and
    optimizer state (and a reference copy), and where a pipeline holds a stage's gradients
    unsharded, the moment that stage's first backward ends (``_walk_schedule``: those
    gradients and its largest module's, nothing else of the moment counted). It reads
    neither activation checkpointing nor FSDP's resharding, so one floor holds for every
    plan that differs only in those; the search sets aside plans whose floor alone passes
    the device (``planner/prune.py``) without pricing their steps."""
    stages, _ = _stages_and_roles(args, job, dims)
    ids = _rank_stage_ids(job, dims, len(stages), 0) if dims.pp > 1 else [0]
    rank = RankStages(args, job, dims, stages, ids)
    c = compute_dtype(job, torch.device(device_type)).itemsize
    static, _ = weights_and_optimizer(args, job, dims, rank.modules, stored_bytes(job, device_type), c, False)
    floor = sum(static.values())
    micro = micro_batch(job, dims)
    if syncs_last(job, dims, micro):
        floor += max(held.grads + held.largest for held in unsynced_grads(rank, c).values())
    return floor


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
    rank = RankStages(args, job, dims, stages, ids)
    stored = stored_bytes(job, device_type)
    micro = micro_batch(job, dims)
    z = sizes(args, job, dims, micro, cp_impl, c, device_type)
    # sharded gradients outlive a backward only when micro-steps accumulate into them, or
    # when a pipeline without FSDP keeps them whole across micro-batches
    accumulating = micro_steps(job, dims) > 1 or (dims.pp > 1 and not uses_fsdp(job, dims))
    # without micro-steps, the walk is the whole step: a stage's gradients land at its first
    # backward and are held from there
    in_walk = accumulating and micro_steps(job, dims) == 1
    static, host = weights_and_optimizer(
        args, job, dims, rank.modules, stored, c, accumulating and not in_walk
    )
    costs = _stage_costs(rank, z, c, stored, micro, accumulating or bool(host), in_walk)
    actions = (
        rank_actions(schedule_name(job.parallelism), dims.pp, len(stages), costs.n_micro, pp_rank)
        if dims.pp > 1
        else (("F", 0, 0), ("B", 0, 0))
    )
    peak = _walk_schedule(actions, costs)
    moment = dict(zip(("gathered_params", "activations", "gradient_buffers"), peak, strict=True))
    rollout = rollout_moment(args, job, dims, rank.modules, c)
    grads = static.get("grads", 0.0)  # held across micro-steps; none while an RL job samples
    if sum(rollout.values()) > sum(moment.values()) + grads:  # its sampling holds more
        static = {k: v for k, v in static.items() if k != "grads"}
        moment = rollout
    return Memory(role, {**static, **{k: v for k, v in moment.items() if v}}, host)


@dataclass
class _StageCosts:
    """What one rank's step allocates and frees, by stage id (``int`` keys) and by kind of
    block (``ModelArgs.layer_kind`` keys)."""

    n_micro: int
    gathered: float  # weights gathered (or cast) for the whole step
    held: float  # activations held for the whole step (``step_mask``)
    saved: dict[int, float]  # what a micro-batch's forward leaves saved in the stage
    pending: dict[int, float]  # a zero-bubble input step's gradients awaiting its weight step
    stage_kinds: dict[int, list[LayerKind]]  # in a fixed order
    heads: set[int]  # stages computing the loss
    embeds: set[int]  # stages ending with the embedding's backward
    head: HeadBytes
    recompute: dict[LayerKind, float]  # what a block's backward rebuilds
    transient: dict[LayerKind, float]  # a block backward's own temporaries
    chain: dict[int, tuple[LayerKind, float, float]]  # by stage: see ``chain_moments``
    block_gathered: dict[LayerKind, float]  # weights alive during a block's backward
    block_activations: dict[LayerKind, float]  # activations alive at the end of a block's backward
    block_buffers: dict[LayerKind, float]  # the float32 gradient a block's reduce-scatter takes
    unsynced_grads: dict[int, Unsynced]
    syncs_at_end: bool  # a multi-stage schedule syncs them after its last backward
    # weights alive as the embedding's backward ends. FSDP (without a pipeline) has resharded
    # every group by its reduce-scatter, as a compiled job's dry run measures. An eager one's
    # tracker (torch's FSDPMemTracker) sees the head's group resharded under TP only, and the
    # embedding's own copy still there; this counts what it measures (docs/planner.md)
    embedding_end_gathered: float
    embedding_grads: float
    embedding_first_grads: float  # the same in the step's first backward (no ``.grad`` yet)
    # gradients that land as each stage's (first) backward ends: sharded without accumulation
    # or offload, or held from then on by a pipeline without FSDP
    stage_grads: dict[int, float]
    block_grads: dict[LayerKind, float]
    first_block: dict[int, LayerKind | None]  # kind of each stage's first block: its backward's last
    before_first: dict[int, float]  # what the stage's later blocks save, freed by then


def _stage_costs(
    rank: RankStages, z: Sizes, c: int, stored: int, micro: int, grads_held: bool, held_in_walk: bool
) -> _StageCosts:
    """The sizes the schedule walk adds and removes on this rank (``grads_held``: gradients kept
    across backwards, accumulating or in host memory; ``held_in_walk``: landing in the walk)."""
    args, job, dims, kind_of = rank.args, rank.job, rank.dims, rank.kind_of
    kinds = sorted(set(kind_of.values()))
    blocks = {
        i: [kind_of[m] for m in rank.stages[i] if m in kind_of] for i in rank.ids
    }  # their kinds, in order
    saves = checkpointing_saves(rank, z)
    casts = casts_per_micro_batch(rank, c, stored)
    # casts saved per micro-batch leave the step's one copy for each forward's saves
    gathered = gathered_bytes(args, job, dims, rank.modules, c, stored) - sum(casts.values())
    if uses_fsdp(job, dims) and kind_of:
        block_gathered, block_buffers = fsdp_block_bytes(rank, gathered, c)
        block_activations = saves.ended
    else:
        block_gathered = dict.fromkeys(kinds, gathered)
        block_activations, block_buffers = saves.recompute, dict.fromkeys(kinds, 0.0)
    n_micro, unsynced = job.training.local_batch_size // micro, syncs_last(job, dims, micro)
    embedding_gathered, embedding_grads = embedding_backward_bytes(
        args, job, dims, c, stored, not unsynced, grads_held
    )
    shards = dims.tp if loss_parallel_enabled(job, dims) else 1
    fresh = held_in_walk or not (grads_held or unsynced)  # gradients land as they are kept
    return _StageCosts(
        n_micro=n_micro,
        gathered=gathered,
        held=step_mask(z),
        saved={i: saves.saved[i] + casts[i] for i in rank.ids},
        pending={
            i: sum(block_weight_output_grad_bytes(z, k, args.qk_norm) for k in blocks[i]) for i in rank.ids
        },
        stage_kinds={i: sorted(set(blocks[i])) for i in rank.ids},
        heads={i for i in rank.ids if "lm_head" in rank.stages[i]},
        embeds={i for i in rank.ids if "embed_tokens" in rank.stages[i]},
        head=_head(args, job, z, dims, shards),
        recompute=saves.recompute,
        transient={k: block_backward_transient_bytes(z, k) for k in kinds},
        chain=chain_moments(rank, z, saves, block_buffers),
        block_gathered=block_gathered,
        block_activations=block_activations,
        block_buffers=block_buffers,
        unsynced_grads=unsynced_grads(rank, c) if unsynced else {},
        syncs_at_end=unsynced and SCHEDULE_STYLES[schedule_name(job.parallelism)].stages_per_rank != 1,
        embedding_end_gathered=_embedding_end_gathered(job, dims, z, gathered, embedding_gathered),
        embedding_grads=embedding_grads,
        embedding_first_grads=embedding_grads - _landed_later(args, job, dims, held_in_walk, unsynced),
        stage_grads={i: landing_grads(args, job, dims, rank.stages[i]) if fresh else 0.0 for i in rank.ids},
        # blocks of one kind keep the same gradients: priced from one of each
        block_grads={
            kind_of[m]: landing_grads(args, job, dims, [m]) for m in one_of_each_key(args, tuple(kind_of))
        },
        first_block={i: next(iter(blocks[i]), None) for i in rank.ids},
        before_first=saves.before_first,
    )


def _landed_later(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, held_in_walk: bool, unsynced: bool
) -> float:
    """The embedding's part of the gradients the walk holds from a stage's first backward
    on, which that backward's embedding moment does not have yet."""
    if held_in_walk:
        return embedding_grad(args, job, dims)
    return embedding_unsynced_grad(args, job, dims) if unsynced else 0.0


def _embedding_end_gathered(
    job: JobConfig, dims: ParallelDims, z: Sizes, gathered: float, embedding: float
) -> float:
    """Weights counted at the embedding's reduce-scatter (see ``_StageCosts``)."""
    if not uses_fsdp(job, dims) or dims.pp > 1:
        return gathered + embedding
    if z.compiled:
        return 0.0
    return embedding if dims.tp > 1 else gathered + embedding


def _head(args: ModelArgs, job: JobConfig, z: Sizes, dims: ParallelDims, shards: int) -> HeadBytes:
    """The final norm, head and loss of a micro-batch: the objective's (RL's policy loss reads
    whole-vocabulary log-probabilities; the others a cross-entropy; chunked, every objective
    keeps the same: ``training.token_logps`` as the chunked loss). A pipeline schedule holds
    the last stage's output (the logits) until its backward."""
    held = dims.pp > 1
    if is_rl(job) and not job.training.loss_chunk_tokens:
        return policy_head_bytes(z, args.vocab_size, dims.tp, held)
    fused = fuses_token_loss(job, shards > 1) and not is_preference(job)  # DPO's log-probs are its own
    return with_mtp_head(
        args, z, head_bytes(z, args.vocab_size, shards, job.training.loss_chunk_tokens, fused, held)
    )


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
    alive, accumulated = k.held, 0.0
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
                peak.consider(k.embedding_end_gathered, alive, accumulated + grads)
            backward_done.add(stage)
        peak.consider(k.gathered, alive, accumulated)
    if k.syncs_at_end:  # weights resharded, each group reduce-scattered in turn
        peak.consider(0.0, alive, accumulated + max(held.sync for held in k.unsynced_grads.values()))
    return peak.moment
