"""The one map between dtype names (as configs and HF config.json spell them) and torch dtypes."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (any dtype, listed or not)."""
    return str(dtype).removeprefix("torch.")
