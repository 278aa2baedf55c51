"""Speculative decoding with Qwen3.5's multi-token-prediction head as the drafter.

A round: the head drafts k tokens, chained on its own outputs (vLLM's MTP proposer: draft i+1
reads the head's normed state of draft i and the embedding of draft i); the model verifies
them in one forward of k + 1 tokens continuing from its cached state, and the longest prefix
it agrees with is kept plus one token of its own (the bonus), so a round yields 1 to k + 1
tokens for one forward of the model. The model's state is then rolled back to the last kept
token: attention needs nothing (a position past it is masked, and written over later), the
Gated DeltaNet layers resume from their state after that token (the verification keeps one
per token, ``Decoder.rewind``). The next round first runs the head over the kept tokens with
the model's true states, overwriting what the drafts wrote in the head's own KV cache.

Greedy, the kept tokens are the model's argmax at each place: the output is plain greedy
decoding's. Sampled, a draft d drawn from the head's q is kept with probability
min(1, p(d) / q(d)) under the model's p, else replaced by a draw from max(0, p - q)
normalised (Leviathan et al. 2023): the tokens are distributed as the model's own samples.
Prompts are decoded one after another (each round keeps a different number of tokens).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from autopar.models.generation.generate import PREFILL_CHUNK, check_prompts
from autopar.models.generation.sampling import Sampling, filtered_logits, next_tokens
from autopar.models.generation.state import Decoder
from autopar.models.qwen import Qwen

ROW = slice(0, 1)
"""Each prompt decodes alone, in row 0 of its own decoder."""


@dataclass
class Acceptance:
    """How one prompt's speculation went."""

    drafted: int = 0
    """Tokens the head drafted."""
    accepted: int = 0
    """Drafted tokens the model kept."""
    forwards: int = 0
    """Forwards of the model that yielded tokens: the prefill's last and each verification
    (plain decoding: one per token)."""
    tokens: int = 0
    """New tokens."""

    def add_round(self, drafted: int, kept: int) -> None:
        """A verification of ``drafted`` drafts that kept ``kept`` tokens (the model's own last)."""
        self.drafted += drafted
        self.accepted += kept - 1
        self.forwards += 1

    def record(self) -> dict[str, float | int]:
        """The output JSONL's ``acceptance``: counts, the acceptance rate and tokens per forward."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rate": self.accepted / max(self.drafted, 1),
            "tokens_per_forward": self.tokens / max(self.forwards, 1),
        }


def draft(
    decoder: Decoder,
    hidden: torch.Tensor,
    following: torch.Tensor,
    start: int,
    count: int,
    sampling: Sampling,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``count`` drafts (count,) after the head catches up on the model's ``hidden`` (1, n, H)
    from position ``start`` with the ``following`` tokens (1, n); sampled, also the head's
    distributions they were drawn from (count, V)."""
    lm_head, device = decoder.model.lm_head, hidden.device
    if count == 0:  # the last token of the budget: nothing to draft
        return torch.zeros(0, dtype=torch.long, device=device), None
    state = decoder.head(hidden, following, ROW, torch.tensor([start], device=device))[:, -1:]  # (1, 1, H)
    position = start + hidden.shape[1] - 1
    drafts, probs = [], []
    for i in range(count):
        logits = lm_head(state[:, -1])  # (1, V)
        if sampling.greedy:
            token = logits.argmax(dim=-1)
        else:
            probs.append(filtered_logits(logits, sampling).softmax(dim=-1))
            token = torch.multinomial(probs[-1], 1, generator=generator)[:, 0]
        drafts.append(token)
        if i < count - 1:  # chained: the head's own state and its draft
            position += 1
            state = decoder.head(state, token[:, None], ROW, torch.tensor([position], device=device))
    return torch.cat(drafts), (torch.cat(probs) if probs else None)


def accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator,
) -> list[int]:
    """The tokens a round keeps: the accepted drafts (k,) and one of the model's, from its
    logits (k + 1, V) at the token before each draft and after the last."""
    if sampling.greedy:
        targets = logits.argmax(dim=-1)  # (k + 1,)
        agreed = int((targets[: len(drafts)] == drafts).cumprod(dim=0).sum())
        return [*drafts[:agreed].tolist(), int(targets[agreed])]
    probs = filtered_logits(logits, sampling).softmax(dim=-1)  # (k + 1, V)
    for i, token in enumerate(drafts.tolist()):
        p, q = probs[i, token], draft_probs[i, token]
        if torch.rand((), generator=generator, device=logits.device) * q > p:  # rejected: p/q odds
            residual = (probs[i] - draft_probs[i]).clamp(min=0)
            residual = residual if residual.sum() > 0 else probs[i]
            resampled = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return [*drafts[:i].tolist(), int(resampled)]
    return [*drafts.tolist(), int(torch.multinomial(probs[-1], 1, generator=generator))]


def prefill(decoder: Decoder, prompt: Sequence[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's hidden states (1, P, H) and its last logits (1, V), ``chunk`` tokens a forward."""
    device = decoder.cursor.positions.device
    tokens = torch.tensor([list(prompt)], device=device)  # (1, P)
    states = []
    for start in range(0, tokens.shape[1], chunk):
        hidden, logits = decoder.hidden(
            tokens[:, start : start + chunk], ROW, torch.tensor([start], device=device)
        )
        states.append(hidden)
    return torch.cat(states, dim=1), logits[:, -1]


def speculate_one(
    model: Qwen,
    prompt: Sequence[int],
    max_new_tokens: int,
    draft_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    stop_ids: Collection[int],
    prefill_chunk: int,
) -> tuple[list[int], Acceptance]:
    """One prompt's new tokens and how its speculation went."""
    device = next(model.parameters()).device
    decoder = Decoder(model, 1, len(prompt) + max_new_tokens)
    decoder.cursor.positions = decoder.cursor.positions.to(device)
    hidden, last = prefill(decoder, prompt, prefill_chunk)
    new = next_tokens(last, sampling, generator).tolist()
    stats = Acceptance(forwards=1)
    following = torch.tensor([[*prompt[1:], new[0]]], device=device)  # (1, P): the token after each state
    start, position = 0, len(prompt)  # of hidden's first state; of the last new token
    while new[-1] not in stop_ids and len(new) < max_new_tokens:
        count = min(draft_tokens, max_new_tokens - len(new) - 1)
        drafts, draft_probs = draft(decoder, hidden, following, start, count, sampling, generator)
        chunk = torch.tensor([new[-1:]], device=device)
        chunk = torch.cat((chunk, drafts[None]), dim=1)  # (1, count + 1)
        states, logits = decoder.hidden(chunk, ROW, torch.tensor([position], device=device), keep_steps=True)
        kept = accept(drafts, draft_probs, logits[0], sampling, generator)
        decoder.rewind(ROW, len(kept))
        stats.add_round(count, len(kept))
        hidden, following = states[:, : len(kept)], torch.tensor([kept], device=device)
        start, position = position, position + len(kept)
        new.extend(kept)
    ends = [i for i, token in enumerate(new) if token in stop_ids]
    new = new[: ends[0] + 1] if ends else new[:max_new_tokens]
    stats.tokens = len(new)
    return new, stats


def speculative_generate(
    model: Qwen,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    draft_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Collection[int] = (),
    prefill_chunk: int = PREFILL_CHUNK,
) -> tuple[list[list[int]], list[Acceptance]]:
    """``generate``'s tokens (greedy: the same; sampled: the same distribution) drafted
    ``draft_tokens`` at a time by the model's MTP head, and each prompt's ``Acceptance``."""
    if getattr(model, "mtp", None) is None:
        raise ValueError("speculative decoding drafts with the model's MTP head, and this model has none")
    if draft_tokens < 1:
        raise ValueError(f"draft_tokens={draft_tokens} must be at least 1")
    check_prompts(prompts, max_new_tokens, model.args.max_position_embeddings)
    if max_new_tokens < 1:
        return [[] for _ in prompts], [Acceptance() for _ in prompts]
    sampling = Sampling(temperature, top_k, top_p, seed)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    results = [
        speculate_one(model, p, max_new_tokens, draft_tokens, sampling, generator, stop_ids, prefill_chunk)
        for p in prompts
    ]
    return [new for new, _ in results], [stats for _, stats in results]
