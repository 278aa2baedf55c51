"""Qwen3.5's multi-token-prediction head, as serving engines run it for speculative decoding
(vLLM ``qwen3_5_mtp.py``, Megatron's ``multi_token_prediction.py``).

At position i the head joins what the model knew there, its final-normed hidden state h[i],
with the next token x[i+1]: ``fc(cat[pre_fc_norm_embedding(embed(x[i+1])),
pre_fc_norm_hidden(h[i])])``, runs ``mtp_num_hidden_layers`` full-attention Qwen3.5 decoder layers at the
model's own rotary positions, ``norm``, and the model's output head: logits for x[i+2]. The
embedding and the output head are the model's (released checkpoints carry no copy), so the
head's own tensors are ``fc``, the three norms and its layers, named as HF's ``mtp.*``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.args import ModelArgs
from autopar.models.qwen import document_mask, document_positions, split_output

MTPMode = Literal["off", "on", "detached"]
"""What ``Qwen35.forward`` runs of the head: nothing, the head with gradients into the whole
model, or the head on detached inputs (its loss trains the head alone)."""


def head_layer_args(args: ModelArgs) -> ModelArgs:
    """``args`` for building one of the head's layers as layer 0 of a model: full attention
    whatever the trunk's layer pattern, experts (with the shared one) when the model has any,
    as vLLM builds ``Qwen3_5DecoderLayer(layer_type="full_attention")``."""
    return dataclasses.replace(
        args,
        num_hidden_layers=1,
        layer_types=("full_attention",),
        mlp_only_layers=(),
        decoder_sparse_step=1,
        mtp_num_hidden_layers=0,
    )


class MTPHead(nn.Module):
    """The head's own tensors and its forward from the trunk's hidden states to the hidden
    states that the model's output head turns into logits for two tokens ahead.

    ``make_block(args, layer)`` and ``make_norm(args)`` are the model's own (``Qwen35``'s), so
    the head's layers and norms are the family's classes, not copies."""

    def __init__(
        self,
        args: ModelArgs,
        make_block: Callable[[ModelArgs, int], nn.Module],
        make_norm: Callable[[ModelArgs], nn.Module],
    ) -> None:
        super().__init__()
        self.next_gate = NextTokenGate()
        self.detached_output = DetachedOutput()
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.pre_fc_norm_embedding = make_norm(args)
        self.pre_fc_norm_hidden = make_norm(args)
        layer_args = head_layer_args(args)
        self.layers = nn.ModuleDict(
            {str(i): make_block(layer_args, 0) for i in range(args.mtp_num_hidden_layers)}
        )
        self.norm = make_norm(args)

    def forward(
        self,
        hidden: torch.Tensor,
        upcoming: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden (B, S, H): the trunk's final-normed states; upcoming (B, S, H): the
        embedding of the token after each (the last position's is of no use: nothing is two
        ahead of it, and causal attention keeps it from the others). ``keep`` (B, S, 1): 0
        where the next token starts another document (``NextTokens.keep``); ``positions`` the
        hidden states' own (the trunk's; decoding continues a sequence), ``documents`` (B, S)
        keep attention and positions within a document.
        Returns the normed states (B, S, H) and the routing statistics of its experts.

        The sequence stays S long (not S-1) so a plan that splits it (sequence parallel)
        splits the head's as the trunk's."""
        if keep is not None:
            upcoming = self.next_gate(upcoming, keep)
        x = torch.cat([self.pre_fc_norm_embedding(upcoming), self.pre_fc_norm_hidden(hidden)], dim=-1)
        h = self.fc(x)  # (B, S, H)
        mask = None
        if documents is not None:
            mask = document_mask(documents)
            if positions is None:
                positions = document_positions(documents)
        routing = None
        for layer in self.layers.values():
            h, stats = split_output(layer(h, positions, mask, documents))
            if stats is not None:
                routing = stats if routing is None else routing + stats
        return self.norm(h), routing


class DetachedOutput(nn.Module):
    """The model's output head on the head's states with its weight detached (``mtp.detach``:
    the head's loss leaves the shared output head alone). A module of its own (no weights) so
    a plan can lay out its input and logits as it does the output head's."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, weight.detach())  # (B, S, V)


class NextTokenGate(nn.Module):
    """``upcoming * keep``: zeroes the embedding of a token that starts another document. A
    module of its own (no weights) so a plan can give ``keep`` (B, S, 1), which the forward
    builds whole, the layout of the embeddings (sequence-sharded under sequence parallel)."""

    def forward(self, upcoming: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return upcoming * keep


class NextTokens(NamedTuple):
    """What the head reads of the token after each position, built on whole sequences
    (``of``): a plan that splits the sequence (context parallel) splits these as it splits
    the tokens, since at the end of a rank's part the next token lies in another's."""

    ids: torch.Tensor
    """(B, S) the token after each (``next_tokens``)."""
    keep: torch.Tensor | None
    """(B, S) bool: the next token lies in this one's document (``keep_mask``); None
    without documents."""

    @staticmethod
    def of(tokens: torch.Tensor, documents: torch.Tensor | None = None) -> NextTokens:
        return NextTokens(next_tokens(tokens), keep_mask(documents))


def next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """(B, S) the token after each: ``tokens[:, 1:]`` and the last token again in the last
    position (whose head output predicts nothing), so the head's inputs keep the sequence's
    length and the embedding runs once on ``cat([tokens, next_tokens(tokens)])``."""
    return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)


def keep_mask(documents: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S) bool: True where token i+1 lies in token i's document, False where it starts
    another (and at the last position); None without ``documents``. Zeroing the embedding
    there (as Megatron's per-sequence roll leaves no token) keeps every position within its
    document; those positions' logits are never a target's (the token two ahead lies
    elsewhere)."""
    if documents is None:
        return None
    same = documents[:, 1:] == documents[:, :-1]  # (B, S-1)
    return torch.cat([same, torch.zeros_like(same[:, :1])], dim=1)  # (B, S)
