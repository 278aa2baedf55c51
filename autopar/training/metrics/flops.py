"""FLOPs per token and model FLOPs utilization (MFU): the one formula the step line, the
benchmarks and the planner share, and the devices' peaks it is measured against."""

from __future__ import annotations

import functools
import resource
import sys

import torch

from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import CHUNK as DELTA_RULE_CHUNK
from autopar.models.qwen3_5.mtp import head_layer_args

# Dense bf16 tensor-core peaks in FLOP/s, by a substring of torch.cuda.get_device_name().
# Order matters: more specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
)


def mixer_matmul_params(args: ModelArgs, layer: int) -> int:
    """Parameters one token meets in block ``layer``'s token mixer: attention's q/k/v/o (gated
    attention's q twice as wide, query and gate), or a Gated DeltaNet's six input projections,
    its depthwise convolution (K multiply-adds per channel) and out_proj."""
    hidden = args.hidden_size
    mixer = args.mixer(layer)
    if mixer == "linear_attention":
        keys = args.linear_num_key_heads * args.linear_key_head_dim
        values = args.linear_num_value_heads * args.linear_value_head_dim
        projections = hidden * (2 * keys + 2 * values + 2 * args.linear_num_value_heads)
        return projections + args.linear_conv_kernel_dim * (2 * keys + values) + values * hidden
    q = args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    return hidden * ((2 if mixer == "gated_attention" else 1) * q + 2 * kv) + q * hidden


def block_matmul_params(args: ModelArgs, layer: int = 0) -> int:
    """Parameters one token meets in block ``layer``'s projections: its token mixer's and the
    SwiGLU MLP's, or in a mixture-of-experts layer the router's, its top-k experts' and its
    shared expert's (the active parameters)."""
    hidden = args.hidden_size
    mixer = mixer_matmul_params(args, layer)
    if args.is_moe_layer(layer):
        experts = args.num_experts_per_tok * 3 * hidden * args.moe_intermediate_size
        shared = 3 * hidden * args.shared_expert_intermediate_size + (
            hidden if args.shared_expert_intermediate_size else 0
        )
        return mixer + hidden * args.num_experts + experts + shared
    return mixer + 3 * hidden * args.intermediate_size


@functools.lru_cache(maxsize=64)
def matmul_params(args: ModelArgs) -> int:
    """Active parameters used in matmuls: every block projection (a token's experts only)
    and the output head (not the lookup)."""
    blocks = sum(block_matmul_params(args, i) for i in range(args.num_hidden_layers))
    return blocks + args.hidden_size * args.vocab_size


def head_matmul_params(args: ModelArgs) -> int:
    """Parameters one token meets in Qwen3.5's multi-token-prediction head (0 without one):
    its ``fc`` (2H -> H), its full-attention layers, and a second pass through the output
    head (the head's own vocabulary-wide logits)."""
    layers = args.mtp_num_hidden_layers
    if not layers:
        return 0
    hidden = args.hidden_size
    return (
        2 * hidden * hidden
        + layers * block_matmul_params(head_layer_args(args), 0)
        + hidden * args.vocab_size
    )


def delta_rule_flops(args: ModelArgs) -> float:
    """Training FLOPs per token of one Gated DeltaNet's recurrence, 3x its forward: per value
    head, the state read, the write and the output (2*dk*dv each) and, within a chunk of C
    tokens, the key Gram row, the query-key row and the chunk's read of the corrections
    (2*C*(2*dk + dv))."""
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    return 3 * args.linear_num_value_heads * (6 * dk * dv + 2 * DELTA_RULE_CHUNK * (2 * dk + dv))


@functools.lru_cache(maxsize=256)
def flops_per_token(args: ModelArgs, seq_len: int, frozen: bool = False, reference: bool = False) -> float:
    """Training FLOPs per token, 6N + 12*L*H*Q*T (PaLM; causal attention not halved), L
    counting the attention layers; a hybrid model's Gated DeltaNet layers add their
    recurrence's (``delta_rule_flops``). With the weights ``frozen`` (LoRA) backward computes
    no weight gradients: 4N (rank-r adapters add under 1%, left out). A preference step's
    ``reference`` adds its forward, a third of 6N + attention. A model built with its
    multi-token-prediction head (``[mtp] enable``) adds the head's matmuls to N and its
    full-attention layers to L (``head_matmul_params``)."""
    mixers = [args.mixer(i) for i in range(args.num_hidden_layers)]
    attention_layers = len(mixers) - mixers.count("linear_attention") + args.mtp_num_hidden_layers
    attention = 12 * attention_layers * args.num_attention_heads * args.head_dim * seq_len
    recurrence = mixers.count("linear_attention") * delta_rule_flops(args) if args.hybrid else 0.0
    matmuls = matmul_params(args) + head_matmul_params(args)
    forward = 2 * matmuls + (attention + recurrence) / 3
    return (4 if frozen else 6) * matmuls + attention + recurrence + (forward if reference else 0.0)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu_percent(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in percent of ``peak`` FLOP/s (None where the peak is unknown);
    ``tokens_per_second`` per device."""
    return None if peak is None else 100.0 * tokens_per_second * flops_per_token / peak


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20
