"""The files of an HF checkpoint folder: which safetensors file holds each tensor, checked
before any weight is read (a damaged folder is one line naming the file and the fix), and the
names the export writes. transformers reads one of two schemes and nothing else:
``model.safetensors`` alone, or ``model-0000k-of-0000n.safetensors`` beside a
``model.safetensors.index.json`` that names every tensor (a ``model.safetensors`` beside an
index is read alone, the index ignored)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from autopar.models.hf_config import HFCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_REDOWNLOAD = "the download is incomplete or damaged: download the model again"


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open`` whose failure names the file (a truncated download fails here, at its header)."""
    try:
        handle = safe_open(file, framework="pt")
    except (SafetensorError, OSError) as err:
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({err}); {_REDOWNLOAD}") from None
    with handle as f:
        yield f


def check_folder(path: Path) -> None:
    """``path`` is a folder (an HF model is one: config.json beside its safetensors)."""
    if path.is_file():
        raise HFCheckpointError(
            f"{path}: a file, not a folder; name the model's folder (the one holding config.json "
            f"and the safetensors, here {path.parent})"
        )
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: no such folder; download the model there")


def tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file of the folder ``path`` that holds it, from the
    index if there is one (every shard checked to hold what the index says), else from
    ``model.safetensors``."""
    check_folder(path)
    if (path / INDEX_FILE).is_file():
        return _indexed_files(path)
    single = path / SINGLE_FILE
    if not single.is_file():
        if any(path.glob("*.bin")):
            raise HFCheckpointError(
                f"{path}: holds PyTorch .bin weights, no {SINGLE_FILE} or {INDEX_FILE}; autopar reads "
                "safetensors: download the model's safetensors, or convert with transformers "
                "(from_pretrained, then save_pretrained)"
            )
        raise HFCheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found; {_REDOWNLOAD}")
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)


def _indexed_files(path: Path) -> dict[str, Path]:
    index = path / INDEX_FILE
    weight_map = _weight_map(index)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        held = f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise HFCheckpointError(
                f"{index}: shard {shard!r} (holding {held}) is outside the model's folder; an index "
                "names files inside its folder: fix the entry or download the model again"
            )
        if not (path / shard).is_file():
            raise HFCheckpointError(
                f"{index}: shard {shard!r} (holding {held}) is not in {path}; {_REDOWNLOAD}"
            )
        with open_safetensors(path / shard) as f:
            absent = sorted(set(names) - set(f.keys()))
        if absent:
            raise HFCheckpointError(
                f"{index}: names {shard} for {absent[0]!r}, but that file does not hold it "
                f"({len(absent)} such tensor(s)); the index and its shards are from different "
                "downloads: download the model again"
            )
    return {name: path / shard for name, shard in weight_map.items()}


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file, refused unless it is one."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise HFCheckpointError(
            f"{index}: not an index with a weight_map ({type(err).__name__}: {err}); {_REDOWNLOAD}"
        ) from None
    if not isinstance(weight_map, Mapping):
        raise HFCheckpointError(
            f"{index}: weight_map is a {type(weight_map).__name__}, not an object mapping each tensor "
            f"name to its shard file; {_REDOWNLOAD}"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise HFCheckpointError(
                f"{index}: weight_map[{name!r}] is {shard!r}, not a shard file name; {_REDOWNLOAD}"
            )
    return dict(weight_map)


def shard_file(k: int, count: int) -> str:
    """The ``k``-th of ``count`` shards (from 1) as transformers names them."""
    return f"model-{k:05d}-of-{count:05d}.safetensors"


def write_index(out: Path, weight_map: Mapping[str, str]) -> None:
    """The index of the shards of ``out``: every tensor's file, and their total size."""
    total = sum(_data_bytes(out / shard) for shard in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(weight_map)}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _data_bytes(file: Path) -> int:
    """The bytes of a safetensors file's tensors: the file less its 8-byte length and header."""
    with file.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return file.stat().st_size - 8 - header
