"""Rows of Parquet files and ``datasets.save_to_disk`` folders, read a chunk at a time.

A table dataset is a ``.parquet`` or ``.arrow`` file, a folder of them (the Hub's shards), or
a folder ``datasets.save_to_disk`` wrote (``state.json`` naming Arrow stream files); of a
folder of splits (a ``DatasetDict``, ``train/`` and ``test/``) one split is read (``splits.py``),
and a folder of tables beside text or JSONL files is refused. A chunk is
a Parquet row group (decoded when asked for, only the columns read) or an Arrow record batch
(memory-mapped, as ``datasets`` itself reads them), so a file far larger than memory is read
a chunk at a time. pyarrow alone reads both: ``datasets`` is not needed to train on what it
saved.

Every file's columns are checked when the dataset is opened (reading only metadata); a row
that does not hold what its column promises is refused naming the file, the row (0-based, as
``dataset[i]`` counts) and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autopar.data.errors import DataError
from autopar.data.splits import choose, folder_files, one_split
from autopar.data.tokens import JSONL_SUFFIXES, TEXT_SUFFIXES

TABLE_SUFFIXES = (".parquet", ".arrow")
CHAT_COLUMNS = ("messages", "conversations")
"""The column that holds a conversation (ShareGPT's is ``conversations``); ``tools`` is read
beside it when present."""
INSTALL_HINT = "pip install 'autopar[data]' (or pip install pyarrow)"


def pyarrow() -> Any:
    """The pyarrow module, or a DataError naming the extra that installs it."""
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading Parquet and Arrow data needs pyarrow: {INSTALL_HINT}") from None
    return pa


def is_table(path: Path) -> bool:
    """A Parquet or Arrow file, a ``save_to_disk`` folder, or a folder holding such files."""
    if path.is_file():
        return path.suffix in TABLE_SUFFIXES
    if not path.is_dir():
        return False
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return True
    return any(p.suffix in TABLE_SUFFIXES for p in folder_files(path))


def table_files(path: Path, section: str = "training", announce: bool = True) -> list[Path]:
    """The files of a table dataset, in reading order: of the split ``section`` reads when
    the folder holds several (``splits.py``)."""
    if path.is_file():
        return [path]
    if (path / "state.json").is_file():
        return saved_files(path)
    found = folder_files(path)
    saved = [p.parent for p in found if p.name == "state.json"]
    tables = [p for p in found if p.suffix in TABLE_SUFFIXES]
    if saved or (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a folder a split
        stray = [p for p in tables if not any(folder in p.parents for folder in saved)]
        if not saved:
            raise DataError(
                f"{path}: has dataset_dict.json but no split's folder (one with state.json); save the "
                "DatasetDict again, or point at the folder of one split's files"
            )
        if stray:
            raise DataError(
                f"{path}: a datasets DatasetDict folder, but {stray[0].relative_to(path)} is in no split's "
                "folder (one with state.json), an unknown layout; point at one split's folder"
            )
        return choose(path, {str(f.relative_to(path)): saved_files(f) for f in saved}, section, announce)
    others = [p for p in found if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES]
    if others:
        raise DataError(
            f"{path}: holds tables ({tables[0].relative_to(path)}) and text or JSONL files "
            f"({others[0].relative_to(path)}); a folder is read as one kind: move the other kind "
            "out (or prepare each with autopar-prepare and blend them with training.dataset_blend)"
        )
    return one_split(path, tables, section, announce)


def saved_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in its ``state.json`` order."""
    try:
        names = [f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path / 'state.json'}: not a datasets save_to_disk state ({err})") from None
    files = [path / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(
            f"{path / 'state.json'}: names {missing[0]}, which is missing; save the dataset again"
        )
    return files


@dataclass(frozen=True)
class Columns:
    """What a dataset's rows are read as: a text column, or a chat column (and ``tools``)."""

    text: str | None = "text"
    """The text column; None: conversations (``CHAT_COLUMNS``)."""
    text_field: str = "training.dataset_text_field"
    """The setting that names the text column, for the errors."""

    def of(self, file: Path, schema: Any) -> list[str]:
        """The columns to read from ``file``; a DataError when they are missing or of the
        wrong type."""
        pa = pyarrow()
        names = list(schema.names)
        if self.text is not None:
            if self.text not in names:
                raise DataError(
                    f"{file}: no column {self.text!r} (its columns: {', '.join(names)}); set "
                    f"{self.text_field} to the column that holds the text"
                )
            kind = schema.field(self.text).type
            if not _is_text(pa, kind):
                raise DataError(
                    f"{file}: column {self.text!r} is {kind}, not text (string); set {self.text_field} "
                    "to the column that holds the text"
                )
            return [self.text]
        chat = next((c for c in CHAT_COLUMNS if c in names), None)
        if chat is None:
            raise DataError(
                f"{file}: no column 'messages' (or ShareGPT's 'conversations') (its columns: "
                f"{', '.join(names)}); chat data holds a list of {{role, content}} per row"
            )
        kind = schema.field(chat).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(
            kind.value_type
        ):
            raise DataError(
                f"{file}: column {chat!r} is {kind}, not a list of messages "
                "(list<struct<role: string, content: string>>)"
            )
        return [chat, "tools"] if "tools" in names else [chat]


def _is_text(pa: Any, kind: Any) -> bool:
    """A string column of any of Arrow's layouts: plain, large, view, or dictionary-encoded
    (pandas' categoricals and many writers store repeated strings so)."""
    if pa.types.is_dictionary(kind):
        return _is_text(pa, kind.value_type)
    view = getattr(pa.types, "is_string_view", None)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or bool(view and view(kind))


class TableRows:
    """The rows of a table dataset as dicts of the read columns, chunk by chunk."""

    def __init__(
        self, path: Path, columns: Columns, section: str = "training", announce: bool = True
    ) -> None:
        """The rows of the split ``section`` reads; ``announce``: log which split that is."""
        pa = pyarrow()
        self.path = path
        self.files = table_files(path, section, announce)
        if not self.files:
            raise DataError(f"{path}: holds no {'/'.join(TABLE_SUFFIXES)} files")
        self._columns: list[list[str]] = []
        self._chunks: list[tuple[int, int]] = []  # (file, chunk within the file)
        sizes: list[int] = []
        self._batches: dict[int, list[Any]] = {}
        for i, file in enumerate(self.files):
            schema, counts = self._open(pa, i, file)
            self._columns.append(columns.of(file, schema))
            self._chunks += [(i, k) for k in range(len(counts))]
            sizes += counts
        self.chunk_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        """Global index of each chunk's first row, and the number of rows last."""
        self._file_starts = {}
        for c, (i, _) in enumerate(self._chunks):
            self._file_starts.setdefault(i, int(self.chunk_starts[c]))
        self._cached: tuple[int, list[dict[str, Any]]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.chunk_starts[-1])

    def _open(self, pa: Any, i: int, file: Path) -> tuple[Any, list[int]]:
        """(schema, rows of each chunk) of file ``i``; Arrow files' batches are kept mapped."""
        try:
            if file.suffix == ".parquet":
                meta = pa.parquet.ParquetFile(file).metadata
                return meta.schema.to_arrow_schema(), [
                    meta.row_group(k).num_rows for k in range(meta.num_row_groups)
                ]
            source = pa.memory_map(str(file))
            try:
                reader = pa.ipc.open_file(source)
                batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
            except pa.ArrowInvalid:  # save_to_disk writes the stream format
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = list(reader)
            self._batches[i] = batches
            return reader.schema, [b.num_rows for b in batches]
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{file}: not a readable {file.suffix[1:]} file ({err})") from None

    def where(self, row: int) -> str:
        """'file: row n' of global row ``row``."""
        chunk = int(np.searchsorted(self.chunk_starts, row, side="right")) - 1
        i = self._chunks[chunk][0]
        return f"{self.files[i]}: row {row - self._file_starts[i]}"

    def chunk(self, chunk: int) -> list[dict[str, Any]]:
        """The rows of chunk ``chunk`` (the last one read is kept)."""
        if self._cached is not None and self._cached[0] == chunk:
            return self._cached[1]
        pa = pyarrow()
        i, k = self._chunks[chunk]
        if i in self._batches:
            table = pa.Table.from_batches([self._batches[i][k]]).select(self._columns[i])
        else:
            table = pa.parquet.ParquetFile(self.files[i]).read_row_group(k, columns=self._columns[i])
        rows = table.to_pylist()
        self._cached = (chunk, rows)
        return rows

    def row(self, row: int) -> dict[str, Any]:
        chunk = int(np.searchsorted(self.chunk_starts, row, side="right")) - 1
        return self.chunk(chunk)[row - int(self.chunk_starts[chunk])]

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(global row index, row) of every row, in order."""
        for chunk in range(len(self._chunks)):
            start = int(self.chunk_starts[chunk])
            for offset, row in enumerate(self.chunk(chunk)):
                yield start + offset, row


def without_nulls(value: Any) -> Any:
    """A table's conversation as its JSON would have it: Arrow gives every message every field
    any message has (null where it had none), so null fields are dropped, at every depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
