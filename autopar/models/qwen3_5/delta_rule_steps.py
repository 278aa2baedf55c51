"""The gated delta rule a token at a time from a given state: what decoding runs.

The chunked kernel (``delta_rule.py``) pads any call to a whole chunk of ``CHUNK`` tokens and
solves it with matmuls, which is right for a prompt and wasteful for one new token: a decode
step would pay for 64. This runs the kernel's defining recurrence directly, per value head h
reading key head ``h // (HV / HK)``, q and k L2-normed and q scaled by ``dk ** -0.5``::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

in fp32, on the kernel's state layout (B, HK, HV / HK, dk, dv), so either can continue the
other's state. A token costs O(dk dv) per head whatever the length before it.
"""

from __future__ import annotations

import torch

from autopar.models.qwen3_5.delta_rule import l2norm

STEPS_MAX = 8
"""Up to this many tokens a call runs token by token; longer ones run the chunked kernel.
Measured fp32 on CPU at Qwen3.5-9B's head sizes: one token costs a tenth of a padded chunk
(0.8 ms against 8 ms), eight about as much as the chunk."""


def _grouped(x: torch.Tensor, key_heads: int) -> torch.Tensor:
    """(b, S, H, ...) -> fp32 (b, S, HK, H / HK, ...): heads grouped under the key head they read."""
    return x.float().unflatten(2, (key_heads, -1))


def delta_rule_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    every_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs (b, S, HV, dv) in v's dtype and the exit state of S tokens entered with
    ``state`` (b, HK, HV / HK, dk, dv) fp32; arguments as ``DeltaRuleKernel.rule`` (no documents:
    a decoded sequence is one document). ``every_state``: the state after each token instead
    (b, S, HK, HV / HK, dk, dv), so that speculative decoding can resume after any of them."""
    key_heads, key_dim = k.shape[2], k.shape[-1]
    q = _grouped(l2norm(q.float()) * key_dim**-0.5, key_heads)  # (b, S, HK, 1, dk)
    k = _grouped(l2norm(k.float()), key_heads)  # (b, S, HK, 1, dk)
    values = _grouped(v, key_heads)  # (b, S, HK, R, dv)
    decay = _grouped(g, key_heads).exp()  # (b, S, HK, R)
    strength = _grouped(beta, key_heads)  # (b, S, HK, R)
    outputs, states = [], []
    for t in range(k.shape[1]):
        state = state * decay[:, t, ..., None, None]  # (b, HK, R, dk, dv)
        read = (k[:, t, :, :, None] @ state)[..., 0, :]  # (b, HK, R, dv): S^T k
        u = strength[:, t, ..., None] * (values[:, t] - read)  # (b, HK, R, dv)
        state = state + k[:, t, :, :, :, None] * u[..., None, :]  # (b, HK, R, dk, dv)
        outputs.append((q[:, t, :, :, None] @ state)[..., 0, :])  # (b, HK, R, dv): S^T q
        states.append(state)
    out = torch.stack(outputs, dim=1).flatten(2, 3)  # (b, S, HV, dv)
    return out.to(v.dtype), torch.stack(states, dim=1) if every_state else state
