"""The single-device model family: exact against HF transformers, deterministic init, flavors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autopar.models import FLAVORS, ModelArgs, Qwen, get_flavor

from jobs import tiny_args

transformers = pytest.importorskip("transformers")

# Published totals from the HF model cards, in billions. The cards round loosely (1.72B is
# "1.7B", Qwen2.5-32B's config gives 32.76B against "32.5B"), hence 1.5% tolerance; a wrong
# width, depth or tie flag moves the count by far more.
PUBLISHED_BILLIONS = {
    ("qwen3", "0.6B"): 0.6,
    ("qwen3", "1.7B"): 1.7,
    ("qwen3", "4B"): 4.0,
    ("qwen3", "8B"): 8.2,
    ("qwen3", "14B"): 14.8,
    ("qwen3", "32B"): 32.8,
    ("qwen3", "30B-A3B"): 30.5,
    ("qwen3", "235B-A22B"): 235.0,
    ("qwen2.5", "0.5B"): 0.49,
    ("qwen2.5", "1.5B"): 1.54,
    ("qwen2.5", "3B"): 3.09,
    ("qwen2.5", "7B"): 7.61,
    ("qwen2.5", "14B"): 14.7,
    ("qwen2.5", "32B"): 32.5,
    ("qwen2.5", "72B"): 72.7,
}


def parity_args(family: str, kv_ratio: int, tied: bool, head_dim: int = 24) -> ModelArgs:
    """``tiny_args`` at odd sizes (a 97-token vocabulary, a 112-wide MLP, head_dim 24 beside
    hidden / heads = 16), where a transposed or mis-split weight cannot match HF by shape."""
    return tiny_args(
        family,
        vocab_size=97,
        intermediate_size=112,
        num_key_value_heads=4 // kv_ratio,
        head_dim=head_dim,
        tie_word_embeddings=tied,
    )


def hf_model_for(args: ModelArgs):
    config_cls = transformers.Qwen3Config if args.qk_norm else transformers.Qwen2Config
    config = config_cls(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.rms_norm_eps,
        tie_word_embeddings=args.tie_word_embeddings,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases and norms start at 0 / 1 in HF; randomize to test them too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def hf_cases():
    for family in ("qwen3", "qwen2"):
        for kv_ratio in (1, 2, 4):
            for tied in (False, True):
                yield pytest.param(family, kv_ratio, tied, id=f"{family}-gqa{kv_ratio}-tied{tied}")


@pytest.mark.parametrize("family,kv_ratio,tied", list(hf_cases()))
def test_logits_and_grads_match_transformers(tmp_path, family, kv_ratio, tied):
    from autopar.models import from_hf

    args = parity_args(family, kv_ratio, tied)  # head_dim 24 != hidden / heads = 16
    hf = hf_model_for(args)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path, dtype=torch.float32)
    assert ours.args == dataclasses.replace(args, max_position_embeddings=128)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))

    hf_logits = hf(tokens).logits
    our_logits = ours(tokens)
    # fp32: same math, only kernel reduction order differs
    assert (our_logits - hf_logits).abs().max().item() <= 1e-4

    for logits in (hf_logits, our_logits):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hf_grad = hf.model.layers[0].self_attn.k_proj.weight.grad
    our_grad = ours.layers["0"].self_attn.k_proj.weight.grad
    torch.testing.assert_close(our_grad, hf_grad, rtol=1e-4, atol=1e-6)
    hf_emb = hf.model.embed_tokens.weight.grad
    torch.testing.assert_close(ours.embed_tokens.weight.grad, hf_emb, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, tied):
    from autopar.models import to_hf

    args = parity_args("qwen3", 2, tied)
    model = Qwen(args)
    model.init_weights(seed=3)
    to_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    assert hf.config.tie_word_embeddings is tied
    tokens = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_import_then_export_is_byte_identical(tmp_path, tied):
    from safetensors.torch import load_file

    from autopar.models import from_hf, to_hf

    args = parity_args("qwen2", 2, tied)
    hf = hf_model_for(args).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    to_hf(from_hf(tmp_path / "hf"), tmp_path / "ours")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "ours" / "model.safetensors")
    original.pop("lm_head.weight", None) if tied else None
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype == torch.bfloat16
        assert exported[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name


def test_sharded_checkpoint_round_trips(tmp_path):
    from autopar.models import from_hf, save_hf

    model = Qwen(parity_args("qwen3", 1, False))
    model.init_weights(seed=4)
    save_hf(dict(model.named_parameters()), model.args, tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = from_hf(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_meta_init_touches_every_parameter_deterministically():
    args = get_flavor("qwen2.5", "debug")
    with torch.device("meta"):
        first, second = Qwen(args), Qwen(args)
    for model in (first, second):
        model.to_empty(device="cpu")
        model.tie_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # anything init_weights misses stays NaN
        model.init_weights(seed=7)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name
    other = Qwen(args)
    other.init_weights(seed=8)
    assert not torch.equal(other.layers["0"].mlp.up_proj.weight, first.layers["0"].mlp.up_proj.weight)


def test_tied_model_shares_one_embedding_matrix():
    model = Qwen(get_flavor("qwen2.5", "debug"))
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("key", list(PUBLISHED_BILLIONS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_flavor_parameter_count_matches_published_size(key):
    with torch.device("meta"):
        model = Qwen(get_flavor(*key))
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED_BILLIONS[key], rel=0.015)


def test_every_flavor_is_listed_with_its_published_size():
    # Qwen3.5's sizes name the vision-language model: tests/test_qwen3_5.py checks its text model
    named = {
        (family, f)
        for family, flavors in FLAVORS.items()
        for f in flavors
        if not f.startswith("debug") and family != "qwen3.5"
    }
    assert named == set(PUBLISHED_BILLIONS)


def test_model_without_embedding_and_head_maps_hidden_to_hidden():
    args = get_flavor("qwen3", "debug")
    full = Qwen(args)
    full.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    stage = Qwen(args)
    stage.load_state_dict(full.state_dict())
    stage.embed_tokens, stage.norm, stage.lm_head = None, None, None
    hidden = full.embed_tokens(tokens)
    out = stage(hidden)
    expected = full.lm_head(full.norm(out))
    torch.testing.assert_close(expected, full(tokens), rtol=0, atol=0)


def test_explicit_positions_equal_default_positions():
    model = Qwen(get_flavor("qwen3", "debug"))
    model.init_weights()
    tokens = torch.randint(0, 512, (2, 12))
    torch.testing.assert_close(model(tokens, positions=torch.arange(12)), model(tokens), rtol=0, atol=0)


def test_unknown_flavor_names_the_choices():
    with pytest.raises(ValueError, match=r"model.flavor='9B' is unknown for qwen3; choose one of"):
        get_flavor("qwen3", "9B")


def test_indivisible_gqa_is_rejected_with_field_names():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of"):
        get_flavor("qwen3", "debug", num_attention_heads=6)


def _export(tmp_path, tied=False):
    from autopar.models import to_hf

    model = Qwen(parity_args("qwen3", 2, tied))
    model.init_weights()
    to_hf(model, tmp_path)
    return tmp_path


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from autopar.models import HFCheckpointError, from_hf

    path = _export(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"missing .* 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        from_hf(path)


def test_shape_mismatch_prints_expected_and_found(tmp_path):
    import json

    from autopar.models import HFCheckpointError, from_hf

    path = _export(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        HFCheckpointError, match=r"gate_proj.weight' has shape \[112, 64\], the config expects \[128, 64\]"
    ):
        from_hf(path)


def test_unsupported_model_type_is_rejected(tmp_path):
    import json

    from autopar.models import HFCheckpointError, from_hf

    path = _export(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="model_type='llama' is not supported"):
        from_hf(path)


def test_tied_config_with_a_different_head_is_rejected(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from autopar.models import HFCheckpointError, from_hf

    path = _export(tmp_path, tied=False)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    save_file(load_file(path / "model.safetensors"), path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        from_hf(path)
