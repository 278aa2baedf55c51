"""What context parallelism adds to a Gated DeltaNet layer (``parallel/state_passing.py``),
per rank and micro-batch, beside what the layer costs on its local tokens.

Each of the rank's ``ranges`` token ranges (two under the head-tail load balancer, else one)
forms its map [M | U], float32 ``dk x (dk + dv)`` per value head, by running the delta-rule
kernel from an identity with ``dk + dv`` state columns; that pass saves the kernel's inputs
(the main pass's own tensors) and one such state per ``SEGMENT`` tokens. One all-gather hands
every rank all ``cp_ranges = cp * ranges`` maps, which the chain S_{j+1} = M_j S_j + U_j keeps
for backward with each state it forms (``dk x dv``), up to the rank's last range: the rank
holding the last range (rank 0 under head-tail, the last rank without) keeps all
``cp_ranges`` maps and ``cp_ranges - 1`` states, the most. The causal convolution's halo
(3 tokens per range) is counted with the convolution (``block_bytes``).

Measured on one Gated DeltaNet under the fake process group (9B, 4096 tokens, CP 8: the saves
are these to the byte), its backward peaks in the chain's: the gathered maps' gradient, one
select's zero-filled gradient and their out-of-place sum, three times the gathered maps
beside them (the dry run's autograd; an in-place sum would keep two). The kernel's own
segment recompute is a custom op whose working set the dry run does not run (fake kernel),
as without CP.

Per-op checkpointing keeps the map pass's outputs (its states and the local maps) and the
chain's matmul outputs, and gathers the maps again in backward (CP all-gathers are
recomputed, ``parallel.activation_checkpoint``).

Time: the all-gather moves ``cp_ranges - ranges`` maps into each rank forward and the
reduce-scatter as many back; the map pass costs the kernel's FLOPs per token with ``dk + dv``
value columns and no outputs (``map_flops_per_token``), and the chain a ``dk x dk`` by
``dk x dv`` product per range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.models.qwen3_5.delta_rule import CHUNK, SEGMENT
from autopar.models.qwen3_5.fla_delta_rule import CHUNK as FLA_CHUNK

FP32 = 4


@dataclass(frozen=True)
class StatePassing:
    """One rank's share of a Gated DeltaNet's state passing, per micro-batch."""

    batch: int  # sequences per micro-batch
    value_heads: int  # per TP rank
    key_dim: int
    value_dim: int
    ranges: int  # this rank's token ranges of each sequence
    cp_ranges: int  # every CP rank's: cp * ranges
    range_tokens: int  # tokens of one range
    fla: bool = False  # FLA's kernels: the map pass keeps FLA's tensors, no segment states
    segment: int = SEGMENT  # ours: tokens per state the map pass keeps
    key_heads: int = 0  # per TP rank (FLA's normed keys)
    dtype_bytes: int = 2

    @property
    def map_bytes(self) -> float:
        """One range's [M | U] for the micro-batch, float32."""
        return FP32 * self.batch * self.value_heads * self.key_dim * (self.key_dim + self.value_dim)

    @property
    def state_bytes(self) -> float:
        """One delta-rule state for the micro-batch, float32."""
        return FP32 * self.batch * self.value_heads * self.key_dim * self.value_dim

    def map_pass_states(self) -> float:
        """What the map pass keeps for backward beyond the main pass's inputs: ours, its state
        per ``SEGMENT`` of each local range (``dk + dv`` columns); FLA's, its per-token tensors
        (``_fla_map_pass``), its [0 | v] values and its [I | 0] entry."""
        if self.fla:
            columns = self.key_dim + self.value_dim
            values = self.dtype_bytes * self.value_heads * columns * self.batch * self.range_tokens
            return self._fla_map_pass() + self.ranges * (values + self.map_bytes)
        return self.ranges * math.ceil(self.range_tokens / self.segment) * self.map_bytes

    def _fla_map_pass(self) -> float:
        """FLA's map pass, per local range: k normed (standing in for q, and as k) with their
        float32 reciprocal norms, the summed decay (float32) and the per-chunk solve A."""
        c = self.dtype_bytes
        per_token = c * (2 * self.key_heads * self.key_dim + self.value_heads * FLA_CHUNK)
        per_token += FP32 * (2 * self.key_heads + self.value_heads)
        return self.ranges * self.batch * self.range_tokens * per_token

    def saved(self) -> float:
        """What the layer saves for backward beyond its local tokens' saves (no checkpointing)."""
        return (
            self.cp_ranges * self.map_bytes + (self.cp_ranges - 1) * self.state_bytes + self.map_pass_states()
        )

    def kept_per_op(self) -> float:
        """What per-op checkpointing keeps of it: the map pass's outputs (its states and this
        rank's maps; FLA's, its per-token tensors and the output it computes unused) and the
        chain's matmul outputs; the gathered maps are gathered again."""
        if self.fla:
            unused = self.dtype_bytes * self.value_heads * (self.key_dim + self.value_dim)
            return (
                self._fla_map_pass() + self.ranges * self.batch * self.range_tokens * unused + self.op_only()
            )
        return self.map_pass_states() + self.op_only()

    def op_only(self) -> float:
        """What per-op checkpointing keeps that the layer does not save without it."""
        return self.ranges * self.map_bytes + (self.cp_ranges - 1) * self.state_bytes

    def backward_transient(self) -> float:
        """The chain's backward beside the saved maps: their accumulated gradient, a select's
        zero-filled one and the sum of the two."""
        return 3 * self.cp_ranges * self.map_bytes

    def received_bytes(self) -> float:
        """What the maps' all-gather brings into this rank (its reduce-scatter sends as much)."""
        return (self.cp_ranges - self.ranges) * self.map_bytes


def map_flops_per_token(value_heads: int, key_dim: int, value_dim: int) -> float:
    """Forward FLOPs per token of the map pass, counted as ``metrics.delta_rule_flops`` counts
    the kernel's, with ``dk + dv`` state columns and no outputs: the state read and write
    (2 * dk * c each) and, within a chunk, the key Gram row and the read of the corrections
    (2 * CHUNK * (dk + c)); c = dk + dv."""
    columns = key_dim + value_dim
    return value_heads * (4 * key_dim * columns + 2 * CHUNK * (key_dim + columns))


def chain_flops(cp_ranges: int, value_heads: int, key_dim: int, value_dim: int) -> float:
    """Forward FLOPs of one chain per sequence: a ``dk x dk`` by ``dk x dv`` product per range."""
    return (cp_ranges - 1) * value_heads * 2 * key_dim * key_dim * value_dim
