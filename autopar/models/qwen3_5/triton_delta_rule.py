"""``training.delta_rule_kernel = "triton"``: our chunked delta rule with its two state
passes as Triton programs of our own (``delta_rule_triton_kernels.py``).

The rule, the chunk-parallel work (``delta_rule_chunks.py``, batched torch ops over every
chunk of a segment) and the contract are ``autopar``'s: the same custom-op pair with fake
implementations and autograd (``delta_rule.chunked_kernel``), packed documents folded into
the chunk terms, an entry state in and the exit state out, a range's map [M | U] for context
parallelism. What differs:

- the forward pass (v' = u - w S, S <- d S + K^T v') and the backward pass (dv' = A^T dO +
  K G, G <- d G + q'^T dO - w^T dv') are one Triton program per (sequence, value head, block
  of ``BLOCK_COLUMNS`` state columns), its block of the fp32 state in registers, looping over
  the chunks: two launches per segment where torch's loop issues a few small matmuls per chunk;
- the chunk terms, the states the passes hand on and their products are in the inputs'
  dtype (bf16 in training) with fp32 accumulation; the decays, the Gram matrices and the
  triangular solve that form them, the decay across each chunk and the state are fp32;
- a segment is ``SEGMENT`` tokens: the backward holds one segment's chunk terms (about a
  dozen (tokens x HV x CHUNK) fp32 tensors) to launch fewer, larger ops.

The forward keeps its inputs and one fp32 state per segment, as ``autopar``'s does (fewer
states: its segments are longer). On a CPU the programs run in Triton's interpreter, which
is how CI holds them to ``autopar`` (``tests/test_triton_delta_rule.py``); slowly, so the
kernel is for CUDA (the default there when Triton imports).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
from torch import Tensor

from autopar.models.qwen3_5.delta_rule import CHUNK, chunked_kernel
from autopar.models.qwen3_5.delta_rule_chunks import Chunks
from autopar.models.qwen3_5.delta_rule_passes import ChunkedRule

SEGMENT = 64 * CHUNK
"""Tokens recomputed together in backward (and one fp32 state kept per segment)."""
BLOCK_COLUMNS = 32
"""State columns per program: at 2 sequences x 16 value heads x dv 128, 128 programs, one per
streaming multiprocessor of an H100."""
NUM_WARPS = 4


def triton_problem() -> str | None:
    """Why the ``triton`` kernel cannot run here, else None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not importable; pip install 'autopar[triton]' (torch's CUDA wheels bring it)"
    return None


@functools.cache
def _interpreted(kernel):
    """``kernel`` run by Triton's interpreter, which takes CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def _launch(kernel, device: torch.device, grid: tuple[int, int], *args, **constants) -> None:
    """``kernel`` compiled on CUDA, interpreted elsewhere. The interpreter gets the integer
    arguments as constexprs: it makes a runtime int a one-element array, which Triton 3.6
    cannot take as a loop bound under numpy >= 2.3 (``int()`` of an array)."""
    if device.type != "cuda":
        import triton.language as tl

        args = tuple(tl.constexpr(a) if isinstance(a, int) else a for a in args)
        _interpreted(kernel)[grid](*args, **constants)
        return
    with torch.cuda.device(device):
        kernel[grid](*args, **constants, num_warps=NUM_WARPS)


def _per_head(x: Tensor, heads: int, trailing: int) -> Tensor:
    """(B, K, R, n, ...) -> contiguous (B * K * R, n, ...) keeping ``trailing`` dims."""
    return x.reshape(heads, *x.shape[3 : 3 + 1 + trailing]).contiguous()


def _constants(chunks: Chunks, columns: int) -> dict[str, object]:
    key_dim = chunks.w.shape[-1]
    return {
        "CHUNK": CHUNK,
        "BK": max(16, _next_power_of_2(key_dim)),
        "BV": min(BLOCK_COLUMNS, max(16, _next_power_of_2(columns))),
        "PRECISION": "ieee" if chunks.w.dtype == torch.float32 else "tf32",
    }


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


class TritonPasses:
    """``delta_rule_passes.StatePasses`` as two Triton programs."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32

    def forward(
        self, chunks: Chunks, state: Tensor, keep_states: bool
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        from autopar.models.qwen3_5.delta_rule_triton_kernels import state_forward_kernel

        lead, (n, key_dim), columns = chunks.w.shape[:3], chunks.w.shape[3:6:2], state.shape[-1]
        heads = math.prod(lead)
        w, u, k_exit = (_per_head(t, heads, 2) for t in (chunks.w, chunks.u, chunks.k_exit))
        decay = _per_head(chunks.exit_decay.float(), heads, 0)
        initial = state.reshape(heads, key_dim, columns).float().contiguous()
        entering = w.new_empty(heads, n, key_dim, columns) if keep_states else w.new_empty(1)
        values, final = u.new_empty(heads, n, CHUNK, columns), torch.empty_like(initial)
        constants = _constants(chunks, columns)
        grid = (-(-columns // constants["BV"]), heads)
        _launch(
            state_forward_kernel,
            w.device,
            grid,
            *(w, u, k_exit, decay, initial, entering, values, final, n, key_dim, columns),
            KEEP_STATES=keep_states,
            **constants,
        )
        kept = entering.reshape(*lead, n, key_dim, columns) if keep_states else None
        return kept, values.reshape(*lead, n, CHUNK, columns), final.reshape(state.shape)

    def backward(
        self, chunks: Chunks, grad_out: Tensor | None, local_grads: Tensor | None, grad_exit: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        from autopar.models.qwen3_5.delta_rule_triton_kernels import state_backward_kernel

        lead, (n, key_dim), columns = chunks.w.shape[:3], chunks.w.shape[3:6:2], grad_exit.shape[-1]
        heads = math.prod(lead)
        w, k_exit = (_per_head(t, heads, 2) for t in (chunks.w, chunks.k_exit))
        decay = _per_head(chunks.exit_decay.float(), heads, 0)
        has_output = grad_out is not None
        q_entry, grad_out, local_grads = (
            _per_head(t, heads, 2) if has_output else w.new_empty(1)
            for t in (chunks.q_entry, grad_out, local_grads)
        )
        final = grad_exit.reshape(heads, key_dim, columns).float().contiguous()
        exits = w.new_empty(heads, n, key_dim, columns)
        grad_values, grad_initial = w.new_empty(heads, n, CHUNK, columns), torch.empty_like(final)
        constants = _constants(chunks, columns)
        grid = (-(-columns // constants["BV"]), heads)
        args = (q_entry, w, k_exit, decay, grad_out, local_grads, final, exits, grad_values, grad_initial)
        _launch(
            state_backward_kernel,
            w.device,
            grid,
            *args,
            n,
            key_dim,
            columns,
            HAS_OUTPUT=has_output,
            **constants,
        )
        return (
            exits.reshape(*lead, n, key_dim, columns),
            grad_values.reshape(*lead, n, CHUNK, columns),
            grad_initial.reshape(grad_exit.shape),
        )


TRITON = chunked_kernel("triton", "triton_gated_delta_rule", ChunkedRule(TritonPasses(), SEGMENT))
"""The kernel with Triton state passes: ``DeltaRuleKernel.rule`` and ``map`` as ``autopar``'s."""
triton_gated_delta_rule = TRITON.rule
"""``DeltaRuleKernel.rule`` by the Triton kernel."""
