"""Training Qwen3.5's multi-token-prediction head with the model (``[mtp]``, issue 55): the
job's checks, the head's layers read from the HF folder, and what a step needs to add the
head's loss (``MTPTraining``).

The head runs inside the model's forward (``Qwen35.forward(..., mtp=...)``), so FSDP gathers
its weights as the model's, tensor parallelism splits it by its own plan
(``parallel.tensor_parallel.head_plan``) and expert parallelism its experts as the trunk's.
Context parallelism splits what the head reads of the tokens after each position and its
targets (built on the whole sequences, ``objectives.language_model``) as it splits the tokens,
and gathers the head's attention as the trunk's. A pipeline runs it on the last stage
beside ``lm_head`` (``split.BESIDE_HEAD``): every stage before the last passes its hidden
states and the next tokens' embeddings on stacked as one (2B, S, H) tensor
(``Qwen35.forward``), so the head's input gradient reaches the embedding through the
pipeline; its targets ride in the schedule's target beside the labels. Pipeline and
context parallelism together are refused (``check_pipelined_head``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.config.errors import ConfigError
from autopar.config.sections import MTP, JobConfig
from autopar.data.loader import IGNORE_INDEX, Batch
from autopar.models.args import ModelArgs
from autopar.models.hf import head_layers
from autopar.models.hf_config import HFCheckpointError
from autopar.parallel.float8 import output_head_in_fp8
from autopar.parallel.mesh import ParallelDims
from autopar.training.objectives.mtp.loss import mtp_labels
from autopar.training.train_context import all_reduce_sum

METRICS = ("mtp_loss", "mtp_acceptance")
"""The head's numbers in metrics.jsonl and the step line (``val_`` ones under validation)."""


def head_layers_of(job: JobConfig, args: ModelArgs) -> int:
    """The head's layers a job with ``[mtp] enable`` builds from its HF folder
    (``model.hf_assets_path``'s config.json and ``mtp.*`` tensors); one line naming the folder
    when it has none."""
    folder = job.model.hf_assets_path
    if not args.hybrid:
        raise ConfigError(
            f"mtp.enable=true, but {job.model.name} has no multi-token-prediction head (Qwen3.5's "
            "only); use --mtp.enable false"
        )
    try:
        return head_layers(folder, args)
    except HFCheckpointError:
        raise ConfigError(
            f"mtp.enable=true, but model.hf_assets_path={folder!r} has no multi-token-prediction head "
            "(mtp_num_hidden_layers > 0 in config.json and mtp.* tensors); fine-tune a released Qwen3.5 "
            "folder that carries one, or use --mtp.enable false"
        ) from None


def check_mtp(job: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """``[mtp]`` is consistent, the model has a head, and nothing the head does not run
    under yet is asked for: one line naming the field and what to do instead."""
    cfg = job.mtp
    if not cfg.enable:
        for name in ("only", "detach"):
            if getattr(cfg, name):
                raise ConfigError(f"mtp.{name}=true without mtp.enable; add --mtp.enable true")
        return
    if cfg.loss_scale < 0:
        raise ConfigError(
            f"mtp.loss_scale={cfg.loss_scale} must be >= 0 (Megatron's default: 0.1; 0 logs the head's "
            "loss and acceptance without training it)"
        )
    if cfg.only and cfg.loss_scale == 0:
        raise ConfigError(
            "mtp.only=true with mtp.loss_scale=0 trains nothing (only the head trains, and at scale 0 "
            "it is measured, not trained); give a scale > 0, or leave mtp.only false to log the head's acceptance"
        )
    if not args.hybrid:
        raise ConfigError(
            f"mtp.enable=true, but model.name={job.model.name!r} has no multi-token-prediction head "
            "(Qwen3.5's only); use --mtp.enable false"
        )
    if args.mtp_num_hidden_layers == 0:
        raise ConfigError(
            f"mtp.enable=true, but model {job.model.name}/{job.model.flavor} has no multi-token-prediction "
            "head; fine-tune a Qwen3.5 folder that carries mtp.* (model.hf_assets_path), set "
            "--model.mtp_num_hidden_layers 1 for a fresh one, or use --mtp.enable false"
        )
    _check_initial_load(job, args)
    check_pipelined_head(cfg, dims)
    refused = {
        "training.dataset_format='preference'": job.training.dataset_format == "preference",
    }
    for setting, asked in refused.items():
        if asked:
            raise ConfigError(
                f"{setting} with mtp.enable=true: not supported with the multi-token-prediction head "
                "yet; turn it off, or use --mtp.enable false"
            )
    _check_lora(job)
    if cfg.detach and job.parallelism.fsdp_reshard_after_forward == "always":
        raise ConfigError(
            "mtp.detach=true with parallelism.fsdp_reshard_after_forward='always': the detached head "
            "reads the output head's weight after its forward; use 'default' or 'never'"
        )
    _check_detached_float8(job, args)


def _check_detached_float8(job: JobConfig, args: ModelArgs) -> None:
    """FP8 converts the head's linears as the trunk's (``fc`` and its layer's projections;
    ``float8.filter_fqns`` and the family's high-precision ones alike). A detached head
    multiplies by the output head's bare weight (``DetachedOutput``), outside ``lm_head``'s
    own forward: in high precision where that weight is a plain tensor, but FSDP's FP8
    all-gather hands over an FP8 weight that only an FP8 linear can multiply."""
    fp8 = job.float8
    if job.mtp.detach and fp8.enable_fsdp_float8_all_gather and output_head_in_fp8(fp8, args):
        raise ConfigError(
            "mtp.detach=true with float8.enable_fsdp_float8_all_gather=true and lm_head in FP8 (not in "
            "float8.filter_fqns): FSDP gathers the output head's weight as an FP8 tensor, which the detached "
            "head cannot multiply outside lm_head's FP8 linear; add lm_head to float8.filter_fqns (the "
            "default), set --float8.enable_fsdp_float8_all_gather false, or use --mtp.detach false"
        )


def _check_lora(job: JobConfig) -> None:
    """LoRA adapts the head's linears as the trunk's (``lora.target_modules`` by suffix:
    ``q_proj`` adapts ``mtp.layers.0.self_attn.q_proj`` too; ``fc`` or ``mtp.fc`` its input
    projection). ``only`` trains the head's whole weights, which LoRA freezes; a detached head
    reads the output head's bare weight, past its adapter."""
    cfg, lora = job.mtp, job.lora
    if not lora.enable:
        return
    if cfg.only:
        raise ConfigError(
            "mtp.only=true with lora.enable=true: only trains the head's own weights, which LoRA freezes; "
            "use one of them (LoRA adapts the head's linears by lora.target_modules, e.g. fc, q_proj)"
        )
    if cfg.detach and any(t.rpartition(".")[2] == "lm_head" for t in lora.target_modules):
        raise ConfigError(
            "mtp.detach=true with lm_head in lora.target_modules: the detached head reads the output head's "
            "weight without its adapter; drop lm_head from lora.target_modules or use --mtp.detach false"
        )


def _check_initial_load(job: JobConfig, args: ModelArgs) -> None:
    """An HF folder the weights start from carries the head too."""
    checkpoint = job.checkpoint
    path = checkpoint.initial_load_path
    if not checkpoint.initial_load_in_hf or path is None or not Path(path).is_dir():
        return
    try:
        head_layers(path, args)
    except HFCheckpointError:
        raise ConfigError(
            f"mtp.enable=true, but checkpoint.initial_load_path={path!r} has no multi-token-prediction head "
            "(mtp.* tensors) to start it from; load a folder that carries one, or use --mtp.enable false"
        ) from None


def check_pipelined_head(cfg: MTP, dims: ParallelDims) -> None:
    """What the head does not run with under a pipeline yet, in one line naming the fields."""
    if dims.pp == 1:
        return
    if dims.cp > 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} with context_parallel_degree={dims.cp} and "
            "mtp.enable=true: not supported yet (the micro-batches carry each rank's chunk of the tokens, "
            "not the head's next tokens and targets built on the whole sequences); use one of them (the "
            "head runs under either alone), or --mtp.enable false"
        )
    if cfg.only:
        raise ConfigError(
            f"mtp.only=true with parallelism.pipeline_parallel_degree={dims.pp}: the stages before the "
            "last would hold no trained weights; train the head alone with FSDP / TP (pipeline degree 1)"
        )


def global_mtp_target_count(batches: list[Batch], dp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The head's targets over the whole global batch (``global_target_count``'s twin): what
    its summed loss is divided by, as the main loss is by its own."""
    local = sum((mtp_labels(b.labels, b.documents) != IGNORE_INDEX).sum() for b in batches).to(torch.float32)
    return all_reduce_sum(local, dp_mesh)
