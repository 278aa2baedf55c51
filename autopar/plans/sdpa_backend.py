"""Pin the attention kernel: each block's attention runs under ``sdpa_kernel`` with the one SDPA
backend ``training.sdpa_backend`` names, so kernels can be compared on one job
(``python -m autopar.bench --variants attn_flash attn_cudnn``); ``auto`` leaves torch's choice.
The model keeps calling ``F.scaled_dot_product_attention``: only its dispatch changes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.plans.context_parallel import resolve_impl

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
CPU_BACKENDS = ("flash", "math")
"""The SDPA kernels torch has on CPU; the others are CUDA kernels."""


def check_sdpa_backend(job: JobConfig, device_type: str) -> None:
    """The pinned kernel exists on the device and takes the attention this job computes."""
    backend = job.training.sdpa_backend
    if device_type != "cuda" and backend not in ("auto", *CPU_BACKENDS):
        raise ConfigError(
            f"training.sdpa_backend={backend!r} is a CUDA kernel; on {device_type} use one of "
            f"{['auto', *CPU_BACKENDS]}"
        )
    if device_type != "cuda" or backend != "flash":
        return
    allgather = (
        job.parallelism.context_parallel_degree > 1 and resolve_impl(job.parallelism, "cuda") == "allgather"
    )
    if job.training.document_masking or allgather:
        # CUDA's flash kernel takes no explicit mask (CPU's does)
        raise ConfigError(
            "training.sdpa_backend='flash' takes no attention mask on CUDA, and "
            + ("document masking" if job.training.document_masking else "all-gather context parallel")
            + " needs one; use auto, efficient, cudnn or math"
        )


def apply_sdpa_backend(model: nn.Module, backend: str) -> None:
    """Run every block's attention under the named SDPA backend."""
    for block in model.layers.values():
        attention = block.self_attn
        attention.forward = functools.partial(_under_backend, attention.forward, BACKENDS[backend])


def _under_backend(forward: Callable[..., Any], backend: SDPBackend, *args: Any, **kwargs: Any) -> Any:
    with sdpa_kernel(backend):
        return forward(*args, **kwargs)
