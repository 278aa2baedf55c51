"""One validation pass over a job, before any process group, model or file is touched.

Every check raises ``ConfigError`` with the field, its value and the fix. Checks that need a
plan's knowledge (degrees, model splits) call the plan modules' own check functions, so
the rule and its message live beside the code that depends on it.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.data.loader import check_data
from autopar.data.tokenizer import build_tokenizer, tokenizer_file
from autopar.data.tokens import DataError
from autopar.models.args import ModelArgs
from autopar.models.flavors import get_flavor
from autopar.models.hf import HFCheckpointError, read_hf_config
from autopar.pipelining.schedule import check_pipeline
from autopar.plans.context_parallel import check_cp
from autopar.plans.float8 import check_float8
from autopar.plans.mesh import ParallelDims, check_model_split


def model_args(job: JobConfig) -> ModelArgs:
    """The job's model: the flavor with ``[model]`` overrides applied."""
    try:
        return get_flavor(job.model.name, job.model.flavor, **job.model.overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_numbers(job: JobConfig) -> None:
    t, o, s = job.training, job.optimizer, job.lr_scheduler
    _require(t.steps >= 1, f"training.steps={t.steps} must be >= 1")
    _require(t.local_batch_size >= 1, f"training.local_batch_size={t.local_batch_size} must be >= 1")
    _require(t.seq_len >= 2, f"training.seq_len={t.seq_len} must be >= 2")
    _require(t.max_norm >= 0, f"training.max_norm={t.max_norm} must be >= 0 (0 disables clipping)")
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"training.global_batch_size={t.global_batch_size} must be -1 or >= 1",
    )
    _require(o.lr >= 0 and math.isfinite(o.lr), f"optimizer.lr={o.lr} must be a finite number >= 0")
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        _require(0 <= value < 1, f"optimizer.{name}={value} must be in [0, 1)")
    _require(o.eps > 0, f"optimizer.eps={o.eps} must be > 0")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    _require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0")
    _require(
        s.warmup_steps <= t.steps,
        f"lr_scheduler.warmup_steps={s.warmup_steps} exceeds training.steps={t.steps}; "
        "lower warmup_steps",
    )
    _require(
        s.decay_ratio is None or 0 < s.decay_ratio <= 1,
        f"lr_scheduler.decay_ratio={s.decay_ratio} must be in (0, 1], or unset",
    )
    _require(0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor={s.min_lr_factor} must be in [0, 1]")
    _require(job.metrics.log_freq >= 1, f"metrics.log_freq={job.metrics.log_freq} must be >= 1")
    _require(
        not job.metrics.enable_tensorboard or importlib.util.find_spec("tensorboard") is not None,
        "metrics.enable_tensorboard=true needs tensorboard: pip install tensorboard",
    )
    c = job.checkpoint
    _require(c.interval >= 1, f"checkpoint.interval={c.interval} must be >= 1")
    _require(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k={c.keep_latest_k} must be >= 0 (0 keeps all)")


def _check_batch(job: JobConfig, dims: ParallelDims) -> None:
    t = job.training
    per_micro_step = t.local_batch_size * dims.dp
    if t.global_batch_size != -1 and t.global_batch_size % per_micro_step:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"local_batch_size x data-parallel degree = {t.local_batch_size} x {dims.dp} = "
            f"{per_micro_step}; use a multiple of {per_micro_step}"
        )


def _check_data(job: JobConfig, args: ModelArgs) -> None:
    t = job.training
    path = job.model.tokenizer_path
    if path is not None and not tokenizer_file(path).is_file():
        raise ConfigError(f"model.tokenizer_path={path!r}: no tokenizer.json there")
    try:
        check_data(t.dataset, t.dataset_path, t.dataset_blend)
        tokenizer = build_tokenizer(path)
    except (DataError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.vocab_size={args.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); raise model.vocab_size or use a smaller tokenizer"
        )
    if t.seq_len > args.max_position_embeddings:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds model.max_position_embeddings="
            f"{args.max_position_embeddings}; lower seq_len or raise max_position_embeddings"
        )


def _check_checkpoint(job: JobConfig, args: ModelArgs) -> None:
    c = job.checkpoint
    if c.initial_load_path is None:
        _require(not c.initial_load_in_hf, "checkpoint.initial_load_in_hf=true needs checkpoint.initial_load_path")
        return
    path = Path(c.initial_load_path)
    if not path.exists():
        raise ConfigError(f"checkpoint.initial_load_path={c.initial_load_path!r}: no such folder")
    if not c.initial_load_in_hf:
        _require(
            (path / ".metadata").is_file(),
            f"checkpoint.initial_load_path={c.initial_load_path!r} is not a DCP checkpoint "
            "(no .metadata); for an HF folder set checkpoint.initial_load_in_hf=true",
        )
        return
    try:
        hf_args = read_hf_config(path)
    except HFCheckpointError as err:
        raise ConfigError(f"checkpoint.initial_load_path: {err}") from None
    for field in ModelArgs.__dataclass_fields__:
        if field in ("initializer_range", "max_position_embeddings"):
            continue
        ours, theirs = getattr(args, field), getattr(hf_args, field)
        if ours != theirs:
            raise ConfigError(
                f"model {job.model.name}/{job.model.flavor} has {field}={ours}, but "
                f"{path / 'config.json'} has {field}={theirs}; pick the matching flavor or "
                f"set --model.{field} {theirs}"
            )


def _check_transforms(job: JobConfig, dims: ParallelDims) -> None:
    ac = job.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        ok = ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1
        _require(ok, f"activation_checkpoint.selective_ac_option={ac.selective_ac_option!r} must be 'op' or a positive integer k (every k-th block)")
    _require(bool(job.compile.components) or not job.compile.enable,
             "compile.components is empty; list 'model' and/or 'loss'")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_float8(job.float8, device_type, dims.tp)
    check_cp(job.parallelism, device_type)


def validate(job: JobConfig, world_size: int) -> ModelArgs:
    """Check the whole job for ``world_size`` ranks; returns the resolved model args."""
    _check_numbers(job)
    args = model_args(job)
    dims = ParallelDims.resolve(job.parallelism, world_size)
    p = job.parallelism
    check_model_split(dims, args, job.training.seq_len, p.enable_sequence_parallel,
                      head_tail=p.context_parallel_load_balancer == "headtail")
    _check_batch(job, dims)
    _check_transforms(job, dims)
    check_pipeline(job.parallelism, args, job.training.local_batch_size)
    _check_data(job, args)
    _check_checkpoint(job, args)
    return args
