"""The state a model carries from one call to the next, and the forward that continues from it.

No maths is re-implemented here: the model's own forward runs, with two of its swappable
parts replaced for the duration (``Decoder.attached``), as parallel plans replace them:

- each attention's ``sdpa`` (the kernel call, after projections, norms and RoPE at the
  positions passed in) by ``CachedAttention``, which writes k and v into a preallocated
  (B, Hkv, L, D) buffer at each token's position and attends to every cached position up to
  the token's own;
- each Gated DeltaNet's ``core.sequence`` (the two steps that read along the sequence,
  whole or passed between context-parallel ranks, which sample rows of their own) by
  ``CachedSequence``, which prepends the last K-1 inputs of each convolution and runs the
  delta rule from the recurrent state entering the chunk (the kernel's entry state), keeping
  the exit state: a call of up to ``STEPS_MAX`` tokens (a decode step) token by token
  (``delta_rule_steps``, O(1) a token), a longer one (a prompt) by the chunked kernel.

Rows are independent: a call names the rows it advances (a prefill one prompt at a time,
a decode step all of them) and each row's tokens carry their own positions, so prompts of
different lengths share a batch without padding entering any row's state.

A decoder made with ``multiple`` > 1 runs every call on a multiple of that many tokens:
sequence parallelism splits each forward's tokens evenly over the tensor-parallel ranks, and
a one-token decode step does not split. The call's tokens are followed by copies of its last
(at its position); nothing of them enters the state (the cache and the recurrent and
convolution states keep the call's own tokens only), and causal layers keep them out of the
real tokens' outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.models.qwen import Qwen, ScaledDotProduct, split_output
from autopar.models.qwen3_5.delta_rule_steps import STEPS_MAX, delta_rule_steps
from autopar.models.qwen3_5.gated_deltanet import DeltaRuleCore, WholeSequence, causal_conv


@dataclass
class Cursor:
    """Where the current call writes: which rows of the state, at which positions (b, S);
    ``keep_steps``: the Gated DeltaNet layers keep their state after each token of the call
    (a speculative verification, which may resume from any of them: ``Decoder.rewind``);
    ``real``: how many of the call's tokens are its own, the rest padding (``Decoder.multiple``);
    ``static``: the positions' values are not known here (a dry run's fake tensors), so
    attention reads every slot, masked, as a compiled step does, and no bound is checked."""

    rows: slice
    positions: Tensor
    keep_steps: bool = False
    real: int = 1
    static: bool = False


class CachedAttention(nn.Module):
    """``ScaledDotProduct``'s place during decoding: a static KV cache and a position mask."""

    def __init__(self, cursor: Cursor, batch: int, length: int) -> None:
        super().__init__()
        self.cursor, self.batch, self.length = cursor, batch, length
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """q (b, Hq, S, D), k and v (b, Hkv, S, D) of the cursor's rows -> (b, Hq, S, D)."""
        if self.k is None:
            shape = (self.batch, k.shape[1], self.length, k.shape[-1])  # (B, Hkv, L, D)
            self.k = k.new_zeros(shape)
            self.v = v.new_zeros(shape)
        rows, positions = self.cursor.rows, self.cursor.positions  # (b, S)
        index = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        keys, values = self.k[rows], self.v[rows]  # views (b, Hkv, L, D)
        own = slice(0, self.cursor.real)  # padding writes nothing
        keys[index[:, own], :, positions[:, own]] = k.transpose(1, 2)[:, own]  # (b, S, Hkv, D) into each slot
        values[index[:, own], :, positions[:, own]] = v.transpose(1, 2)[:, own]
        # eager: the slots up to the last token's; compiled: all of them, masked, so that every
        # decode step has one shape and the graph one compilation
        end = self.length if torch.compiler.is_compiling() or self.cursor.static else int(positions.max()) + 1
        slots = torch.arange(end, device=positions.device)
        visible = (slots <= positions[:, :, None])[:, None]  # (b, 1, S, end): a slot at or before the token
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=visible, enable_gqa=gqa
        )

    def spread(self, where: Tensor) -> None:
        """Row r's cache becomes row ``where[r]``'s (B,)."""
        if self.k is not None and self.v is not None:
            self.k.copy_(self.k[where])
            self.v.copy_(self.v[where])


class LastPosition(nn.Module):
    """A head applied to one position of its input (B, S, H) only, the call's last own
    token: (B, 1, V)."""

    def __init__(self, head: nn.Module, position: int) -> None:
        super().__init__()
        self.head, self.position = head, position

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(hidden[:, self.position : self.position + 1])


class CachedSequence(WholeSequence):
    """``WholeSequence``'s place during decoding: convolution and delta rule continue from
    the state the cursor's rows left (zero before their first token). The delta rule is
    always ours (``delta_rule_steps`` for a few tokens, else the chunked kernel
    ``torch.ops.autopar.gated_delta_rule``), whose entry and exit states this needs, whichever
    kernel training runs."""

    def __init__(self, cursor: Cursor, batch: int) -> None:
        super().__init__()
        self.cursor, self.batch = cursor, batch
        self.conv: list[Tensor] | None = None
        self.recurrent: Tensor | None = None
        self.joined: list[Tensor] = []
        """With ``keep_steps``: each convolution's state before the call and inputs (b, K-1+S, C)."""
        self.recurrent_steps: Tensor | None = None
        """With ``keep_steps``: the recurrent state after each token (b, S, HK, HV / HK, dk, dv)."""

    def convolve(
        self, inputs: tuple[Tensor, ...], weights: tuple[Tensor, ...], documents: Tensor | None
    ) -> tuple[Tensor, ...]:
        """Each input (b, S, C) convolved after the K-1 inputs before it; those become the state."""
        rows = self.cursor.rows
        if self.conv is None:
            self.conv = [
                x.new_zeros(self.batch, w.shape[-1] - 1, x.shape[-1]) for x, w in zip(inputs, weights)
            ]
        outputs, self.joined = [], []
        real = self.cursor.real
        for state, x, w in zip(self.conv, inputs, weights):
            joined = torch.cat((state[rows], x), dim=1)  # (b, K - 1 + S, C)
            outputs.append(causal_conv(joined, w, None)[:, state.shape[1] :])  # (b, S, C)
            state[rows] = joined[:, real : real + state.shape[1]]  # the K-1 inputs up to the last own token
            if self.cursor.keep_steps:
                self.joined.append(joined)
        return tuple(outputs)

    def delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, documents: Tensor | None
    ) -> Tensor:
        """The rule over the chunk from the rows' recurrent state (B, HK, HV / HK, dk, dv) fp32;
        over the call's own tokens only, zeros for its padding."""
        rows, real, count = self.cursor.rows, self.cursor.real, k.shape[1]
        if real < count:
            out = self.delta_rule(*(x[:, :real] for x in (q, k, v, g, beta)), documents)
            return torch.cat((out, out.new_zeros(out.shape[0], count - real, *out.shape[2:])), dim=1)
        if self.recurrent is None:
            heads, dk, dv = k.shape[2], k.shape[-1], v.shape[-1]
            self.recurrent = v.new_zeros(self.batch, heads, v.shape[2] // heads, dk, dv, dtype=torch.float32)
        entry = self.recurrent[rows]
        if self.cursor.keep_steps:
            out, self.recurrent_steps = delta_rule_steps(q, k, v, g, beta, entry, every_state=True)
            exit_state = self.recurrent_steps[:, -1]
        elif k.shape[1] <= STEPS_MAX:
            out, exit_state = delta_rule_steps(q, k, v, g, beta, entry)
        else:
            out, _, exit_state = torch.ops.autopar.gated_delta_rule(
                q, k, v, g, beta, None, entry.contiguous(), None
            )
        self.recurrent[rows] = exit_state
        return out

    def spread(self, where: Tensor) -> None:
        """Row r's convolution and recurrent state become row ``where[r]``'s (B,)."""
        for state in self.conv or ():
            state.copy_(state[where])
        if self.recurrent is not None:
            self.recurrent.copy_(self.recurrent[where])

    def rewind(self, kept: int) -> None:
        """The cursor's rows' state as after the first ``kept`` tokens of the last call (made
        with ``keep_steps``), as if the rest had not run."""
        assert self.conv is not None and self.recurrent_steps is not None and self.joined
        rows = self.cursor.rows
        for state, joined in zip(self.conv, self.joined):
            state[rows] = joined[:, kept : kept + state.shape[1]]  # the K-1 inputs up to token kept-1
        self.recurrent[rows] = self.recurrent_steps[:, kept - 1]


class Decoder:
    """A model with decoding state for ``batch`` rows of up to ``length`` tokens each.

    ``forward(tokens, rows, start)`` runs tokens (b, S) of ``rows`` whose first token sits at
    ``start`` (b,) and returns their logits (b, S, V); the state then holds them. ``step``
    runs one token of every row, through ``torch.compile`` when ``compiled``: its shapes are
    the same at every step (the cache is static), so it compiles once per decoder.
    ``multiple``: every forward runs a multiple of this many tokens (module docstring);
    ``static``: positions of unknown value (``Cursor``).
    """

    def __init__(
        self,
        model: Qwen,
        batch: int,
        length: int,
        compiled: bool = False,
        multiple: int = 1,
        static: bool = False,
    ) -> None:
        self.model, self.batch, self.length, self.multiple = model, batch, length, multiple
        self.one_token = torch.compile(self.logits, dynamic=False) if compiled else self.logits
        self.cursor = Cursor(slice(None), torch.zeros(batch, 1, dtype=torch.long), static=static)
        self.attention: dict[nn.Module, CachedAttention] = {}
        self.sequences: dict[object, CachedSequence] = {}
        self.heads: dict[int, LastPosition] = {}
        for module in model.modules():
            if isinstance(getattr(module, "sdpa", None), ScaledDotProduct):
                self.attention[module] = CachedAttention(self.cursor, batch, length)
            if isinstance(module, DeltaRuleCore):  # its sequence whole, or passed between CP ranks
                self.sequences[module] = CachedSequence(self.cursor, batch)

    @contextmanager
    def attached(self) -> Iterator[None]:
        """The model's kernels swapped for the cached ones, restored on exit."""
        saved = {m: m.sdpa for m in self.attention} | {m: m.sequence for m in self.sequences}
        try:
            for module, cached in self.attention.items():
                module.sdpa = cached
            for module, cached in self.sequences.items():
                module.sequence = cached
            yield
        finally:
            for module, original in saved.items():
                if module in self.attention:
                    module.sdpa = original
                else:
                    module.sequence = original

    def place(self, rows: slice, start: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Point the cursor at ``tokens`` (b, S) of ``rows`` from ``start`` (b,); the tokens and
        their positions as the forward runs them (b, S'), padded to ``multiple`` with copies
        of the last token at its position."""
        count = tokens.shape[1]
        positions = start[:, None] + torch.arange(count, device=start.device)  # (b, S)
        if not self.cursor.static and int(positions.max()) >= self.length:
            raise ValueError(f"position {int(positions.max())} is past the decoder's length {self.length}")
        pad = -count % self.multiple
        if pad:
            tokens = torch.cat((tokens, tokens[:, -1:].expand(-1, pad)), dim=1)
            positions = torch.cat((positions, positions[:, -1:].expand(-1, pad)), dim=1)
        self.cursor.rows, self.cursor.positions, self.cursor.real = rows, positions, count
        return tokens, positions

    @torch.no_grad()
    def forward(self, tokens: Tensor, rows: slice, start: Tensor) -> Tensor:
        """Logits (b, S, V) of ``tokens`` (b, S) continuing ``rows`` at positions from ``start`` (b,)."""
        count = tokens.shape[1]
        tokens, positions = self.place(rows, start, tokens)
        with self.attached():
            return self.logits(tokens, positions)[:, :count]

    @torch.no_grad()
    def last_logits(self, tokens: Tensor, rows: slice, start: Tensor) -> Tensor:
        """``forward``'s logits of the last token only (b, V): a prompt's earlier positions
        need none, and the head over them would be a (b, S, V) tensor and its FLOPs. The
        model's own forward runs (a plan's hooks on it: FSDP's root gathers the head), its
        head reading the last position only."""
        tokens, positions = self.place(rows, start, tokens)
        with self.attached(), self.head_at(self.cursor.real - 1):
            return self.logits(tokens, positions)[:, -1]

    @contextmanager
    def head_at(self, position: int) -> Iterator[None]:
        """The model's head reading ``position`` only, restored on exit (one wrapper a
        position, so that a compiled step sees the same module every call)."""
        head = self.model.lm_head
        assert head is not None, "a decoder runs a whole model"
        self.model.lm_head = self.heads.setdefault(position, LastPosition(head, position))
        try:
            yield
        finally:
            self.model.lm_head = head

    @torch.no_grad()
    def hidden(
        self, tokens: Tensor, rows: slice, start: Tensor, keep_steps: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``forward``'s final-normed hidden states (b, S, H) and logits (b, S, V): the MTP
        head reads the states. ``keep_steps``: ``rewind`` can then resume after any token."""
        count = tokens.shape[1]
        tokens, positions = self.place(rows, start, tokens)
        self.cursor.keep_steps = keep_steps
        try:
            with self.attached():
                hidden, _ = self.model.trunk(tokens, positions=positions)
                return hidden[:, :count], self.model.lm_head(hidden)[:, :count]
        finally:
            self.cursor.keep_steps = False

    @torch.no_grad()
    def head(self, hidden: Tensor, following: Tensor, rows: slice, start: Tensor) -> Tensor:
        """The MTP head's normed states (b, S, H) from the trunk's (or its own) ``hidden`` (b, S, H)
        at positions from ``start`` and the token ``following`` (b, S) each; its attention's
        cache is this decoder's, like the trunk's."""
        count = hidden.shape[1]
        following, positions = self.place(rows, start, following)
        if following.shape[1] > count:
            hidden = torch.cat((hidden, hidden[:, -1:].expand(-1, following.shape[1] - count, -1)), dim=1)
        with self.attached():
            out, _ = self.model.mtp(hidden, self.model.embed_tokens(following), positions=positions)
            return out[:, :count]

    def spread(self, where: Tensor) -> None:
        """Each row's state becomes row ``where[r]``'s (B,): prompts prefilled once, each into
        one row, then copied to every row that continues it."""
        for cached in (*self.attention.values(), *self.sequences.values()):
            cached.spread(where)

    def rewind(self, rows: slice, kept: int) -> None:
        """``rows``' Gated DeltaNet state as after the first ``kept`` tokens of the last
        ``hidden(..., keep_steps=True)``. Attention needs nothing: a cached position past the
        next token's is never visible, and is written over when a token gets there."""
        self.cursor.rows = rows
        for sequence in self.sequences.values():
            sequence.rewind(kept)

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits (B, V) of one token (B,) of every row, each at its position (B,)."""
        tokens, positions = self.place(slice(None), positions, tokens[:, None])
        padded = self.head_at(0) if self.multiple > 1 else nullcontext()
        with self.attached(), padded:
            return self.one_token(tokens, positions)[:, 0]

    def logits(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """The model's logits (b, S, V) of tokens (b, S) at positions (b, S), state attached."""
        return split_output(self.model(tokens, positions=positions))[0]
