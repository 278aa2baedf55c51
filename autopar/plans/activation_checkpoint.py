"""Activation checkpointing of transformer blocks: trade recompute for activation memory.

- ``full``: every block keeps only its input and recomputes the rest in backward.
- ``selective`` with an integer option k: every k-th block is fully checkpointed.
- ``selective`` with option ``op``: every block saves the outputs of its expensive ops
  (matmuls and grouped GEMMs, attention, collectives) and recomputes only the cheap ones (norms, RoPE,
  activations, casts), which costs a few percent of speed for most of the memory saving.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.config.errors import ConfigError
from autopar.config.job import ActivationCheckpoint

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        getattr(_aten, "_grouped_mm", None) and _aten._grouped_mm.default,
        getattr(_aten, "_scaled_mm", None) and _aten._scaled_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_reduce.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops._c10d_functional_autograd.all_to_all_single.default,
    )
    if op
)
"""Ops whose outputs per-op selective checkpointing keeps instead of recomputing."""


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_save_expensive_ops)


PROFILER_OPS = frozenset(
    (
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    )
)


class _ProfilerRangesUncounted(TorchDispatchMode):
    """Run the profiler's range ops past per-op checkpointing. A module FSDP shards inside a
    checkpointed block (a mixture of experts' own group under EP) records one more range in
    recompute than in forward (it is its iteration's first FSDP module then), and per-op
    checkpointing would count that extra op as forward and recompute disagreeing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in PROFILER_OPS:
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _recompute_under_forward_modes(per_op: bool):
    """(forward, recompute) contexts for eager ``checkpoint``: recompute runs under the
    torch-function modes that were active in the forward. Context parallel's attention is
    such a mode, and backward (where recompute happens) runs with it switched off. (A
    compiled block recomputes inside its compiled backward, which needs no mode.)"""
    forward, recompute = _op_context() if per_op else (contextlib.nullcontext(), contextlib.nullcontext())
    uncounted = _ProfilerRangesUncounted if per_op else contextlib.nullcontext
    modes = _get_current_function_mode_stack()

    @contextlib.contextmanager
    def counted_forward():
        with forward, uncounted():
            yield

    @contextlib.contextmanager
    def recompute_as_forward():
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            stack.enter_context(recompute)
            stack.enter_context(uncounted())
            yield

    return counted_forward(), recompute_as_forward()


def check_ac(cfg: ActivationCheckpoint) -> None:
    """Refuse a selective option that is neither 'op' nor a positive integer."""
    option = cfg.selective_ac_option
    if cfg.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option={option!r} must be 'op' or a positive "
            "integer k (every k-th block)"
        )


def checkpointed_layers(cfg: ActivationCheckpoint, layer_ids: list[str]) -> list[str]:
    """Which blocks get wrapped (``layer_ids`` are the model's own, e.g. a pipeline stage's)."""
    if cfg.mode == "none":
        return []
    if cfg.mode == "full" or cfg.selective_ac_option == "op":
        return list(layer_ids)
    every = int(cfg.selective_ac_option)
    return [i for i in layer_ids if int(i) % every == 0]


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint, compiled: bool) -> None:
    """Wrap the chosen blocks in place (parameter names gain a wrapper prefix that
    checkpoints and the init code strip). ``compiled``: the blocks will be compiled, and
    torch.compile accepts only dispatch-mode contexts."""
    per_op = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    if not compiled:
        extra = {"context_fn": functools.partial(_recompute_under_forward_modes, per_op)}
    else:
        extra = {"context_fn": _op_context} if per_op else {}
    for i in checkpointed_layers(cfg, list(model.layers.keys())):
        model.layers[i] = checkpoint_wrapper(
            model.layers[i],
            checkpoint_fn=functools.partial(checkpoint, use_reentrant=False),
            preserve_rng_state=False,  # the model draws no random numbers in forward
            **extra,
        )
