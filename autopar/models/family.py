"""Model families: the one place that says which class builds a model and how its weights
start. Every floor above asks here (``build_model``, ``family_of``) instead of naming a class,
so a new family is a folder of files and a row of ``FAMILIES``; what differs per layer
(token mixer, feed-forward) is ``ModelArgs.layer_kind``, and plans key their tables on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.models.args import ModelArgs
from autopar.models.qwen import Qwen
from autopar.models.qwen3_5.model import Qwen35


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """``model.name`` in a job."""
    model: type[Qwen]
    """Builds it; its ``initial_value`` gives each parameter's deterministic start."""
    high_precision: tuple[str, ...] = ()
    """Linears FP8 never converts (name suffixes), whatever ``float8.filter_fqns`` says: tiny
    projections whose FP8 error the released FP8 checkpoints avoid too."""
    fused_linears: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """HF's fused linear (module path within a block) -> ours that split it, in its row
    order: LoRA adapts them as one (one A, their Bs stacked), peft names them as HF's."""


FAMILIES: dict[str, ModelFamily] = {
    "qwen2.5": ModelFamily("qwen2.5", Qwen),
    "qwen3": ModelFamily("qwen3", Qwen),
    "qwen3.5": ModelFamily(
        "qwen3.5",
        Qwen35,
        # the decay and write-strength projections (one row per value head) and the shared
        # expert's one-row gate stay bf16 in Qwen's own FP8 checkpoints, as does the conv
        high_precision=("linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.shared_expert_gate"),
        fused_linears={
            "linear_attn.in_proj_qkv": (
                "linear_attn.in_proj_q",
                "linear_attn.in_proj_k",
                "linear_attn.in_proj_v",
            )
        },
    ),
}


def family_of(args: ModelArgs) -> ModelFamily:
    return FAMILIES[args.family]


def build_model(args: ModelArgs) -> Qwen:
    """The single-device model ``args`` describe (on the current default device)."""
    return family_of(args).model(args)
