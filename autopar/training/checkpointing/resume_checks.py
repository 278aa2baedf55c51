"""What a resume is checked against: the data and base a checkpoint records, compared with the
job's before any step (refused when the weights would not fit), and after the load the
changes since the save (said in a line, and applied from here on)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from autopar.config.sections import JobConfig
from autopar.data.dataset import SampleSource
from autopar.data.errors import DataError
from autopar.data.tokenizer import tokenizer_file
from autopar.models.args import ModelArgs
from autopar.training.checkpointing.checkpoint import Checkpointer
from autopar.training.checkpointing.previous_run import changed_settings, listed
from autopar.training.faults import TrainingStopped
from autopar.training.optim import follow_config
from autopar.training.resolve import tokenizer_path

logger = logging.getLogger("autopar")


def data_identity(job: JobConfig, samples: SampleSource) -> dict[str, str]:
    """What the job trains on, as a checkpoint records it: the tokenizer (its file and a digest
    of it) and the dataset with its format."""
    path = tokenizer_path(job)
    if path is None:
        tokenizer, digest = "the built-in byte tokenizer", "byte"
    else:
        file = tokenizer_file(path)
        tokenizer, digest = str(file), hashlib.sha256(file.read_bytes()).hexdigest()
    return {
        "tokenizer": tokenizer,
        "tokenizer_sha256": digest,
        "dataset": f"{samples.describe()} as {job.training.dataset_format}",
    }


def lora_base(job: JobConfig) -> str:
    """The frozen weights a LoRA run's adapters were trained on, as its checkpoints record it."""
    checkpoint = job.checkpoint
    return checkpoint.initial_load_path or f"seeded initialization (debug.seed {job.debug.seed})"


def check_resumed_tokenizer(checkpointer: Checkpointer, data: dict[str, str]) -> None:
    """Refuse, before any step, to resume a checkpoint trained with another tokenizer: its
    embeddings were learned for other token ids."""
    candidate = checkpointer.candidate_train_state()
    if candidate is None:
        return
    step, saved = candidate
    if saved.get("tokenizer_sha256", data["tokenizer_sha256"]) == data["tokenizer_sha256"]:
        return
    path = checkpointer.folder / f"step-{step}"
    raise DataError(
        f"{path} was trained with tokenizer {saved['tokenizer']}, this job uses {data['tokenizer']}: "
        f"resuming would continue on other token ids. Give this job its own --job.dump_folder "
        f"(to start from those weights anyway: --checkpoint.initial_load_path {path})"
    )


def check_resumed_base(checkpointer: Checkpointer, job: JobConfig) -> None:
    """Refuse, before any step, to resume LoRA adapters on another base than they were
    trained on: a LoRA checkpoint holds the adapters only."""
    candidate = checkpointer.candidate_train_state() if job.lora.enable else None
    if candidate is None:
        return
    step, saved = candidate[0], candidate[1].get("lora_base")
    if saved is None or saved == lora_base(job):
        return
    path = checkpointer.folder / f"step-{step}"
    raise TrainingStopped(
        f"{path} holds LoRA adapters trained on {saved}, but this job's base is {lora_base(job)}: "
        f"resume with the base they were trained on (--checkpoint.initial_load_path {saved}), or give "
        "this job its own --job.dump_folder"
    )


def follow_this_job(
    job: JobConfig,
    args: ModelArgs,
    optimizers: list[torch.optim.Optimizer],
    checkpointer: Checkpointer,
    step: int,
    saved: dict[str, Any],
) -> None:
    """After a resume to ``step``: AdamW's hyperparameters are this job's (loading the
    checkpoint put back the saved ones), the settings changed since the checkpoint are said in
    one line, and a rewind to an explicit checkpoint.load_step discards the later checkpoints."""
    follow_config(optimizers, job.optimizer)
    changes = changed_settings(saved, job, args)
    if changes and step < job.training.steps:  # else nothing runs with them
        logger.info(
            "resuming step %d with settings changed since its checkpoint, applied from here on: %s",
            step,
            listed(changes, most=len(changes)),
        )
    if job.checkpoint.load_step >= 0:
        discarded = checkpointer.discard_after(step)
        if discarded:
            logger.warning(
                "rewound to step %d (checkpoint.allow_rewind): discarded checkpoints %s and the "
                "metrics of the steps after it",
                step,
                ", ".join(f"step-{s}" for s in discarded),
            )


def warn_changed_data_shape(
    step: int, saved: dict[str, Any], data: dict[str, str], now: dict[str, int]
) -> None:
    """Resuming with other data (``data``), seq_len or batch (``now``) works, but is not the
    run that was saved (another tokenizer is refused at start)."""
    if saved.get("dataset", data["dataset"]) != data["dataset"]:
        logger.warning(
            "resuming step %d on other data: the checkpoint was trained on %s, this job reads %s; "
            "the data position (%d samples) is carried over to it. For a new run on this data use "
            "another --job.dump_folder",
            step,
            saved["dataset"],
            data["dataset"],
            saved["consumed_samples"],
        )
    changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    if not changed:
        return
    logger.warning(
        "resuming step %d with %s since the checkpoint: the data position is kept in samples "
        "(%d so far), so with another seq_len the next text is not where the saved run stopped "
        "(some is skipped or seen twice), and with another batch each later step takes another "
        "number of tokens under the same learning-rate schedule; the losses will not match an "
        "uninterrupted run",
        step,
        ", ".join(changed),
        saved["consumed_samples"],
    )
