"""A job as the trainer and the tools read it: the config parser bound to the model's
argument names, the model args a job resolves to, and jobs derived from a base job.

``autopar.config`` cannot import the model (it is the ground floor), so the names that
``[model]`` accepts besides its own fields are passed to it from here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from pathlib import Path

from autopar.config import parse
from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig, Model
from autopar.data.chat import CHATML_TOKENIZER, ChatFormat
from autopar.models.args import ModelArgs
from autopar.models.flavors import get_flavor, with_overrides
from autopar.models.hf_config import HFCheckpointError, read_hf_config
from autopar.training.objectives.mtp.checks import head_layers_of

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
    """The job's model: the config.json of ``model.hf_assets_path``, else the flavor (also for
    an assets folder holding only a tokenizer, as torchtitan's ``--assets tokenizer`` download
    leaves it), with the ``[model]`` overrides applied."""
    model = job.model
    if model.hf_assets_path is None:
        return _flavor_args(job)
    if Path(model.hf_assets_path).is_file():
        raise ConfigError(
            f"model.hf_assets_path={model.hf_assets_path!r} is a file; name the model's folder (here "
            f"{Path(model.hf_assets_path).parent}), or give a tokenizer.json as model.tokenizer_path"
        )
    if not Path(model.hf_assets_path).is_dir():
        name = Path(model.hf_assets_path).name
        raise ConfigError(
            f"model.hf_assets_path={model.hf_assets_path!r}: no such folder; download the model there "
            f"(e.g. huggingface-cli download Qwen/{name} --local-dir {model.hf_assets_path}), "
            f"or unset it (--model.hf_assets_path none) to build flavor {model.flavor!r}"
        )
    if not _has_config(job):
        return _flavor_args(job)
    try:
        args = read_hf_config(model.hf_assets_path)
    except HFCheckpointError as err:
        raise ConfigError(f"model.hf_assets_path: {err}") from None
    family = args.family
    if model.name != family:
        raise ConfigError(
            f"model.name={model.name!r}, but {model.hf_assets_path}/config.json is a {family} "
            f"model; set model.name={family!r}"
        )
    if job.mtp.enable:  # the folder's head, built and loaded as the model's own
        args = dataclasses.replace(args, mtp_num_hidden_layers=head_layers_of(job, args))
    try:
        return with_overrides(args, model.overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _flavor_args(job: JobConfig) -> ModelArgs:
    try:
        return get_flavor(job.model.name, job.model.flavor, **job.model.overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _has_config(job: JobConfig) -> bool:
    return job.model.hf_assets_path is not None and (Path(job.model.hf_assets_path) / "config.json").is_file()


SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def model_source(job: JobConfig) -> str:
    """Where the model's shape comes from, for the start-up summary."""
    model = job.model
    if model.hf_assets_path is None:
        return f"flavor {model.flavor}"
    if not _has_config(job):
        return f"flavor {model.flavor} (no config.json in {model.hf_assets_path}: shape from the flavor)"
    return f"{model.hf_assets_path}/config.json"


def flavor_mismatch(job: JobConfig) -> str | None:
    """One line when the job names a flavor (other than the default) whose shape differs from
    its assets folder's config.json, which wins; None otherwise."""
    model = job.model
    if not _has_config(job) or model.flavor == Model().flavor:
        return None
    try:
        flavor = get_flavor(model.name, model.flavor)
        config = read_hf_config(model.hf_assets_path)
    except (ValueError, HFCheckpointError):
        return None
    differ = [
        f"{k} {getattr(flavor, k)} vs {getattr(config, k)}"
        for k in SHAPE_FIELDS
        if getattr(flavor, k) != getattr(config, k)
    ]
    if not differ:
        return None
    return (
        f"model.flavor={model.flavor!r} and {model.hf_assets_path}/config.json are different models "
        f"({', '.join(differ)}); training the config.json's. To train the flavor, set "
        "model.tokenizer_path to the folder and unset model.hf_assets_path; else name the matching flavor"
    )


SHIPPED_TOKENIZERS = {"chatml": CHATML_TOKENIZER}
"""Tokenizers shipped with autopar, by the name ``model.tokenizer_path`` may give (a preset
names one wherever the package is installed)."""


def tokenizer_path(job: JobConfig) -> str | None:
    """The tokenizer the job uses: ``model.tokenizer_path`` (a path, or a name of
    ``SHIPPED_TOKENIZERS``), else the tokenizer.json of ``model.hf_assets_path``; None for the
    built-in byte tokenizer."""
    if job.model.tokenizer_path is not None:
        shipped = SHIPPED_TOKENIZERS.get(job.model.tokenizer_path)
        if shipped is not None and not Path(job.model.tokenizer_path).exists():
            return str(shipped)
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
