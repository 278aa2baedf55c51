"""Sample prompts during training (``validation.sample_prompts``): every ``validation.freq``
steps, the model's greedy reply to each prompt of a JSONL file, logged and appended to
``<dump_folder>/samples.jsonl`` as ``{"step", "prompt_ids", "new_ids", "text"}``.

The cheapest sanity check there is: a run whose replies turn to repeated tokens has gone
wrong whatever its loss says. Every rank gathers the full weights (collective, one tensor at
a time); the first rank loads them into a plain fp32 copy of the model and decodes with
``autopar.models.generation``, the others wait at a barrier. The copy is kept between
samplings: one full fp32 model on the first rank's device.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.data.chat_template import template_text
from autopar.data.errors import DataError
from autopar.data.prompts import check_vocabulary, read_prompts, stop_ids
from autopar.data.tokenizer import Tokenizer
from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.models.generation import generate
from autopar.models.generation.generate import check_prompts
from autopar.models.qwen import Qwen, canonical_name
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.world import World
from autopar.training.resolve import tokenizer_path

logger = logging.getLogger("autopar")


def check_sample_prompts(job: JobConfig, dims: ParallelDims) -> None:
    """``validation.sample_prompts`` names a file, and the plan keeps the whole model in one
    module per rank (no pipeline stages) with plain weights (no LoRA adapters)."""
    path = job.validation.sample_prompts
    if path is None:
        return
    if not Path(path).is_file():
        raise ConfigError(f"validation.sample_prompts={path!r} is not a file; name a JSONL file of prompts")
    if job.validation.freq < 1:
        raise ConfigError(f"validation.freq={job.validation.freq} must be >= 1")
    if dims.pp > 1:
        raise ConfigError(
            f"validation.sample_prompts with pipeline_parallel_degree={dims.pp}: sampling needs the "
            "whole model on each rank; unset validation.sample_prompts or use pipeline_parallel_degree=1"
        )
    if job.lora.enable:
        raise ConfigError(
            "validation.sample_prompts with lora.enable=true: sampling does not merge adapters yet; "
            "unset validation.sample_prompts and sample the export with python -m autopar.generate"
        )


class PromptSampler:
    """The job's sample prompts, read and checked now (before any training step)."""

    def __init__(self, job: JobConfig, args: ModelArgs, tokenizer: Tokenizer, world: World) -> None:
        path = job.validation.sample_prompts
        template = template_text(tokenizer_path(job), job.training.chat_template)
        self.prompts = read_prompts(path, tokenizer, template, "validation.sample_prompts")
        self.max_new_tokens = job.generate.max_new_tokens
        try:
            check_prompts(self.prompts, self.max_new_tokens, args.max_position_embeddings)
        except ValueError as err:
            raise DataError(f"{path}: {err}") from None
        check_vocabulary(self.prompts, args.vocab_size, path)
        self.tokenizer, self.stops = tokenizer, stop_ids(tokenizer)
        self.args, self.world = args, world
        self.output = Path(job.job.dump_folder) / "samples.jsonl"
        self.model: Qwen | None = None

    def run(self, step: int, part: nn.Module) -> None:
        """Sample with ``part``'s weights at ``step`` (collective over every rank)."""
        weights = {}
        for name, tensor in part.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.world.is_main:
                weights[canonical_name(name)] = full.detach().float()
        if self.world.is_main:
            self._sample(step, weights)
        if dist.is_initialized():
            dist.barrier()

    def _sample(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        if self.model is None:
            with torch.device(self.world.device):
                self.model = build_model(self.args).eval()
        self.model.load_state_dict(weights)
        new = generate(self.model, self.prompts, self.max_new_tokens, stop_ids=self.stops)
        with self.output.open("a", encoding="utf-8") as out:
            for prompt, ids in zip(self.prompts, new):
                text = self.tokenizer.decode([i for i in ids if i not in self.stops])
                logger.info("sample at step %d: %r -> %r", step, self.tokenizer.decode(prompt), text)
                out.write(
                    json.dumps({"step": step, "prompt_ids": prompt, "new_ids": ids, "text": text}) + "\n"
                )
