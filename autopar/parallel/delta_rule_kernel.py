"""Qwen3.5's delta-rule kernel (``training.delta_rule_kernel``), set on every Gated DeltaNet
layer of a built model through the layer core's ``sequence`` seam: autopar's own kernel
(``models/qwen3_5/delta_rule.py``) or FLA's Triton kernels (``models/qwen3_5/fla_delta_rule.py``)."""

from __future__ import annotations

from torch import nn

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import AUTOPAR
from autopar.models.qwen3_5.fla_delta_rule import FLA, fla_version_problem
from autopar.models.qwen3_5.gated_deltanet import DeltaRuleCore

KERNELS = {kernel.name: kernel for kernel in (AUTOPAR, FLA)}


def check_delta_rule_kernel(job: JobConfig, args: ModelArgs, device_type: str) -> None:
    """FLA's kernels need a hybrid model and CUDA."""
    if job.training.delta_rule_kernel != "fla":
        return
    field = "training.delta_rule_kernel='fla'"
    if not args.hybrid:
        raise ConfigError(
            f"{field} runs Gated DeltaNet layers, which {job.model.name} has none of; leave it autopar"
        )
    if device_type != "cuda":
        raise ConfigError(
            f"{field} runs Triton CUDA kernels; on {device_type} use training.delta_rule_kernel autopar"
        )


def check_fla_installed(job: JobConfig) -> None:
    """Where the job runs (not where it is planned): FLA's pinned version importable."""
    problem = None if job.training.delta_rule_kernel != "fla" else fla_version_problem()
    if problem:
        raise ConfigError(f"training.delta_rule_kernel='fla': {problem}; or use autopar")


def apply_delta_rule_kernel(model: nn.Module, kernel: str) -> None:
    """Every Gated DeltaNet layer's delta rule by ``kernel``, whole sequence or under context
    parallelism (the layer's ``sequence`` keeps its kind and takes the kernel)."""
    for module in model.modules():
        if isinstance(module, DeltaRuleCore):
            module.sequence.kernel = KERNELS[kernel]
