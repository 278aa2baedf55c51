"""Qwen3-MoE on one device: exact against transformers' Qwen3MoeForCausalLM (logits, the
load-balancing loss and its gradients), HF export, and the two expert kernels agreeing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autopar.models import ModelArgs, Qwen, from_hf, get_flavor, to_hf
from autopar.models.moe import load_balancing_loss
from autopar.parallel.expert_parallel import apply_expert_kernel

from jobs import tiny_moe_args

transformers = pytest.importorskip("transformers")


def moe_args(tied: bool = False, norm_topk_prob: bool = True, **fields: object) -> ModelArgs:
    """``tiny_moe_args`` at sizes of its own for HF parity: 6 experts of width 16 in every block."""
    own = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "head_dim": 8,
        "num_experts": 6,
        "moe_intermediate_size": 16,
        "mlp_only_layers": (),
    }
    return tiny_moe_args(**{**own, "tie_word_embeddings": tied, "norm_topk_prob": norm_topk_prob, **fields})


def hf_moe_for(args: ModelArgs):
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        norm_topk_prob=args.norm_topk_prob,
        decoder_sparse_step=args.decoder_sparse_step,
        mlp_only_layers=list(args.mlp_only_layers),
        router_aux_loss_coef=args.router_aux_loss_coef,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_word_embeddings,
        max_position_embeddings=args.max_position_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # HF starts the router at zero and norms at one: randomize all
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.float().eval()


CASES = {
    "untied-renormalized": moe_args(),
    "tied-raw-topk": moe_args(tied=True, norm_topk_prob=False),
    "dense-layers-between": moe_args(mlp_only_layers=(0,), decoder_sparse_step=2),
}


@pytest.fixture(params=list(CASES), scope="module")
def pair(request, tmp_path_factory):
    """(transformers model, ours loaded from its save_pretrained folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = hf_moe_for(CASES[request.param])
    hf.save_pretrained(folder)
    return hf, from_hf(folder, dtype=torch.float32)


def tokens(batch: int = 2, seqlen: int = 13) -> torch.Tensor:
    return torch.randint(0, 97, (batch, seqlen), generator=torch.Generator().manual_seed(1))


def test_the_hf_config_becomes_our_args(pair):
    hf, ours = pair
    assert ours.args.num_experts == hf.config.num_experts
    assert ours.args.mlp_only_layers == tuple(hf.config.mlp_only_layers)
    moe_layers = [i for i in range(4) if ours.args.is_moe_layer(i)]
    assert moe_layers == [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]


def test_logits_and_load_balancing_loss_match_transformers(pair):
    hf, ours = pair
    batch = tokens()
    with torch.no_grad():
        theirs = hf(batch, output_router_logits=True)
        logits, routing = ours(batch)
    assert (logits - theirs.logits).abs().max().item() <= 1e-4
    # HF's loss is over the whole batch: the per-sequence statistics summed
    aux = load_balancing_loss(routing.sum(dim=0), ours.args.num_experts_per_tok)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=0)


def test_training_loss_gradients_match_transformers(pair):
    hf, ours = pair
    hf.zero_grad()
    ours.zero_grad()
    batch = tokens(batch=1)
    theirs = hf(batch, labels=batch, output_router_logits=True).loss  # CE + coef * aux
    logits, routing = ours(batch)
    ce = F.cross_entropy(logits[0, :-1], batch[0, 1:])
    (ce + ours.args.router_aux_loss_coef * load_balancing_loss(routing[0], 2)).backward()
    theirs.backward()
    moe = next(i for i in range(4) if ours.args.is_moe_layer(i))
    torch.testing.assert_close(
        ours.layers[str(moe)].mlp.gate.weight.grad,
        hf.model.layers[moe].mlp.gate.weight.grad,
        rtol=1e-4,
        atol=1e-6,
    )
    ours_up = ours.layers[str(moe)].mlp.experts.up_proj.grad  # (E, I, H)
    hf_gate_up = hf.model.layers[moe].mlp.experts.gate_up_proj.grad  # (E, 2I, H)
    torch.testing.assert_close(ours_up, hf_gate_up[:, 16:], rtol=1e-4, atol=1e-6)


def test_the_load_balancing_loss_moves_the_router(pair):
    _, ours = pair
    ours.zero_grad()
    routing = ours(tokens())[1]
    load_balancing_loss(routing.sum(dim=0), 2).backward()
    moe = next(i for i in range(4) if ours.args.is_moe_layer(i))
    assert ours.layers[str(moe)].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_identical_logits_and_aux(tmp_path, tied):
    args = moe_args(tied=tied, mlp_only_layers=(1,))
    model = Qwen(args)
    model.init_weights(seed=3)
    to_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    batch = tokens()
    theirs = hf(batch, output_router_logits=True)
    logits, routing = model(batch)
    torch.testing.assert_close(theirs.logits, logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(theirs.aux_loss, load_balancing_loss(routing.sum(0), 2), rtol=1e-5, atol=0)


def test_grouped_and_per_expert_kernels_agree():
    model = Qwen(get_flavor("qwen3", "debug-moe"))
    model.init_weights(seed=0)
    batch = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    for kernel in ("grouped", "loop"):
        apply_expert_kernel(model, kernel)
        model.zero_grad()
        logits, routing = model(batch)
        (logits.square().mean() + load_balancing_loss(routing.sum(0), 2)).backward()
        results[kernel] = (logits, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results["grouped"][0], results["loop"][0], rtol=1e-5, atol=1e-6)
    for grouped, loop in zip(results["grouped"][1], results["loop"][1], strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts_per_tok": 7}, "num_experts_per_tok=7 must be between 1 and model.num_experts=6"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be positive"),
        ({"qk_norm": False}, "Qwen3-MoE, which has qk_norm"),
    ],
)
def test_an_impossible_moe_shape_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(moe_args(), **fields).check()
