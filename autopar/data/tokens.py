"""Token streams: documents from text/jsonl, tokenized and joined with end-of-text tokens.

A prepared dataset is ``NAME.bin`` (the flat token stream, uint16 or uint32), ``NAME.idx``
(where each document ends) and ``NAME.json`` (dtype, sizes, the tokenizer that made it); a
prepared chat dataset adds ``NAME.mask`` (one byte per token: 1 where it is learned). It is
memory-mapped, so a dataset far larger than RAM costs nothing to open; Megatron users know
this as an indexed dataset.
"""

from __future__ import annotations

import array
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from autopar.data.errors import DataError, check_unicode, not_utf8
from autopar.data.jsonl import jsonl_records
from autopar.data.splits import folder_files, one_split
from autopar.data.tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
FORMAT_VERSION = 1
BUILTIN_DATASETS = {
    "autopar_corpus": Path(__file__).parent / "corpus",
    "preference_example": Path(__file__).parent / "preference_example" / "pairs.jsonl",
    "rl_example": Path(__file__).parent / "rl_example" / "prompts.jsonl",
}
"""Datasets shipped with autopar, by the name ``training.dataset`` uses."""

logger = logging.getLogger(__name__)


def source_files(path: Path, section: str = "training") -> list[Path]:
    """The text / jsonl files under ``path`` (itself, or a folder's files in sorted order, of
    the split ``section`` reads when they name several: ``splits.py``); a folder's other files
    are named in a warning, not read."""
    if path.is_file():
        return [path]
    if path.exists() and not path.is_dir():
        raise DataError(
            f"{path}: not a regular file or folder (a pipe or a device?); save the data to a file"
        )
    if not path.is_dir():
        raise DataError(f"{path}: no such file or folder")
    found = folder_files(path)
    files = [p for p in found if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES]
    if not files:
        raise DataError(f"{path}: holds no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
    other = [p.name for p in found if p not in files]
    if other:
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        logger.warning(
            "%s: ignoring %d file(s) that are not %s: %s%s (a prepared .bin is read by pointing "
            "training.dataset_path at it, not at its folder)",
            path,
            len(other),
            "/".join(TEXT_SUFFIXES + JSONL_SUFFIXES),
            ", ".join(other[:3]),
            more,
        )
    return one_split(path, files, section)


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of a text file (the whole file) or a jsonl file (the ``text_field`` of each
    line)."""
    try:
        if path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field)
        elif path.suffix in TEXT_SUFFIXES:
            yield path.read_text(encoding="utf-8-sig")
        else:
            raise DataError(f"{path}: unsupported file type; use {TEXT_SUFFIXES + JSONL_SUFFIXES}")
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or field not in record:
            keys = f" (its keys: {', '.join(map(str, record))})" if isinstance(record, dict) else ""
            raise DataError(
                f'{where}: not a JSON object with a "{field}" field{keys}; set '
                "training.dataset_text_field (prepare: --text-field) to the key that holds the text"
            )
        text = record[field]
        if not isinstance(text, str):
            raise DataError(f'{where}: "{field}" is {type(text).__name__} {text!r}, not a string')
        check_unicode(text, f'{where}: "{field}"')
        yield text


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_files(files: list[Path], tokenizer: Tokenizer, text_field: str = "text") -> np.ndarray:
    """One token stream: every document followed by end-of-text."""
    chunks = []
    for file in files:
        for doc in documents(file, text_field):
            chunks.append(np.asarray([*tokenizer.encode(doc), tokenizer.eos_id], dtype=np.int64))
    if not chunks:
        raise DataError(f"{files[0].parent}: no documents found")
    return np.concatenate(chunks).astype(token_dtype(tokenizer.vocab_size))


def is_prepared(path: Path) -> bool:
    """A ``.bin`` path, or a prefix with ``.bin`` and ``.json`` beside it."""
    if path.suffix == ".bin":
        return True
    return path.with_suffix(".json").is_file() and path.with_suffix(".bin").is_file()


def write_prepared(
    documents: Iterable[tuple[np.ndarray, np.ndarray | None]],
    prefix: Path,
    tokenizer: Tokenizer,
    sources: list[str],
    chat: dict[str, str] | None = None,
) -> tuple[Path, int]:
    """Write ``documents`` (each one's token ids and, with ``chat``, learned mask), streamed
    one at a time: ``prefix.idx`` (int64 end offset of every document: text ends after each
    end-of-text, conversations after each conversation), ``prefix.mask`` (with ``chat``),
    ``prefix.json`` (``chat``: how the conversations were rendered) and last ``prefix.bin``
    (tokens), renamed into place when complete: a prefix with a .bin is whole, and a bad
    document or an interrupted run leaves none. Returns (.bin path, tokens)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path, mask_path = prefix.with_suffix(".bin"), prefix.with_suffix(".mask")
    partial, mask_partial = bin_path.with_suffix(".bin.partial"), mask_path.with_suffix(".mask.partial")
    dtype = token_dtype(tokenizer.vocab_size)
    ends = array.array("q")
    total = learned = 0
    try:
        with partial.open("wb") as out, mask_partial.open("wb") as mask_out:
            for ids, mask in documents:
                out.write(ids.astype(dtype).tobytes())
                if chat is None:
                    ends.extend((np.flatnonzero(ids == tokenizer.eos_id) + total + 1).tolist())
                else:
                    assert mask is not None, "a conversation has its learned mask"
                    mask_out.write(mask.astype(np.uint8).tobytes())
                    learned += int(mask.sum())
                    ends.append(total + ids.size)
                total += ids.size
        if not total:
            raise DataError(f"{sources[0] if sources else prefix}: no documents found")
        if chat is not None and not learned:
            raise DataError(
                f"{sources[0]}: no token to learn (no assistant turn with loss_on={chat['loss_on']!r})"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        mask_partial.unlink(missing_ok=True)
        raise
    np.frombuffer(ends, dtype=np.int64).tofile(prefix.with_suffix(".idx"))
    if chat is not None:
        mask_partial.rename(mask_path)
    else:
        mask_partial.unlink()
    meta = {
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "num_tokens": total,
        "num_documents": len(ends),
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "sources": sources,
        **({"chat": chat} if chat is not None else {}),
    }
    prefix.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    partial.rename(bin_path)
    return bin_path, total


def read_learned(path: Path) -> np.ndarray | None:
    """The learned-token mask of a prepared chat dataset (memory-mapped), or None for text."""
    if not is_prepared(path):
        return None
    meta = _read_meta(path.with_suffix(".json"))
    if "chat" not in meta:
        return None
    mask = path.with_suffix(".mask")
    if not mask.is_file() or mask.stat().st_size != meta["num_tokens"]:
        raise DataError(
            f"{mask}: a prepared chat dataset needs one mask byte per token ({meta['num_tokens']}); "
            "the file is missing or truncated: re-run python -m autopar.data.prepare --format chat"
        )
    return np.memmap(mask, dtype=np.uint8, mode="r").view(bool)


def document_ends(path: Path, tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Where each document of ``tokens`` ends: a prepared dataset's index (memory-mapped),
    else after every end-of-text token of a stream tokenized now."""
    if is_prepared(path):
        idx = path.with_suffix(".idx")
        return np.memmap(idx, dtype=np.int64, mode="r") if idx.stat().st_size else np.empty(0, np.int64)
    return np.flatnonzero(np.asarray(tokens) == eos_id) + 1


def prepared_chat(path: Path) -> dict[str, str] | None:
    """How a prepared chat dataset was rendered ({"loss_on", "template"}), or None."""
    return _read_meta(path.with_suffix(".json")).get("chat") if is_prepared(path) else None


_META_KEYS = ("version", "dtype", "num_tokens", "num_documents", "tokenizer", "vocab_size")
_IDX_CHUNK = 1 << 24


def _read_meta(meta_path: Path) -> dict:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{meta_path}: not readable JSON ({err})") from None
    missing = [key for key in _META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise DataError(f"{meta_path}: lacks {missing}; re-run python -m autopar.data.prepare")
    if meta["version"] != FORMAT_VERSION:
        raise DataError(
            f"{meta_path}: format version {meta['version']}, this autopar reads {FORMAT_VERSION}; "
            "re-run python -m autopar.data.prepare"
        )
    return meta


def _check_index(idx_path: Path, num_documents: int, num_tokens: int) -> None:
    """Document ends are strictly increasing, within the stream, and the last one ends it."""
    ends = np.memmap(idx_path, dtype=np.int64, mode="r") if idx_path.stat().st_size else np.empty(0, np.int64)
    if ends.size != num_documents or idx_path.stat().st_size != num_documents * 8:
        raise DataError(
            f"{idx_path}: {idx_path.stat().st_size} bytes, but {num_documents} documents need "
            f"{num_documents * 8}; the file is truncated or from another dataset"
        )
    previous = 0
    for start in range(0, ends.size, _IDX_CHUNK):
        chunk = np.asarray(ends[start : start + _IDX_CHUNK])
        steps = np.diff(chunk, prepend=previous)
        if (steps <= 0).any():
            k = start + int(np.argmax(steps <= 0))
            raise DataError(f"{idx_path}: document {k} ends at {int(ends[k])}, not after the one before")
        previous = int(chunk[-1])
    if previous != num_tokens:
        raise DataError(
            f"{idx_path}: the last document ends at {previous}, the stream has {num_tokens} tokens"
        )


def read_prepared(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """Memory-map a prepared dataset after checking it against its metadata: sizes, the
    document index, the dtype for its vocabulary, and the tokenizer that made it."""
    meta_path, bin_path, idx_path = (path.with_suffix(s) for s in (".json", ".bin", ".idx"))
    for file in (bin_path, idx_path, meta_path):
        if not file.is_file():
            raise DataError(
                f"{path}: a prepared dataset needs {bin_path.name}, {idx_path.name} and {meta_path.name}"
            )
    meta = _read_meta(meta_path)
    if meta["tokenizer"] != tokenizer.name or meta["vocab_size"] != tokenizer.vocab_size:
        raise DataError(
            f"{meta_path}: prepared with tokenizer {meta['tokenizer']!r} ({meta['vocab_size']} tokens), but "
            f"the job uses {tokenizer.name!r} ({tokenizer.vocab_size}); re-run python -m autopar.data.prepare "
            "with model.tokenizer_path"
        )
    if meta["num_tokens"] < 1:
        raise DataError(f"{meta_path}: the dataset holds no tokens")
    dtype = token_dtype(meta["vocab_size"])
    if meta["dtype"] != dtype.name:
        raise DataError(
            f"{meta_path}: dtype {meta['dtype']!r}, but a {meta['vocab_size']}-token vocabulary is stored as {dtype.name}"
        )
    expected = meta["num_tokens"] * dtype.itemsize
    if bin_path.stat().st_size != expected:
        raise DataError(
            f"{bin_path}: {bin_path.stat().st_size} bytes, but {meta_path.name} says {meta['num_tokens']} "
            f"{dtype.name} tokens ({expected} bytes); the file is truncated or from another dataset"
        )
    _check_index(idx_path, meta["num_documents"], meta["num_tokens"])
    return np.memmap(bin_path, dtype=dtype, mode="r")


def load_tokens(
    path: Path, tokenizer: Tokenizer, text_field: str = "text", section: str = "training"
) -> np.ndarray:
    """The token stream of a prepared dataset, or of text/jsonl files tokenized now (of the
    split ``section`` reads)."""
    if is_prepared(path):
        return read_prepared(path, tokenizer)
    return tokenize_files(source_files(path, section), tokenizer, text_field)
