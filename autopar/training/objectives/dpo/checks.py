"""A preference job's checks, before any work: ``[dpo]`` against the data, the plan and the
model, and ``dpo.reference_path`` against the model it must hold (``check_preference``,
called by ``training.preflight``)."""

from __future__ import annotations

from pathlib import Path

from autopar.config.checks import changed_fields
from autopar.config.errors import ConfigError
from autopar.config.sections import DPO, JobConfig
from autopar.models.args import ModelArgs
from autopar.models.hf_config import CONFIG_FILE
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import check_forward_only_schedule
from autopar.training.checkpointing.adapters import ADAPTER_CONFIG
from autopar.training.checkpointing.dcp_state import saved_keys
from autopar.training.checkpointing.initial_load import check_dcp_model, check_dcp_weights, check_hf_weights
from autopar.training.objectives.dpo.loss import LOSS_TYPES, SMOOTHED


def is_preference(job: JobConfig) -> bool:
    return job.training.dataset_format == "preference"


def check_preference(job: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """``[dpo]`` and the plan agree with preference data (and ``[dpo]`` is not set without
    it), and ``dpo.reference_path`` holds this model's weights."""
    cfg = job.dpo
    if not is_preference(job):
        _check_unused(cfg)
        return
    _check_losses(cfg)
    seq_len = job.training.seq_len
    if cfg.max_length != -1 and cfg.max_length < 2:
        raise ConfigError(
            f"dpo.max_length={cfg.max_length} must be at least 2 (a prompt token and a completion token), "
            "or -1 (half of training.seq_len)"
        )
    if cfg.max_length != -1 and 2 * cfg.max_length > seq_len:
        raise ConfigError(
            f"dpo.max_length={cfg.max_length}: a pair (two sequences) must fit one row of training.seq_len="
            f"{seq_len}; use at most {seq_len // 2}, or -1"
        )
    if cfg.reference == "adapters_off" and not job.lora.enable:
        raise ConfigError(
            "dpo.reference='adapters_off' is the LoRA model with its adapters bypassed, and lora.enable=false; "
            "use --lora.enable true, or --dpo.reference copy"
        )
    if cfg.reference == "adapters_off" and cfg.reference_path is not None:
        raise ConfigError(
            "dpo.reference_path with dpo.reference='adapters_off': the reference is the LoRA base itself; "
            "unset reference_path, or use --dpo.reference copy"
        )
    if dims.pp > 1:
        _check_pipelined(job, args)
    if job.validation.enable and job.validation.seq_len not in (-1, seq_len):
        raise ConfigError(
            f"validation.seq_len={job.validation.seq_len} with preference data: held-out pairs are packed "
            f"as training's are, in rows of training.seq_len={seq_len}; leave validation.seq_len at -1"
        )
    if cfg.reference_path is not None:
        check_reference_path(Path(cfg.reference_path), args, f"{job.model.name}/{job.model.flavor}")


def _check_unused(cfg: DPO) -> None:
    """A job without preference data reads no ``[dpo]`` setting: one set is refused rather
    than dropped."""
    changed = changed_fields(cfg)
    if changed:
        shown = ", ".join(f"dpo.{name}={getattr(cfg, name)!r}" for name in changed)
        raise ConfigError(
            f"{shown} without preference data: only a preference job reads [dpo]; set "
            "--training.dataset_format preference (or leave [dpo] out)"
        )


def _check_losses(cfg: DPO) -> None:
    """The loss types, their weights and what they read: each named once, weights that
    train, a label smoothing some loss type reads."""
    unknown = [name for name in cfg.loss_type if name not in LOSS_TYPES]
    if unknown or not cfg.loss_type:
        raise ConfigError(f"dpo.loss_type={cfg.loss_type} must name one or more of {list(LOSS_TYPES)}")
    twice = next((name for i, name in enumerate(cfg.loss_type) if name in cfg.loss_type[:i]), None)
    if twice is not None:
        raise ConfigError(
            f"dpo.loss_type names {twice} twice ({cfg.loss_type}), which would count its loss twice; name "
            "each once and weigh them with --dpo.loss_weights"
        )
    weights = cfg.loss_weights
    if weights is not None and len(weights) != len(cfg.loss_type):
        raise ConfigError(f"dpo.loss_weights={weights} needs one weight per dpo.loss_type={cfg.loss_type}")
    for i, weight in enumerate(weights or ()):
        if weight < 0:
            raise ConfigError(
                f"dpo.loss_weights[{i}]={weight} ({cfg.loss_type[i]}) must be >= 0: a negative weight "
                "pushes that loss up"
            )
    if weights is not None and not any(weights):
        raise ConfigError(f"dpo.loss_weights={weights} trains nothing; give at least one weight > 0")
    if cfg.beta <= 0:
        raise ConfigError(f"dpo.beta={cfg.beta} must be > 0")
    if not 0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={cfg.label_smoothing} must be in [0, 0.5)")
    if cfg.label_smoothing > 0 and not set(cfg.loss_type) & set(SMOOTHED):
        raise ConfigError(
            f"dpo.label_smoothing={cfg.label_smoothing} is read by dpo.loss_type {' and '.join(SMOOTHED)} only, "
            f"and dpo.loss_type={cfg.loss_type} reads none (TRL 1.16's sigmoid ignores it too); add robust "
            "(or exo_pair) to dpo.loss_type, or leave label_smoothing at 0"
        )
    if "exo_pair" in cfg.loss_type and cfg.label_smoothing == 0:
        raise ConfigError(
            "dpo.loss_type exo_pair needs dpo.label_smoothing > 0 (it takes log(label_smoothing))"
        )


def check_reference_path(path: Path, args: ModelArgs, model_label: str) -> None:
    """``dpo.reference_path`` holds this model's whole weights: an HF folder of it, or an
    intact DCP checkpoint of it (not a LoRA run's adapters), each checked as
    ``checkpoint.initial_load_path`` is, before any work."""
    field = "dpo.reference_path"
    named = f"{field}={str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{named}: no such folder")
    if (path / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{named} is a LoRA adapter folder, which holds adapters only; the reference is a whole model: "
            "name the base those adapters were trained on (an HF folder or a DCP checkpoint)"
        )
    if (path / CONFIG_FILE).is_file():
        check_hf_weights(path, args, model_label, field)
        return
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"{named} is neither an HF model folder (no {CONFIG_FILE}) nor a DCP checkpoint (no .metadata); "
            "name the reference model's folder"
        )
    check_dcp_weights(path, field)
    if any(".lora_" in key for key in saved_keys(path)):
        raise ConfigError(
            f"{named} is a LoRA run's checkpoint, which holds its adapters only; name the base that run "
            "started from (its checkpoint.initial_load_path)"
        )
    check_dcp_model(path, args, model_label, field)


def _check_pipelined(job: JobConfig, args: ModelArgs) -> None:
    """Pipelined DPO's own limits: a schedule whose forward-only pass runs (the reference's),
    and rows that hold what one device's hold."""
    if args.moe and job.dpo.packing:
        raise ConfigError(
            "dpo.packing=true for a mixture of experts under pipeline parallelism: the load-balancing "
            "loss is per row, and a pipeline packs each micro-batch's pairs into rows of their own, "
            "other rows than one device's; use --dpo.packing false (each sequence its own row)"
        )
    check_forward_only_schedule(job.parallelism, "training.dataset_format='preference'")
