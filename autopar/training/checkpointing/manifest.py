"""The manifest a checkpoint is verified by: every file of a save with its size and CRC-32.

CRC-32 because zlib streams it at disk speed and it catches truncation and flipped bytes,
which is what goes wrong on disk; it is no defence against tampering. The ranks share the
checksumming, on save and on resume."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(names: list[str]) -> list[str]:
    """This rank's part of a list every rank holds: every world-size-th name."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gathered(mine: list[Any]) -> list[Any]:
    """Every rank's list, concatenated in rank order (the same on every rank)."""
    if not dist.is_initialized():
        return mine
    every: list[list[Any]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return [item for items in every for item in items]


def write_manifest(folder: Path) -> None:
    """List every file in ``folder`` with its size and CRC-32 (collective: ranks share the
    checksumming, rank 0 writes the list)."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    mine = [(name, (folder / name).stat().st_size, _crc32(folder / name)) for name in _my_share(names)]
    files = {name: {"bytes": size, "crc32": crc} for name, size, crc in _gathered(mine)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def broken_file(folder: Path) -> str | None:
    """What is wrong with the checkpoint in ``folder`` by its manifest (collective), or None.
    A checkpoint without a manifest (saved before manifests existed) is not checked."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    files, problems = _read_manifest(manifest)
    for name in _my_share(sorted(files)):
        path, expected = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (size := path.stat().st_size) != expected["bytes"]:
            problems.append(f"{path} has {size} bytes, {expected['bytes']} were written")
        elif _crc32(path) != expected["crc32"]:
            problems.append(f"{path} does not match the checksum written with it")
    problems = _gathered(problems)
    return problems[0] if problems else None


def _read_manifest(manifest: Path) -> tuple[dict[str, Any], list[str]]:
    """The files a manifest lists ({name: {"bytes", "crc32"}}), or none and the problem when
    the manifest itself is damaged (the checkpoint then counts as broken)."""
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        if all(isinstance(e["bytes"], int) and isinstance(e["crc32"], int) for e in files.values()):
            return files, []
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not a manifest's
        pass
    return {}, [f"{manifest} is damaged (not a JSON list of files, sizes and checksums)"]
