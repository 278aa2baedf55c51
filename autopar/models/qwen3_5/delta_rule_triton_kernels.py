"""The delta rule's two state passes as Triton programs (imported only where Triton is).

One program per (sequence, value head, block of ``BV`` state columns) holds its block of
the fp32 state (dk x BV) in registers and loops over the chunks: forward from the entry
state, backward (the state's gradient) from the exit state's, newest chunk first. The
chunk terms arrive contiguous, (B * HV, n, CHUNK, ...) per value head, formed by
``delta_rule_chunks.prepare``. Products run in the terms' dtype with fp32 accumulation
(fp32 terms: full fp32 products, no TF32).

Written for Triton 3.6 (the GPU image's): every product whose operand is a transpose (K^T
v', w^T dv', q'^T dO) loads that operand transposed from memory rather than transposing a
register tile, and no accumulator is fed transposed to ``tl.dot`` (the pattern Triton 3.4 to
3.7.0 miscompile on Hopper, fla-core issue #640).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def state_forward_kernel(
    w,
    u,
    k_exit,
    exit_decay,
    initial,
    entering,
    values,
    final,
    n_chunks,
    key_dim,
    columns,
    CHUNK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    KEEP_STATES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """S <- d S + K^T (u - w S) over the chunks; stores each chunk's net writes (and, with
    ``KEEP_STATES``, the state entering it) and the exit state."""
    i_v = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    key_ok = keys < key_dim
    col_ok = cols < columns
    tile = key_ok[:, None] & col_ok[None, :]
    state_at = keys[:, None] * columns + cols[None, :]  # (BK, BV) in a (dk, c) state
    by_key = rows[:, None] * key_dim + keys[None, :]  # (C, BK) in a (C, dk) chunk term
    by_key_t = keys[:, None] + rows[None, :] * key_dim  # (BK, C): the same term read transposed
    by_col = rows[:, None] * columns + cols[None, :]  # (C, BV) in a (C, c) chunk term
    state = tl.load(initial + head * key_dim * columns + state_at, mask=tile, other=0.0).to(tl.float32)
    for c in range(n_chunks):
        chunk = head * n_chunks + c
        if KEEP_STATES:
            out_state = entering + chunk * key_dim * columns + state_at
            tl.store(out_state, state.to(entering.dtype.element_ty), mask=tile)
        w_c = tl.load(w + chunk * CHUNK * key_dim + by_key, mask=key_ok[None, :], other=0.0)
        u_c = tl.load(u + chunk * CHUNK * columns + by_col, mask=col_ok[None, :], other=0.0)
        value = u_c.to(tl.float32) - tl.dot(w_c, state.to(w_c.dtype), input_precision=PRECISION)
        value = value.to(w_c.dtype)  # (C, BV)
        tl.store(values + chunk * CHUNK * columns + by_col, value, mask=col_ok[None, :])
        keys_t = tl.load(k_exit + chunk * CHUNK * key_dim + by_key_t, mask=key_ok[:, None], other=0.0)
        decay = tl.load(exit_decay + chunk)
        state = state * decay + tl.dot(keys_t, value, input_precision=PRECISION)
    tl.store(final + head * key_dim * columns + state_at, state, mask=tile)


@triton.jit
def state_backward_kernel(
    q_entry,
    w,
    k_exit,
    exit_decay,
    grad_out,
    local_grads,
    grad_final,
    grad_exits,
    grad_values,
    grad_initial,
    n_chunks,
    key_dim,
    columns,
    CHUNK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_OUTPUT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """G <- d G + q'^T dO - w^T dv', dv' = A^T dO + K G, newest chunk first from the exit
    state's gradient; stores each chunk's exit-state gradient and dv', and the entry's G.
    Without ``HAS_OUTPUT`` (a range's map) there is no dO."""
    i_v = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    key_ok = keys < key_dim
    col_ok = cols < columns
    tile = key_ok[:, None] & col_ok[None, :]
    state_at = keys[:, None] * columns + cols[None, :]
    by_key = rows[:, None] * key_dim + keys[None, :]
    by_key_t = keys[:, None] + rows[None, :] * key_dim
    by_col = rows[:, None] * columns + cols[None, :]
    grad = tl.load(grad_final + head * key_dim * columns + state_at, mask=tile, other=0.0).to(tl.float32)
    for i in range(n_chunks):
        chunk = head * n_chunks + n_chunks - 1 - i
        tl.store(
            grad_exits + chunk * key_dim * columns + state_at, grad.to(grad_exits.dtype.element_ty), mask=tile
        )
        key_c = tl.load(k_exit + chunk * CHUNK * key_dim + by_key, mask=key_ok[None, :], other=0.0)
        grad_value = tl.dot(key_c, grad.to(key_c.dtype), input_precision=PRECISION)  # (C, BV)
        if HAS_OUTPUT:
            local = tl.load(local_grads + chunk * CHUNK * columns + by_col, mask=col_ok[None, :], other=0.0)
            grad_value += local.to(tl.float32)
        grad_value = grad_value.to(key_c.dtype)
        tl.store(grad_values + chunk * CHUNK * columns + by_col, grad_value, mask=col_ok[None, :])
        w_t = tl.load(w + chunk * CHUNK * key_dim + by_key_t, mask=key_ok[:, None], other=0.0)
        decay = tl.load(exit_decay + chunk)
        grad = grad * decay - tl.dot(w_t, grad_value, input_precision=PRECISION)
        if HAS_OUTPUT:
            q_t = tl.load(q_entry + chunk * CHUNK * key_dim + by_key_t, mask=key_ok[:, None], other=0.0)
            d_out = tl.load(grad_out + chunk * CHUNK * columns + by_col, mask=col_ok[None, :], other=0.0)
            grad += tl.dot(q_t, d_out, input_precision=PRECISION)
    tl.store(grad_initial + head * key_dim * columns + state_at, grad, mask=tile)
