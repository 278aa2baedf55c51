"""The sampler's speculative rows: tokens/s of MTP speculative decoding (k drafts per
verification) against plain greedy decoding of the same model, with the head's acceptance
and tokens per forward; ``bench_generate --speculative 1 2`` adds them to its table. Each
prompt is generated alone (batch 1), ``--new`` tokens with no stop token; the time is the
whole generation's (prefill included: the same work in both), the fastest of ``--repeat``,
plain and speculative taking turns.

Two heads on the debug Qwen3.5 with a one-layer MTP head, fp32 on CPU, batch 1:

- ``random``: the initial weights (``init_weights``), on random prompts. A random head agrees
  with the model by chance only (about 1 / vocabulary): the floor, where speculation pays the
  head and the longer verification for nothing.
- ``trained``: model and head trained together (main loss + the head's, Adam) for
  ``--train-steps`` steps on the shipped chat example (24 conversations, rendered with chatml),
  then prompted with those conversations up to the assistant's turn. The model has memorized
  the set, so this is a ceiling of what a head that knows the model's text does, not a
  measurement on held-out data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autopar.data.chat import CHAT_EXAMPLE
from autopar.data.chat_template import render, template_text
from autopar.data.tokenizer import build_tokenizer
from autopar.models import build_model, get_flavor
from autopar.models.generation import generate
from autopar.models.generation.speculative import speculative_generate
from autopar.models.qwen3_5.model import Qwen35
from autopar.training.resolve import SHIPPED_TOKENIZERS


@dataclass
class SpeculativeRow:
    head: str
    draft_tokens: int
    prompts: int
    new_tokens: int
    plain_tps: float
    speculative_tps: float
    speedup: float
    acceptance: float
    tokens_per_forward: float
    tokens_equal_plain: bool


def model_with_head(seed: int) -> Qwen35:
    """The debug Qwen3.5 with a one-layer head, initial weights."""
    model = build_model(dataclasses.replace(get_flavor("qwen3.5", "debug"), mtp_num_hidden_layers=1))
    model.init_weights(seed=seed)
    return model


def chat_example(seq_len: int) -> tuple[torch.Tensor, list[list[int]]]:
    """The shipped chat example under chatml: each conversation's tokens cut or padded (with the
    end-of-text id) to ``seq_len`` (N, seq_len), and its prompt up to the assistant's turn."""
    path = str(SHIPPED_TOKENIZERS["chatml"])
    tokenizer, template = build_tokenizer(path), template_text(path)
    rows, prompts = [], []
    for line in CHAT_EXAMPLE.read_text().splitlines():
        messages = json.loads(line)["messages"]
        ids = tokenizer.encode(render(messages, template))[:seq_len]
        rows.append(ids + [tokenizer.eos_id] * (seq_len - len(ids)))
        prompts.append(tokenizer.encode(render(messages[:-1], template, generation_prompt=True)))
    return torch.tensor(rows), prompts


def train_on_chat_example(model: Qwen35, steps: int, seq_len: int = 192, lr: float = 3e-3) -> list[list[int]]:
    """Train model and head together (the next token's loss plus the head's, on the token two
    ahead) on the whole chat example per step; its prompts."""
    tokens, prompts = chat_example(seq_len)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits, head_logits = model(tokens[:, :-1], mtp="on")  # (N, S-1, V) each
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        # the head's last position predicts nothing: (N, S-2, V) against the tokens two ahead
        loss = loss + F.cross_entropy(head_logits[:, :-1].flatten(0, 1), tokens[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return prompts


def best_seconds(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Each run's fastest of ``repeat`` timings, the runs taking turns in each repetition, so
    that a busy machine slows them alike and the minimum drops what it added."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def head_rows(
    head: str, model: Qwen35, prompts: list[list[int]], draft_tokens: list[int], new: int, repeat: int
) -> list[SpeculativeRow]:
    """One head's rows: each prompt generated alone, ``new`` tokens, plain and at each k;
    tokens/s over the whole generations (their prefills are the same work in both)."""
    plain_tokens = [generate(model, [p], new)[0] for p in prompts]
    runs: dict[str, Callable[[], object]] = {"plain": lambda: [generate(model, [p], new) for p in prompts]}
    results = {}
    for k in draft_tokens:
        results[k] = [speculative_generate(model, [p], new, k) for p in prompts]  # also a warm-up
        runs[str(k)] = functools.partial(speculate_each, model, prompts, new, k)
    seconds = best_seconds(runs, repeat)
    plain = len(prompts) * new / seconds["plain"]
    rows = []
    for k, outcome in results.items():
        stats = [s for _, (s,) in outcome]
        tps = len(prompts) * new / seconds[str(k)]
        rows.append(
            SpeculativeRow(
                head=head,
                draft_tokens=k,
                prompts=len(prompts),
                new_tokens=new,
                plain_tps=plain,
                speculative_tps=tps,
                speedup=tps / plain,
                acceptance=sum(s.accepted for s in stats) / max(sum(s.drafted for s in stats), 1),
                tokens_per_forward=sum(s.tokens for s in stats) / sum(s.forwards for s in stats),
                tokens_equal_plain=[out[0] for out, _ in outcome] == plain_tokens,
            )
        )
    return rows


def speculate_each(model: Qwen35, prompts: list[list[int]], new: int, k: int) -> None:
    for p in prompts:
        speculative_generate(model, [p], new, k)


def speculative_rows(
    draft_tokens: list[int], prompt: int, new: int, train_steps: int, seed: int, repeat: int
) -> list[SpeculativeRow]:
    """Rows for the random head on 4 random ``prompt``-token prompts, and for the trained head
    on 4 of the chat example's prompts, at each k of ``draft_tokens``."""
    if not draft_tokens:
        return []
    model = model_with_head(seed).eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.args.vocab_size, (4, prompt), generator=gen).tolist()
    rows = head_rows("random", model, prompts, draft_tokens, new, repeat)
    if train_steps > 0:
        trained = model_with_head(seed)
        prompts = train_on_chat_example(trained, train_steps)[:4]
        rows += head_rows(f"trained {train_steps} steps", trained, prompts, draft_tokens, new, repeat)
    return rows


def speculative_table(rows: list[SpeculativeRow]) -> str:
    header = (
        f"{'head (qwen3.5:debug)':<22} {'k':>2} {'plain tok/s':>11} {'speculative':>11} {'speedup':>7} "
        f"{'acceptance':>10} {'tokens/forward':>14} {'= plain':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.head:<22} {r.draft_tokens:>2} {r.plain_tps:>11.0f} {r.speculative_tps:>11.0f} "
            f"{r.speedup:>6.2f}x {r.acceptance:>10.1%} {r.tokens_per_forward:>14.2f} {r.tokens_equal_plain!s:>7}"
        )
    return "\n".join(lines)
