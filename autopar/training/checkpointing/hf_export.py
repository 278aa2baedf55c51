"""A run's Hugging Face output: the model of a DCP checkpoint as an HF folder, or under LoRA
its peft adapter folder (and the merged model), each written whole or not at all."""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.models.dtypes import DTYPES
from autopar.models.family import build_model
from autopar.models.hf import copy_assets, save_hf_like
from autopar.models.hf_config import CONFIG_FILE
from autopar.parallel.materialize import FullValue
from autopar.training.checkpointing.adapters import BaseTensors, export_merged, save_adapter, saved_adapters
from autopar.training.checkpointing.dcp_state import read_model_tensors
from autopar.training.checkpointing.folder_swap import finish_interrupted_swap, swap_into_place
from autopar.training.faults import TrainingStopped
from autopar.training.resolve import tokenizer_path

logger = logging.getLogger("autopar")


def export_hf(
    checkpoint_dir: str | Path,
    args: ModelArgs,
    out_dir: str | Path,
    dtype: torch.dtype,
    source: str | Path | None = None,
) -> None:
    """Write the model of a DCP checkpoint as an HF folder, one safetensors shard in memory
    at a time. From a vision-language ``source`` (the HF folder the run started from) it
    writes that layout, and the source's vision tower, MTP head and config.json come along
    unchanged: the export loads and serves as the whole model did."""
    with torch.device("meta"):
        layout = {n: (p.shape, dtype) for n, p in build_model(args).named_parameters()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        return read_model_tensors(checkpoint_dir, {n: layout[n][0] for n in names}, dtype)

    save_hf_like(layout, load, args, out_dir, source)


def export_run(
    job: JobConfig, args: ModelArgs, ckpt: Path, out: Path, initial_values: Callable[[], FullValue]
) -> None:
    """Write ``out`` from checkpoint ``ckpt``: the model, or under LoRA its peft adapter folder
    (and, with lora.merge_on_export, the merged model beside it as ``<out>-merged``, on the base
    ``initial_values`` gives when the run did not start from a DCP folder)."""
    checkpoint, lora = job.checkpoint, job.lora
    dtype = DTYPES[checkpoint.export_dtype]
    source = checkpoint.initial_load_path if checkpoint.initial_load_in_hf else None
    if not lora.enable:
        write_export(job, ckpt, out, lambda folder: export_hf(ckpt, args, folder, dtype, source))
        return
    adapters = saved_adapters(ckpt)
    base_model = job.model.hf_assets_path or checkpoint.initial_load_path
    cast = {n: t.to(dtype) for n, t in adapters.items()}
    write_export(job, ckpt, out, lambda folder: save_adapter(cast, lora, folder, args, base_model))
    if lora.merge_on_export:
        merged = out.with_name(f"{out.name}-merged")
        base = base_tensors(job, initial_values)
        write_export(
            job, ckpt, merged, lambda folder: export_merged(adapters, base, args, lora, folder, dtype, source)
        )


def base_tensors(job: JobConfig, initial_values: Callable[[], FullValue]) -> BaseTensors:
    """The weights a run started from (a LoRA run's frozen base), by name."""
    checkpoint = job.checkpoint
    if checkpoint.initial_load_path is not None and not checkpoint.initial_load_in_hf:
        return functools.partial(read_model_tensors, checkpoint.initial_load_path)
    value = initial_values()
    return lambda shapes: {n: value(n, shape) for n, shape in shapes.items()}


def write_export(job: JobConfig, ckpt: Path, out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a ``.partial`` folder renamed to ``out`` when complete, so a full disk
    leaves no half export (and says so); the tokenizer files go with a model folder."""
    partial = out.with_name(out.name + ".partial")
    finish_interrupted_swap(out, out.with_name(out.name + ".old"))
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write(partial)
        assets: list[str] = []
        source = job.model.hf_assets_path or tokenizer_path(job)
        if source is not None and (partial / CONFIG_FILE).is_file():
            assets = copy_assets(source, partial)
        swap_into_place(partial, out, out.with_name(out.name + ".old"))
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as its own error
        shutil.rmtree(partial, ignore_errors=True)
        raise TrainingStopped(
            f"could not write the HF export {out}: {err}; nothing was left there, and checkpoint "
            f"{ckpt} is kept: free space and run the same command again to export it"
        ) from err
    logger.info("exported HF folder %s (with %s)", out, ", ".join(assets) or "no tokenizer files")
