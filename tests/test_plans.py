"""Plans are data: every module path they name exists in every flavor of every family."""

from __future__ import annotations

import pytest
import torch

from autopar.models import FLAVORS, Qwen, build_model, get_flavor
from autopar.parallel.fsdp import fsdp_groups
from autopar.parallel.tensor_parallel import tp_plan

ALL_FLAVORS = [(family, flavor) for family, flavors in FLAVORS.items() for flavor in flavors]


def meta_model(family: str, flavor: str, **overrides) -> Qwen:
    with torch.device("meta"):
        return build_model(get_flavor(family, flavor, **overrides))


@pytest.mark.parametrize("family, flavor", ALL_FLAVORS)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_every_tp_plan_path_resolves(family, flavor, sequence_parallel):
    model = meta_model(family, flavor)
    plan = tp_plan(model.args, list(model.layers.keys()), sequence_parallel, loss_parallel=True)
    for path in plan:
        assert isinstance(model.get_submodule(path), torch.nn.Module), path
    # a mixture of experts runs whole on every TP rank (its shared expert too): not split
    mixtures = tuple(
        f"{path}." for path, style in plan.items() if type(style).__name__ == "PrepareModuleInputOutput"
    )
    linears = {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.startswith(mixtures)
    }
    assert linears <= set(plan), "every linear is sharded"


@pytest.mark.parametrize("family, flavor", ALL_FLAVORS)
def test_qk_norms_are_planned_exactly_for_qwen3(family, flavor):
    model = meta_model(family, flavor)
    plan = tp_plan(model.args, ["0"], True, True)
    assert ("layers.0.self_attn.q_norm" in plan) == (family == "qwen3")


@pytest.mark.parametrize("family, flavor", ALL_FLAVORS)
def test_fsdp_groups_resolve_and_cover_every_parameter(family, flavor):
    model = meta_model(family, flavor)
    groups = fsdp_groups(model, "default", pipelined=False)
    grouped = set()
    for paths, _ in groups:
        for path in paths:
            grouped |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()}
    everything = {n for n, _ in model.named_parameters()}
    root_only = everything - grouped
    # tied embedding/head stay with the root (one parameter, one group); nothing else does
    assert root_only == ({"embed_tokens.weight", "norm.weight"} if model.args.tie_word_embeddings else set())


def test_fsdp_reshard_policy_keeps_blocks_gathered_under_pipelining():
    model = meta_model("qwen3", "debug")
    assert all(not reshard for _, reshard in fsdp_groups(model, "default", pipelined=True))
    assert all(reshard for paths, reshard in fsdp_groups(model, "always", pipelined=True))
