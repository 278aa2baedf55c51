"""Context parallelism: each CP rank holds a slice of every sequence and attends to all of it.

Inputs, labels and RoPE positions are split along the sequence. With the ``headtail`` load
balancer a rank holds chunk r and chunk 2*cp-1-r of 2*cp chunks, so under the causal mask
every rank has the same amount of attention work (the layout torch and Megatron use).

Two implementations, one switch (``parallelism.context_parallel_impl``), the same results:

- ``ring``: torch's ``context_parallel`` (ring attention; k/v shards rotated by all-gather or
  all-to-all). It dispatches only the CUDA SDPA kernels, so it needs CUDA.
- ``allgather``: k and v are all-gathered over the CP ranks with an autograd-aware collective
  (backward reduce-scatters their gradients) and each rank attends with a causal mask built
  from the global positions, as Megatron's ``cp_comm_type=allgather`` and Llama 3. It runs
  anywhere, which is why it exists: CI proves CP numerics on CPU with it. It gathers the
  grouped k/v heads (a GQA model's few), and expands them to every query head after the
  gather where the kernel needs that (``expand_kv``).

This module is the only place that touches torch's private CP options.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from autopar.config.errors import ConfigError
from autopar.config.sections import Parallelism
from autopar.data.loader import Batch
from autopar.models.qwen import document_positions, repeat_kv
from autopar.parallel.torch_internals import funcol, ring_attention_options

# torch 2.13 renamed the autograd-aware all-gather; 2.11 has only the old name
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd
"""All-gather along ``gather_dim`` whose backward reduce-scatters the gradient."""


def resolve_impl(cfg: Parallelism, device_type: str) -> str:
    if cfg.context_parallel_impl != "auto":
        return cfg.context_parallel_impl
    return "ring" if device_type == "cuda" else "allgather"


def check_cp(
    cfg: Parallelism, device_type: str, compiled: bool, ac_mode: str, document_masking: bool = False
) -> None:
    if cfg.context_parallel_degree == 1:
        return
    impl = resolve_impl(cfg, device_type)
    if impl == "ring" and document_masking:
        raise ConfigError(
            "training.document_masking=true with context_parallel_impl='ring': torch's ring "
            f"attention runs causal attention only; use {_allgather(compiled, ac_mode)} (it masks by "
            "document id and global position)"
        )
    if document_masking and cfg.pipeline_parallel_degree > 1:
        raise ConfigError(
            "training.document_masking=true with context_parallel_degree > 1 and "
            "pipeline_parallel_degree > 1: the CP attention mask is built per step, not per "
            "pipeline micro-batch; use --parallelism.pipeline_parallel_degree 1 (or no document masking)"
        )
    if impl == "ring" and device_type != "cuda":
        raise ConfigError(
            "parallelism.context_parallel_impl='ring' needs CUDA: torch's ring attention has no "
            f"CPU kernel; use {_allgather(compiled, ac_mode)}"
        )
    if impl == "allgather" and compiled and ac_mode != "none":
        # measured: the compiled backward recomputes attention over the local k/v only
        raise ConfigError(
            f"context_parallel_impl='allgather' with compile.enable=true and activation_checkpoint."
            f"mode={ac_mode!r} gives wrong gradients (the compiled recomputation drops the k/v "
            "all-gather); use --activation_checkpoint.mode none or --compile.enable false"
        )


def _allgather(compiled: bool, ac_mode: str) -> str:
    """The flags that switch to the all-gather implementation, with those its rule below needs."""
    flags = "--parallelism.context_parallel_impl allgather"
    if compiled and ac_mode != "none":
        flags += " and --activation_checkpoint.mode none (or --compile.enable false: compiled, its recomputation drops the all-gather)"
    return flags


def shard_sequence(x: torch.Tensor, rank: int, size: int, head_tail: bool, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of ``x`` along ``dim``: chunks r and 2*size-1-r, or chunk r."""
    if not head_tail:
        return x.chunk(size, dim=dim)[rank]
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=dim)


def unshard_sequence(parts: list[torch.Tensor], head_tail: bool, dim: int = 1) -> torch.Tensor:
    """The whole of a tensor from every CP rank's ``shard_sequence`` part, in rank order."""
    if not head_tail:
        return torch.cat(parts, dim=dim)
    size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


class AllGatherKVAttention(TorchFunctionMode):
    """Causal SDPA over the whole sequence for this rank's queries: k/v gathered from all CP
    ranks, the mask from global positions (so any sharding layout is handled) and, with
    packed documents, from their ids: a query sees only keys of its own document. The
    model's own document mask, over this rank's tokens only, is replaced by that one."""

    def __init__(
        self,
        mesh: DeviceMesh,
        q_positions: torch.Tensor,
        documents: torch.Tensor | None = None,
        q_documents: torch.Tensor | None = None,
        expand_kv: bool = False,
    ) -> None:
        """``q_positions`` (S_local,): where this rank's tokens sit; ``documents`` (B, S): the
        whole rows' document ids, ``q_documents`` (B, S_local) this rank's; ``expand_kv``:
        grouped k/v heads are expanded after the gather (the kernel takes none grouped)."""
        super().__init__()
        self.mesh = mesh
        self.expand_kv = expand_kv
        kv_positions = all_gather(q_positions, gather_dim=0, group=mesh)  # (S,) in k/v order
        self.mask = kv_positions[None, :] <= q_positions[:, None]  # (S_local, S)
        if documents is not None:
            same = q_documents[:, :, None] == documents[:, None, kv_positions]  # (B, S_local, S)
            self.mask = (self.mask & same)[:, None]  # (B, 1, S_local, S)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        # the model masks by document exactly when it was given documents, as this mode was
        masked = kwargs.get("attn_mask") is not None
        if len(args) > 3 or masked != (self.mask.dim() == 4) or (not masked and not kwargs.get("is_causal")):
            raise NotImplementedError("context parallel supports causal SDPA, or the model's document mask")
        extra = {k: v for k, v in kwargs.items() if k not in ("is_causal", "attn_mask")}
        key = all_gather(key.contiguous(), gather_dim=2, group=self.mesh)  # (B, H, S, D)
        value = all_gather(value.contiguous(), gather_dim=2, group=self.mesh)
        if self.expand_kv and extra.get("enable_gqa"):
            n_rep = query.shape[1] // key.shape[1]
            key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
            extra["enable_gqa"] = False
        return func(query, key, value, attn_mask=self.mask, **extra)


class ContextParallel:
    """Shards one micro-batch and makes attention span the CP ranks while it runs."""

    def __init__(self, cfg: Parallelism, mesh: DeviceMesh, device_type: str, expand_kv: bool = False) -> None:
        """``expand_kv``: all-gather CP expands grouped k/v heads after gathering them (where
        the kernel takes none grouped, ``sdpa_backend.native_gqa``)."""
        self.mesh = mesh
        self.impl = resolve_impl(cfg, device_type)
        self.expand_kv = expand_kv
        self.head_tail = cfg.context_parallel_load_balancer == "headtail"
        self.rotate_method = cfg.context_parallel_rotate_method

    @contextlib.contextmanager
    def __call__(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor]]:
        """Yields (this rank's batch slice, its RoPE positions (B, S_local)) (``split``)."""
        with self.split(batch) as (local, positions, _):
            yield local, positions

    @contextlib.contextmanager
    def split(
        self, batch: Batch, per_position: tuple[torch.Tensor | None, ...] = ()
    ) -> Iterator[tuple[Batch, torch.Tensor, tuple[torch.Tensor | None, ...]]]:
        """Yields (this rank's batch slice, its RoPE positions (B, S_local), its slices of
        ``per_position``). With packed documents the slice keeps its tokens' document ids
        (for the layers that pass state between ranks, ``state_passing.py``); attention is
        masked by document over the whole sequence here, and the positions restart per
        document. ``per_position``: more (B, S) tensors built on the whole sequences (None
        stays None), split as the tokens are: what a position reads of the tokens after it
        (the multi-token-prediction head's), which this rank's slice alone cannot tell."""
        bsz, seqlen = batch.inputs.shape
        positions = torch.arange(seqlen, device=batch.inputs.device).expand(bsz, seqlen).contiguous()
        if self.impl == "ring":
            assert batch.documents is None, "check_cp refuses document masking with ring attention"
            with self._ring(batch, positions, per_position) as sharded:
                yield sharded
            return
        rank, size = self.mesh.get_local_rank(), self.mesh.size()
        rope = positions if batch.documents is None else document_positions(batch.documents)
        inputs, labels, pos, rope = (
            shard_sequence(t, rank, size, self.head_tail)
            for t in (batch.inputs, batch.labels, positions, rope)
        )
        documents = batch.documents
        q_documents = None if documents is None else shard_sequence(documents, rank, size, self.head_tail)
        local = tuple(
            None if t is None else shard_sequence(t, rank, size, self.head_tail) for t in per_position
        )
        with AllGatherKVAttention(self.mesh, pos[0], documents, q_documents, self.expand_kv):
            yield Batch(inputs, labels, q_documents), rope, local

    @contextlib.contextmanager
    def _ring(
        self, batch: Batch, positions: torch.Tensor, per_position: tuple[torch.Tensor | None, ...]
    ) -> Iterator[tuple[Batch, torch.Tensor, tuple[torch.Tensor | None, ...]]]:
        from torch.distributed.tensor.experimental import context_parallel

        # torch shards these in place, so they must be fresh contiguous tensors
        inputs, labels = batch.inputs.clone(), batch.labels.clone()
        local = tuple(None if t is None else t.clone() for t in per_position)
        buffers = [inputs, labels, positions, *(t for t in local if t is not None)]
        with (
            ring_attention_options(self.rotate_method, self.head_tail),
            context_parallel(
                self.mesh,
                buffers=buffers,
                buffer_seq_dims=[1] * len(buffers),
                no_restore_buffers=set(buffers),
            ),
        ):
            yield Batch(inputs, labels), positions, local
