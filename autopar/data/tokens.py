"""Token streams: documents from text/jsonl, tokenized and joined with end-of-text tokens.

A prepared dataset is ``NAME.bin`` (the flat token stream, uint16 or uint32), ``NAME.idx``
(where each document ends) and ``NAME.json`` (dtype, sizes, the tokenizer that made it). It is memory-mapped, so a dataset far
larger than RAM costs nothing to open; Megatron users know this as an indexed dataset.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from autopar.data.tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
FORMAT_VERSION = 1
BUILTIN_DATASETS = {"autopar_corpus": Path(__file__).parent / "corpus"}
"""Datasets shipped with autopar, by the name ``training.dataset`` uses."""


class DataError(ValueError):
    """A dataset that cannot be read; the message names the file."""


def source_files(path: Path) -> list[Path]:
    """The text / jsonl files under ``path`` (itself, or a folder's files in sorted order)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
    if not files:
        raise DataError(f"{path}: holds no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
    return files


def documents(path: Path) -> Iterator[str]:
    """Documents of a text file (the whole file) or a jsonl file (the "text" of each line)."""
    if path.suffix in JSONL_SUFFIXES:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f'{path}:{lineno}: not a JSON object with a "text" field') from None
    elif path.suffix in TEXT_SUFFIXES:
        yield path.read_text(encoding="utf-8")
    else:
        raise DataError(f"{path}: unsupported file type; use {TEXT_SUFFIXES + JSONL_SUFFIXES}")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_files(files: list[Path], tokenizer: Tokenizer) -> np.ndarray:
    """One token stream: every document followed by end-of-text."""
    chunks = []
    for file in files:
        for doc in documents(file):
            chunks.append(np.asarray([*tokenizer.encode(doc), tokenizer.eos_id], dtype=np.int64))
    if not chunks:
        raise DataError(f"{files[0].parent}: no documents found")
    return np.concatenate(chunks).astype(token_dtype(tokenizer.vocab_size))


def is_prepared(path: Path) -> bool:
    """A ``.bin`` path, or a prefix with ``.bin`` and ``.json`` beside it."""
    if path.suffix == ".bin":
        return True
    return path.with_suffix(".json").is_file() and path.with_suffix(".bin").is_file()


def write_prepared(tokens: np.ndarray, prefix: Path, tokenizer: Tokenizer, sources: list[str]) -> Path:
    """Write ``prefix.bin`` (tokens), ``prefix.idx`` (int64 end offset of every document) and
    ``prefix.json``; the .bin is renamed into place when complete."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path = prefix.with_suffix(".bin")
    partial = bin_path.with_suffix(".bin.partial")
    tokens.tofile(partial)
    document_ends = np.flatnonzero(tokens == tokenizer.eos_id).astype(np.int64) + 1
    document_ends.tofile(prefix.with_suffix(".idx"))
    partial.rename(bin_path)
    meta = {
        "version": FORMAT_VERSION,
        "dtype": tokens.dtype.name,
        "num_tokens": int(tokens.size),
        "num_documents": int(document_ends.size),
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "sources": sources,
    }
    prefix.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return bin_path


def read_prepared(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """Memory-map a prepared dataset, refusing one made with another tokenizer."""
    meta_path = path.with_suffix(".json")
    bin_path = path.with_suffix(".bin")
    if not meta_path.is_file() or not bin_path.is_file():
        raise DataError(f"{path}: a prepared dataset needs both {bin_path.name} and {meta_path.name}")
    meta = json.loads(meta_path.read_text())
    if meta.get("tokenizer") != tokenizer.name:
        raise DataError(
            f"{meta_path}: prepared with tokenizer {meta.get('tokenizer')!r}, but the job uses "
            f"{tokenizer.name!r}; re-run python -m autopar.data.prepare with model.tokenizer_path"
        )
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")
    if tokens.size != meta["num_tokens"]:
        raise DataError(f"{bin_path}: holds {tokens.size} tokens, {meta_path.name} says {meta['num_tokens']}")
    return tokens


def load_tokens(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """The token stream of a prepared dataset, or of text/jsonl files tokenized now."""
    if is_prepared(path):
        return read_prepared(path, tokenizer)
    return tokenize_files(source_files(path), tokenizer)
