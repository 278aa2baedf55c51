"""What one compiled block saves for backward without checkpointing, by its kind. A compiled
block's forward and backward are one graph that the partitioner splits: it keeps the matmuls'
and the attention kernel's inputs and outputs and recomputes the elementwise work in backward
(norms, SiLU, RoPE, casts), so the float32 copies eager autograd keeps are gone. Read off the
saved tensors of one block of each kind compiled on fake tensors with inductor's
decompositions and partitioner (``dry_run.SAVES_AS_INDUCTOR``), and held against the compiled
dry run (``tests/test_planner.py``); ``c`` the compute dtype's bytes, heads per TP rank:

- every block keeps its input and the attention sublayer's output sum (``c``, sequence-sharded
  under SP), both norms' outputs the projections take (``c``, gathered under SP) and a float32
  rsqrt per row of each norm;
- softmax attention keeps the rotated q, k and v SDPA takes, its output and float32
  logsumexp, and with q/k norms their inputs and a float32 rsqrt per head; gated attention
  also keeps the gate beside the query and the gated output ``o_proj`` takes;
- a Gated DeltaNet keeps per convolution channel the left-padded copy, the convolution's
  output and SiLU's; z, the delta rule's output and the gated norm's output; the delta
  rule's float32 states; per value head the decay g (float32), the gated norm's rsqrt, a's
  projection and beta. Under CP (``parallel/state_passing.py``) the convolution runs on the
  concatenated channels of each range extended by the previous one's tail (both copies and
  the concatenated taps kept), g is not kept, and the state passing keeps what it keeps
  eagerly (the gathered maps, the chain's states, the map pass's segment states); packed
  documents add their int64 ids and a boolean mask per tap (per range under CP, and every
  range's last id);
- a SwiGLU keeps gate, up and their product; a mixture of experts its router's logits and
  float32 probabilities, the routing indices and weights, each routed row's token copy and
  its weighted output, per routed row a SwiGLU's; a shared expert its SwiGLU's, its output
  and its gate.

Where no formula was read off (LoRA's frozen blocks, a Gated DeltaNet with FLA's kernel) the
eager count stands: compiled saves no more than eager.
"""

from __future__ import annotations

from autopar.models.args import LayerKind
from autopar.planner.block_bytes import (
    FP32,
    Sizes,
    block_bytes_no_ac,
    block_bytes_op_ac,
    delta_rule_states,
    linear_channels,
    state_passing,
)


def block_saves(z: Sizes, kind: LayerKind, qk_norm: bool) -> float:
    """Bytes one block of ``kind`` saves per micro-batch without checkpointing, compiled
    (``Sizes.compiled``) or eager."""
    compiled = compiled_block_bytes(z, kind, qk_norm) if z.compiled else None
    return block_bytes_no_ac(z, kind, qk_norm) if compiled is None else compiled


def block_op_saves(z: Sizes, tp: int, kind: LayerKind) -> float:
    """Bytes one block of ``kind`` keeps under per-op checkpointing. Compiled, the partitioner
    keeps only what backward reads: under TP not the output projections' outputs (the
    mixer's, and a dense feed-forward's), whose all-reduce or reduce-scatter outputs it keeps
    (dry run, Qwen3-8B TP 2 + SP: 11% over before)."""
    kept = block_bytes_op_ac(z, tp, kind)
    if not z.compiled or tp == 1:
        return kept
    return kept - z.dtype_bytes * z.hidden * z.tokens * (1 if kind[1] == "moe" else 2)


def compiled_block_bytes(z: Sizes, kind: LayerKind, qk_norm: bool) -> float | None:
    """``block_saves`` of a compiled block; None where no formula was read off."""
    mixer, feed_forward = kind
    if z.frozen or (mixer == "linear_attention" and z.fla):
        return None
    if mixer == "attention":
        mixes = _attention(z, qk_norm, gated=False)
    elif mixer == "gated_attention":
        mixes = _attention(z, qk_norm=True, gated=True)
    else:
        mixes = _gated_deltanet(z)
    return _residuals_and_norms(z) + mixes + (_mixture(z) if feed_forward == "moe" else _swiglu(z, z.ffn))


def _residuals_and_norms(z: Sizes) -> float:
    t, c = z.tokens, z.dtype_bytes
    return (2 * c * z.hidden * t + 2 * FP32 * t) / z.sp_shards + 2 * c * z.hidden * t


def _attention(z: Sizes, qk_norm: bool, gated: bool) -> float:
    t, c = z.tokens, z.dtype_bytes
    query = z.q_heads * z.head_dim * t
    queries = (2 + qk_norm + 2 * gated) * c * query  # rotated q, output; q's norm input; gate, gated
    keys = (
        2 * c * z.sdpa_kv_heads * z.head_dim * t * z.kv_seq_factor + qk_norm * c * z.kv_heads * z.head_dim * t
    )
    statistics = FP32 * t * (z.q_heads + qk_norm * (z.q_heads + z.kv_heads))
    return queries + keys + statistics + c * z.mask


def _gated_deltanet(z: Sizes) -> float:
    t, c = z.tokens, z.dtype_bytes
    keys, values = linear_channels(z)
    channels, taps, sequences = 2 * keys + values, z.conv_width - 1, t // z.seq
    passing = state_passing(z)
    halo = 3 * taps * z.ranges if passing else taps  # the padded copy's; per range, the extended one's too
    convolution = c * channels * (3 * t + halo * sequences + (z.conv_width if passing else 0))
    gated = 3 * c * values * t  # z, the delta rule's output, the gated norm's
    per_head = 2 * c + FP32 * (1 if passing else 2)  # a and beta; g, and the norm's rsqrt
    # the ids (int64) and a boolean mask per tap; under CP per range, and every range's last id
    crossing = (3 * taps * z.ranges + 8 * z.cp_ranges) * sequences if passing else 0
    documents = 11 * t + crossing if z.documents else 0
    kept = convolution + gated + per_head * z.linear_value_heads * t + documents + delta_rule_states(z)
    return kept + (passing.saved() if passing else 0.0)


def _swiglu(z: Sizes, width: int, rows: int | None = None) -> float:
    return 3 * z.dtype_bytes * width * (z.tokens if rows is None else rows)


def _mixture(z: Sizes) -> float:
    t, c = z.tokens, z.dtype_bytes
    rows = z.top_k * t
    router = (FP32 + c) * z.experts * t + 12 * t
    routing = (FP32 + 8 + 16) * rows + (16 * rows if z.ep > 1 else 0)
    experts = 2 * c * rows * z.hidden + _swiglu(z, z.moe_inter, rows)
    shared = (_swiglu(z, z.shared_inter) + c * (z.hidden + 1) * t) if z.shared_inter else 0.0
    return router + routing + experts + shared
