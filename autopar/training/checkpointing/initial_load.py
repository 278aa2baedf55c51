"""Checks, before any work, of the checkpoints a job names: ``checkpoint.initial_load_path``
(the right kind, this model's shape) and ``checkpoint.load_step`` (a complete step)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from autopar.config.errors import ConfigError
from autopar.config.sections import Checkpoint
from autopar.models.args import ModelArgs
from autopar.models.hf import HFTensors
from autopar.models.hf_config import HFCheckpointError, read_hf_config
from autopar.training.checkpointing.dcp_state import READ_ERRORS, complete_steps, model_mismatch, saved_keys
from autopar.training.checkpointing.manifest import broken_file

DAMAGED_FIX = "copy or save it again, or start from other weights"


def check_initial_load(cfg: Checkpoint, args: ModelArgs, model_label: str) -> None:
    """``initial_load_path`` names a checkpoint of the right kind, and an HF one this model's
    shape (``model_label`` names the model in the message, e.g. ``qwen3/8B``)."""
    if cfg.initial_load_path is None:
        if cfg.initial_load_in_hf:
            raise ConfigError("checkpoint.initial_load_in_hf=true needs checkpoint.initial_load_path")
        return
    path = Path(cfg.initial_load_path)
    if not path.exists():
        raise ConfigError(f"checkpoint.initial_load_path={cfg.initial_load_path!r}: no such folder")
    if not cfg.initial_load_in_hf:
        _check_initial_dcp(path, args, model_label)
        return
    check_hf_weights(path, args, model_label, "checkpoint.initial_load_path")


def check_hf_weights(path: Path, args: ModelArgs, model_label: str, field: str) -> None:
    """The HF folder ``path`` (the job's ``field``) describes this model and holds every
    tensor in its shape (read from the files' headers, no weight read)."""
    try:
        hf_args = read_hf_config(path)
    except HFCheckpointError as err:
        raise ConfigError(f"{field}: {err}") from None
    for name in ModelArgs.__dataclass_fields__:
        # the MTP head is built only when a job asks for it (mtp.enable); HFTensors below
        # finds its tensors then
        if name in ("initializer_range", "max_position_embeddings", "mtp_num_hidden_layers"):
            continue
        ours, theirs = getattr(args, name), getattr(hf_args, name)
        if ours != theirs:
            raise ConfigError(
                f"{field}: model {model_label} has {name}={ours}, but {path / 'config.json'} has "
                f"{name}={theirs}; pick the matching flavor or set --model.{name} {theirs}"
            )
    try:
        HFTensors(path, args)  # every file readable, every tensor there in its shape
    except HFCheckpointError as err:
        raise ConfigError(f"{field}: {err}") from None


def _check_initial_dcp(path: Path, args: ModelArgs, model_label: str) -> None:
    """A DCP ``initial_load_path`` holds every weight of this model, each in its shape (the
    load itself is not strict: a missing or extra weight would pass unnoticed)."""
    field = f"checkpoint.initial_load_path={str(path)!r}"
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"{field} is not a DCP checkpoint (no .metadata); for an HF folder set "
            "checkpoint.initial_load_in_hf=true"
        )
    check_dcp_model(path, args, model_label, "checkpoint.initial_load_path")


def check_dcp_model(path: Path, args: ModelArgs, model_label: str, field: str) -> None:
    """The DCP checkpoint ``path`` (the job's ``field``) holds every weight of this model in
    its shape, read from its ``.metadata``."""
    named = f"{field}={str(path)!r}"
    try:
        mismatch = model_mismatch(path, args)
    except Exception as err:  # DCP unpickles .metadata: any error means a damaged file
        raise ConfigError(f"{named}: {path / '.metadata'} is not readable ({type(err).__name__})") from None
    if mismatch is not None:
        raise ConfigError(
            f"{named} was saved from another model than {model_label}: {mismatch}; start from a "
            "checkpoint of this model (a LoRA run's saves hold its adapters only), or set the "
            "--model.* fields it was saved with"
        )


def check_dcp_weights(path: Path, field: str) -> None:
    """A DCP folder of weights, named by the job's ``field``, is there and its ``.metadata``
    reads: one line before any work (its files are verified when read: ``reading_weights``)."""
    named = f"{field}={str(path)!r}"
    if not path.is_dir():
        raise ConfigError(f"{named}: no such folder")
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{named} is not a DCP checkpoint (no .metadata)")
    try:
        saved_keys(path)
    except READ_ERRORS as err:  # DCP unpickles .metadata: any error means a damaged file
        raise ConfigError(
            f"{named}: {path / '.metadata'} is damaged ({type(err).__name__}); {DAMAGED_FIX}"
        ) from None


@contextmanager
def reading_weights(path: Path | str, field: str) -> Iterator[None]:
    """Reading weights from the DCP folder ``path`` (the job's ``field``), its files verified
    first against the manifest a run's saves carry (collective under a process group: the
    ranks share the checksumming), naming the damaged file; without a manifest, a file that
    cannot be read is one line naming the folder."""
    problem = broken_file(Path(path))
    if problem is not None:
        raise ConfigError(f"{field}={str(path)!r} is damaged: {problem}; {DAMAGED_FIX}")
    try:
        yield
    except READ_ERRORS as err:
        cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) else err
        raise ConfigError(
            f"{field}={str(path)!r}: a file of it is damaged ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0]}); {DAMAGED_FIX}"
        ) from None


def check_load_step(cfg: Checkpoint, dump_folder: str) -> None:
    """An explicit ``load_step`` names a complete checkpoint of this job (whether its files
    are intact is checked when resuming, by every rank)."""
    if cfg.load_step < -1:
        raise ConfigError(
            f"checkpoint.load_step={cfg.load_step}: use -1 (the latest complete checkpoint) or a saved step number"
        )
    if cfg.load_step == -1:
        return
    if not cfg.enable:
        raise ConfigError(f"checkpoint.load_step={cfg.load_step} needs checkpoint.enable=true")
    folder = Path(dump_folder) / cfg.folder
    steps = complete_steps(folder)
    if cfg.load_step not in steps:
        raise ConfigError(
            f"checkpoint.load_step={cfg.load_step}: no complete checkpoint {folder}/step-{cfg.load_step}; "
            f"complete steps there: {steps}"
        )
