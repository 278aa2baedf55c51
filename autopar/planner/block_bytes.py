"""What one block saves for backward, per micro-batch on one rank, by its kind
(``ModelArgs.layer_kind``: token mixer and feed-forward), without checkpointing, under
per-op checkpointing, the gradients a zero-bubble schedule keeps and a block backward's own
temporaries. ``planner/memory.py`` walks a rank's step with them; ``planner/activations.py`` says what a
Qwen2.5/3 block (``attention`` mixer) saves. Qwen3.5's blocks, read off
``torch.autograd.graph.saved_tensors_hooks`` on one block of each kind and held against
the dry run (``c`` the compute dtype's bytes, heads per TP rank):

- each zero-centred RMSNorm (``ZeroCenteredRMSNorm``) saves its float32 input, a float32
  rsqrt per row and the float32 normalized copy that (1 + w)'s gradient reads;
- gated attention saves what attention does (q, k, v, output, logsumexp; RoPE's tables of
  the rotated dims only), its zero-centred q/k norms', and ``c`` sigmoid(gate) and the gated
  output ``o_proj`` takes;
- a Gated DeltaNet saves its input; per convolution channel (q, k and v) the projection's
  output (the taps' gradient), the left-padded copy the shifted taps read (with packed
  documents, each masked shifted copy instead), the convolution's output (SiLU's) and SiLU's
  output (the delta rule's q, k, v); the decay's softplus input and output, g (float32) and
  beta; one float32 state (HV x dk x dv) per ``delta_rule.SEGMENT`` tokens of each sequence;
  the gated norm's float32 input, rsqrt, normalized and weighted ``c`` copies, float32 z
  and silu(z); and ``out_proj``'s input. Per-op checkpointing keeps the six projections',
  the delta rule's (output and states) and ``out_proj``'s outputs;
- a mixture's shared expert (Qwen3.5-MoE) saves a SwiGLU's, its output and sigmoid(gate)
  beside the routed experts; TP leaves a mixture of experts whole, shared expert included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.models.args import LayerKind
from autopar.models.qwen3_5.delta_rule import SEGMENT
from autopar.models.qwen3_5.fla_delta_rule import CHUNK as FLA_CHUNK
from autopar.parallel.activation_checkpoint import low_rank
from autopar.planner.hybrid_cp import StatePassing

FP32 = 4


@dataclass(frozen=True)
class Sizes:
    """Per-rank sizes that the activation formulas need."""

    tokens: int  # tokens of one micro-batch on this rank (after the CP split)
    seq: int  # this rank's tokens per sequence
    dtype_bytes: int  # of the compute dtype
    hidden: int
    q_heads: int  # per TP rank
    kv_heads: int  # per TP rank
    sdpa_kv_heads: int  # k/v heads SDPA is given: kv_heads, or q_heads where expanded before it
    head_dim: int
    ffn: int  # intermediate size per TP rank
    sp_shards: int  # sequence-parallel shard factor of norms and residuals
    kv_seq_factor: int  # how many times the local sequence k/v span (all-gather CP)
    mask: int  # elements of the explicit attention mask (0: SDPA's built-in causal one)
    experts: int = 0  # a mixture of experts': experts, top-k, intermediate size per expert
    top_k: int = 0
    moe_inter: int = 0
    norm_topk: bool = False
    ep: int = 1
    regather: bool = False  # per-op AC gathers SP's inputs again in backward (``op_regather``)
    compiled: bool = False  # the blocks compiled: their saves as the partitioner keeps them
    frozen: bool = False  # LoRA: norm and head weights take no gradient, so save no input for one
    rank: int = 0  # LoRA's adapters: rank, dropout, and per kind of block the
    dropout: bool = False  # (in, out) features per TP rank of each adapted linear
    adapted: dict[LayerKind, tuple[tuple[int, int, bool], ...]] = field(default_factory=dict)  # and B kept
    kept_inputs: dict[LayerKind, frozenset[str]] = field(default_factory=dict)  # LoRA: see INPUTS
    head_adapted: bool = False
    experts_adapted: bool = False  # LoRA on the experts: they save what their adapters' gradients read
    # Qwen3.5: partial RoPE, a mixture's shared expert, and per TP rank the Gated DeltaNet's
    # key and value heads, their widths and the convolution's
    rotary_dim: int = 0
    shared_inter: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_width: int = 0
    documents: bool = False  # packed documents: the convolution masks each shifted copy
    fla: bool = False  # training.delta_rule_kernel: FLA's, which keeps other tensors than ours
    delta_rule_segment: int = SEGMENT  # ours: tokens per fp32 state kept (autopar's or triton's)
    # context parallelism: this rank's token ranges of each sequence (2 under the head-tail
    # load balancer) and every CP rank's (cp * ranges; 1 without CP)
    ranges: int = 1
    cp_ranges: int = 1

    def keeps(self, kind: LayerKind, inputs: str) -> bool:
        """Whether a block saves the input its linears named by ``inputs`` share: for their
        weights' gradients, or under LoRA an adapter's (without dropout: dropout saves its own)."""
        return not self.frozen or inputs in self.kept_inputs.get(kind, frozenset())


INPUTS = dict.fromkeys(("q_proj", "k_proj", "v_proj"), "attention")
INPUTS |= dict.fromkeys(("gate_proj", "up_proj"), "mlp") | {"down_proj": "down"}
INPUTS |= dict.fromkeys(tuple(f"in_proj_{x}" for x in "qkvzab"), "attention")
INPUTS |= dict.fromkeys(("o_proj", "out_proj"), "out")
"""Which input a block linear takes: q/k/v (a Gated DeltaNet's six input projections) share
the normed hidden state, gate/up theirs, down the SwiGLU product, and the mixer's output
projection its output (Qwen2.5/3's o_proj's: attention's output, which attention saves
anyway; gated attention's gated product and a Gated DeltaNet's normed one are saved for it)."""


def lora_bytes_no_ac(z: Sizes, kind: LayerKind) -> float:
    """What LoRA adds to a block's saves: each adapted linear's A output (rank wide, for B's
    gradient) and, with dropout, its mask and the dropped input A takes (the input the base
    saves is otherwise A's too)."""
    t, linears = z.tokens, z.adapted.get(kind, ())
    dropped = sum((z.dtype_bytes + 1) * fan_in * t for fan_in, *_ in linears) if z.dropout else 0.0
    return z.dtype_bytes * z.rank * t * len(linears) + dropped


def lora_bytes_op_ac(z: Sizes, kind: LayerKind) -> float:
    """Per-op checkpointing keeps both adapter matmuls' outputs: A's (rank wide) and B's (as
    wide as the base's) unless it recomputes B as a low-rank matmul (``activation_checkpoint.low_rank``)."""
    linears = z.adapted.get(kind, ())
    return sum(z.dtype_bytes * (z.rank + (fan_out if kept else 0)) * z.tokens for _, fan_out, kept in linears)


def moe_bytes_no_ac(z: Sizes) -> float:
    """What a mixture of experts saves beyond its input (``moe.MoE``; every TP rank routes the
    whole sequence): the router's float32 probabilities and top-k indices (and the top-k
    weights and their sum when renormalized), each routed row's token index, copy of its
    token, SwiGLU saves and output, the weights, and the index that restores choice order;
    under EP, the index that regroups the rows received. Routing is taken as balanced: each
    rank's experts receive ``top_k`` rows per token (the load-balancing loss's aim). Under
    LoRA the router and experts are frozen: the token copies and the SwiGLU product only
    their weight gradients read are not saved, unless the experts are adapted, whose adapters'
    gradients read them too and save each row's two rank-wide A outputs."""
    t = z.tokens
    rows = z.top_k * t
    router = FP32 * z.experts * t + 8 * rows + ((FP32 * (rows + t)) if z.norm_topk else 0)
    indices = 16 * rows + (16 * rows if z.ep > 1 else 0)
    frozen = z.frozen and not z.experts_adapted
    copies, swiglu = (1, 3) if frozen else (2, 4)  # (T*k, H) copies; (T*k, I) saves
    adapters = 2 * z.rank if z.experts_adapted else 0
    experts = (
        copies * z.dtype_bytes * rows * z.hidden
        + (swiglu * z.moe_inter + adapters) * z.dtype_bytes * rows
        + z.dtype_bytes * rows
    )
    return router + indices + experts


def _attention_block_no_ac(z: Sizes, qk_norm: bool, kind: LayerKind) -> float:
    """``block_bytes_no_ac`` of a Qwen2.5/3 block (softmax attention, RMSNorms)."""
    t, moe = z.tokens, kind[1] == "moe"
    normed = 0 if z.frozen else z.dtype_bytes  # the normalized copy the weight's gradient needs
    norm = (FP32 + normed) * z.hidden * t / z.sp_shards + FP32 * t / z.sp_shards
    # a mixture of experts' input is the frozen router's under LoRA: not saved
    mlp_input = (not z.frozen) if moe else z.keeps(kind, "mlp")
    linear_inputs = z.dtype_bytes * z.hidden * t * (z.keeps(kind, "attention") + mlp_input)
    heads = z.q_heads * z.head_dim * t
    qk = (
        (FP32 + normed) * (z.q_heads + z.kv_heads) * z.head_dim * t + FP32 * (z.q_heads + z.kv_heads) * t
        if qk_norm
        else 0
    )
    rope = 4 * z.dtype_bytes * z.seq * z.head_dim
    attention = (
        2 * z.dtype_bytes * heads
        + 2 * z.dtype_bytes * z.sdpa_kv_heads * z.head_dim * t * z.kv_seq_factor
        + FP32 * z.q_heads * t
    )
    # gate, silu(gate), up and (for down's weight) their product
    mlp = moe_bytes_no_ac(z) if moe else (3 + z.keeps(kind, "down")) * z.dtype_bytes * z.ffn * t
    mask = z.dtype_bytes * z.mask  # SDPA turns a boolean mask into an additive one and saves it
    return 2 * norm + linear_inputs + qk + rope + attention + mlp + mask + lora_bytes_no_ac(z, kind)


def _attention_block_op_ac(z: Sizes, tp: int, kind: LayerKind) -> float:
    """``block_bytes_op_ac`` of a Qwen2.5/3 block."""
    t, moe = z.tokens, kind[1] == "moe"
    qkv = z.dtype_bytes * (z.q_heads + 2 * z.kv_heads) * z.head_dim * t
    attention = z.dtype_bytes * z.q_heads * z.head_dim * t + FP32 * z.q_heads * t
    out_proj = 2 * z.dtype_bytes * z.hidden * t  # o_proj and down_proj (or the experts' weighted sum) outputs
    mlp = _experts_op_ac(z, kind) if moe else 2 * z.dtype_bytes * z.ffn * t
    block_input = z.dtype_bytes * z.hidden * t / z.sp_shards
    collectives = _collectives_op_ac(z, tp, kind)
    return qkv + attention + out_proj + mlp + block_input + collectives + lora_bytes_op_ac(z, kind)


def op_only_bytes(z: Sizes, kind: LayerKind) -> float:
    """What per-op checkpointing keeps, or rebuilds, that a block without checkpointing does
    not save, so its backward rebuilds no less for it: adapted experts' B outputs, as wide as
    the base's (kept, or where ``low_rank`` recomputed in backward: measured alike);
    Qwen3.5's projections whose outputs only float32 copies or later ops' outputs are saved
    of (``_hybrid_op_only``)."""
    mixer = _hybrid_op_only(z, kind) if kind[0] != "attention" else 0.0
    if not (kind[1] == "moe" and z.experts_adapted):
        return mixer
    return mixer + _expert_b_bytes(z, kept_only=False)


def _expert_b_bytes(z: Sizes, kept_only: bool) -> float:
    """Adapted experts' B outputs (gate/up's and down's), or those per-op checkpointing keeps."""
    widths = [w for w in (2 * z.moe_inter, z.hidden) if not (kept_only and low_rank(z.rank, w))]
    return z.dtype_bytes * z.top_k * z.tokens * sum(widths)


def _hybrid_op_only(z: Sizes, kind: LayerKind) -> float:
    """Gated attention's q (with its gate) and k projections, normed from float32 copies; a
    Gated DeltaNet's a, b and z projections and the delta rule's output, of which only the
    decay's, sigmoid's and the gated norm's float32 work is saved."""
    if kind[0] == "gated_attention":
        return z.dtype_bytes * (2 * z.q_heads + z.kv_heads) * z.head_dim * z.tokens
    values = z.linear_value_heads * z.linear_value_dim
    passing = state_passing(z)
    return z.dtype_bytes * (2 * z.linear_value_heads + 2 * values) * z.tokens + (
        passing.op_only() if passing else 0.0
    )


def _attention_block_weight_output_grads(z: Sizes, qk_norm: bool, kind: LayerKind) -> float:
    """``block_weight_output_grad_bytes`` of a Qwen2.5/3 block."""
    t, moe = z.tokens, kind[1] == "moe"
    # qkv, o, and gate/up, down (a mixture of experts: router, and per routed row)
    mlp = z.experts + z.top_k * (2 * z.moe_inter + z.hidden) if moe else 2 * z.ffn + z.hidden
    projections = (z.q_heads + 2 * z.kv_heads) * z.head_dim + z.hidden + mlp
    norms = 2 * z.hidden / z.sp_shards + ((z.q_heads + z.kv_heads) * z.head_dim if qk_norm else 0)
    return z.dtype_bytes * t * (projections + norms)


def _feed_forward_transient(z: Sizes, kind: LayerKind) -> float:
    """The gradients alive inside one block's backward beside its saves: at SwiGLU's product,
    the gradient arriving at it and the two it sends to silu(gate) and up (per routed row in
    a mixture of experts)."""
    if kind[1] != "moe":
        return 3 * z.dtype_bytes * z.ffn * z.tokens
    rows = z.top_k * z.tokens
    return 3 * z.dtype_bytes * rows * z.moe_inter + 2 * z.dtype_bytes * rows * z.hidden


def _experts_op_ac(z: Sizes, kind: LayerKind) -> float:
    """Per-op AC in a mixture of experts: router logits, the experts' three grouped GEMMs (and
    EP's two all-to-alls)."""
    t = z.tokens
    rows = z.top_k * t
    mlp = (
        z.dtype_bytes * z.experts * t
        + 2 * z.dtype_bytes * rows * z.moe_inter
        + z.dtype_bytes * rows * z.hidden
    )
    mlp += 2 * z.dtype_bytes * rows * z.hidden if z.ep > 1 else 0.0
    # adapted experts: both A outputs (rank wide) and the B outputs not recomputed (as wide as the base's)
    if z.experts_adapted:
        mlp += z.dtype_bytes * rows * 2 * z.rank + _expert_b_bytes(z, kept_only=True)
    return mlp


def _collectives_op_ac(z: Sizes, tp: int, kind: LayerKind) -> float:
    """Per-op AC keeps TP's collectives' outputs: under SP, an all-gather (c*h) before each
    sublayer (unless ``op_regather`` gathers it again in backward) and a reduce-scatter
    (c*h/tp) after the token mixer and a dense MLP (a mixture of experts' output is split
    without one); otherwise an all-reduce after each (only the mixer's before a mixture of
    experts)."""
    if tp == 1:
        return 0.0
    reduce_scatters = 1 if kind[1] == "moe" else 2
    if z.sp_shards > 1:
        gathers = 0 if z.regather else 2
        return z.dtype_bytes * z.hidden * z.tokens * (gathers + reduce_scatters / tp)
    return z.dtype_bytes * z.hidden * z.tokens * reduce_scatters


def _zero_centred_norm(z: Sizes) -> float:
    """A zero-centred RMSNorm's saves: float32 input, rsqrt per row and (for the weight's
    gradient) the float32 normalized copy; sequence-sharded under SP."""
    normed = 0 if z.frozen else FP32
    return ((FP32 + normed) * z.hidden * z.tokens + FP32 * z.tokens) / z.sp_shards


def linear_channels(z: Sizes) -> tuple[int, int]:
    """(key, value) channels of a Gated DeltaNet on one TP rank."""
    return z.linear_key_heads * z.linear_key_dim, z.linear_value_heads * z.linear_value_dim


def delta_rule_states(z: Sizes) -> float:
    """What the delta-rule kernel keeps beyond its inputs. Ours (autopar, triton): the float32
    state per value head and segment (``delta_rule_segment`` tokens) of each local token range
    (under CP the kernel runs once per range). FLA's: the per-chunk solve A (a CHUNK-wide row per token and value head) and the
    float32 reciprocal norms of q and k (its normed q, k and summed decay take the places of
    the q, k and decay ours keeps)."""
    if z.fla:
        return z.tokens * (z.dtype_bytes * FLA_CHUNK * z.linear_value_heads + FP32 * 2 * z.linear_key_heads)
    segments = z.ranges * -(-(z.seq // z.ranges) // z.delta_rule_segment)
    per_sequence = z.linear_value_heads * z.linear_key_dim * z.linear_value_dim * segments
    return FP32 * per_sequence * (z.tokens // z.seq)


def state_passing(z: Sizes) -> StatePassing | None:
    """A Gated DeltaNet's context parallelism on this rank (None without CP)."""
    if z.cp_ranges == 1:
        return None
    return StatePassing(
        batch=z.tokens // z.seq,
        value_heads=z.linear_value_heads,
        key_dim=z.linear_key_dim,
        value_dim=z.linear_value_dim,
        ranges=z.ranges,
        cp_ranges=z.cp_ranges,
        range_tokens=z.seq // z.ranges,
        fla=z.fla,
        segment=z.delta_rule_segment,
        key_heads=z.linear_key_heads,
        dtype_bytes=z.dtype_bytes,
    )


def _conv_halo(z: Sizes, channels: int) -> float:
    """Under CP the convolution runs per range on a copy extended by the previous range's
    last ``width - 1`` tokens, which it keeps for its taps' gradient (and, without documents,
    its left-padded copy too), in place of the whole sequence's."""
    if z.cp_ranges == 1 or z.frozen:
        return 0.0
    taps = z.conv_width - 1
    copies = z.ranges if z.documents else 3 * z.ranges - 1
    return z.dtype_bytes * channels * (z.tokens // z.seq) * taps * copies


def _gated_attention_no_ac(z: Sizes, kind: LayerKind) -> float:
    t, c = z.tokens, z.dtype_bytes
    query = z.q_heads * z.head_dim * t
    heads = z.q_heads + z.kv_heads
    normed = 0 if z.frozen else FP32
    qk_norms = (FP32 + normed) * heads * z.head_dim * t + FP32 * heads * t
    rope = 4 * c * z.seq * z.rotary_dim
    sdpa = 2 * c * query + 2 * c * z.sdpa_kv_heads * z.head_dim * t * z.kv_seq_factor + FP32 * z.q_heads * t
    gate = c * query * (1 + z.keeps(kind, "out"))  # sigmoid(gate), and the gated output o_proj takes
    return c * z.hidden * t * z.keeps(kind, "attention") + qk_norms + rope + sdpa + gate + c * z.mask


def _linear_attention_no_ac(z: Sizes, kind: LayerKind) -> float:
    """Frozen (LoRA), the convolution keeps no copies for its taps' gradient, the decay no
    softplus output for A_log's, the gated norm no normalized copy for its weight's."""
    t, c, trained = z.tokens, z.dtype_bytes, not z.frozen
    keys, values = linear_channels(z)
    channels, taps = 2 * keys + values, z.conv_width - 1
    if z.documents:  # each shifted copy masked (and its boolean mask), the document ids
        conv = (2 + (1 + taps) * trained) * c * channels * t + 3 * taps * t + 8 * t
    else:
        conv = (2 + 2 * trained) * c * channels * t + c * taps * channels * (t // z.seq) * trained
    heads = z.linear_value_heads * t
    decay = (2 + trained) * FP32 * heads + c * heads  # softplus's input and output, g; beta
    passing = state_passing(z)
    conv += _conv_halo(z, channels) + (passing.saved() if passing else 0.0)
    return (
        c * z.hidden * t * z.keeps(kind, "attention")
        + conv
        + decay
        + delta_rule_states(z)
        + _gated_norm_and_out(z, kind)
    )


def _gated_norm_and_out(z: Sizes, kind: LayerKind) -> float:
    """A Gated DeltaNet's gated norm (float32 input, rsqrt, normalized and weighted copies,
    float32 z and silu(z)) and ``out_proj``'s input."""
    t, c, values = z.tokens, z.dtype_bytes, z.linear_value_heads * z.linear_value_dim
    norm = (3 * FP32 + (1 + (not z.frozen)) * c) * values * t + FP32 * z.linear_value_heads * t
    return norm + c * values * t * z.keeps(kind, "out")


def _shared_expert(z: Sizes, per_token: int) -> float:
    return per_token * z.dtype_bytes * z.tokens if z.shared_inter else 0.0


def _feed_forward_no_ac(z: Sizes, kind: LayerKind) -> float:
    t, c = z.tokens, z.dtype_bytes
    if kind[1] != "moe":
        return c * z.hidden * t * z.keeps(kind, "mlp") + (3 + z.keeps(kind, "down")) * c * z.ffn * t
    # the shared expert: its SwiGLU saves, and its output and sigmoid(gate) for their product
    return (
        c * z.hidden * t * (not z.frozen)
        + moe_bytes_no_ac(z)
        + _shared_expert(z, 4 * z.shared_inter + z.hidden + 1)
    )


def _hybrid_block_no_ac(z: Sizes, kind: LayerKind) -> float:
    mixer = (
        _gated_attention_no_ac(z, kind) if kind[0] == "gated_attention" else _linear_attention_no_ac(z, kind)
    )
    return 2 * _zero_centred_norm(z) + mixer + _feed_forward_no_ac(z, kind) + lora_bytes_no_ac(z, kind)


def _hybrid_block_op_ac(z: Sizes, tp: int, kind: LayerKind) -> float:
    t, c = z.tokens, z.dtype_bytes
    if kind[0] == "gated_attention":  # q (with its gate), k, v; SDPA's output and logsumexp
        mixer = c * (3 * z.q_heads + 2 * z.kv_heads) * z.head_dim * t + FP32 * z.q_heads * t
    else:  # the six projections, the delta rule's output and states (and CP's, ``hybrid_cp``)
        keys, values = linear_channels(z)
        mixer = c * (2 * keys + 3 * values + 2 * z.linear_value_heads) * t + delta_rule_states(z)
        if z.fla:  # its kept outputs: normed q and k, and the summed decay
            mixer += (c * 2 * keys + FP32 * z.linear_value_heads) * t
        passing = state_passing(z)
        mixer += passing.kept_per_op() if passing else 0.0
    if kind[1] == "moe":
        mlp = _experts_op_ac(z, kind) + _shared_expert(z, 2 * z.shared_inter + z.hidden + 1)
    else:
        mlp = 2 * c * z.ffn * t
    out_proj = 2 * c * z.hidden * t  # the mixer's out projection, down_proj (or the experts' weighted sum)
    block_input = c * z.hidden * t / z.sp_shards
    return mixer + mlp + out_proj + block_input + _collectives_op_ac(z, tp, kind) + lora_bytes_op_ac(z, kind)


def _hybrid_block_weight_output_grads(z: Sizes, kind: LayerKind) -> float:
    """Projections' outputs (``c``); the zero-centred norms' products with (1 + w) are float32;
    a Gated DeltaNet's convolution output (its taps), gated norm product and the two float32
    decay terms A_log and dt_bias enter."""
    t, c = z.tokens, z.dtype_bytes
    norms = 2 * FP32 * z.hidden / z.sp_shards
    if kind[0] == "gated_attention":
        heads = (z.q_heads + z.kv_heads) * z.head_dim
        mixer = (
            c * ((2 * z.q_heads + 2 * z.kv_heads) * z.head_dim + z.hidden) + FP32 * heads
        )  # q|gate, k, v, o
    else:
        keys, values = linear_channels(z)
        projections = 2 * keys + 2 * values + 2 * z.linear_value_heads + z.hidden
        mixer = c * (projections + 2 * keys + values + values) + 2 * FP32 * z.linear_value_heads
    if kind[1] == "moe":
        mlp = z.experts + z.top_k * (2 * z.moe_inter + z.hidden)
        mlp += 2 * z.shared_inter + z.hidden + 1 if z.shared_inter else 0
    else:
        mlp = 2 * z.ffn + z.hidden
    return t * (norms + mixer + c * mlp)


def _mixer_transient(z: Sizes, kind: LayerKind) -> float:
    """A Gated DeltaNet's backward: the delta rule's gradients of q, k, v, g and beta at once."""
    if kind[0] != "linear_attention":
        return 0.0
    keys, values = linear_channels(z)
    return z.tokens * (
        z.dtype_bytes * (2 * keys + values + z.linear_value_heads) + FP32 * z.linear_value_heads
    )


def chain_backward_bytes(z: Sizes, kind: LayerKind) -> float | None:
    """Under CP, a Gated DeltaNet block's activations at its chain's backward (``hybrid_cp``)
    beside all its saves: the delta rule's gradients and the gathered maps' beside them, less
    what the backward freed by then (the feed-forward's and the second norm's saves, the
    gated norm's, ``out_proj``'s input and the delta rule's states). None: no such moment."""
    passing = state_passing(z) if kind[0] == "linear_attention" else None
    if passing is None:
        return None
    freed = _feed_forward_no_ac(z, kind) + _zero_centred_norm(z) + _gated_norm_and_out(z, kind)
    return _mixer_transient(z, kind) + passing.backward_transient() - freed - delta_rule_states(z)


def formed_weight_grads(z: Sizes, kind: LayerKind) -> float:
    """The compute-dtype weight gradients a Gated DeltaNet block's backward has formed by its
    chain's (FSDP reduces them as the block's ends): the feed-forward's, ``out_proj``'s and
    ``in_proj_z``'s, per TP rank. Of a mixture, the router's and the shared expert's: under EP
    the routed experts are an FSDP group of their own, reduced by then, and without EP the dry
    run holds theirs apart from this moment (Qwen3.5-35B-A3B CP 4: +11% with them). Under
    LoRA the frozen weights form none (the adapters' are rank-sized, left out)."""
    if z.frozen:
        return 0.0
    values = z.linear_value_heads * z.linear_value_dim
    if kind[1] == "moe":
        feed_forward = z.hidden * (z.experts + 3 * z.shared_inter + 1)
    else:
        feed_forward = 3 * z.hidden * z.ffn
    return z.dtype_bytes * (feed_forward + 2 * values * z.hidden)


def block_bytes_no_ac(z: Sizes, kind: LayerKind, qk_norm: bool) -> float:
    """Bytes one block of ``kind`` saves for backward per micro-batch, without checkpointing."""
    if kind[0] == "attention":
        return _attention_block_no_ac(z, qk_norm, kind)
    return _hybrid_block_no_ac(z, kind)


def block_bytes_op_ac(z: Sizes, tp: int, kind: LayerKind) -> float:
    """Bytes one block of ``kind`` keeps under per-op selective checkpointing (matmul,
    attention, delta rule and collective outputs, and the block input)."""
    if kind[0] == "attention":
        return _attention_block_op_ac(z, tp, kind)
    return _hybrid_block_op_ac(z, tp, kind)


def block_weight_output_grad_bytes(z: Sizes, kind: LayerKind, qk_norm: bool) -> float:
    """The gradients at the outputs of one block's weighted ops (projections and norms), which
    a zero-bubble schedule keeps from a micro-batch's input step to its weight step."""
    if kind[0] == "attention":
        return _attention_block_weight_output_grads(z, qk_norm, kind)
    return _hybrid_block_weight_output_grads(z, kind)


def block_backward_transient_bytes(z: Sizes, kind: LayerKind) -> float:
    """The gradients alive inside one block's backward beside its saves (the feed-forward's,
    or a Gated DeltaNet's where larger)."""
    if kind[0] == "attention":
        return _feed_forward_transient(z, kind)
    return max(_feed_forward_transient(z, kind), _mixer_transient(z, kind))
