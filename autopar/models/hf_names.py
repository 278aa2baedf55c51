"""Our parameter names beside an HF checkpoint's tensor names, for every family: a prefix,
one tensor per expert of a stacked expert weight, or a slice of a fused tensor (Qwen3.5)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autopar.models.args import ModelArgs
from autopar.models.hf_layout import TEXT_PREFIX, VISION_LANGUAGE_PREFIX, HFLayout, Piece
from autopar.models.qwen import canonical_name
from autopar.models.qwen3_5.hf import qwen3_5_pieces

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


MTP_PREFIX = "mtp."
"""Qwen3.5's multi-token-prediction head: ours and HF's names alike (no text-model prefix)."""


def to_hf_name(name: str, prefix: str = TEXT_PREFIX) -> str:
    name = canonical_name(name)
    return name if name == "lm_head.weight" else f"{prefix}{name}"


def hf_pieces(
    args: ModelArgs, name: str, shape: tuple[int, ...], layout: HFLayout | None = None
) -> list[Piece]:
    """The HF tensors that hold our parameter ``name`` in ``layout`` (the text-only one by
    default): itself, one per expert of a stacked expert weight, or a slice of a fused one."""
    layout = layout or HFLayout()
    name = canonical_name(name)
    if name.startswith(MTP_PREFIX):  # Qwen3.5's head sits at the top of every layout
        layout = layout._replace(prefix="")
    if args.hybrid:
        found = qwen3_5_pieces(args, name, shape, layout)
        if found is not None:
            return found
    module, _, leaf = name.rpartition(".")
    if module.endswith("mlp.experts") and leaf in _EXPERT_WEIGHTS:
        return [
            Piece(f"{layout.prefix}{module}.{e}.{leaf}.weight", tuple(shape[1:])) for e in range(shape[0])
        ]
    return [Piece(to_hf_name(name, layout.prefix), tuple(shape))]


def hf_tensors(
    args: ModelArgs, name: str, tensor: torch.Tensor, layout: HFLayout | None = None
) -> list[Part]:
    """Our parameter ``name`` as (HF name, its slice or None, the values) of the HF tensors
    that hold it; slices of one fused HF tensor are joined by ``join_parts``."""
    pieces = hf_pieces(args, name, tuple(tensor.shape), layout)
    if len(pieces) == 1:
        return [(pieces[0].hf_name, pieces[0].part, tensor)]
    return [(piece.hf_name, piece.part, part) for piece, part in zip(pieces, tensor.unbind(0), strict=True)]


Part = tuple[str, "tuple[int, int, int] | None", torch.Tensor]


def join_parts(parts: list[Part]) -> dict[str, torch.Tensor]:
    """HF name -> tensor, slices of a fused tensor concatenated in place order."""
    whole: dict[str, torch.Tensor] = {}
    sliced: dict[str, list[tuple[tuple[int, int, int], torch.Tensor]]] = {}
    for hf_name, part, tensor in parts:
        if part is None:
            whole[hf_name] = tensor
        else:
            sliced.setdefault(hf_name, []).append((part, tensor))
    for hf_name, pieces in sliced.items():
        pieces.sort(key=lambda p: p[0][1])
        whole[hf_name] = torch.cat([t for _, t in pieces], dim=pieces[0][0][0])
    return whole


PASSED_THROUGH = ("model.visual.", MTP_PREFIX)
"""Tensors of a vision-language checkpoint that text training leaves as they are (the vision
tower, the multi-token-prediction head): ignored on load, copied through on export (the head
is loaded and written as the model's own when a job asks for it: ``from_hf(..., mtp=True)``)."""


def detect_layout(names: Iterable[str]) -> HFLayout:
    """The layout of a checkpoint holding tensors ``names``."""
    names = set(names)
    prefix = (
        VISION_LANGUAGE_PREFIX if f"{VISION_LANGUAGE_PREFIX}embed_tokens.weight" in names else TEXT_PREFIX
    )
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    return HFLayout(prefix, fused)
