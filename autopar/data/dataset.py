"""Samples: packed token windows, visited in seeded per-epoch order, optionally blended.

A sample is a pure function of its global index ``j``. The loader asks for indices
``[consumed, consumed + global_batch)`` at each step, so the data a step sees does not depend
on how many data-parallel ranks share it, and resuming needs nothing but ``consumed``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from autopar.data.errors import DataError

_BLEND_CHUNK = 1 << 16


class SampleSource(Protocol):
    def sample(self, index: int) -> np.ndarray:
        """The (seq_len + 1) tokens of global sample ``index``."""
        ...

    def describe(self) -> str:
        """What the samples come from, for the start-up log."""
        ...

    def targets(self, index: int) -> np.ndarray | None:
        """Which of sample ``index``'s seq_len targets are learned (bool), or None: all are."""
        ...

    def documents(self, index: int) -> np.ndarray | None:
        """The document id of each of sample ``index``'s seq_len + 1 tokens (0 for the
        first), or None without document boundaries."""
        ...


class PackedWindows:
    """Window k is tokens[k*S : k*S + S + 1] (consecutive windows share one token, so every
    token is a target exactly once per epoch). Epoch e visits windows in permutation(seed, e).
    With ``vocab_size``, a window holding an id outside the vocabulary is refused as it is read
    (a damaged or foreign file; checking when read costs nothing, scanning a large file at open
    would)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        name: str = "dataset",
        vocab_size: int | None = None,
        seq_len_field: str = "training.seq_len",
        learned: np.ndarray | None = None,
        document_ends: np.ndarray | None = None,
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.name = name
        self.vocab_size = vocab_size
        self.learned = learned
        """Per token: whether it is a target (chat data); None: every token is."""
        self.document_ends = document_ends
        """Sorted end offset of every document (for document masking); None: not used."""
        self.num_windows = (tokens.size - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"{name}: {tokens.size} tokens cannot fill one sequence of {seq_len_field}="
                f"{seq_len} (+1 target); lower {seq_len_field} or add data"
            )
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def describe(self) -> str:
        learned = "" if self.learned is None else f", {int(self.learned.sum()):,} learned"
        return f"{self.name} ({self.tokens.size:,} tokens{learned})"

    def _start(self, index: int) -> int:
        epoch, k = divmod(index, self.num_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch = epoch
        return int(self._order[k]) * self.seq_len

    def targets(self, index: int) -> np.ndarray | None:
        if self.learned is None:
            return None
        start = self._start(index)
        return np.asarray(self.learned[start + 1 : start + self.seq_len + 1], dtype=bool)

    def documents(self, index: int) -> np.ndarray | None:
        if self.document_ends is None:
            return None
        start = self._start(index)
        ids = np.searchsorted(self.document_ends, np.arange(start, start + self.seq_len + 1), side="right")
        return ids - ids[0]

    def sample(self, index: int) -> np.ndarray:
        start = self._start(index)
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if self.vocab_size is not None and window.max() >= self.vocab_size:
            at = start + int(np.argmax(window >= self.vocab_size))
            raise DataError(
                f"{self.name}: token {int(self.tokens[at])} at position {at} is outside the "
                f"{self.vocab_size}-token vocabulary; the file is damaged or was made with another "
                "tokenizer: re-run python -m autopar.data.prepare"
            )
        return window


class Blend:
    """Sample j comes from part d with probability weights[d]; draws are seeded per chunk of
    indices and each part is read in its own order, so the blend is reproducible."""

    def __init__(self, parts: list[PackedWindows], weights: list[float], seed: int) -> None:
        total = float(sum(weights))
        self.parts = parts
        self.probs = np.asarray(weights, dtype=np.float64) / total
        self.seed = seed
        self._part = np.empty(0, dtype=np.int64)
        self._index = np.empty(0, dtype=np.int64)
        self._counts = np.zeros(len(parts), dtype=np.int64)

    def describe(self) -> str:
        return "blend of " + ", ".join(
            f"{p:.0%} {part.describe()}" for p, part in zip(self.probs, self.parts)
        )

    def _extend(self) -> None:
        chunk = len(self._part) // _BLEND_CHUNK
        rng = np.random.default_rng([self.seed, 7919, chunk])
        part = rng.choice(len(self.parts), size=_BLEND_CHUNK, p=self.probs)
        index = np.empty(_BLEND_CHUNK, dtype=np.int64)
        for d in range(len(self.parts)):
            mask = part == d
            index[mask] = self._counts[d] + np.arange(mask.sum())
            self._counts[d] += mask.sum()
        self._part = np.concatenate([self._part, part])
        self._index = np.concatenate([self._index, index])

    def _where(self, index: int) -> tuple[PackedWindows, int]:
        while index >= len(self._part):
            self._extend()
        return self.parts[int(self._part[index])], int(self._index[index])

    def sample(self, index: int) -> np.ndarray:
        part, k = self._where(index)
        return part.sample(k)

    def targets(self, index: int) -> np.ndarray | None:
        part, k = self._where(index)
        return part.targets(k)

    def documents(self, index: int) -> np.ndarray | None:
        part, k = self._where(index)
        return part.documents(k)
