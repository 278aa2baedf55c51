"""What a micro-batch's forward leaves saved for backward on one rank, before anything is
built: the per-rank sizes the formulas read (``sizes``), the head and loss, and what
activation checkpointing keeps and rebuilds. Counted from what autograd saves in this
model's forward (read off ``torch.autograd.graph.saved_tensors_hooks`` and checked against
the dry run):

per token of a block, with ``c`` the compute dtype's bytes and heads/intermediate per TP rank,
- each RMSNorm: its float32 input, the normalized ``c`` copy and a float32 rsqrt per row
  (sharded along the sequence under sequence parallel); each sublayer's linear input ``c*h``
  (gathered over the sequence under SP);
- Qwen3's q/k norms the same per head; attention saves q, k and v (with as many heads as
  SDPA is given: the k/v heads where the kernel takes them grouped, else expanded to every
  query head, ``plans.sdpa_backend.native_gqa``), its output and a float32 logsumexp;
- SwiGLU saves gate, silu(gate), up and their product, ``4*c*I``;
- an explicit attention mask (document masking: one per sequence; all-gather CP: one
  causal mask by global position) is saved by SDPA as an additive ``c`` copy per block;
  checkpointed blocks keep the boolean one as an input instead and rebuild the copy;
- a mixture of experts (``moe_bytes_no_ac``) saves, per routed row, its token's copy, the
  experts' SwiGLU saves and output, and a few indices, with routing taken as balanced (the
  load-balancing loss's aim; real routing on CPU ranks stays within the same 10%).

Blocks of each kind are sized by ``planner/block_bytes.py``, which also says what Qwen3.5's
blocks (Gated DeltaNet, gated attention, zero-centred norms, the shared expert) save.
Under LoRA frozen norms and heads save no normalized copy or input for a weight gradient, a
linear keeps its input only where an adapter takes it, and each adapter saves its rank-wide
A output (``lora_bytes_no_ac``).

Selective per-op checkpointing keeps the outputs of matmuls, attention and collectives
(``plans.activation_checkpoint.SAVED_OPS``; context parallel's k/v all-gathers excepted:
backward gathers again); full checkpointing keeps each block's input and recomputes one
block at a time in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.config.sections import JobConfig
from autopar.models.args import LayerKind, ModelArgs
from autopar.models.qwen3_5.mtp import head_layer_args
from autopar.parallel.activation_checkpoint import checkpointed_layers, low_rank, per_op, regathers
from autopar.parallel.compile import compiles_blocks
from autopar.parallel.delta_rule_kernel import SEGMENTS, resolve_delta_rule_kernel
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.sdpa_backend import native_gqa
from autopar.planner.block_bytes import (
    FP32,
    INPUTS,
    Sizes,
    block_bytes_no_ac,
    chain_backward_bytes,
    formed_weight_grads,
    op_only_bytes,
)
from autopar.planner.compiled_block_bytes import block_op_saves, block_saves
from autopar.planner.params import (
    RankStages,
    experts_adapted,
    is_block_kind,
    layer_expert_numel,
    lora_linears,
    uses_fsdp,
)
from autopar.training.objectives.build import packs_documents


@dataclass(frozen=True)
class HeadBytes:
    """The final norm, head and loss of one micro-batch: what stays saved from its forward to
    its backward, and what exists beside that only while the loss runs forward and backward."""

    saved: float
    forward: float
    backward: float


def head_bytes(
    z: Sizes,
    vocab: int,
    tp_loss_parallel: int,
    chunk_tokens: int = 0,
    fused: bool = False,
    held: bool = False,
) -> HeadBytes:
    """Saved: the final norm's saves, the head's gathered input and the loss's float32
    log-softmax output; the logits (c) only while the loss runs forward, unless a pipeline
    schedule ``held`` its stage's output until its backward. Backward: the float32
    gradients of nll and log-softmax (under loss parallel, vocab-sharded, and three: torch's
    fused backward keeps its one-hot target, the sum with softmax and the product alive at
    once). The chunked loss saves the logits and their gradient (c, vocab-sharded under loss
    parallel too), computed in forward beside one chunk's float32 log-probabilities, their
    exponent and the masked gradient;
    its backward scales the gradient into a third c copy. A ``fused`` (compiled) loss, as
    inductor writes it, saves the logits and each row's float32 maximum and log-sum-exp, and
    its backward writes the gradient in the logits' dtype beside a float32 row buffer."""
    t = z.tokens
    logits = z.dtype_bytes * (vocab // tp_loss_parallel) * t
    fp32_logits = logits * FP32 // z.dtype_bytes
    kept = _norm_and_head_saves(z) + logits
    if fused:
        return HeadBytes(kept + 2 * FP32 * t, 0.0, logits + FP32 * t)
    unheld = 0.0 if held else logits
    if chunk_tokens:  # the gradient computed in forward is saved, not the logits
        chunk = (3 * FP32 + z.dtype_bytes) * (vocab // tp_loss_parallel) * min(chunk_tokens, t)
        return HeadBytes(kept - unheld + logits, chunk + unheld, logits)
    gradients = 3 if tp_loss_parallel > 1 else 2
    return HeadBytes(kept - unheld + fp32_logits, unheld, gradients * fp32_logits)


def _norm_and_head_saves(z: Sizes) -> float:
    """The final norm's saves and the head's input (for its weight's gradient)."""
    t = z.tokens
    weighted = not z.frozen or z.head_adapted  # a frozen head needs no input for its gradient
    norm = (FP32 + (0 if z.frozen else z.dtype_bytes)) * z.hidden * t / z.sp_shards + FP32 * t / z.sp_shards
    return norm + (z.dtype_bytes * z.hidden * t if weighted else 0)


def policy_head_bytes(z: Sizes, vocab: int, tp: int, held: bool = False) -> HeadBytes:
    """``head_bytes`` for RL's policy loss (``rl.loss.token_logps_and_entropy``), which reads
    whole-vocabulary log-probabilities: under TP the logits (c, vocab-sharded, alive while the
    loss runs forward, or until its backward where ``held``) are gathered whole first. Saved:
    the float32 log-softmax. Forward, beside
    it: the float32 logits it was taken of (and the gathered c logits under TP). Backward: the
    float32 gradients of the picked log-probabilities and of the log-softmax (dry run, Qwen3-8B
    LoRA RL, 8 x 2,048 tokens a micro-batch: 45.49 GiB measured, this 45.47)."""
    t = z.tokens
    fp32_logits = FP32 * vocab * t
    logits = z.dtype_bytes * (vocab // tp) * t
    gathered = z.dtype_bytes * vocab * t if tp > 1 else 0
    unheld = 0.0 if held else logits
    kept = _norm_and_head_saves(z) + logits - unheld
    return HeadBytes(kept + fp32_logits, fp32_logits + gathered + unheld, 2 * fp32_logits)


def with_mtp_head(args: ModelArgs, z: Sizes, head: HeadBytes) -> HeadBytes:
    """``head`` with Qwen3.5's multi-token-prediction head beside it (as is without one): its
    forward saves, from the trunk's output to its loss, what the main output does once more
    (a final norm, the output head's input, a second vocabulary-wide logits and their loss),
    its layers' saves as a full-attention block's without checkpointing (the head's layer
    is not recomputed), its two pre-fc norms' and ``fc``'s input (2H, gathered under SP).
    Whichever loss runs its backward first does so beside the other's saves: the backward's
    own temporaries are one loss's (dry run, Qwen3.5-2B shapes at 4096 tokens: measured
    +6.4 GiB of activations with the head, backward temporaries unchanged)."""
    layers = args.mtp_num_hidden_layers
    if not layers:
        return head
    t, h, c = z.tokens, z.hidden, z.dtype_bytes
    kind = head_layer_args(args).layer_kind(0)
    norms = 2 * ((FP32 + (0 if z.frozen else c)) * h * t / z.sp_shards + FP32 * t / z.sp_shards)
    own = layers * block_bytes_no_ac(z, kind, args.qk_norm) + norms + c * 2 * h * t
    return HeadBytes(2 * head.saved + own, head.forward, head.backward)


def step_mask(z: Sizes) -> float:
    """All-gather CP's boolean attention mask (``parallel.context_parallel``: this rank's
    queries by every key's global position), which its context holds for the whole step on
    every stage, attention layers or not (dry run, Qwen3.5-27B shapes at 131,072 tokens, CP 8
    x 1F1B pp 2: 2 GiB on a first stage of Gated DeltaNets, 11.6% under before)."""
    return float(z.mask) if z.kv_seq_factor > 1 else 0.0


def sizes(
    args: ModelArgs,
    job: JobConfig,
    dims: ParallelDims,
    micro_batch: int,
    cp_impl: str,
    c: int,
    device_type: str = "cuda",
) -> Sizes:
    seq = job.training.seq_len // dims.cp
    sequence_parallel = dims.tp > 1 and job.parallelism.enable_sequence_parallel
    kv_seq_factor = dims.cp if (dims.cp > 1 and cp_impl == "allgather") else 1
    # a query row per local token over every key: per sequence under document masking, one
    # shared causal one under all-gather CP
    mask = seq * seq * kv_seq_factor * (micro_batch if packs_documents(job) else kv_seq_factor > 1)
    return Sizes(
        tokens=micro_batch * seq,
        seq=seq,
        dtype_bytes=c,
        hidden=args.hidden_size,
        q_heads=args.num_attention_heads // dims.tp,
        kv_heads=args.num_key_value_heads // dims.tp,
        sdpa_kv_heads=(
            args.num_key_value_heads if native_gqa(job, device_type, cp_impl) else args.num_attention_heads
        )
        // dims.tp,
        head_dim=args.head_dim,
        ffn=args.intermediate_size // dims.tp,
        sp_shards=dims.tp if sequence_parallel else 1,
        regather=sequence_parallel and regathers(job.activation_checkpoint),
        compiled=compiles_blocks(job.compile),
        kv_seq_factor=kv_seq_factor,
        mask=mask,
        experts=args.num_experts,
        top_k=args.num_experts_per_tok if args.moe else 0,
        moe_inter=args.moe_intermediate_size,
        norm_topk=args.norm_topk_prob,
        ep=dims.ep,
        **_hybrid_sizes(args, job, dims, device_type),
        **_context_ranges(job, dims),
        **_lora_sizes(args, job, dims),
    )


def _hybrid_sizes(args: ModelArgs, job: JobConfig, dims: ParallelDims, device_type: str) -> dict[str, object]:
    """``Sizes``' Qwen3.5 fields: TP splits the Gated DeltaNet by head, as attention."""
    if not args.hybrid:
        return {}
    kernel = resolve_delta_rule_kernel(job.training.delta_rule_kernel, device_type)
    return {
        "rotary_dim": args.rotary_dim,
        "shared_inter": args.shared_expert_intermediate_size,
        "linear_key_heads": args.linear_num_key_heads // dims.tp,
        "linear_value_heads": args.linear_num_value_heads // dims.tp,
        "linear_key_dim": args.linear_key_head_dim,
        "linear_value_dim": args.linear_value_head_dim,
        "conv_width": args.linear_conv_kernel_dim,
        "documents": packs_documents(job),
        "fla": kernel == "fla",
        "delta_rule_segment": SEGMENTS.get(kernel, 0),
    }


def _context_ranges(job: JobConfig, dims: ParallelDims) -> dict[str, int]:
    """``Sizes``' CP ranges: each rank holds two token ranges of a sequence under the
    head-tail load balancer (``parallel.context_parallel.shard_sequence``), else one."""
    if dims.cp == 1:
        return {}
    ranges = 2 if job.parallelism.context_parallel_load_balancer == "headtail" else 1
    return {"ranges": ranges, "cp_ranges": dims.cp * ranges}


def _lora_sizes(args: ModelArgs, job: JobConfig, dims: ParallelDims) -> dict[str, object]:
    """``Sizes``' LoRA fields: the adapted linears of the first block of each kind."""
    cfg = job.lora
    if not cfg.enable:
        return {}
    targets = tuple(cfg.target_modules)
    return {
        "frozen": True,
        "rank": cfg.rank,
        "dropout": cfg.dropout > 0,
        "adapted": _adapted_linears(args, targets, dims.tp, cfg.rank),
        "kept_inputs": {} if cfg.dropout > 0 else _adapted_inputs(args, targets),
        "head_adapted": any(key == "lm_head" for key, *_ in lora_linears(args, targets)),
        "experts_adapted": experts_adapted(args, targets),
    }


def _adapted_inputs(args: ModelArgs, targets: tuple[str, ...]) -> dict[LayerKind, frozenset[str]]:
    """Per kind of block, the ``INPUTS`` some adapted linear takes."""
    inputs: dict[LayerKind, set[str]] = {}
    for key, name, *_ in lora_linears(args, targets):
        if is_block_kind(key) and name in INPUTS:
            inputs.setdefault(key, set()).add(INPUTS[name])
    return {k: frozenset(v) for k, v in inputs.items()}


def _adapted_linears(
    args: ModelArgs, targets: tuple[str, ...], tp: int, rank: int
) -> dict[LayerKind, tuple[tuple[int, int, bool], ...]]:
    """Per kind of block, the (in, out) features per TP rank of each adapted linear, and
    whether per-op checkpointing keeps its B output (not where it is ``low_rank``, which
    reads the whole width, as the checkpointing policy sees DTensors)."""
    adapted: dict[LayerKind, list[tuple[int, int, bool]]] = {}
    for key, _, fan_in, fan_out, dim in lora_linears(args, targets):
        if is_block_kind(key):
            local = (-(-fan_in // tp) if dim == 1 else fan_in, -(-fan_out // tp) if dim == 0 else fan_out)
            adapted.setdefault(key, []).append((*local, not low_rank(rank, fan_out)))
    return {k: tuple(v) for k, v in adapted.items()}


@dataclass
class Saves:
    """What activation checkpointing leaves saved and rebuilds (see ``checkpointing_saves``)."""

    saved: dict[int, float]  # by stage: a micro-batch's forward
    recompute: dict[LayerKind, float]  # by kind of block: what its backward rebuilds
    ended: dict[LayerKind, float]  # by kind of block: activations its backward leaves changed
    before_first: dict[int, float]  # by stage: its blocks' saves but the first block's
    blocks: dict[int, list[float]]  # by stage: each block's saves, in order


def checkpointing_saves(rank: RankStages, z: Sizes) -> Saves:
    """Under the job's activation checkpointing: what a micro-batch's forward leaves saved in
    each stage, what a block's backward rebuilds, and (per kind of block) the activations
    that block's backward leaves changed at its end: the rebuilt ones still alive (full AC),
    those per-op AC rebuilt alive and those it kept used up, or its own freed (no AC)."""
    job, stages, kind_of = rank.job, rank.stages, rank.kind_of
    ac = job.activation_checkpoint
    op = per_op(ac)
    layers = [m.split(".")[1] for m in kind_of]
    full = set() if op else set(checkpointed_layers(ac, layers))
    kinds = sorted(set(kind_of.values()))
    # a block's backward rebuilds what eager autograd would have saved: a compiled block's
    # too, whose graph recomputes what its partitioner dropped (fake, one block of each
    # kind: its backward peaks within 0.2 GiB of the eager block's)
    eager = {k: block_bytes_no_ac(z, k, rank.args.qk_norm) for k in kinds}
    no_ac = {k: block_saves(z, k, rank.args.qk_norm) for k in kinds}
    per_block = {k: block_op_saves(z, rank.dims.tp, k) if op else no_ac[k] for k in kinds}
    # a checkpointed block's inputs stay alive: the hidden states, and the model's boolean
    # mask (under CP with packed documents its (B, 1, S_local, S_local) one, which CP's
    # replaces in attention; dry run, Qwen3-0.6B CP 2 at 16K tokens, full AC: +64 MiB; CP's
    # own is held for the whole step, ``step_mask``)
    block_input = z.dtype_bytes * z.hidden * z.tokens / z.sp_shards
    local_mask = z.tokens * z.seq if rank.dims.cp > 1 and packs_documents(job) else 0
    held_mask = z.mask - step_mask(z) + local_mask if (op or full) else 0.0
    blocks = {
        i: [
            block_input if m.split(".")[1] in full else per_block[kind_of[m]]
            for m in stages[i]
            if m in kind_of
        ]
        for i in rank.ids
    }
    # a stage keeps its blocks' saves, and under pipelining the activation it received and
    # the one it sent (kept for backward); with Qwen3.5's head trained, each beside the next
    # tokens' embeddings (``mtp_pipeline``)
    hop = block_input * (2 if job.mtp.enable and rank.args.mtp_num_hidden_layers else 1)
    saved = {i: sum(blocks[i]) + hop * ((i > 0) + (i < len(stages) - 1)) + held_mask for i in rank.ids}
    # what a block's backward rebuilds: all of it (full/every-k) or what per-op AC dropped
    recompute = {
        k: eager[k] - per_block[k] + op_only_bytes(z, k)
        if op
        else (eager[k] if full else eager[k] - no_ac[k])
        for k in kinds
    }
    ended = {
        k: recompute[k] if full else (recompute[k] - per_block[k] if op else -per_block[k]) for k in kinds
    }
    return Saves(saved, recompute, ended, {i: sum(blocks[i][1:]) for i in rank.ids}, blocks)


def chain_moments(
    rank: RankStages, z: Sizes, saves: Saves, block_buffers: dict[LayerKind, float]
) -> dict[int, tuple[LayerKind, float, float]]:
    """By stage with a Gated DeltaNet under CP (``hybrid_cp``), the moment of its last such
    block's chain backward, late in the block's: (its kind, the activations beside the
    stage's saves, the float32 buffer held). The blocks after it have freed their saves; the
    block's own rebuilds and chain temporaries, less what its backward freed by then, sit
    beside the weight gradients it formed so far (under FSDP, reduced at the block's end) and
    the last reduce-scatter's input, which FSDP holds until the block's ends: the block
    after it's, or under EP its own experts' group's (dry run, Qwen3.5-9B at 4 layers, CP 8:
    -15% without these, the stage's peak then)."""
    args, job, dims, stages, kind_of = rank.args, rank.job, rank.dims, rank.stages, rank.kind_of
    moments = {}
    for i in saves.blocks:
        blocks = [m for m in stages[i] if m in kind_of]
        passing = [j for j, m in enumerate(blocks) if chain_backward_bytes(z, kind_of[m]) is not None]
        if not passing:
            continue
        last, fsdp = passing[-1], uses_fsdp(job, dims)
        kind = kind_of[blocks[last]]
        held = block_buffers[kind_of[blocks[last + 1]]] if last + 1 < len(blocks) else 0.0
        if fsdp and kind[1] == "moe" and dims.ep > 1:
            held = FP32 * layer_expert_numel(args, dims.ep)
        formed = formed_weight_grads(z, kind) if fsdp else 0.0
        beside = (
            saves.recompute[kind] + chain_backward_bytes(z, kind) + formed - sum(saves.blocks[i][last + 1 :])
        )
        moments[i] = (kind, beside, held)
    return moments
