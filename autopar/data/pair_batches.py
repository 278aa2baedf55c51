"""Preference pairs into micro-batches: each pair whole in one row, several pairs per row.

A micro-batch holds ``local_batch_size`` pairs. Pair j of it becomes two documents of one
row: prompt + chosen (document id ``2j``) and prompt + rejected (``2j + 1``); its targets are
the completions' tokens only (TRL's completion mask), and padding is document -1 with no
target. With document masking, a sequence sees only itself and its positions start at 0, so
packing k pairs gives each pair the log-probabilities it has alone in a row of its own.

Step t covers pairs ``[t*G, (t+1)*G)`` of a seeded per-epoch order; micro-step m of
data-parallel rank r reads pairs ``start + m*D*L + r*L + [0, L)`` (as ``StepLoader`` does
with samples), so the data a step sees does not depend on the plan, and resuming needs the
number of pairs consumed only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from autopar.data.loader import IGNORE_INDEX, Batch, RankSteps


class PairIds(Protocol):
    """One tokenized preference pair: prompt ids and each completion's ids."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def sequence_rows(pair: PairIds) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, targets) of the pair's chosen and rejected sequences: a target is the next
    token where that token is part of the completion, else ``IGNORE_INDEX``."""
    out = []
    for completion in (pair.chosen, pair.rejected):
        tokens = np.concatenate([pair.prompt, completion]).astype(np.int64)
        targets = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
        start = max(len(pair.prompt) - 1, 0)
        targets[start : len(tokens) - 1] = tokens[start + 1 :]
        out.append((tokens, targets))
    return out


def pair_length(pair: PairIds) -> int:
    return 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)


def pack_pairs(
    pairs: Sequence[PairIds], seq_len: int, pad_id: int, packing: bool = True, fixed_rows: int | None = None
) -> Batch:
    """The rows of one micro-batch: pairs in order, a new row when the next pair does not
    fit (``packing``), or each sequence in a row of its own (TRL's layout, padded to
    ``seq_len``). Every pair must fit in ``seq_len`` (``truncate`` to ``seq_len // 2`` per sequence).
    ``fixed_rows``: as many rows always, the last ones padding (at most one row per pair
    packed, two unpacked)."""
    rows: list[list[tuple[np.ndarray, np.ndarray, int]]] = [[]]
    used = 0
    for j, pair in enumerate(pairs):
        sequences = [(tokens, targets, 2 * j + k) for k, (tokens, targets) in enumerate(sequence_rows(pair))]
        length = pair_length(pair)
        assert length <= seq_len, f"pair of {length} tokens in rows of {seq_len}: truncated before packing"
        if packing:
            if used + length > seq_len and rows[-1]:
                rows.append([])
                used = 0
            rows[-1].extend(sequences)
            used += length
        else:
            rows.extend([[s] for s in sequences])
    rows = [row for row in rows if row]
    if fixed_rows is not None:
        assert len(rows) <= fixed_rows, f"{len(rows)} rows asked to fit {fixed_rows}"
        rows += [[] for _ in range(fixed_rows - len(rows))]
    inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    documents = np.full((len(rows), seq_len), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for tokens, targets, doc in row:
            end = at + len(tokens)
            inputs[r, at:end], labels[r, at:end], documents[r, at:end] = tokens, targets, doc
            at = end
    return Batch(torch.from_numpy(inputs), torch.from_numpy(labels), torch.from_numpy(documents))


def rows_per_pairs(pairs: int, packing: bool) -> int:
    """The rows that always hold ``pairs`` pairs: one each packed (a pair fits a row), two unpacked."""
    return pairs if packing else 2 * pairs


def pack_groups(
    pairs: Sequence[PairIds], groups: int, seq_len: int, pad_id: int, packing: bool = True
) -> Batch:
    """A pipeline's micro-batch layout: the pairs cut into ``groups`` equal groups in order,
    each packed alone into the same number of rows (``rows_per_pairs``) with its own document
    ids 2j / 2j + 1, j counted from the group's first pair. A schedule that cuts the rows into
    ``groups`` equal chunks gives every chunk whole pairs, and every step the same shapes."""
    per_group = len(pairs) // groups
    assert per_group * groups == len(pairs), "validated: the pipeline micro-batch size divides the pairs"
    rows = rows_per_pairs(per_group, packing)
    parts = [
        pack_pairs(pairs[g * per_group : (g + 1) * per_group], seq_len, pad_id, packing, rows)
        for g in range(groups)
    ]
    return Batch(
        *(torch.cat([getattr(b, name) for b in parts]) for name in ("inputs", "labels", "documents"))
    )


def chosen_targets(batch: Batch) -> torch.Tensor:
    """(B, S) bool: the targets that belong to chosen completions (even document ids)."""
    assert batch.documents is not None
    return (batch.labels != IGNORE_INDEX) & (batch.documents >= 0) & (batch.documents % 2 == 0)


@dataclass(frozen=True)
class PairSource:
    """A preference dataset's pairs, and what was done to them (for the start-up line)."""

    pairs: Sequence[PairIds]
    name: str
    truncated: int = 0
    identical: int = 0
    made_identical: int = 0

    def describe(self) -> str:
        notes = [f"{len(self.pairs)} pairs"]
        if self.truncated:
            notes.append(f"{self.truncated} truncated to dpo.max_length")
        if self.identical:
            made = f", {self.made_identical} of them by truncation" if self.made_identical else ""
            notes.append(f"{self.identical} with chosen = rejected (nothing to learn from them{made})")
        return f"{self.name} ({', '.join(notes)})"


@dataclass(eq=False, kw_only=True)
class PairLoader(RankSteps):
    """Yields the micro-batches of one optimizer step for one data-parallel rank, each with
    ``local_batch`` pairs (``Batch.pairs``: their indices in the data, for a precomputed
    reference)."""

    pairs: Sequence[PairIds]
    seq_len: int
    pad_id: int
    seed: int
    packing: bool = True
    pipeline_groups: int | None = None
    """Under pipeline parallelism, micro-batches in ``pack_groups``' layout of that many groups
    (fixed shapes, whole pairs per pipeline micro-batch)."""
    _order: tuple[int, np.ndarray] = field(
        default_factory=lambda: (-1, np.empty(0, dtype=np.int64)), init=False, repr=False
    )
    """(epoch, its permutation of the pairs) of the last pair visited."""

    def pair_index(self, k: int) -> int:
        """The data index of the k-th pair visited: epoch ``k // N`` visits them in a permutation
        seeded by (seed, epoch)."""
        epoch, at = divmod(k, len(self.pairs))
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs)))
        return int(self._order[1][at])

    def micro_batch(self, first: int) -> Batch:
        """The micro-batch of the pairs visited at ``first`` onwards (``local_batch`` of them)."""
        indices = [self.pair_index(k) for k in range(first, first + self.local_batch)]
        chosen = [self.pairs[i] for i in indices]
        if self.pipeline_groups is None:
            batch = pack_pairs(chosen, self.seq_len, self.pad_id, self.packing)
        else:
            batch = pack_groups(chosen, self.pipeline_groups, self.seq_len, self.pad_id, self.packing)
        return Batch(
            batch.inputs.to(self.device),
            batch.labels.to(self.device),
            batch.documents.to(self.device),
            torch.tensor(indices, device=self.device),
        )
