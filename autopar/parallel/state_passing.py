"""Context parallelism for Gated DeltaNet: the ranks pass delta-rule states, not tokens.

Under CP each rank holds one contiguous token range of every sequence, or two with the
head-tail load balancer (ranges r and 2 * cp - 1 - r of 2 * cp), the layout attention's CP
uses. The delta rule is affine in the state a range starts from (``delta_rule_map``), so a
rank's ranges collapse to fp32 maps [M | U] whose size does not depend on their length:

1. each rank forms its ranges' maps; one all-gather over the CP group gives every rank all
   of them, and each rank chains them in sequence order, S_{j+1} = M_j S_j + U_j, up to its
   own ranges' entry states (a few small matmuls);
2. each rank runs the kernel on its ranges from those entry states.

Autograd mirrors it: the kernel's backward yields the entry states' gradients, the chain's
backward turns them into the maps' gradients, and the all-gather's backward
(reduce-scatter) returns each map's to the rank that formed it. The causal convolution
before the rule reads the previous range's last ``width - 1`` tokens (all-gathered the same
way). Packed documents: a range whose first token starts a document takes no state, and a
document that starts inside a range zeroes its map's M, so state crosses ranks exactly
where a document does. No head count limits it: TP's head-sharded layers pass their own
heads' states.

Per GDN layer and step each rank receives the other ranges' maps, 4 HV dk (dk + dv) bytes
per sequence each, whatever the sequence length (``planner/block_bytes.py`` prices it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.models.qwen3_5.delta_rule import AUTOPAR, DeltaRuleKernel
from autopar.models.qwen3_5.gated_deltanet import DeltaRuleCore, causal_conv
from autopar.parallel.context_parallel import all_gather


def local_ranges(rank: int, size: int, head_tail: bool) -> list[int]:
    """The sequence-order indices of the token ranges a CP rank holds (``shard_sequence``'s layout)."""
    return [rank, 2 * size - 1 - rank] if head_tail else [rank]


class StatePassing:
    """``DeltaRuleCore.sequence`` under context parallelism: the convolution and the delta
    rule over this rank's ranges, reading the earlier ranges' tails and states."""

    def __init__(self, mesh: DeviceMesh, head_tail: bool, kernel: DeltaRuleKernel = AUTOPAR) -> None:
        self.mesh = mesh
        self.kernel = kernel
        """Forms the maps and runs the rule from the entry states (ours or FLA's)."""
        size = mesh.size()
        self.ranges = local_ranges(mesh.get_local_rank(), size, head_tail)
        gathered = [j for rank in range(size) for j in local_ranges(rank, size, head_tail)]
        self.row = {j: row for row, j in enumerate(gathered)}
        """Sequence-order range -> its row in an all-gather of every rank's ranges."""

    def _gather(self, pieces: list[Tensor]) -> Tensor:
        """Every rank's per-range tensors stacked (rows as ``self.row``); autograd-aware."""
        return all_gather(torch.stack(pieces).contiguous(), gather_dim=0, group=self.mesh)

    def _split(self, x: Tensor | None) -> list[Tensor | None]:
        return [None] * len(self.ranges) if x is None else list(x.chunk(len(self.ranges), dim=1))

    def convolve(
        self, inputs: tuple[Tensor, ...], weights: tuple[Tensor, ...], documents: Tensor | None
    ) -> tuple[Tensor, ...]:
        """``causal_conv`` of each input (B, S_local, C_i) as over the whole sequence: each
        range reads the previous range's last ``width - 1`` tokens (zeros before the first)."""
        halo = weights[0].shape[-1] - 1
        x = torch.cat(inputs, dim=-1)  # (B, S_local, C), one gather for all of them
        weight = torch.cat(weights, dim=0)
        pieces, docs = self._split(x), self._split(documents)
        tails = self._gather([p[:, -halo:] for p in pieces])  # (ranges, B, halo, C)
        doc_tails = None if documents is None else self._gather([d[:, -halo:] for d in docs])
        out = []
        for j, piece, piece_docs in zip(self.ranges, pieces, docs):
            if j == 0:  # zeros read off the gather, so that this rank's backward joins its reduce-scatter
                before = tails[self.row[0]] * 0
                before_docs = None if documents is None else torch.full_like(piece_docs[:, :halo], -1)
            else:
                before = tails[self.row[j - 1]]
                before_docs = None if documents is None else doc_tails[self.row[j - 1]]
            extended = torch.cat((before, piece), dim=1)
            extended_docs = None if documents is None else torch.cat((before_docs, piece_docs), dim=1)
            out.append(causal_conv(extended, weight, extended_docs)[:, halo:])
        return torch.cat(out, dim=1).split([t.shape[-1] for t in inputs], dim=-1)

    def delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, documents: Tensor | None
    ) -> Tensor:
        """``gated_delta_rule`` over this rank's ranges, each from the state the earlier
        ranges (on any rank) leave it."""
        split = [self._split(t) for t in (q, k, v, g, beta, documents)]
        per_range = list(zip(*split))  # (q, k, v, g, beta, documents) of each local range
        previous = [None] * len(self.ranges)
        if documents is not None:
            last = self._gather([d[:, -1] for d in split[5]])  # (ranges, B) each range's last document
            previous = [d[:, 0] if j == 0 else last[self.row[j - 1]] for j, d in zip(self.ranges, split[5])]
        maps = self._gather([self.kernel.map(*r[1:], before) for r, before in zip(per_range, previous)])
        entries = self._entry_states(maps, q.shape[-1])
        out = [
            self.kernel.rule(*r, entries[j], before) for j, r, before in zip(self.ranges, per_range, previous)
        ]
        return torch.cat(out, dim=1)

    def _entry_states(self, maps: Tensor, key_dim: int) -> dict[int, Tensor]:
        """Sequence-order range -> the fp32 state entering it. The first range's, zero, is
        read off the gather like the others, so that every rank's backward joins the
        gather's reduce-scatter (a rank holding only the first range would skip it)."""
        state = maps[self.row[0]][..., key_dim:] * 0
        entries = {0: state}
        for j in range(max(self.ranges)):
            move, offset = maps[self.row[j]].split((key_dim, maps.shape[-1] - key_dim), dim=-1)
            state = move @ state + offset
            entries[j + 1] = state
        return entries


def apply_state_passing(model: nn.Module, mesh: DeviceMesh, head_tail: bool) -> int:
    """Make every Gated DeltaNet layer of ``model`` span the CP ranks, with the kernel it
    has; returns how many."""
    cores = [m for m in model.modules() if isinstance(m, DeltaRuleCore)]
    for core in cores:
        core.sequence = StatePassing(mesh, head_tail, core.sequence.kernel)
    return len(cores)
