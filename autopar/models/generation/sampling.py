"""Choosing the next token from logits: greedy at temperature 0, else sampled after
temperature, top-k and top-p (nucleus) filtering, in transformers' order."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0: greedy (argmax); above 0 the logits are divided by it and a token is drawn."""
    top_k: int = 0
    """Draw among the k likeliest tokens only; 0: all."""
    top_p: float = 1.0
    """Draw among the likeliest tokens whose probabilities reach p together; 1: all."""
    seed: int = 0
    """Seeds the draws: the same seed, prompts and model give the same tokens."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(b, V) fp32 logits scaled by the temperature, tokens outside top-k / top-p at -inf;
    worked in place on a copy of its own (a rollout's thousand rows make every (b, V) float32
    tensor GiBs: top-p holds six of them at once, sort indices counted twice)."""
    logits = logits.to(torch.float32, copy=True).div_(sampling.temperature)
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits.masked_fill_(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = probs.cumsum(dim=-1).sub_(probs) >= sampling.top_p  # the likelier tokens' mass reaches p
        del probs  # the likeliest token is never dropped
        logits.scatter_(-1, order, ordered.masked_fill_(drop, float("-inf")))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """(b,) the next token of each row from its last logits (b, V)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(b,) each chosen token's log-probability from its row's logits (b, V), fp32, at the
    sampling temperature (1 when greedy) over the whole vocabulary: what a training forward
    scores the token at (TRL divides its logits by the temperature too)."""
    scaled = logits.float() / (sampling.temperature if not sampling.greedy else 1.0)
    return scaled.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
