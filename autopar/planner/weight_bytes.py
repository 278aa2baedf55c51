"""Bytes of one rank's weights, gradients and optimizer state at the moments of its step: as
stored (float32 masters, or LoRA's frozen base in its own dtype with float32 adapters, and
a DPO job's reference copy), the compute-dtype copies FSDP gathers or autograd keeps as
casts, and the float32 gradients that land, are held across micro-batches or wait in a
reduce-scatter buffer. Under pipelining with FSDP, gradients stay unsharded in float32 from
a stage's first backward to its last micro-batch (torch turns gradient sync off in between).
CPU offload moves the weights, their gradients and the optimizer state to host memory.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from autopar.config.sections import JobConfig
from autopar.models.args import LayerKind, ModelArgs
from autopar.parallel.activation_checkpoint import checkpointed_layers
from autopar.parallel.fsdp import reshards_blocks
from autopar.parallel.lora import base_storage_dtype
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.mixed_precision import compute_dtype
from autopar.parallel.pipelining.schedule import (
    SCHEDULE_STYLES,
    schedule_name,
)
from autopar.planner.block_bytes import (
    FP32,
)
from autopar.planner.params import (
    RankStages,
    is_block_kind,
    key_counts,
    layer_expert_numel,
    modules_numel,
    numel_of_key,
    numel_total,
    one_of_each_key,
    trained_numel,
    trained_numel_key,
    uses_fsdp,
)
from autopar.training.objectives.build import copies_reference


def stored_bytes(job: JobConfig, device_type: str) -> int:
    """Bytes per element of a weight as stored: float32 masters, or LoRA's frozen base in its
    own dtype."""
    if not job.lora.enable:
        return FP32
    return base_storage_dtype(job.lora, compute_dtype(job, torch.device(device_type))).itemsize


def micro_batch(job: JobConfig, dims: ParallelDims) -> int:
    """Sequences a forward runs at once: a pipeline's micro-batch, else the local batch."""
    return job.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else job.training.local_batch_size


def micro_steps(job: JobConfig, dims: ParallelDims) -> int:
    training = job.training
    if training.global_batch_size <= 0:
        return 1
    return training.global_batch_size // (training.local_batch_size * dims.dp)


def weights_and_optimizer(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    modules: list[str],
    stored: int,
    c: int,
    accumulating: bool,
) -> tuple[dict[str, float], dict[str, float]]:
    """(device bytes, host bytes) of the rank's weights, optimizer state and the gradients
    that outlive a backward. CPU offload keeps the master weights, the step's gradients
    (each shard lands there as its reduce-scatter ends) and the optimizer state in host memory."""
    numel = modules_numel(args, job, dims, modules)
    trained = trained_numel(args, job, dims, modules)
    static = {
        "params": stored * numel + (FP32 * trained if job.lora.enable else 0.0),
        "optimizer": 2 * FP32 * trained,
        "grads": landing_grads(args, job, dims, modules) if accumulating else 0.0,
    }
    reference = _reference_bytes(args, job, dims, modules, c)
    if reference:  # a DPO job's frozen copy, kept where the weights are (the host under offload)
        static["reference"] = reference
    if job.training.enable_cpu_offload:
        return {}, {**static, "grads": FP32 * trained}
    return static, {}


def _reference_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int
) -> float:
    """A DPO or RL job's frozen reference copy (``dpo.reference = "copy"``, ``rl.reference =
    "copy"`` with ``rl.beta > 0``): the model's weights in the compute dtype (``c`` bytes),
    sharded as the policy's, with no gradients or optimizer state; its forward runs before the
    policy's, so its activations are gone by the peak. ``adapters_off`` and ``precomputed``
    hold none."""
    if not copies_reference(job):
        return 0.0
    return c * modules_numel(args, job, dims, modules)


def gathered_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int, stored: int
) -> float:
    """Compute-dtype copies of parameters alive at the peak: FSDP's unsharded head (its group
    is not resharded after forward), or every block when nothing reshards (pipelining);
    without FSDP, the compute-dtype casts of weights ``stored`` wider, which autograd keeps
    for backward (not an untied embedding's: the lookup's backward needs only the tokens; nor,
    without a pipeline, a checkpointed block's, whose backward casts again: dry run, Qwen3-1.7B
    on one rank, full or per-op AC, eager or compiled, 2.6 GiB over before)."""
    if not uses_fsdp(job, dims):
        if not args.tie_word_embeddings:
            modules = [m for m in modules if m != "embed_tokens"]
        if dims.pp == 1:  # a pipeline's are ``casts_per_micro_batch``'s, this the one copy
            layers = [m.split(".")[1] for m in modules if m.startswith("layers.")]
            checkpointed = {f"layers.{i}" for i in checkpointed_layers(job.activation_checkpoint, layers)}
            modules = [m for m in modules if m not in checkpointed]
        return modules_numel(args, job, dims, modules, sharded=False) * c if c < stored else 0.0
    if _keeps_blocks(job, dims):
        return _gathered_numel(args, job, dims, modules, c) * c
    return _head_group_bytes(args, job, dims, modules, c)


def _gathered_numel(args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int) -> int:
    """Elements of the unsharded copies FSDP makes of ``modules``. Experts whose FSDP group
    is a single rank (expert parallelism took every data rank) and compute in their own
    float32 have none: FSDP uses the sharded weights in place (measured), unless they are in
    host memory."""
    numel = modules_numel(args, job, dims, modules, sharded=False)
    in_place = c == FP32 and not job.training.enable_cpu_offload
    if in_place and dims.ep > 1 and dims.ep == dims.dp_shard * dims.cp:
        moe_layers = sum(
            n for key, n in key_counts(args, tuple(modules)) if is_block_kind(key) and key[1] == "moe"
        )
        numel -= moe_layers * layer_expert_numel(args, dims.ep)
    return numel


def casts_per_micro_batch(rank: RankStages, c: int, stored: int) -> dict[int, float]:
    """By stage: the compute-dtype weight casts each micro-batch's forward leaves saved, when
    a pipeline without FSDP casts its weights anew in every forward. Autograd keeps a cast
    until that micro-batch's backward (a zero-bubble weight step: the input step keeps the
    graph), unless the block is checkpointed, whose backward casts again (an untied
    embedding's lookup needs no weight in backward). Dry run, Qwen3-8B TP 4 x Interleaved1F1B
    pp 2 without FSDP: +33% before these were counted (as one copy) with the gradients below."""
    args, job, dims, stages, ids = rank.args, rank.job, rank.dims, rank.stages, rank.ids
    if dims.pp == 1 or uses_fsdp(job, dims) or c >= stored:
        return dict.fromkeys(ids, 0.0)
    layers = [m.split(".")[1] for m in rank.kind_of]
    checkpointed = {f"layers.{i}" for i in checkpointed_layers(job.activation_checkpoint, layers)}
    untied_embedding = set() if args.tie_word_embeddings else {"embed_tokens"}
    return {
        i: c
        * modules_numel(
            args, job, dims, [m for m in stages[i] if m not in checkpointed | untied_embedding], sharded=False
        )
        for i in ids
    }


def fsdp_block_bytes(
    rank: RankStages, gathered: float, c: int
) -> tuple[dict[LayerKind, float], dict[LayerKind, float]]:
    """Per kind of block under FSDP, at the end of its backward: the weights alive (its own
    gathered copy and the block before it, which backward prefetches, unless every block
    stays gathered) and the float32 gradient its reduce-scatter takes."""
    args, job, dims, modules, kind_of = rank.args, rank.job, rank.dims, rank.modules, rank.kind_of
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


def landing_grads(args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str]) -> float:
    """The float32 gradients ``modules`` keep once their backward ends, sharded as stored."""
    return FP32 * trained_numel(args, job, dims, modules)


def embedding_backward_bytes(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, c: int, stored: int, synced: bool, held: bool
) -> tuple[float, float]:
    """(gathered weights, gradient temporaries) the embedding's backward adds. Its gradient
    covers the whole vocabulary: under TP every rank sees every token's output gradient, so
    the vocabulary-sharded lookup computes the whole (replicated) gradient, from which the
    rank's rows are copied (``parallel.tensor_parallel.keep_embedding_grad_sharded``), and
    under FSDP it is the unsharded weight's. Without FSDP it is computed in the compute dtype,
    cast to the stored float32 (a temporary where ``held`` gradients accumulate it, else the
    ``.grad`` itself); when FSDP syncs, it copies its TP shard into a float32 reduce-scatter
    buffer (and gathers the embedding again, unless it is tied to the head, whose group stays
    gathered)."""
    if job.lora.enable:
        return 0.0, 0.0  # frozen
    whole = args.vocab_size * args.hidden_size
    if not uses_fsdp(job, dims):
        cast = c * whole if c < stored else 0.0
        if dims.tp == 1:
            return 0.0, cast + (FP32 * whole if held else 0.0)
        # the rows are copied out of the whole compute-dtype gradient (of the weight's cast
        # where mixed precision casts it), then cast to float32: counted with the landed
        # gradients, they are not there yet where nothing was held before; where they were,
        # the new float32 rows are added into them in place (dry run, a TP 2 x 1F1B first stage)
        rows = modules_numel(args, job, dims, ["embed_tokens"])
        width = c if c < stored else FP32
        copied = width * rows if c < stored else 0.0  # the copy the float32 cast reads
        rows_cast = copied + FP32 * rows
        return 0.0, max(width * (whole + rows), rows_cast) - (0.0 if held else FP32 * rows)
    shard = modules_numel(args, job, dims, ["embed_tokens"], sharded=False)
    regathered = 0.0 if (args.tie_word_embeddings or _keeps_blocks(job, dims)) else c * shard
    if dims.tp == 1:
        return regathered, c * whole + (FP32 * shard if synced else 0.0)
    # the rows are copied out of the whole gradient, freed before FSDP casts or reduces them
    # (``keep_embedding_grad_sharded``; unsynced, they are added into the held float32 ones).
    # Without a pipeline the head is in the embedding's FSDP group: its unsharded gradient
    # waits for that group's reduce-scatter, after the embedding's backward (dry run,
    # Qwen2.5-72B FSDP 32 x TP 8: 0.29 GiB)
    head = (
        0.0
        if (dims.pp > 1 or args.tie_word_embeddings)
        else c * modules_numel(args, job, dims, ["lm_head"], sharded=False)
    )
    return regathered, max(c * whole, FP32 * shard if synced else 0.0) + c * shard + head


def embedding_unsynced_grad(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> float:
    """The embedding's float32 gradient among a stage's unsynced ones (``unsynced_grads``):
    FSDP casts it from the first backward's at that backward's very end."""
    return 0.0 if job.lora.enable else FP32 * modules_numel(args, job, dims, ["embed_tokens"], sharded=False)


def embedding_grad(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> float:
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


def syncs_last(job: JobConfig, dims: ParallelDims, micro: int) -> bool:
    """Whether gradients stay unsharded in float32 from a stage's first backward on: torch's
    pipeline stage turns FSDP's gradient sync off for every micro-batch but the last, and a
    schedule with several stages per rank reduces them all after its last backward, even for
    one micro-batch (dry run, Qwen3-8B FSDP 4 x Interleaved1F1B pp 2, one micro-batch, first
    stage: -16% before)."""
    if dims.pp == 1 or not uses_fsdp(job, dims):
        return False
    several_stages = SCHEDULE_STYLES[schedule_name(job.parallelism)].stages_per_rank != 1
    return several_stages or job.training.local_batch_size // micro > 1


@dataclass(frozen=True)
class Unsynced:
    """A stage's gradients held unsharded across micro-batches, until its last syncs them."""

    grads: float  # all of them, in float32
    largest: float  # its largest module's, in the compute dtype, before it joins them
    sync: float  # the largest group's reduce-scatter: float32 input, output and its division


def unsynced_grads(rank: RankStages, c: int) -> dict[int, Unsynced]:
    """By stage: its gradients held unsharded (``syncs_last``)."""
    whole, sharded = (
        trained_numel_key(rank.job, rank.dims, sharded=False),
        trained_numel_key(rank.job, rank.dims),
    )
    return {i: _unsynced_stage(rank.args, tuple(rank.stages[i]), c, whole, sharded) for i in rank.ids}


@functools.lru_cache(maxsize=4096)
def _unsynced_stage(
    args: ModelArgs, modules: tuple[str, ...], c: int, whole_key: tuple, sharded_key: tuple
) -> Unsynced:
    """One stage's ``Unsynced``: the same for every plan of one split and one set of shards
    (the search meets each thousands of times)."""
    whole, sharded = numel_of_key(args, whole_key), numel_of_key(args, sharded_key)
    whole_of = {m: numel_total(whole, args, (m,)) for m in one_of_each_key(args, modules)}
    largest = max(whole_of, key=whole_of.__getitem__)
    return Unsynced(
        grads=FP32 * numel_total(whole, args, modules),
        largest=c * whole_of[largest],
        sync=FP32 * (whole_of[largest] + 2 * numel_total(sharded, args, (largest,))),
    )
