"""Activation checkpointing of transformer blocks: trade recompute for activation memory.

- ``full``: every block keeps only its input and recomputes the rest in backward.
- ``selective`` with an integer option k: every k-th block is fully checkpointed.
- ``selective`` with option ``op``: every block saves the outputs of its expensive ops
  (matmuls and grouped GEMMs, attention, collectives) and recomputes only the cheap ones (norms, RoPE,
  activations, casts, LoRA's low-rank B matmuls), which costs a few percent of speed for most
  of the memory saving.
- ``selective`` with option ``op_regather``: ``op``, but under sequence parallelism the
  all-gathered inputs of the attention and feed-forward projections (the sequence whole, TP
  times the sharded input) are gathered again in backward instead of kept, as Megatron's
  sequence-parallel linears do: two all-gathers more per block for that memory.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.config.errors import ConfigError
from autopar.config.sections import ActivationCheckpoint
from autopar.parallel.delta_rule_kernel import KERNELS
from autopar.parallel.torch_internals import (
    TorchDispatchMode,
    checkpoint_wrapper,
    function_mode_stack,
    tree_map,
)

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
        # Gated DeltaNet's recurrence by every kernel (and its segment states, or what FLA's keep)
        *(kernel.forward.default for kernel in KERNELS.values()),
    )
    if op
)
"""Ops whose outputs per-op selective checkpointing keeps instead of recomputing."""


_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_MATMUL_LEFT = {
    op: left
    for op, left in (
        (_aten.mm.default, 0),
        (_aten.bmm.default, 0),
        (_aten.addmm.default, 1),
        (getattr(_aten, "_grouped_mm", None) and _aten._grouped_mm.default, 0),
    )
    if op
}
"""Matmuls, and which argument is their left operand (the right one follows it)."""

LOW_RANK = 256
"""The widest inner dimension ``low_rank`` counts as cheap to recompute."""


def low_rank(inner: int, width: int) -> bool:
    """Whether per-op checkpointing recomputes a matmul of this inner dimension and output
    width rather than keep its output: a narrow inner dimension into a 16x wider output
    (LoRA's B: rank r into the base linear's width), whose recompute costs r / in_features
    of the base's matmul and whose output as much memory as the base's."""
    return inner <= LOW_RANK and 16 * inner <= width


def _low_rank(op: object, args: tuple) -> bool:
    left = _MATMUL_LEFT.get(op)
    return left is not None and low_rank(args[left].shape[-1], args[left + 1].shape[-1])


def _kept(op: object, args: tuple, recomputed_groups: frozenset[str]) -> bool:
    """Whether per-op checkpointing keeps this op's output: an op of ``SAVED_OPS``, except a
    low-rank matmul (``_low_rank``) and an all-gather over one of ``recomputed_groups``
    (context parallel's: its k/v span the whole sequence, so keeping them for every block
    would cost what CP saves; backward gathers them again, as torch's ring attention does)."""
    if op not in SAVED_OPS or _low_rank(op, args):
        return False
    return not (op is _ALL_GATHER and args[2] in recomputed_groups)


def _save_expensive_ops(recomputed_groups: frozenset[str], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if _kept(op, args, recomputed_groups):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _op_context(recomputed_groups: frozenset[str]):
    return create_selective_checkpoint_contexts(functools.partial(_save_expensive_ops, recomputed_groups))


class _SavedOutputs:
    """Outputs of the ops in ``SAVED_OPS``, per op in call order, from one block's forward.
    Each is released at its first reuse (so recompute holds no more than torch's own
    selective checkpointing) unless ``keep``: the block will be recomputed twice."""

    def __init__(self, keep: bool, recomputed_groups: frozenset[str]) -> None:
        self.by_op: dict[object, list[object]] = {}
        self.keep = keep
        self.recomputed_groups = recomputed_groups


def _detached(value: object) -> object:
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


class _SaveExpensiveOps(TorchDispatchMode):
    """Forward of an eager per-op checkpointed block: keeps the expensive ops' outputs."""

    def __init__(self, saved: _SavedOutputs) -> None:
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if _kept(func, args, self.saved.recomputed_groups):
            self.saved.by_op.setdefault(func, []).append(_detached(out))
        return out


class _ReuseExpensiveOps(TorchDispatchMode):
    """Recompute of an eager per-op checkpointed block: the expensive ops answer from the
    forward's outputs, the rest run again. Unlike torch's selective-checkpoint cache, an
    output can serve a second recompute: zero-bubble schedules recompute a block once for
    the input gradients and again for the weight gradients. Only ``SAVED_OPS`` are
    counted, so ops that run a different number of times in recompute (profiler ranges of
    a module FSDP shards inside the block) cannot misalign forward and recompute."""

    def __init__(self, saved: _SavedOutputs) -> None:
        super().__init__()
        self.saved = saved
        self.calls: dict[object, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not _kept(func, args, self.saved.recomputed_groups):
            return func(*args, **(kwargs or {}))
        index = self.calls.get(func, 0)
        self.calls[func] = index + 1
        outputs = self.saved.by_op.get(func, [])
        if index >= len(outputs) or outputs[index] is None:
            raise RuntimeError(
                f"per-op activation checkpointing: recompute called {func} more often than the "
                "forward did, or recomputed the block again where one recompute was expected"
            )
        value = outputs[index]
        if not self.saved.keep:
            outputs[index] = None
        return _detached(value)


class _Recompute:
    """Context of one eager block's recompute, re-enterable: it runs under the torch-function
    modes that were active in the forward (context parallel's attention is such a mode, and
    backward, where recompute happens, runs with it off) and, for per-op checkpointing,
    reuses the forward's expensive outputs. Zero-bubble schedules enter it twice per block."""

    def __init__(self, modes: tuple[object, ...], saved: _SavedOutputs | None) -> None:
        self.modes = modes
        self.saved = saved
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        active = [id(mode) for mode in function_mode_stack()]
        for mode in self.modes:
            # the weight pass of a zero-bubble schedule may run with the mode still on: a mode
            # entered twice would hand its own attention call to its second copy
            if id(mode) not in active:
                stack.enter_context(mode)  # type: ignore[arg-type]
        if self.saved is not None:
            stack.enter_context(_ReuseExpensiveOps(self.saved))
        self.stacks.append(stack)

    def __exit__(self, *exc: object) -> bool | None:
        return self.stacks.pop().__exit__(*exc)  # type: ignore[arg-type]


def _eager_contexts(
    per_op: bool, recomputed_twice: bool, recomputed_groups: frozenset[str]
) -> tuple[contextlib.AbstractContextManager, _Recompute]:
    """(forward, recompute) contexts for an eager ``checkpoint``. (A compiled block
    recomputes inside its compiled backward, which needs neither.)"""
    saved = _SavedOutputs(recomputed_twice, recomputed_groups) if per_op else None
    forward = _SaveExpensiveOps(saved) if saved is not None else contextlib.nullcontext()
    return forward, _Recompute(tuple(function_mode_stack()), saved)


PER_OP_OPTIONS = ("op", "op_regather")
"""Selective options that checkpoint per op."""


def per_op(cfg: ActivationCheckpoint) -> bool:
    """Whether ``cfg`` checkpoints every block per op (``op`` or ``op_regather``)."""
    return cfg.mode == "selective" and cfg.selective_ac_option in PER_OP_OPTIONS


def regathers(cfg: ActivationCheckpoint) -> bool:
    """Whether per-op checkpointing gathers sequence parallelism's inputs again in backward."""
    return cfg.mode == "selective" and cfg.selective_ac_option == "op_regather"


def check_ac(cfg: ActivationCheckpoint, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a selective option that is neither per-op nor a positive integer, and
    ``op_regather`` where no sequence-parallel input is gathered (it would be ``op``)."""
    option = cfg.selective_ac_option
    valid = option in PER_OP_OPTIONS or (option.isdigit() and int(option) >= 1)
    if cfg.mode == "selective" and not valid:
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option={option!r} must be 'op', 'op_regather' or a "
            "positive integer k (every k-th block)"
        )
    if regathers(cfg) and not (tp > 1 and sequence_parallel):
        raise ConfigError(
            "activation_checkpoint.selective_ac_option='op_regather' gathers sequence parallelism's inputs "
            f"again in backward, and this plan gathers none (tensor_parallel_degree={tp}, "
            f"enable_sequence_parallel={str(sequence_parallel).lower()}); use 'op'"
        )


def compiled_inside(cfg: ActivationCheckpoint) -> bool:
    """Whether a compiled job compiles its checkpointed blocks' insides, checkpointing each
    eagerly around its graph: full (or every-k) checkpointing. Traced into the graph instead,
    a block under tensor parallelism fails its first backward (the partitioner hands autograd
    a DeviceMesh as a saved tensor; torch 2.13, CPU, inductor and aot_eager alike). Per-op
    checkpointing must be traced: its policy is the partitioner's."""
    return cfg.mode != "none" and not per_op(cfg)


def checkpointed_layers(cfg: ActivationCheckpoint, layer_ids: list[str]) -> list[str]:
    """Which blocks get wrapped (``layer_ids`` are the model's own, e.g. a pipeline stage's)."""
    if cfg.mode == "none":
        return []
    if cfg.mode == "full" or per_op(cfg):
        return list(layer_ids)
    every = int(cfg.selective_ac_option)
    return [i for i in layer_ids if int(i) % every == 0]


def apply_ac(
    model: nn.Module,
    cfg: ActivationCheckpoint,
    compiled: bool,
    recomputed_twice: bool = False,
    recomputed_groups: frozenset[str] = frozenset(),
    random: bool = False,
) -> None:
    """Wrap the chosen blocks in place (parameter names gain a wrapper prefix that
    checkpoints and the init code strip). ``compiled``: the blocks will be compiled, and
    torch.compile accepts only dispatch-mode contexts. ``recomputed_twice``: backward runs
    as two passes (zero-bubble schedules), each recomputing the blocks. Per-op checkpointing
    gathers again, rather than keeps, what it all-gathers over ``recomputed_groups``.
    ``random``: the blocks draw random numbers (LoRA's dropout), so recompute replays the
    forward's random state. A fully checkpointed block is checkpointed eagerly around its
    compiled graph (``compiled_inside``), so only per-op checkpointing differs compiled."""
    op = per_op(cfg)
    if compiled and op:
        context = functools.partial(_op_context, recomputed_groups)
    else:
        context = functools.partial(_eager_contexts, op, recomputed_twice, recomputed_groups)
    for i in checkpointed_layers(cfg, list(model.layers.keys())):
        model.layers[i] = checkpoint_wrapper(
            model.layers[i],
            checkpoint_fn=functools.partial(checkpoint, use_reentrant=False),
            preserve_rng_state=random,
            context_fn=context,
        )
