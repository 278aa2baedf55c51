"""Qwen3.5 / 3.6, dense and MoE: the hybrid decoder, single-device and plan-free.

Three Gated DeltaNet layers (``linear_attn``) to one gated attention layer (``self_attn``),
as ``ModelArgs.mixer`` says per layer. It is ``Qwen`` with other blocks and a zero-centred
final norm, so embedding, head, pipeline pruning and the forward's contract (documents,
positions, routing statistics) are the same code.

Numerics follow HF's ``modeling_qwen3_5``: RMSNorms scale by (1 + w) in fp32; attention
projects a sigmoid gate beside each query head; RoPE turns the first
``partial_rotary_factor`` of each head's dims; the mixture of experts adds a shared expert
weighted by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.models.args import ModelArgs
from autopar.models.moe import MoE
from autopar.models.qwen import MLP, Attention, Block, Qwen, RMSNorm, dense_start
from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet
from autopar.models.qwen3_5.mtp import MTPHead, MTPMode, NextTokens, keep_mask


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), all in fp32, cast at the end; the weight starts at 0."""

    def forward(self, x: Tensor) -> Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(Attention):
    """Grouped-query attention with q/k norms, partial RoPE and a sigmoid output gate per
    query head: ``q_proj`` yields [query | gate] for each head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(
            args,
            queries=2,
            rotary_dim=args.rotary_dim,
            output_bias=args.attention_bias,
            norm=ZeroCenteredRMSNorm,
        )

    def forward(self, x: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        query, gate = (
            self.q_proj(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        )  # (B, S, Hq, D)
        out = self.attend(x, query, positions, mask) * torch.sigmoid(gate)  # (B, S, Hq, D)
        return self.o_proj(out.reshape(bsz, seqlen, -1))  # (B, S, H)


class SharedExpertMoE(MoE):
    """Routed experts (softmax top-k, renormalised) plus a shared SwiGLU expert that every
    token runs, weighted by sigmoid(shared_expert_gate(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        routed, stats = super().forward(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared, stats


class HybridBlock(Block):
    """Pre-norm block whose token mixer is a Gated DeltaNet (``linear_attn``) or gated
    attention (``self_attn``), as HF names them; zero-centred norms, a shared-expert MoE."""

    norm_type = ZeroCenteredRMSNorm
    moe_type = SharedExpertMoE

    def add_mixer(self, args: ModelArgs, layer: int) -> None:
        linear = args.mixer(layer) == "linear_attention"
        self.linear_attn = GatedDeltaNet(args) if linear else None
        self.self_attn = None if linear else GatedAttention(args)


def hybrid_start(args: ModelArgs, name: str, out: Tensor, generator: torch.Generator) -> Tensor:
    """Qwen3.5's starts (HF's), filling ``out`` (fp32): zero-centred norms 0, the gated norm
    1, ``dt_bias`` 1, ``A_log`` the log of U(0.01, 16), the convolutions uniform within
    1 / sqrt(kernel width) (HF's conv1d default); every other tensor as ``dense_start``."""
    leaf = name.rpartition(".")[2]
    if name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
        return out.fill_(1.0)
    if name.endswith("norm.weight"):
        return out.zero_()
    if leaf == "A_log":
        return out.uniform_(0.01, 16.0, generator=generator).log_()
    if leaf.startswith("conv_"):
        bound = 1.0 / math.sqrt(out.shape[-1])
        return out.uniform_(-bound, bound, generator=generator)
    return dense_start(args, name, out, generator)


class Qwen35(Qwen):
    """The Qwen3.5 decoder: ``Qwen`` with hybrid blocks and a zero-centred final norm, and,
    when ``args.mtp_num_hidden_layers > 0``, the multi-token-prediction head ``mtp`` (see ``mtp.py``)."""

    block_type = HybridBlock
    start = staticmethod(hybrid_start)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.mtp: MTPHead | None = (
            MTPHead(args, self.make_block, self.make_norm) if args.mtp_num_hidden_layers else None
        )

    def forward(
        self,
        tokens: Tensor,
        routing: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        documents: Tensor | None = None,
        mtp: MTPMode = "off",
        upcoming: NextTokens | None = None,
    ) -> Tensor | tuple[Tensor, Tensor] | tuple[object, Tensor]:
        """``Qwen.forward``; with ``mtp`` "on" or "detached", ``(that output, the head's
        logits (B, S, V))`` from the same pass: a training step gets both losses from one
        forward of the whole module (the way FSDP gathers and frees its weights), the head's
        experts' routing statistics added to the trunk's. "detached": the head's loss trains
        only the head (``mtp_logits_from``). ``upcoming``: the next tokens as built on the
        whole sequences, when ``tokens`` are only a part of them (context parallel); None:
        ``NextTokens.of(tokens, documents)``.

        A pipeline stage (no ``lm_head``, or no ``embed_tokens``) passes on its hidden states
        and the embeddings of the next tokens stacked as one (2B, S, H) tensor: the head on
        the last stage reads the embedding that only the first holds, and its gradient flows
        back through every stage to it, as on one device."""
        if mtp == "off":
            return super().forward(tokens, routing, positions=positions, documents=documents)
        if self.embed_tokens is None:  # a later pipeline stage: the stacked states passed on
            both, keep = tokens, keep_mask(documents)  # (2B, S, H), (B, S)
        else:
            upcoming = NextTokens.of(tokens, documents) if upcoming is None else upcoming
            both = self.embed_tokens(torch.cat([tokens, upcoming.ids]))  # (2B, S, H)
            keep = upcoming.keep
        embedded, next_embedded = both.chunk(2)  # each (B, S, H)
        hidden, routing = self.decode(embedded, routing, positions=positions, documents=documents)
        if self.lm_head is None:  # a pipeline stage before the last
            return self.with_routing(torch.cat([hidden, next_embedded]), routing, hidden)  # (2B, S, H)
        detach = mtp == "detached"
        head_hidden, head_routing = self._head_hidden(
            hidden, next_embedded, keep, positions, documents, detach
        )
        if detach:  # the output head's weight learns from the main loss only
            logits = self.lm_head(hidden)  # (B, S, V)
            head_logits = self._head().detached_output(head_hidden, self.lm_head.weight)  # (B, S, V)
        else:  # one call of the output head for both, so FSDP sees one use of its weight
            logits, head_logits = self.lm_head(torch.cat([hidden, head_hidden])).chunk(2)  # each (B, S, V)
        if head_routing is not None:
            routing = head_routing if routing is None else routing + head_routing
        return self.with_routing(logits, routing, hidden), head_logits

    def mtp_logits(self, tokens: Tensor, documents: Tensor | None = None) -> Tensor:
        """The head's logits (B, S-1, V) for tokens (B, S): position i predicts token i+2 from
        the trunk's state at i and token i+1. Under ``documents`` (B, S) nothing crosses a
        document's end (a document's last position predicts nothing of use)."""
        self._head()  # before the trunk's work
        hidden, _ = self.trunk(tokens, documents=documents)
        return self.mtp_logits_from(hidden, tokens, documents)[0][:, :-1]

    def mtp_logits_from(
        self, hidden: Tensor, tokens: Tensor, documents: Tensor | None = None, detach: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The head's logits (B, S, V) from the trunk's final-normed ``hidden`` (B, S, H)
        (``trunk``), and the routing statistics of its experts. ``detach``: the head's loss
        trains only the head (no gradient into the trunk, the shared embedding or the shared
        output head; Megatron's ``mtp_detach_heads``). Outside a training step: a step
        wrapped by FSDP gets the same from ``forward(..., mtp=...)``. The last position's
        logits predict nothing (``mtp_logits`` leaves them out)."""
        upcoming = NextTokens.of(tokens, documents)
        next_embedded = self.embed_tokens(upcoming.ids)  # (B, S, H)
        head_hidden, routing = self._head_hidden(
            hidden, next_embedded, upcoming.keep, None, documents, detach
        )
        weight = self.lm_head.weight.detach() if detach else self.lm_head.weight
        return F.linear(head_hidden, weight), routing

    def _head_hidden(
        self,
        hidden: Tensor,
        next_embedded: Tensor,
        keep: Tensor | None,
        positions: Tensor | None,
        documents: Tensor | None,
        detach: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The head's normed states (B, S, H) from the trunk's states and the embeddings of
        the next tokens (B, S, H) each (``keep`` (B, S): ``NextTokens.keep``), and its
        routing statistics."""
        head = self._head()
        if detach:
            hidden, next_embedded = hidden.detach(), next_embedded.detach()
        gate = None if keep is None else keep.unsqueeze(-1).to(next_embedded.dtype)  # (B, S, 1)
        return head(hidden, next_embedded, gate, positions, documents)

    def _head(self) -> MTPHead:
        if self.mtp is None:
            raise ValueError(
                "this model has no multi-token-prediction head; load one with from_hf(..., mtp=True) "
                "from a Qwen3.5 folder that carries mtp.* tensors"
            )
        return self.mtp
