"""Qwen3.5's delta-rule kernel (``training.delta_rule_kernel``), set on every Gated DeltaNet
layer of a built model through the layer core's ``sequence`` seam: autopar's own kernel
(``models/qwen3_5/delta_rule.py``), the same with Triton state passes
(``models/qwen3_5/triton_delta_rule.py``) or FLA's Triton kernels
(``models/qwen3_5/fla_delta_rule.py``); ``auto`` is ``triton`` on CUDA where Triton imports,
else ``autopar``."""

from __future__ import annotations

import logging

from torch import nn

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import AUTOPAR, SEGMENT
from autopar.models.qwen3_5.fla_delta_rule import FLA, fla_version_problem
from autopar.models.qwen3_5.gated_deltanet import DeltaRuleCore
from autopar.models.qwen3_5.triton_delta_rule import SEGMENT as TRITON_SEGMENT
from autopar.models.qwen3_5.triton_delta_rule import TRITON, triton_problem

logger = logging.getLogger(__name__)

KERNELS = {kernel.name: kernel for kernel in (AUTOPAR, FLA, TRITON)}
SEGMENTS = {"autopar": SEGMENT, "triton": TRITON_SEGMENT}
"""Tokens per fp32 state a chunked kernel keeps for backward (FLA's keeps other tensors)."""


def resolve_delta_rule_kernel(kernel: str, device_type: str, triton_imports: bool = True) -> str:
    """The kernel ``training.delta_rule_kernel`` runs on ``device_type``: ``auto`` is triton
    on CUDA where Triton imports (torch's CUDA wheels bring it; a plan assumes so), else autopar."""
    if kernel != "auto":
        return kernel
    return "triton" if device_type == "cuda" and triton_imports else "autopar"


def check_delta_rule_kernel(job: JobConfig, args: ModelArgs, device_type: str) -> None:
    """FLA's and our Triton kernels need a hybrid model; FLA's needs CUDA."""
    kernel = job.training.delta_rule_kernel
    if kernel not in ("fla", "triton"):
        return
    field = f"training.delta_rule_kernel='{kernel}'"
    if not args.hybrid:
        raise ConfigError(
            f"{field} runs Gated DeltaNet layers, which {job.model.name} has none of; leave it auto"
        )
    if kernel == "fla" and device_type != "cuda":
        raise ConfigError(
            f"{field} runs Triton CUDA kernels; on {device_type} use training.delta_rule_kernel autopar"
        )


def check_kernel_installed(job: JobConfig) -> None:
    """Where the job runs (not where it is planned): the kernel's packages importable (FLA's
    pinned version; Triton)."""
    kernel = job.training.delta_rule_kernel
    problem = fla_version_problem() if kernel == "fla" else triton_problem() if kernel == "triton" else None
    if problem:
        raise ConfigError(f"training.delta_rule_kernel='{kernel}': {problem}; or use autopar")


def apply_delta_rule_kernel(model: nn.Module, kernel: str, device_type: str) -> str:
    """Every Gated DeltaNet layer's delta rule by ``kernel`` (resolved for ``device_type``),
    whole sequence or under context parallelism (the layer's ``sequence`` keeps its kind and
    takes the kernel); returns the kernel's name."""
    name = resolve_delta_rule_kernel(kernel, device_type, triton_problem() is None)
    cores = [module for module in model.modules() if isinstance(module, DeltaRuleCore)]
    for core in cores:
        core.sequence.kernel = KERNELS[name]
    if cores and name == "triton" and device_type != "cuda":
        logger.warning(
            "Gated DeltaNet: the triton kernel's programs run in Triton's interpreter on %s (slow)",
            device_type,
        )
    return name
