"""MFU accounting: FLOPs per token from the model's real matmul parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.models import FLAVORS, Qwen, get_flavor
from autopar.models.moe import Experts, Router
from autopar.training.metrics import flops_per_token, matmul_params


@pytest.mark.parametrize("family, flavor", [(f, v) for f, vs in FLAVORS.items() for v in vs])
def test_matmul_params_count_every_linear_weight_once_and_a_tokens_experts(family, flavor):
    with torch.device("meta"):
        model = Qwen(get_flavor(family, flavor))
    args = model.args
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Router))}
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    active = experts * args.num_experts_per_tok // max(args.num_experts, 1)
    assert matmul_params(args) == sum(weights.values()) + active


def test_flops_per_token_follow_the_palm_formula():
    args = get_flavor("qwen3", "8B")
    n = matmul_params(args)
    attention = 12 * 36 * 32 * 128 * 4096
    assert flops_per_token(args, 4096) == 6 * n + attention
    assert 6 * n / 1e9 == pytest.approx(6 * 7.57, rel=0.01)  # 7.57B matmul parameters incl. the head
