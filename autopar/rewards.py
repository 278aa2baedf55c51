"""Verifiable rewards to train with (``[rl] reward_funcs = ["autopar.rewards:answer_match"]``).

Each has TRL's reward-function signature, ``f(prompts, completions, completion_ids,
**columns) -> list[float | None]``: ``completions`` are texts, or for conversational prompts
lists holding the assistant's message; ``columns`` are the prompt records' other fields by
name; ``None`` means the reward does not apply to that completion (it is left out of that
function's mean, as TRL's NaN is). This module imports nothing of autopar: a user's reward
file can copy any of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_GSM8K = re.compile(r"####\s*([^\n]+)")
_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """A completion as text: itself, or its (last) message's content."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The answer a solution ends with: GSM8K's ``#### n`` (its last), else the last
    ``\\boxed{}``; normalised (spaces, thousands separators and a trailing period dropped)."""
    found = _GSM8K.findall(text)
    answer = found[-1] if found else boxed(text)
    if answer is None:
        return None
    return answer.strip().replace(",", "").replace(" ", "").rstrip(".") or None


def answer_match(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str | None] | None = None, **_: Any
) -> list[float | None]:
    """1 where the completion's final answer equals the record's ``answer`` column (itself
    a final answer or a GSM8K solution ending ``#### n``), else 0; None without an answer
    (a record, or data, without that column)."""
    if answer is None:
        return [None] * len(completions)
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            rewards.append(None)
            continue
        target = final_answer(str(expected)) or str(expected).strip()
        rewards.append(1.0 if final_answer(completion_text(completion)) == target else 0.0)
    return rewards


def think_format(completions: Sequence[Any], **_: Any) -> list[float]:
    """1 where the completion reasons inside ``<think>...</think>`` and then answers, else 0."""
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


def length_penalty(completion_ids: Sequence[Sequence[int]], **_: Any) -> list[float]:
    """Minus a thousandth per completion token: weight it to trade answers against length."""
    return [-0.001 * len(ids) for ids in completion_ids]


def letter_share(completions: Sequence[Any], letter: Sequence[str], **_: Any) -> list[float]:
    """The toy task of the ``rl_debug`` preset: the share of the completion's characters that
    are the record's ``letter`` (a random tiny model starts near 1/40 and learns to say it)."""
    rewards = []
    for completion, wanted in zip(completions, letter, strict=True):
        text = completion_text(completion)
        rewards.append(text.count(wanted) / len(text) if text else 0.0)
    return rewards
