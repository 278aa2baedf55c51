"""MFU accounting: FLOPs per token from the model's real matmul parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.models import FLAVORS, build_model, get_flavor
from autopar.models.moe import Experts, Router
from autopar.training.metrics.flops import flops_per_token, matmul_params


@pytest.mark.parametrize("family, flavor", [(f, v) for f, vs in FLAVORS.items() for v in vs])
def test_matmul_params_count_every_linear_weight_once_and_a_tokens_experts(family, flavor):
    with torch.device("meta"):
        model = build_model(get_flavor(family, flavor))
    args = model.args
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Router))}
    # a Gated DeltaNet's depthwise convolution: kernel-width multiply-adds per channel
    weights |= {id(p): p.numel() for n, p in model.named_parameters() if ".core.conv_" in n}
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    active = experts * args.num_experts_per_tok // max(args.num_experts, 1)
    assert matmul_params(args) == sum(weights.values()) + active


def test_flops_per_token_follow_the_palm_formula():
    args = get_flavor("qwen3", "8B")
    n = matmul_params(args)
    attention = 12 * 36 * 32 * 128 * 4096
    assert flops_per_token(args, 4096) == 6 * n + attention
    assert 6 * n / 1e9 == pytest.approx(6 * 7.57, rel=0.01)  # 7.57B matmul parameters incl. the head


def test_hybrid_flops_count_attention_in_its_layers_and_the_delta_rule_in_the_others():
    from autopar.training.metrics.flops import delta_rule_flops

    args = get_flavor("qwen3.5", "9B")  # 8 gated attention layers, 24 Gated DeltaNet ones
    attention = 12 * 8 * 16 * 256 * 4096
    recurrence = 24 * 3 * 32 * (6 * 128 * 128 + 2 * 64 * (2 * 128 + 128))
    assert delta_rule_flops(args) * 24 == recurrence
    assert flops_per_token(args, 4096) == 6 * matmul_params(args) + attention + recurrence
