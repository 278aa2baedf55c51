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
from autopar.config.job import Training

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
CPU_BACKENDS = ("flash", "math")
"""The SDPA kernels torch has on CPU; the others are CUDA kernels."""


def check_sdpa_backend(training: Training, device_type: str) -> None:
    backend = training.sdpa_backend
    if backend == "auto":
        return
    if device_type != "cuda" and backend not in CPU_BACKENDS:
        raise ConfigError(
            f"training.sdpa_backend={backend!r} is a CUDA kernel; on {device_type} use one of "
            f"{['auto', *CPU_BACKENDS]}"
        )
    if backend == "flash" and training.document_masking:
        raise ConfigError(
            "training.sdpa_backend='flash' cannot take document masking's attention mask; use "
            "auto, efficient, cudnn or math"
        )


def apply_sdpa_backend(model: nn.Module, backend: str) -> None:
    """Run every block's attention under the named SDPA backend (``auto``: no change)."""
    if backend == "auto":
        return
    for block in model.layers.values():
        attention = block.self_attn
        attention.forward = functools.partial(_under_backend, attention.forward, BACKENDS[backend])


def _under_backend(forward: Callable[..., Any], backend: SDPBackend, *args: Any, **kwargs: Any) -> Any:
    with sdpa_kernel(backend):
        return forward(*args, **kwargs)
