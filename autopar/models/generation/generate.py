"""Generation: prefill each prompt into its row of the state (consecutive prompts of one
length together), then decode all rows together one token per step, each at its own position,
until every row stops or reaches its budget."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch

from autopar.models.generation.sampling import Sampling, next_tokens, token_logps
from autopar.models.generation.state import Decoder
from autopar.models.qwen import Qwen

PREFILL_CHUNK = 512
"""Prompt tokens run per forward during prefill; each chunk continues from the state."""
COMPILED_LENGTHS = 256
"""A compiled decoder's cache holds a multiple of this many positions, so that calls of
similar lengths (and batch) reuse one compiled step instead of compiling their own."""


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, limit: int) -> None:
    """One line for a prompt that cannot run: empty, or too long for ``limit`` positions."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; give it at least one token")
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, and with max_new_tokens={max_new_tokens} passes the "
                f"model's limit of {limit} positions (max_position_embeddings); shorten it or lower max_new_tokens"
            )


def same_lengths(prompts: Sequence[Sequence[int]]) -> list[slice]:
    """The runs of consecutive prompts of one length: each is prefilled as one batch."""
    runs, first = [], 0
    for row in range(1, len(prompts) + 1):
        if row == len(prompts) or len(prompts[row]) != len(prompts[first]):
            runs.append(slice(first, row))
            first = row
    return runs


def distinct(prompts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in order of first appearance, and each prompt's index among them:
    a group's copies of one prompt (GRPO's ``num_generations``) need one prefill, not one each."""
    index: dict[tuple[int, ...], int] = {}
    where = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return list(index), where


def prefill(decoder: Decoder, prompts: Sequence[Sequence[int]], rows: slice, chunk: int) -> torch.Tensor:
    """Run ``prompts`` (of one length) into ``rows`` of the state, ``chunk`` tokens a forward;
    their last logits (b, V), the only ones computed."""
    device = decoder.cursor.positions.device
    tokens = torch.tensor([list(p) for p in prompts], device=device)  # (b, S)
    for start in range(0, tokens.shape[1], chunk):
        piece = tokens[:, start : start + chunk]
        logits = decoder.last_logits(piece, rows, torch.full((len(prompts),), start, device=device))
    return logits


class Generated(NamedTuple):
    tokens: list[list[int]]
    """Each prompt's new tokens."""
    logps: list[list[float]]
    """Each new token's log-probability under the model at the sampling temperature (1 when
    greedy), of the unfiltered distribution (top-k / top-p only choose among tokens)."""


def generate(
    model: Qwen,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Collection[int] = (),
    prefill_chunk: int = PREFILL_CHUNK,
    compiled: bool = False,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Each prompt's new tokens: up to ``max_new_tokens``, ending at the first of ``stop_ids``
    (kept). Greedy at ``temperature`` 0, else sampled (see ``Sampling``). ``compiled``: the
    decode step runs through ``torch.compile`` (``Decoder.step``). ``on_token(row, token)``
    hears each token as it is chosen (streaming)."""
    sampling = Sampling(temperature, top_k, top_p, seed)
    return sample(
        model, prompts, max_new_tokens, sampling, stop_ids, prefill_chunk, compiled, on_token
    ).tokens


def sample(
    model: Qwen,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Collection[int] = (),
    prefill_chunk: int = PREFILL_CHUNK,
    compiled: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    multiple: int = 1,
) -> Generated:
    """``generate``'s tokens, and each one's log-probability (``Generated``). ``whole``: makes
    the model's last logits whole over the vocabulary where a plan splits them; ``agree``: the
    tokens every rank sampling the same rows goes on with (one rank's), so that ranks whose
    forwards exchange tokens (expert parallelism) stop at the same step; ``multiple``: every
    forward runs a multiple of this many tokens (``Decoder``; a plan that splits them evenly)."""
    check_prompts(prompts, max_new_tokens, model.args.max_position_embeddings)
    if not prompts or max_new_tokens < 1:
        return Generated([[] for _ in prompts], [[] for _ in prompts])
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    length = max(len(p) for p in prompts) + max_new_tokens
    if compiled:  # lengths of the same multiple share the compiled step's shapes
        length = min(-(-length // COMPILED_LENGTHS) * COMPILED_LENGTHS, model.args.max_position_embeddings)
    decoder = Decoder(model, len(prompts), length, compiled, multiple)
    decoder.cursor.positions = decoder.cursor.positions.to(device)
    unique, where = distinct(prompts)  # prefilled into the first rows, then copied to their own
    last = torch.cat([prefill(decoder, unique[rows], rows, prefill_chunk) for rows in same_lengths(unique)])
    last = whole(last) if whole is not None else last
    if len(unique) < len(prompts):
        spread = torch.tensor(where, device=device)
        decoder.spread(spread)
        last = last[spread]
    position = torch.tensor([len(p) for p in prompts], device=device)  # (B,) where the next token goes
    new: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        chosen = next_tokens(last, sampling, generator)  # (B,)
        chosen = agree(chosen) if agree is not None else chosen
        chosen_logps = token_logps(last, chosen, sampling)
        for row, (token, logp) in enumerate(zip(chosen.tolist(), chosen_logps.tolist())):
            if not done[row]:
                new[row].append(token)
                logps[row].append(logp)
                done[row] = token in stop_ids
                if on_token is not None:
                    on_token(row, token)
        if all(done) or step == max_new_tokens - 1:
            break
        last = decoder.step(chosen, position)
        last = whole(last) if whole is not None else last
        position = position + 1
    return Generated(new, logps)
