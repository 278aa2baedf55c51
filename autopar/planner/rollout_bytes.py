"""An on-policy RL job's rollout moment: what a rank holds while it samples.

Sampling (``training/objectives/rl/engine.py``) runs between optimizer steps on the job's own
parts, so its moment sits beside the training step's, not on top of it: the weights and
optimizer state stay, the gradients are gone, and on top come

- FSDP's unsharded weights, gathered once for the whole rollout (``fsdp_weights_gathered``),
  in the compute dtype (TP-sharded as the plan keeps them);
- the decoding state of every completion the rank samples at once (``models/generation/
  state.py``): each attention layer's k and v cache (rows, Hkv/tp, L, D) in the compute
  dtype; each Gated DeltaNet's three convolution states (rows, K-1, C/tp) in the compute dtype
  and its recurrent state (rows, HV/tp, dk, dv) in float32;
- a decode step's logits (rows, V) whole over the vocabulary in the compute dtype, and the
  float32 tensors the draw holds at once (``sampler_copies``; a prefill computes the head at
  each prompt's last position only).

A row holds the prompt and the whole completion (``rl.job`` refuses prompts that leave no
room), so ``L`` is at most ``seq_len + 1``. The rank samples its data-parallel share of the step's
completions, split again over its context-parallel ranks (``rollout_rows``).
"""

from __future__ import annotations

from autopar.config.sections import RL, JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.mesh import ParallelDims
from autopar.planner.params import modules_numel, uses_fsdp

FP32 = 4


def samples_live(job: JobConfig) -> bool:
    """An RL job that samples (a replay samples nothing)."""
    return job.training.dataset_format == "prompts" and job.rl.replay is None


def sampler_copies(cfg: RL) -> float:
    """float32 (rows, V) tensors a draw holds at once (``models/generation/sampling.py``): the
    scaled logits and their probabilities; under top-p the sorted logits, their int64 order
    (two), their probabilities and running sum, and a quarter for the mask. Measured by the
    dry run: top-k adds nothing at its peak."""
    return 6.25 if cfg.top_p < 1.0 else 2.0


def decode_state_bytes(args: ModelArgs, tp: int, rows: int, length: int, c: int) -> float:
    """The sampler's decoding state for ``rows`` rows of up to ``length`` tokens on one of
    ``tp`` tensor-parallel ranks, activations ``c`` bytes an element."""
    attention = linear = 0
    for layer in range(args.num_hidden_layers):
        if args.mixer(layer) == "linear_attention":
            linear += 1
        else:
            attention += 1
    kv = 2 * rows * (args.num_key_value_heads // tp) * length * args.head_dim * c
    total = attention * kv
    if linear:
        key_heads, value_heads = args.linear_num_key_heads // tp, args.linear_num_value_heads // tp
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        conv = rows * (args.linear_conv_kernel_dim - 1) * (2 * key_heads * dk + value_heads * dv) * c
        recurrent = rows * value_heads * dk * dv * FP32
        total += linear * (conv + recurrent)
    return float(total)


def rollout_rows(job: JobConfig, dims: ParallelDims) -> int:
    """Completions one rank samples at once: its data-parallel share, split over CP; an
    expert-parallel group's ranks each sample all the group's rows (their forwards exchange
    tokens, so they decode together). The larger of a step's and, under ``[validation]``, a
    held-out step's (``validation.local_batch_size`` a rank, sampled between steps too)."""
    completions = job.training.global_batch(dims.dp)
    if job.validation.enable:
        completions = max(completions, job.validation.local_batch_size * dims.dp)
    return -(-completions // (dims.dp * dims.cp)) * dims.ep


def rollout_moment(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, modules: list[str], c: int
) -> dict[str, float]:
    """What a rank adds to its weights and optimizer state while sampling (module docstring);
    empty for a job that does not sample."""
    if not samples_live(job):
        return {}
    rows = rollout_rows(job, dims)
    seq_len = job.training.seq_len
    moment = {
        "decode_state": decode_state_bytes(args, dims.tp, rows, seq_len + 1, c),
        "decode_logits": float(rows * args.vocab_size * (c + sampler_copies(job.rl) * FP32)),
    }
    if uses_fsdp(job, dims):
        moment["gathered_params"] = float(modules_numel(args, job, dims, modules, sharded=False) * c)
    return moment
