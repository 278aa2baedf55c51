"""Where a model's tensors sit in an HF checkpoint: the names' prefix and how experts are stored."""

from __future__ import annotations

from typing import NamedTuple

TEXT_PREFIX = "model."
VISION_LANGUAGE_PREFIX = "model.language_model."
"""Qwen3.5's released checkpoints are the vision-language model: text weights sit here, beside
``model.visual.*`` and the multi-token-prediction head ``mtp.*``."""


class HFLayout(NamedTuple):
    prefix: str = TEXT_PREFIX
    """Before every text-model tensor name but ``lm_head.weight``."""
    fused_experts: bool = False
    """Experts stacked as ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj``
    (E, H, I) (Qwen3.5-MoE's released files), not one tensor per expert (what transformers
    writes)."""

    @property
    def vision_language(self) -> bool:
        return self.prefix == VISION_LANGUAGE_PREFIX


class Piece(NamedTuple):
    """One HF tensor holding (part of) one of our parameters."""

    hf_name: str
    shape: tuple[int, ...]
    """The shape of what it holds of ours (the HF tensor's, unless ``part``)."""
    part: tuple[int, int, int] | None = None
    """(dim, start, stop): ours is this slice of a fused HF tensor."""
