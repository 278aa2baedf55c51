"""``dpo.reference = "precomputed"``: the reference's log-probabilities of every pair, computed
in one pass before training and kept beside the job, so training holds no reference.

The table is keyed by a digest of the pairs' token ids and of where the reference's weights
come from: a later run (a resume) reads it back, and one whose data or reference changed is
refused rather than trained against another model's numbers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.config.errors import ConfigError
from autopar.data.loader import Batch
from autopar.data.pair_batches import PairIds
from autopar.training.objectives.dpo.objective import ReferenceLogps

logger = logging.getLogger("autopar")

TABLE_FILE = "reference_logps.pt"
"""The table's file in ``job.dump_folder``: {"key": digest, "logps": (N, 2) fp32}."""


def table_key(pairs: Sequence[PairIds], reference: str) -> str:
    """A digest of the pairs' token ids, in order, and of the reference's description."""
    digest = hashlib.sha256(reference.encode())
    for pair in pairs:
        for ids in (pair.prompt, pair.chosen, pair.rejected):
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(ids.astype("<i8").tobytes())
    return digest.hexdigest()


def read_table(path: Path, key: str) -> torch.Tensor | None:
    """The table at ``path`` if it is there and of this key; a table of other pairs or another
    reference is refused (it would train against the wrong numbers)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        table, saved_key = saved["logps"], saved["key"]
    except Exception as err:  # a damaged file: compute it again
        logger.warning("%s could not be read (%s); computing the reference log-probs again", path, err)
        return None
    if saved_key != key:
        raise ConfigError(
            f"{path} holds reference log-probs of other pairs or another reference than this job's; "
            "delete it to compute them again, or give this job its own --job.dump_folder"
        )
    return table


def compute_table(
    reference: ReferenceLogps,
    pairs: Sequence[PairIds],
    local_batch: int,
    pack: Callable[[Sequence[PairIds]], Batch],
    device: torch.device,
    dp_mesh: DeviceMesh | None,
) -> torch.Tensor:
    """(N, 2) chosen and rejected reference log-probabilities of every pair: micro-batches of
    ``local_batch`` pairs dealt round-robin to the data-parallel ranks (every rank runs as many,
    the last ones wrapping round, as FSDP's collectives need), then summed over them."""
    n, dp = len(pairs), 1 if dp_mesh is None else dp_mesh.size()
    rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
    batches = -(-n // local_batch)
    table = torch.zeros(n, 2, device=device)
    written = torch.zeros(n, 1, device=device)
    for b in range(rank, -(-batches // dp) * dp, dp):
        indices = [(b * local_batch + k) % n for k in range(local_batch)]
        packed = pack([pairs[i] for i in indices])
        batch = Batch(packed.inputs.to(device), packed.labels.to(device), packed.documents.to(device))
        (logps,) = reference([batch])
        logps = logps.view(-1, 2)
        index = torch.tensor(indices, device=device)
        table.index_copy_(0, index, logps)
        written.index_fill_(0, index, 1.0)
    if dp > 1:
        dist.all_reduce(table, group=dp_mesh.get_group())
        dist.all_reduce(written, group=dp_mesh.get_group())
    return table / written  # a pair two ranks both computed (wrapping round) is counted once


def save_table(path: Path, table: torch.Tensor, key: str) -> None:
    """Write the table atomically (a stopped pass leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"key": key, "logps": table.cpu()}, partial)
    partial.replace(path)
