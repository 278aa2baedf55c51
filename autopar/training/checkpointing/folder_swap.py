"""Replacing a folder so that one whole copy is on disk at every moment (checkpoints, exports)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

logger = logging.getLogger("autopar")


def swap_into_place(new: Path, final: Path, aside: Path) -> None:
    """Rename the complete folder ``new`` to ``final``. A ``final`` already there is renamed to
    ``aside`` first and deleted only once ``new`` is in place, so at every moment one of them
    is whole on disk (``finish_interrupted_swap`` tidies up after a kill in between)."""
    finish_interrupted_swap(final, aside)
    if final.exists():
        final.rename(aside)
    new.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


def finish_interrupted_swap(final: Path, aside: Path) -> None:
    """After ``swap_into_place`` was killed: the old folder goes back to ``final`` when the
    new one never got there, and is deleted when it did."""
    if not aside.exists():
        return
    if final.exists():
        shutil.rmtree(aside)
    else:
        aside.rename(final)
        logger.warning("%s: put back in place (a replacement of it was interrupted)", final)
