"""Which files of a dataset folder are data, and which split of it a job reads.

Hub downloads and ``DatasetDict.save_to_disk`` keep splits side by side: as folders (``train/``
and ``test/``, Parquet shards or ``save_to_disk`` folders, with or without ``dataset_dict.json``)
or as file names (``data/train-00000-of-00002.parquet``, ``test.jsonl``). Reading such a folder
whole would train on the test split, so one split is read, and one log line says which:
``train`` for ``[training]``; ``validation``, else ``test``, for ``[validation]``. Another split
is read by pointing at its folder or files. A folder whose files name several splits and also
hold files of none is refused: which of them are training data cannot be told.

A folder's hidden files (``.cache/`` that ``hf download`` writes, ``.ipynb_checkpoints/``) and
its dataset cards (``README.md``) are not data.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from autopar.data.errors import DataError

logger = logging.getLogger(__name__)

SPLIT_WORDS = (
    "train",
    "training",
    "validation",
    "valid",
    "val",
    "dev",
    "test",
    "testing",
    "eval",
    "evaluation",
)
"""Names that make a folder, or the start of a file name, a split (the words ``datasets``
recognizes)."""
WANTED = {
    "training": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev", "test", "testing", "eval", "evaluation"),
    "prepare": ("train", "training"),
}
"""The split each reader reads (prepare writes training data), first found wins."""
DATASET_CARDS = ("readme.md",)
_SHARD = re.compile(r"^(?P<split>\w+?)-\d{5}-of-\d{5}")
_WORD = re.compile(rf"^({'|'.join(SPLIT_WORDS)})(?=[-._ 0-9]|$)", re.IGNORECASE)


def folder_files(root: Path) -> list[Path]:
    """Every file under ``root`` that may be data, sorted: hidden paths and dataset cards are
    left out."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and p.name.lower() not in DATASET_CARDS
    )


def split_of(relative: Path) -> str | None:
    """The split a file's path below the dataset folder names: a folder named as a split,
    else the file's shard name (``NAME-00000-of-00004``) or leading split word; None: none."""
    for part in relative.parts[:-1]:
        if part.lower() in SPLIT_WORDS:
            return part.lower()
    shard = _SHARD.match(relative.name)
    if shard:
        return shard["split"]
    word = _WORD.match(relative.name)
    return word[1].lower() if word else None


def one_split(root: Path, files: list[Path], section: str, announce: bool = True) -> list[Path]:
    """``files`` (under ``root``), or those of the split ``section`` reads when they name
    several splits."""
    groups: dict[str | None, list[Path]] = {}
    for file in files:
        groups.setdefault(split_of(file.relative_to(root)), []).append(file)
    named = sorted(name for name in groups if name is not None)
    if len(named) < 2:
        return files
    if None in groups:
        raise DataError(
            f"{root}: holds the files of splits {', '.join(named)} and files of none "
            f"({groups[None][0].relative_to(root)}), an unknown layout; move the files to train on "
            f"into a folder of their own and point {setting(section)} there"
        )
    return choose(root, {name: groups[name] for name in named}, section, announce)


def setting(section: str) -> str:
    """What names the data of ``section``: a job's ``<section>.dataset_path``, or prepare's
    ``--input``."""
    return "--input" if section == "prepare" else f"{section}.dataset_path"


def choose(root: Path, splits: dict[str, list[Path]], section: str, announce: bool = True) -> list[Path]:
    """The files of the split ``section`` reads (``WANTED``), said in one log line; a
    DataError naming the splits when none of them is one it reads."""
    if len(splits) == 1:
        return next(iter(splits.values()))
    order = WANTED[section]
    wanted = next((name for name in order if name in splits), None)
    names = ", ".join(sorted(splits))
    if wanted is None:
        reads = " or ".join(repr(name) for name in order if name in ("train", "validation", "test"))
        raise DataError(
            f"{root}: holds the splits {names}, and {section} reads {reads}; point "
            f"{setting(section)} at one split's folder or files"
        )
    if announce:
        logger.info(
            "%s: holds the splits %s; %s reads %r (%d file(s)); to read another, point "
            "%s at its folder or files",
            root,
            names,
            section,
            wanted,
            len(splits[wanted]),
            setting(section),
        )
    return splits[wanted]
