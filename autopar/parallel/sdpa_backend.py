"""The attention kernel. Pinned: each block's attention runs under ``sdpa_kernel`` with the one
SDPA backend ``training.sdpa_backend`` names, so kernels can be compared on one job
(``python -m autopar.bench --variants attn_flash attn_cudnn``); ``auto`` leaves torch's choice.
The model keeps calling ``F.scaled_dot_product_attention``: only its dispatch changes.

Grouped-query attention: where the kernel that will run takes fewer k/v heads than query
heads, the model passes them as they are (``enable_gqa``) and no expanded copy is made or
saved; elsewhere it expands them first (``native_gqa`` is the rule)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.models.qwen import ScaledDotProduct
from autopar.parallel.context_parallel import resolve_impl
from autopar.parallel.mixed_precision import compute_dtype

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


def native_gqa(job: JobConfig, device_type: str, cp_impl: str) -> bool:
    """Whether the kernel this job's attention will dispatch to takes grouped k/v heads itself.

    CPU's flash kernel does, with or without a mask. On CUDA (torch's order: flash, efficient,
    math, cuDNN) flash and cuDNN do, in half precision, torch's ring attention around them
    too (``tests/test_gpu.py``, on an H100 with torch 2.11); flash takes no mask and the
    efficient kernel no grouped heads, so a masked or float32 call with grouped heads would
    land on the math kernel, which saves the S x S matrix: those keep expanding k/v."""
    if device_type != "cuda":
        return True
    half = compute_dtype(job, torch.device(device_type)) != torch.float32
    backend = job.training.sdpa_backend
    all_gather_cp = job.parallelism.context_parallel_degree > 1 and cp_impl == "allgather"
    masked = job.training.document_masking or all_gather_cp  # all-gather CP masks by position
    return half and (backend == "cudnn" or (backend in ("auto", "flash") and not masked))


def model_groups_kv(job: JobConfig, device_type: str, cp_impl: str) -> bool:
    """Whether the model hands SDPA grouped k/v heads: where the kernel takes them
    (``native_gqa``), and under all-gather CP, which gathers them grouped (a GQA model's
    query-over-k/v heads times fewer bytes) and expands them after the gather where the
    kernel needs that (``ContextParallel``'s ``expand_kv``)."""
    all_gather_cp = job.parallelism.context_parallel_degree > 1 and cp_impl == "allgather"
    return all_gather_cp or native_gqa(job, device_type, cp_impl)


class PinnedScaledDotProduct(ScaledDotProduct):
    """``ScaledDotProduct`` under one named SDPA backend (``sdpa_kernel``)."""

    def __init__(self, native_gqa: bool, backend: str) -> None:
        super().__init__(native_gqa)
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        with sdpa_kernel(BACKENDS[self.backend]):
            return super().forward(q, k, v, mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend}"


def apply_attention_kernel(model: nn.Module, native: bool, backend: str = "auto") -> None:
    """Swap in every block's attention kernel call: grouped k/v heads passed to SDPA as they
    are (``native``) or expanded to every query head first, under the named SDPA backend
    (``auto``: torch's choice)."""
    pinned = backend != "auto"
    for block in model.layers.values():
        if block.self_attn is not None:  # a hybrid model's Gated DeltaNet layers have none
            block.self_attn.sdpa = (
                PinnedScaledDotProduct(native, backend) if pinned else ScaledDotProduct(native)
            )
