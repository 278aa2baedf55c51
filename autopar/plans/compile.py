"""torch.compile of each transformer block, in place (parameter names do not change).

Blocks are compiled one by one rather than the whole model so that FSDP can gather each
block's parameters around its own graph, and so one compiled graph serves every block
(they share code and shapes). ``fullgraph=True``: a graph break in a block is an error, not
a silent slowdown.
"""

from __future__ import annotations

from torch import nn

from autopar.config.job import Compile


def apply_compile(model: nn.Module, cfg: Compile) -> None:
    for block in model.layers.values():
        block.compile(fullgraph=True, backend=cfg.backend)
