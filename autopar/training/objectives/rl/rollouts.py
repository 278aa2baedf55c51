"""A step's completions: kept as ``<dump_folder>/rollouts/step-<N>.jsonl``, read back to
replay a step, and packed into the micro-batches the loss trains on.

One line per completion: ``step``, ``group`` (the index of its prompt in the step: a group's
completions share it), ``prompt`` (as given), ``prompt_ids``, ``completion_ids``,
``completion`` (text, or the assistant's message for conversational prompts), ``rewards`` (by
function, null where it did not apply), ``reward`` (weighted), ``advantage``, ``logps`` (the
sampler's, per completion token, at the sampling temperature) and ``truncated``.

A micro-batch packs its completions as documents, each ``prompt + completion`` whole in one
row of ``training.seq_len``: inputs are the document's tokens but the last, labels its next
tokens, learned on the completion's only; the per-token columns the loss reads ride beside
the labels (``loss.CHANNELS``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.config.errors import ConfigError
from autopar.data.loader import IGNORE_INDEX, Batch

FOLDER = "rollouts"


@dataclass(frozen=True)
class Completion:
    """One sampled completion and what the step learned of it."""

    step: int
    group: int
    prompt: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    completion: Any
    rewards: dict[str, float | None]
    reward: float | None
    advantage: float
    logps: list[float] | None
    truncated: bool

    @property
    def tokens(self) -> int:
        """Its document's length in a packed row: prompt + completion, but the last token."""
        return len(self.prompt_ids) + len(self.completion_ids) - 1


def rollout_file(dump_folder: str | Path, step: int) -> Path:
    return Path(dump_folder) / FOLDER / f"step-{step}.jsonl"


def write_rollouts(path: Path, completions: Sequence[Completion]) -> None:
    """Every completion of a step, one JSON line each, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with partial.open("w", encoding="utf-8") as out:
        for completion in completions:
            out.write(json.dumps(_json_safe(asdict(completion)), ensure_ascii=False) + "\n")
    partial.replace(path)


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinite numbers as null (JSON has none)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return {k: clean(v) for k, v in record.items()}


def read_replay(path: str | Path, vocab_size: int) -> dict[int, list[Completion]]:
    """The completions of a rollouts file, or of a folder of ``step-*.jsonl``, by step; one
    ConfigError naming the file and line for a record that does not read."""
    source = Path(path)
    files = sorted(source.glob("step-*.jsonl")) if source.is_dir() else [source]
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(
            f"rl.replay={str(path)!r} is not a rollouts file or a folder of step-N.jsonl files; name "
            f"<dump_folder>/{FOLDER}/step-N.jsonl or its folder"
        )
    steps: dict[int, list[Completion]] = {}
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                completion = _parse(line, f"{file}:{number}", vocab_size)
                steps.setdefault(completion.step, []).append(completion)
    return steps


def _parse(line: str, where: str, vocab_size: int) -> Completion:
    try:
        record = json.loads(line)
        completion = Completion(**{name: record[name] for name in Completion.__dataclass_fields__})
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(
            f"rl.replay: {where} is not a rollout record ({err}); replay a file autopar wrote"
        ) from None
    ids = completion.prompt_ids + completion.completion_ids
    if not completion.completion_ids or max(ids) >= vocab_size or min(ids) < 0:
        raise ConfigError(
            f"rl.replay: {where} holds token ids outside the model's vocabulary (0..{vocab_size - 1}) or no "
            "completion; replay rollouts of a model with this tokenizer"
        )
    if completion.logps is not None and len(completion.logps) != len(completion.completion_ids):
        raise ConfigError(
            f"rl.replay: {where} has {len(completion.logps)} logps for {len(completion.completion_ids)} tokens"
        )
    return completion


@dataclass(frozen=True)
class Packed:
    """A completion as the loss reads it: its tokens, and per completion token its weight in
    the step loss, its pi_old and reference log-probabilities; ``learned`` False keeps it out of
    the loss (a truncated completion under mask_truncated_completions)."""

    completion: Completion
    weights: list[float]
    old_logps: list[float]
    ref_logps: list[float]
    learned: bool = True


def pack_micro_batch(items: Sequence[Packed], seq_len: int, pad_id: int, groups: int | None = None) -> Batch:
    """The rows of one micro-batch: each item a document whole in one row, a new row when the
    next does not fit; labels (R, seq_len, 7) carry ``loss.CHANNELS``. ``groups`` (a pipeline's
    micro-batches): the items cut into that many equal groups in order, each packed alone into
    as many rows as it has items (one always fits), so the schedule's equal cuts of the rows
    give each pipeline micro-batch whole completions, and every step the same shapes."""
    if groups is None:
        rows = _rows(items, range(len(items)), seq_len)
    else:
        per_group = len(items) // groups
        assert per_group * groups == len(items), "validated: the pipeline micro-batches divide the batch"
        rows = []
        for g in range(groups):
            members = _rows(items, range(g * per_group, (g + 1) * per_group), seq_len)
            rows += members + [[] for _ in range(per_group - len(members))]
    inputs = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    documents = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    columns = torch.zeros(len(rows), seq_len, 7)
    columns[..., 0] = IGNORE_INDEX
    columns[..., 1] = -1
    columns[..., 6] = 1.0
    for r, members in enumerate(rows):
        at = 0
        for index in members:
            at = _place(items[index], index, inputs[r], documents[r], columns[r], at)
    return Batch(inputs, columns, documents)


def _rows(items: Sequence[Packed], indices: range, seq_len: int) -> list[list[int]]:
    """``indices`` of ``items`` in rows of ``seq_len``, in order, a new row when the next does
    not fit."""
    rows: list[list[int]] = [[]]
    used = 0
    for index in indices:
        if used + items[index].completion.tokens > seq_len and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += items[index].completion.tokens
    return rows


def _place(
    item: Packed, index: int, inputs: torch.Tensor, documents: torch.Tensor, columns: torch.Tensor, at: int
) -> int:
    """Write one document from position ``at`` of a row; returns where the next one starts."""
    completion = item.completion
    tokens = completion.prompt_ids + completion.completion_ids
    end = at + len(tokens) - 1
    inputs[at:end] = torch.tensor(tokens[:-1])
    documents[at:end] = index
    first = at + len(completion.prompt_ids) - 1  # the position whose label is the first completion token
    n = len(completion.completion_ids)
    if item.learned:
        columns[first:end, 0] = torch.tensor(completion.completion_ids, dtype=torch.float32)
    columns[at:end, 1] = index
    columns[first:end, 2] = torch.tensor(item.weights)
    columns[first:end, 3] = completion.advantage
    columns[first:end, 4] = torch.tensor(item.old_logps[:n])
    columns[first:end, 5] = torch.tensor(item.ref_logps[:n])
    return end
