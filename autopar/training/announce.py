"""The start-up summary of a run: one line saying what is trained, how, on what, and for how long."""

from __future__ import annotations

import logging

import torch

from autopar.config.checks import inert_float8
from autopar.config.sections import JobConfig
from autopar.data.dataset import SampleSource
from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.parallel.lora import apply_lora
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.world import World
from autopar.training.metrics.flops import matmul_params
from autopar.training.resolve import flavor_mismatch, model_source, tokenizer_path

logger = logging.getLogger("autopar")


def announce(
    job: JobConfig,
    args: ModelArgs,
    dims: ParallelDims,
    world: World,
    samples: SampleSource,
    global_batch: int,
) -> None:
    """The start-up summary: model, plan, data and tokenizer, and what was adjusted."""
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(args).parameters())
    active = f" ({matmul_params(args) / 1e6:.3g}M active in matmuls)" if args.moe else ""
    if job.lora.enable:
        with torch.device("meta"):
            adapted = build_model(args)
            apply_lora(adapted, job.lora, torch.float32)
        trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        active += f" ({trained / 1e6:.3g}M trained: LoRA rank {job.lora.rank})"
    tokenizer = tokenizer_path(job) or "the built-in byte tokenizer (no tokenizer.json given)"
    shape = model_source(job)
    mismatch = flavor_mismatch(job)
    if mismatch:
        logger.warning(mismatch)
    if job.model.overrides:
        shape += f" with {job.model.overrides}"
    logger.info(
        "%s %s: %.3gM parameters%s, %d layers | dp_replicate=%d dp_shard=%d tp=%d cp=%d pp=%d%s on %d %s "
        "rank(s) | data: %s; tokenizer: %s | %d steps of %d x %d tokens",
        job.model.name,
        shape,
        params / 1e6,
        active,
        args.num_hidden_layers,
        dims.dp_replicate,
        dims.dp_shard,
        dims.tp,
        dims.cp,
        dims.pp,
        f" ep={dims.ep}" if dims.ep > 1 else "",
        world.size,
        world.device.type,
        samples.describe(),
        tokenizer,
        job.training.steps,
        global_batch,
        job.training.seq_len,
    )
    inert = inert_float8(job)
    if inert:
        logger.warning(inert)
    if job.lr_scheduler.warmup_steps > job.training.steps:
        logger.warning(
            "lr_scheduler.warmup_steps=%d exceeds training.steps=%d: warming up over all %d steps",
            job.lr_scheduler.warmup_steps,
            job.training.steps,
            job.training.steps,
        )
