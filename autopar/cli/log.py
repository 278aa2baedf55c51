"""Logging with the rank in every line; only rank 0 speaks unless asked otherwise."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from autopar.parallel.torch_internals import untested_torch_warning


def setup_logging(rank: int, all_ranks: bool = False) -> None:
    level = logging.INFO if rank == 0 or all_ranks else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # DTensor notes every two-step reduction on 2-D meshes (the gradient norm of FSDP x TP
    # does one per step); useful when tuning, noise in a training log.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def warn_if_untested_torch() -> None:
    """One warning line when this torch is newer than the range autopar was tested with."""
    warning = untested_torch_warning()
    if warning is not None:
        logging.getLogger("autopar").warning(warning)


@contextmanager
def quiet(level: int = logging.WARNING) -> Iterator[None]:
    """autopar's own lines below ``level`` dropped inside, the level before restored after:
    a parity run in this process leaves a later training's log as it was."""
    logger = logging.getLogger("autopar")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
