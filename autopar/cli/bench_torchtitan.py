"""torchtitan on the same job, as one row of the benchmark table:

    python -m autopar.bench --job.config train_configs/qwen3_1.7b.toml --variants compiled torchtitan

The ``torchtitan`` variant (optionally ``torchtitan:key=value,...``, applied to our job first)
writes the job as a torchtitan 0.2.2 job file and runs torchtitan's own ``Trainer`` on the
same ranks, steps and warm-up, timed as ours is: each ``train_step``, median of the timed
ones (torchtitan logs every step, so each step ends in its loss's host sync), peak allocated
memory over the steps, and MFU by our FLOPs convention from the same tokens/s. Both read the
shipped corpus; torchtitan tokenizes it with the shipped ChatML tokenizer (it needs a
``tokenizer.json``), so losses start alike (ln 151,936 over the full vocabulary) but do not
follow each other. A job torchtitan cannot run as written is a config error before anything
starts.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from autopar.config.errors import ConfigError
from autopar.config.parse import toml_value
from autopar.config.sections import JobConfig
from autopar.data.chat import CHATML_TOKENIZER
from autopar.data.tokens import BUILTIN_DATASETS
from autopar.training.metrics.flops import peak_flops

TORCHTITAN = "torchtitan==0.2.2"
FLAVORS = ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
"""torchtitan 0.2.2's dense Qwen3 flavors, the same shapes as ours of the same name."""


def check_torchtitan_job(job: JobConfig) -> None:
    """The job is one torchtitan runs as it is, and torchtitan is installed."""
    model = job.model
    if model.name != "qwen3" or model.flavor not in FLAVORS or model.overrides or model.hf_assets_path:
        raise ConfigError(
            f"torchtitan runs its own Qwen3 flavors {list(FLAVORS)} as they are; "
            f"this job's model is {model.name}/{model.flavor}"
            + (f" with {model.overrides}" if model.overrides else "")
        )
    unsupported = {
        "float8.enable": job.float8.enable,
        "training.loss_chunk_tokens": job.training.loss_chunk_tokens,
        "training.document_masking": job.training.document_masking,
        "parallelism.pipeline_parallel_degree": job.parallelism.pipeline_parallel_degree != 1,
        "parallelism.expert_parallel_degree": job.parallelism.expert_parallel_degree != 1,
    }
    if job.training.sdpa_backend != "auto":
        unsupported["training.sdpa_backend"] = job.training.sdpa_backend
    named = [key for key, value in unsupported.items() if value]
    if named:
        raise ConfigError(
            f"torchtitan has no {named} as we have it; unset it for this row (and give it a row "
            "of its own among ours)"
        )
    if importlib.util.find_spec("torchtitan") is None:
        raise ConfigError(
            f"needs {TORCHTITAN} installed (pip install {TORCHTITAN}; on a "
            "machine with no network, carry its wheels: docs/performance.md says which)"
        )


def torchtitan_config(job: JobConfig) -> dict[str, dict[str, Any]]:
    """``job`` as a torchtitan job file's sections (their field names are ours)."""
    training, parallelism, ac = job.training, job.parallelism, job.activation_checkpoint
    precision = "bfloat16" if training.mixed_precision_param == "auto" else training.mixed_precision_param
    optimizer = job.optimizer
    return {
        "job": {"dump_folder": str(Path(job.job.dump_folder) / "torchtitan"), "description": "autopar bench"},
        "model": {"name": "qwen3", "flavor": job.model.flavor, "hf_assets_path": str(CHATML_TOKENIZER)},
        "optimizer": {
            "name": "AdamW",
            "lr": optimizer.lr,
            "eps": optimizer.eps,
            "beta1": optimizer.beta1,
            "beta2": optimizer.beta2,
            "weight_decay": optimizer.weight_decay,
            "implementation": "fused" if optimizer.implementation == "auto" else optimizer.implementation,
        },
        "lr_scheduler": {"warmup_steps": job.lr_scheduler.warmup_steps},
        "training": {
            "local_batch_size": training.local_batch_size,
            "global_batch_size": training.global_batch_size,
            "seq_len": training.seq_len,
            "steps": training.steps,
            "max_norm": training.max_norm,
            "mixed_precision_param": precision,
            "mixed_precision_reduce": training.mixed_precision_reduce,
            "enable_cpu_offload": training.enable_cpu_offload,
            "dataset": "c4_test",  # its loader reads any local folder of text files
            "dataset_path": str(BUILTIN_DATASETS["autopar_corpus"]),
        },
        "parallelism": {
            "data_parallel_replicate_degree": parallelism.data_parallel_replicate_degree,
            "data_parallel_shard_degree": parallelism.data_parallel_shard_degree,
            "tensor_parallel_degree": parallelism.tensor_parallel_degree,
            "context_parallel_degree": parallelism.context_parallel_degree,
            "fsdp_reshard_after_forward": parallelism.fsdp_reshard_after_forward,
            "disable_loss_parallel": parallelism.disable_loss_parallel,
        },
        "activation_checkpoint": {"mode": ac.mode, "selective_ac_option": ac.selective_ac_option},
        "compile": {"enable": job.compile.enable, "components": list(job.compile.components)},
        "metrics": {"log_freq": 1, "enable_tensorboard": False, "disable_color_printing": True},
        "checkpoint": {"enable": False},
        "debug": {"seed": job.debug.seed},
    }


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """TOML text of flat sections."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {toml_value(v)}\n" for key, v in fields.items())
        for name, fields in sections.items()
    )


def write_torchtitan_job(job: JobConfig) -> Path:
    """The job file, beside the variant's outputs (``python -m torchtitan.train
    --job.config_file`` reruns it as it ran)."""
    path = Path(job.job.dump_folder) / "torchtitan.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(torchtitan_config(job)))
    return path


def torchtitan_on_rank(job_file: str, warmup: int) -> dict:
    """torchtitan's Trainer on this rank (its process group already up, which torchtitan
    keeps), each ``train_step`` timed and each logged loss and peak memory recorded."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    config = ConfigManager().parse_args(["--job.config_file", job_file])
    trainer = Trainer(config)
    times: list[float] = []
    losses: list[float] = []
    peaks: list[int] = []
    step, log = trainer.train_step, trainer.metrics_processor.log

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = step(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    def recorded_log(step_: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        losses.append(float(global_avg_loss))
        peaks.append(torch.cuda.max_memory_allocated())  # torchtitan resets the peak after logging
        return log(step_, global_avg_loss, *args, **kwargs)

    trainer.train_step, trainer.metrics_processor.log = timed_step, recorded_log
    try:
        trainer.train()
    finally:
        trainer.close()
    return {
        "step_seconds": statistics.median(times[warmup:]),
        "peak_memory_gib": max(peaks) / 2**30,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "device": torch.cuda.get_device_name(),
        "peak_flops": peak_flops(torch.device("cuda", torch.cuda.current_device())),
    }
