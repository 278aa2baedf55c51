"""Logging with the rank in every line; only rank 0 speaks unless asked otherwise."""

from __future__ import annotations

import logging


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
