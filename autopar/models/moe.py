"""Qwen3-MoE's routed mixture of SwiGLU experts, single-device and free of parallel code.

A layer's experts are stacked into three (E, out, in) tensors, so a plan can shard them along
the expert dim (expert parallel) or FSDP-shard them like any weight, and tokens grouped by
expert run as one grouped GEMM per projection (``torch._grouped_mm``) or, where that kernel is
missing, one matmul per expert.

Routing is HF's: logits in the compute dtype, softmax in fp32, top-k, optionally renormalized.
Every MoE layer also returns its routing statistics per sequence, (B, 2, E) in fp32: how many
of a sequence's top-k choices went to each expert, and the sum of its tokens' routing
probabilities per expert (with gradient). Summed over layers they give HF's load-balancing
loss (``load_balancing_loss``); kept per sequence, the loss of any split of a batch (micro-
batches, data-parallel ranks, context-parallel shards) adds up to the loss of the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.args import ModelArgs

ExpertKernel = Literal["auto", "grouped", "loop"]


class Router(nn.Module):
    """The gate: token -> (fp32 probabilities over experts, top-k weights, top-k experts)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)  # (T, E)
        top, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return probs, top.to(x.dtype), experts


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands here: every row a multiple of 16
    bytes (its strides' requirement, and its CPU backward's); on CUDA in bf16 on Hopper or
    newer; on CPU in bf16 when compiled."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if not all(n * x.element_size() % 16 == 0 for n in (*weight.shape[1:], x.shape[-1])):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # the kernel's shape function (what compile traces) takes bf16 only
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return True


ExpertMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows grouped by expert, a stacked (E, out, in) weight) -> each expert's rows times its
(out, in) slice, transposed: one grouped GEMM, or one matmul per expert."""


def on_expert_rows(
    body: Callable[[ExpertMatmul], torch.Tensor],
    x: torch.Tensor,
    counts: torch.Tensor,
    weights: Sequence[torch.Tensor],
    kernel: ExpertKernel = "auto",
) -> torch.Tensor:
    """``body`` given the kernel's ``ExpertMatmul`` for rows grouped by expert, ``counts[e]``
    of them for expert e; ``weights`` are every stacked weight it multiplies by (grouped only
    where all of them allow it)."""
    if kernel == "grouped" or (kernel == "auto" and all(grouped_mm_usable(x, w) for w in weights)):
        offsets = counts.cumsum(0).to(torch.int32)
        return body(lambda rows, weight: torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets))
    return _per_expert(body, counts)


@torch.compiler.disable  # row counts known only at run time: compile traces around it
def _per_expert(body: Callable[[ExpertMatmul], torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    sizes = counts.tolist()  # one host sync per layer

    def matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([part @ weight[e].T for e, part in enumerate(rows.split(sizes))])

    return body(matmul)


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    kernel: ExpertKernel = "auto",
) -> torch.Tensor:
    """SwiGLU expert e on its ``counts[e]`` rows of ``x`` (rows grouped by expert), for the
    (E, out, in) weights given: a plan running a slice of the experts passes its slice."""

    def swiglu(matmul: ExpertMatmul) -> torch.Tensor:
        return matmul(F.silu(matmul(x, gate_proj)) * matmul(x, up_proj), down_proj)

    return on_expert_rows(swiglu, x, counts, (gate_proj, up_proj, down_proj), kernel)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked (E, out, in) weights."""

    def __init__(self, args: ModelArgs, kernel: ExpertKernel = "auto") -> None:
        super().__init__()
        experts, hidden, inter = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.kernel = kernel
        """``grouped`` (one grouped GEMM per projection), ``loop`` (a matmul per expert, any
        device) or ``auto`` (grouped where ``grouped_mm_usable``). A plain attribute, not a
        submodule taking the weights as inputs: module hooks on weight inputs (FSDP's memory
        tracker among them) hold extra copies."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, H): rows grouped by expert, ``counts[e]`` of them for expert e."""
        return run_experts(x, counts, self.gate_proj, self.up_proj, self.down_proj, self.kernel)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}"


class MoE(nn.Module):
    """Route each token to its top-k experts and sum their outputs by routing weight."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.gate = Router(args)
        self.experts = Experts(args)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, S, H), routing statistics (B, 2, E) fp32)."""
        bsz, seqlen, hidden = x.shape
        tokens = x.reshape(-1, hidden)  # (T, H)
        probs, weights, experts = self.gate(tokens)  # (T, E), (T, k), (T, k)
        top_k = experts.shape[-1]
        choice = experts.flatten()  # (T*k,) token t's j-th expert at t*k + j
        order = choice.argsort(stable=True)  # choices grouped by expert
        source = order // top_k  # the token of each grouped choice
        # a scatter-add, not bincount: its (E,) shape does not depend on the data
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, choice, torch.ones_like(choice)
        )
        out = self.experts(tokens[source], counts)  # (T*k, H) grouped by expert
        # back in choice order, then each token's k outputs weighted and summed in one bmm:
        # autograd keeps one (T*k, H) copy (a scatter-add would keep two)
        out = out[order.argsort()].view(-1, top_k, hidden)  # (T, k, H)
        combined = torch.bmm(weights.unsqueeze(1), out)  # (T, 1, H)
        return combined.view(bsz, seqlen, hidden), routing_statistics(probs, experts, bsz)


def routing_statistics(probs: torch.Tensor, experts: torch.Tensor, bsz: int) -> torch.Tensor:
    """(B, 2, E): per sequence, top-k choices per expert (no gradient) and summed routing
    probabilities per expert."""
    num_experts = probs.shape[-1]
    chosen = torch.zeros_like(probs).scatter_add_(1, experts, torch.ones_like(experts, dtype=probs.dtype))
    return torch.stack((chosen, probs), dim=1).view(bsz, -1, 2, num_experts).sum(dim=1)


def load_balancing_loss(stats: torch.Tensor, top_k: int) -> torch.Tensor:
    """HF's (Switch Transformer) load-balancing loss of the tokens ``stats`` (..., 2, E)
    sums over (all MoE layers of a sequence, or more): ``E * sum_e f_e * P_e``, with ``f_e``
    the fraction of choices and ``P_e`` the mean probability of expert ``e`` per routed row.
    Sum ``stats`` over a batch first for HF's value on that batch."""
    counts, probs = stats.unbind(dim=-2)
    rows = counts.detach().sum(dim=-1, keepdim=True) / top_k  # tokens x layers
    return counts.shape[-1] * (counts.detach() * probs / rows.square()).sum(dim=-1)
