"""Token-summed cross-entropy, normalized once per optimizer step by the global token count.

Summing token losses and dividing by the number of target tokens in the whole global batch
(all micro-steps, all data-parallel and context-parallel ranks) makes the loss and the
gradients independent of how the batch is split: accumulation 4x2 equals batch 8, and every
parallel plan sees the single-device numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.data.loader import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32. logits (B, S, V), labels (B, S)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
