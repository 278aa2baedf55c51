"""The checks a job passes before any process group, model or file is touched (``check_job``).

Every check raises ``ConfigError`` naming the field, its value and the fix. The rules live
beside the code that depends on them (each part's ``check_*``); this module only calls them
all, in an order that reports the most basic mistake first. ``check_plan`` is the subset
that decides whether a parallel plan can run at all, which the planner reuses.
"""

from __future__ import annotations

import logging

import torch

from autopar.config.checks import check_numbers, check_output_folders
from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.data.loader import check_batch, check_training_data
from autopar.models.args import ModelArgs
from autopar.parallel.activation_checkpoint import check_ac
from autopar.parallel.compile import check_compile, check_compile_backend, compiles_blocks
from autopar.parallel.context_parallel import check_cp
from autopar.parallel.delta_rule_kernel import check_delta_rule_kernel, check_kernel_installed
from autopar.parallel.expert_parallel import check_ep
from autopar.parallel.float8 import check_float8, check_float8_filter
from autopar.parallel.lora import check_lora
from autopar.parallel.mesh import ParallelDims, check_model_split
from autopar.parallel.mixed_precision import compute_dtype
from autopar.parallel.pipelining.schedule import check_pipeline
from autopar.parallel.sdpa_backend import check_sdpa_backend
from autopar.training.checkpointing.initial_load import check_initial_load, check_load_step
from autopar.training.metrics.profiling import check_profiling
from autopar.training.metrics.sinks import check_wandb
from autopar.training.objectives.build import packs_documents
from autopar.training.objectives.dpo.checks import check_preference
from autopar.training.objectives.mtp.checks import check_mtp
from autopar.training.objectives.rl.job import check_rl
from autopar.training.resolve import model_args, tokenizer_path
from autopar.training.validation import check_validation

logger = logging.getLogger("autopar")


def check_loss_chunks(job: JobConfig) -> None:
    chunk = job.training.loss_chunk_tokens
    if chunk < 0:
        raise ConfigError(f"training.loss_chunk_tokens={chunk} must be >= 0 (0: no chunking)")


def check_expert_kernel(job: JobConfig, args: ModelArgs, device_type: str) -> None:
    """A forced grouped expert GEMM must be one torch can compile: its traced shape function
    takes bfloat16 only (``auto`` falls back to the per-expert loop there by itself)."""
    compiled = compiles_blocks(job.compile)
    if not (args.moe and job.training.expert_kernel == "grouped" and compiled):
        return
    dtype = compute_dtype(job, torch.device(device_type))
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"training.expert_kernel='grouped' with compile.enable=true needs bfloat16 compute (torch "
            f"traces its grouped GEMM in bfloat16 only), and this job computes in {dtype}; use "
            "--training.mixed_precision_param bfloat16, --training.expert_kernel auto, or --compile.enable false"
        )


def check_plan(job: JobConfig, args: ModelArgs, world_size: int, device_type: str) -> ParallelDims:
    """The parallel plan and its transformations fit this model on ``world_size`` ranks of
    ``device_type``; returns the resolved degrees."""
    parallelism = job.parallelism
    dims = ParallelDims.resolve(parallelism, world_size, args.num_experts)
    check_model_split(
        dims,
        args,
        job.training.seq_len,
        parallelism.enable_sequence_parallel,
        head_tail=parallelism.context_parallel_load_balancer == "headtail",
    )
    check_batch(job.training, dims.dp)
    check_loss_chunks(job)
    check_ac(job.activation_checkpoint, dims.tp, parallelism.enable_sequence_parallel)
    check_ep(dims.ep, job.activation_checkpoint, compiles_blocks(job.compile))
    check_compile(job.compile)
    check_float8(job.float8, device_type, dims.tp, job.compile.enable, job.lora.enable)
    check_cp(
        parallelism,
        device_type,
        job.compile.enable,
        job.activation_checkpoint.mode,
        packs_documents(job),
    )
    check_pipeline(parallelism, args, job.training.local_batch_size)
    check_sdpa_backend(job, device_type)
    check_expert_kernel(job, args, device_type)
    check_delta_rule_kernel(job, args, device_type)
    check_preference(job, dims, args)
    check_rl(job, dims, args)
    check_mtp(job, args, dims)
    return dims


def check_nodes(job: JobConfig, world_size: int, ranks_per_node: int | None) -> None:
    """A launch of ``ranks_per_node`` ranks on each node (None: not launched by torchrun)
    against the plan: the GPUs per node it was planned for, and tensor parallelism within a
    node (its ranks are consecutive: it spans nodes unless its degree divides the node's)."""
    if ranks_per_node is None:
        return
    planned = job.parallelism.gpus_per_node
    if planned != -1 and planned != ranks_per_node:
        raise ConfigError(
            f"parallelism.gpus_per_node={planned} (the planner's --gpus-per-node), but this launch "
            f"runs LOCAL_WORLD_SIZE={ranks_per_node} ranks per node (torchrun --nproc_per_node); launch "
            f"{planned} per node, or plan again with python -m autopar.plan --gpus-per-node {ranks_per_node}"
        )
    tp = job.parallelism.tensor_parallel_degree
    if world_size > ranks_per_node and tp > 1 and ranks_per_node % tp:
        logger.warning(
            "parallelism.tensor_parallel_degree=%d spans nodes of %d ranks (LOCAL_WORLD_SIZE): its "
            "every-layer collectives cross the network; use a degree that divides %d",
            tp,
            ranks_per_node,
            ranks_per_node,
        )


def check_job(job: JobConfig, world_size: int, device_type: str | None = None) -> ModelArgs:
    """Check the whole job for ``world_size`` ranks of ``device_type`` (default: this
    machine's); the resolved model args."""
    check_numbers(job)
    args = model_args(job)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dims = check_plan(job, args, world_size, device_type)
    check_validation(job, args, dims)
    check_float8_filter(job.float8, args)
    check_lora(job, args, device_type)
    check_profiling(job.profiling, device_type)
    check_compile_backend(job.compile)
    check_training_data(job.training, tokenizer_path(job), args.vocab_size, args.max_position_embeddings)
    check_initial_load(job.checkpoint, args, f"{job.model.name}/{job.model.flavor}")
    check_load_step(job.checkpoint, job.job.dump_folder)
    check_output_folders(job)
    check_wandb(job)
    if device_type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    ):  # where it runs, not where it is planned
        check_kernel_installed(job)
    return args
