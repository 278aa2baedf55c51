"""A job as the trainer and the tools read it: the config parser bound to the model's
argument names, the model args a job resolves to, and jobs derived from a base job.

``autopar.config`` cannot import the model (it is the ground floor), so the names that
``[model]`` accepts besides its own fields are passed to it from here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

from autopar.config import parse
from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.data.chat import ChatFormat
from autopar.models.args import ModelArgs
from autopar.models.flavors import get_flavor, with_overrides
from autopar.models.hf import HFCheckpointError, read_hf_config

MODEL_FIELDS = parse.field_types(ModelArgs)
"""Model argument name -> type: what ``--model.<arg>`` and ``[model]`` keys may set."""


def parse_job(argv: list[str]) -> JobConfig:
    """The resolved JobConfig of a command line (CLI > TOML > defaults), not yet validated."""
    return parse.parse_job(argv, MODEL_FIELDS)


def set_field(job: JobConfig, dotted: str, value: str) -> None:
    """Assign one ``section.field`` from a string, as the command line would."""
    parse.set_field(job, dotted, value, True, MODEL_FIELDS)


def derive_job(base: JobConfig, overrides: Iterable[str]) -> JobConfig:
    """A copy of ``base`` with ``key=value`` overrides applied as command-line flags."""
    return parse.derive_job(base, overrides, MODEL_FIELDS)


def short_run(job: JobConfig, steps: int) -> JobConfig:
    """``job`` cut to a ``steps``-step measurement: warmup clamped, no checkpoints or export."""
    job = copy.deepcopy(job)
    job.training.steps = steps
    job.lr_scheduler.warmup_steps = min(job.lr_scheduler.warmup_steps, steps)
    job.checkpoint.enable = False
    job.checkpoint.last_save_in_hf = False
    return job


def model_args(job: JobConfig) -> ModelArgs:
    """The job's model: the flavor, or the config.json of ``model.hf_assets_path``, with the
    ``[model]`` overrides applied."""
    model = job.model
    if model.hf_assets_path is None:
        try:
            return get_flavor(model.name, model.flavor, **model.overrides)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if not Path(model.hf_assets_path).is_dir():
        name = Path(model.hf_assets_path).name
        raise ConfigError(
            f"model.hf_assets_path={model.hf_assets_path!r}: no such folder; download the model there "
            f"(e.g. huggingface-cli download Qwen/{name} --local-dir {model.hf_assets_path}), "
            f"or unset it (--model.hf_assets_path none) to build flavor {model.flavor!r}"
        )
    try:
        args = read_hf_config(model.hf_assets_path)
    except HFCheckpointError as err:
        raise ConfigError(f"model.hf_assets_path: {err}") from None
    family = "qwen3" if args.qk_norm else "qwen2.5"
    if model.name != family:
        raise ConfigError(
            f"model.name={model.name!r}, but {model.hf_assets_path}/config.json is a {family} "
            f"model; set model.name={family!r}"
        )
    try:
        return with_overrides(args, model.overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def tokenizer_path(job: JobConfig) -> str | None:
    """The tokenizer the job uses: ``model.tokenizer_path``, else the tokenizer.json of
    ``model.hf_assets_path``; None for the built-in byte tokenizer."""
    if job.model.tokenizer_path is not None:
        return job.model.tokenizer_path
    assets = job.model.hf_assets_path
    if assets is not None and (Path(assets) / "tokenizer.json").is_file():
        return assets
    return None


def chat_format(job: JobConfig) -> ChatFormat | None:
    """How the job's data files are rendered when they hold conversations (None: plain text)."""
    training = job.training
    path = tokenizer_path(job)
    if training.dataset_format != "chat" or path is None:
        return None
    return ChatFormat(path, training.chat_template, training.loss_on)
