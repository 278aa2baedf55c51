"""The token stream of a table dataset, tokenized a row at a time as windows need it.

Opening reads every row once, a chunk at a time, to learn each row's length in tokens; what
is kept is the end offset of every row (8 bytes a row: the document index a prepared file
keeps in its ``.idx``), never the text or its tokens. A window then reads only the rows it
covers, from the chunk that holds them, and tokenizes them again. The stream is the one the
same rows in JSONL give (text: each document then end-of-text; chat: each conversation
rendered by the template), so ``PackedWindows`` visits the same windows in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from autopar.data.chat import ChatFormat, ConversationEncoder, parse_record
from autopar.data.errors import DataError, check_unicode
from autopar.data.tables import Columns, TableRows, without_nulls
from autopar.data.tokenizer import Tokenizer

Encoded = tuple[np.ndarray, np.ndarray | None]
"""A row's token ids and, for chat, which of them are learned."""
_ROWS_KEPT = 256


def text_encoder(tokenizer: Tokenizer, column: str) -> Callable[[dict[str, Any], str], Encoded]:
    """A text row: its document's tokens, then end-of-text."""

    def encode(row: dict[str, Any], where: str) -> Encoded:
        text = row[column]
        if not isinstance(text, str):
            raise DataError(f"{where}, column {column!r}: {text!r}, not a string; drop or fill the row")
        check_unicode(text, f"{where}, column {column!r}")
        return np.asarray([*tokenizer.encode(text), tokenizer.eos_id], dtype=np.int64), None

    return encode


def chat_encoder(chat: ChatFormat) -> Callable[[dict[str, Any], str], Encoded]:
    """A chat row: its conversation rendered by the template, and the learned mask."""
    conversations = ConversationEncoder(chat)

    def encode(row: dict[str, Any], where: str) -> Encoded:
        return conversations(parse_record(without_nulls(row), where), where)

    return encode


def row_encoder(
    tokenizer: Tokenizer,
    chat: ChatFormat | None,
    text_column: str,
    text_field: str = "training.dataset_text_field",
) -> tuple[Columns, Callable[[dict[str, Any], str], Encoded]]:
    """The columns a job reads from a table and how a row becomes tokens; ``text_field``: the
    setting that names the text column (for the errors: a job's field, prepare's flag)."""
    if chat is not None:
        return Columns(text=None), chat_encoder(chat)
    return Columns(text=text_column, text_field=text_field), text_encoder(tokenizer, text_column)


class RowTokens:
    """A table dataset's token stream as ``PackedWindows`` reads a token array: ``size``,
    slices ``stream[a:b]`` and ``learned`` (chat), with ``ends`` (each row's end offset);
    ``pad`` extends it with a never-learned pad id, as ``chat.pad_to_windows`` does an array."""

    def __init__(self, rows: TableRows, encode: Callable[[dict[str, Any], str], Encoded]) -> None:
        self.rows = rows
        self._kept: OrderedDict[int, Encoded] = OrderedDict()
        self.encode = encode
        lengths = np.empty(rows.num_rows, dtype=np.int64)
        learned = 0
        chat = False
        for index, row in rows:
            ids, mask = encode(row, rows.where(index))
            lengths[index] = ids.size
            if mask is not None:
                chat = True
                learned += int(mask.sum())
        self.ends = np.cumsum(lengths)
        self.num_tokens = int(self.ends[-1]) if self.ends.size else 0
        self.size = self.num_tokens
        self.num_learned = learned
        self.pad_id = 0
        self.learned: LearnedMask | None = LearnedMask(self) if chat else None

    def pad(self, seq_len: int, pad_id: int) -> None:
        """Pad so the last partial sequence is kept whole (``chat.pad_to_windows``)."""
        self.size = self.num_tokens + (-(self.num_tokens - 1)) % seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.size

    def _row(self, index: int) -> Encoded:
        if index in self._kept:
            self._kept.move_to_end(index)
            return self._kept[index]
        encoded = self.encode(self.rows.row(index), self.rows.where(index))
        self._kept[index] = encoded
        if len(self._kept) > _ROWS_KEPT:
            self._kept.popitem(last=False)
        return encoded

    def read(self, start: int, stop: int) -> Encoded:
        """Tokens [start, stop) and their learned mask (None for text)."""
        ids = np.full(stop - start, self.pad_id, dtype=np.int64)
        mask = np.zeros(stop - start, dtype=bool) if self.learned is not None else None
        first = int(np.searchsorted(self.ends, start, side="right"))
        for index in range(first, self.ends.size):
            row_start = int(self.ends[index - 1]) if index else 0
            if row_start >= stop:
                break
            row_ids, row_mask = self._row(index)
            a, b = max(start, row_start), min(stop, row_start + row_ids.size)
            ids[a - start : b - start] = row_ids[a - row_start : b - row_start]
            if mask is not None and row_mask is not None:
                mask[a - start : b - start] = row_mask[a - row_start : b - row_start]
        return ids, mask

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            return self.read(start, max(start, stop))[0]
        return self.read(key, key + 1)[0][0]


class LearnedMask:
    """The learned mask of a chat ``RowTokens``, read as its tokens are."""

    def __init__(self, stream: RowTokens) -> None:
        self.stream = stream

    def sum(self) -> int:
        return self.stream.num_learned

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, _ = key.indices(self.stream.size)
        mask = self.stream.read(start, max(start, stop))[1]
        assert mask is not None, "a chat stream has a mask"
        return mask


def open_table(
    path: Path, tokenizer: Tokenizer, chat: ChatFormat | None, text_column: str, section: str = "training"
) -> RowTokens:
    """The token stream of the table dataset at ``path`` (of the split ``section`` reads)."""
    columns, encode = row_encoder(tokenizer, chat, text_column)
    stream = RowTokens(TableRows(path, columns, section), encode)
    if stream.num_tokens == 0:
        raise DataError(f"{path}: holds no rows")
    if chat is not None and not stream.num_learned:
        raise DataError(
            f"{path}: no token to learn (no assistant turn with training.loss_on={chat.loss_on!r})"
        )
    return stream
