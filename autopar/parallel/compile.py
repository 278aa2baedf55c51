"""torch.compile of each transformer block, in place (parameter names do not change).

Blocks are compiled one by one rather than the whole model so that FSDP can gather each
block's parameters around its own graph, and so one compiled graph serves every block
(they share code and shapes). ``fullgraph=True``: a graph break in a block is an error, not
a silent slowdown (except around a mixture of experts' data-dependent routing).
"""

from __future__ import annotations

import difflib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.config.errors import ConfigError
from autopar.config.sections import Compile
from autopar.models.moe import MoE
from autopar.parallel.torch_internals import checkpointed_inside, key_compile_cache_on_vector_isa


def compiles_blocks(cfg: Compile) -> bool:
    """Whether the job compiles its transformer blocks (not only its loss)."""
    return cfg.enable and "model" in cfg.components


def check_compile(cfg: Compile) -> None:
    if cfg.enable and not cfg.components:
        raise ConfigError("compile.components is empty; list 'model' and/or 'loss'")


def check_compile_backend(cfg: Compile) -> None:
    """A compile backend torch knows (listing them imports every backend: about 2 s, so the
    planner, which checks many plans of one job, leaves this to ``check_job``)."""
    if not cfg.enable:
        return
    backends = torch._dynamo.list_backends(exclude_tags=())
    if cfg.backend not in backends:
        close = difflib.get_close_matches(cfg.backend, backends, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "see torch._dynamo.list_backends()"
        raise ConfigError(f"compile.backend={cfg.backend!r} is not a torch.compile backend; {hint}")


def _fresh_output(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.clone()


def apply_compile(model: nn.Module, cfg: Compile, inside_checkpoints: bool = False) -> None:
    """``inside_checkpoints``: compile each checkpointed block's inside, its checkpointing then
    running eagerly around the graph (``activation_checkpoint.compiled_inside``)."""
    key_compile_cache_on_vector_isa()
    for block in model.layers.values():
        # a mixture of experts learns its row counts per expert at run time: its per-expert
        # loop and expert-parallel all-to-all run between graphs (the only breaks allowed)
        routed = any(isinstance(m, MoE) for m in block.modules())
        target = checkpointed_inside(block) if inside_checkpoints else block
        target.compile(fullgraph=not routed, backend=cfg.backend)
    embedding = model.embed_tokens
    if embedding is not None and isinstance(embedding.weight, DTensor):
        # A tensor-parallel embedding hands the first block ``DTensor.to_local()``, a view
        # of the DTensor's local tensor. With that view as a compiled graph's input, its
        # gradient reaches DTensor's redistribute backward as a plain tensor and backward
        # fails (seen on torch 2.13, CPU). A fresh copy of the (B, S/tp, H) activations,
        # once per micro-batch, avoids it.
        embedding.register_forward_hook(_fresh_output)
