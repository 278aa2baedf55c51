"""Qwen3.5 / 3.6 on one device: exact against transformers' own classes (text-only and
vision-language layouts, dense and MoE, per-expert and fused experts), HF export both ways,
packed documents equal to documents alone, flavors and bad shapes."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from autopar.models import FLAVORS, HFCheckpointError, build_model, from_hf, get_flavor, to_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers >= 5.2 has the Qwen3.5 classes", allow_module_level=True)

from jobs import QWEN3_5_ODD, QWEN3_5_ODD_EXPERTS, QWEN3_5_VISION  # noqa: E402

TEXT = QWEN3_5_ODD
MOE = {**TEXT, **QWEN3_5_ODD_EXPERTS}
VISION = {**QWEN3_5_VISION, "out_hidden_size": TEXT["hidden_size"]}


def hf_model(kind: str, tied: bool = False):
    """A transformers Qwen3.5 of ``kind`` (dense/moe x text/vl) with every weight randomized
    (HF starts norms and the router at zero)."""
    moe = kind.startswith("moe")
    fields = {**(MOE if moe else TEXT), "tie_word_embeddings": tied}
    if kind.endswith("vl"):
        config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        model_cls = (
            transformers.Qwen3_5MoeForConditionalGeneration
            if moe
            else transformers.Qwen3_5ForConditionalGeneration
        )
        config = config_cls(text_config=fields, vision_config=VISION, tie_word_embeddings=tied)
    else:
        config_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
        config = config_cls(**fields)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name and "A_log" not in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return model.float().eval()


def logits_of(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def tokens(seqlen: int = 150) -> torch.Tensor:
    """Longer than two of the kernel's 64-token chunks, not a multiple of one."""
    return torch.randint(0, 97, (2, seqlen), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["dense-text", "moe-text", "dense-vl", "moe-vl"])
def pair(request, tmp_path_factory):
    """(transformers model, ours loaded from its save_pretrained folder, that folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param)
    hf.save_pretrained(folder)
    return hf, from_hf(folder, dtype=torch.float32), folder


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    x = tokens()
    theirs = hf(input_ids=x).logits
    # fp32, the same math summed in another order. With every weight drawn at std 0.2 the
    # logits reach about 6 and differ by at most 4.1e-5 of that (MoE, VL); from HF's own
    # initialization by 1.8e-7 absolute. A wrong split or norm is off by O(1).
    assert (logits_of(ours(x)) - theirs).abs().max().item() <= 2e-4 * theirs.abs().max().item()


def test_gradients_match_transformers(pair):
    hf, ours, _ = pair
    x = tokens(90)
    for model, out in ((hf, hf(input_ids=x).logits), (ours, logits_of(ours(x)))):
        model.zero_grad()
        F.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    text = hf.model.language_model if hasattr(hf.model, "language_model") else hf.model
    theirs, mine = text.layers[0].linear_attn, ours.layers["0"].linear_attn
    keys = 2 * 12
    assert_close_grad(mine.in_proj_k.weight.grad, theirs.in_proj_qkv.weight.grad[keys : 2 * keys])
    assert_close_grad(mine.core.A_log.grad, theirs.A_log.grad)
    assert_close_grad(mine.core.conv_v.grad, theirs.conv1d.weight.grad[2 * keys :])
    assert_close_grad(
        ours.layers["1"].self_attn.q_proj.weight.grad, text.layers[1].self_attn.q_proj.weight.grad
    )
    assert_close_grad(ours.embed_tokens.weight.grad, text.embed_tokens.weight.grad)


def assert_close_grad(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """fp32 gradients through five layers differ by sum order: measured at most 5.3e-5 of the
    norm (MoE, layer 0's k projection); a mis-split or transposed weight is off by O(1)."""
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 5e-4


def test_the_config_becomes_our_args(pair):
    _, ours, _ = pair
    args = ours.args
    assert args.family == "qwen3.5"
    assert [args.mixer(i) for i in range(5)] == [
        "linear_attention",
        "gated_attention",
        "linear_attention",
        "linear_attention",
        "gated_attention",
    ]
    assert (args.rotary_dim, args.linear_num_value_heads // args.linear_num_key_heads) == (8, 3)


def test_export_loads_in_transformers_with_identical_logits(pair, tmp_path):
    _hf, ours, _ = pair
    to_hf(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    x = tokens()
    theirs = back(input_ids=x).logits
    assert (logits_of(ours(x)) - theirs).abs().max().item() <= 2e-4 * theirs.abs().max().item()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] in (
        "qwen3_5_text",
        "qwen3_5_moe_text",
    )


def test_official_fused_expert_layout_loads(tmp_path):
    """Released Qwen3.5-MoE files stack experts as gate_up_proj (E, 2I, H) and down_proj
    (E, H, I); transformers re-saves them per expert. Both load to the same model."""
    hf = hf_model("moe-text")
    hf.save_pretrained(tmp_path / "per_expert")
    tensors = load_file(tmp_path / "per_expert" / "model.safetensors")
    fused = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            fused[name] = tensor
    for layer in range(5):
        prefix = f"model.layers.{layer}.mlp.experts"
        per = [
            [tensors[f"{prefix}.{e}.{w}.weight"] for e in range(5)]
            for w in ("gate_proj", "up_proj", "down_proj")
        ]
        fused[f"{prefix}.gate_up_proj"] = torch.cat((torch.stack(per[0]), torch.stack(per[1])), dim=1)
        fused[f"{prefix}.down_proj"] = torch.stack(per[2])
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    x = tokens(40)
    a, b = from_hf(tmp_path / "per_expert"), from_hf(tmp_path / "fused")
    assert torch.equal(logits_of(a(x)), logits_of(b(x)))


def test_vision_language_checkpoint_loads_its_text_model(tmp_path):
    hf = hf_model("dense-vl", tied=True)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    assert ours.args.tie_word_embeddings  # the tie flag sits at the top of a VL config
    x = tokens(70)
    theirs = hf(input_ids=x).logits
    assert (logits_of(ours(x)) - theirs).abs().max().item() <= 2e-4 * theirs.abs().max().item()


def test_import_then_export_keeps_every_text_tensor_bit_for_bit(tmp_path):
    hf = hf_model("dense-text").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    to_hf(from_hf(tmp_path / "hf"), tmp_path / "ours")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "ours" / "model.safetensors")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert exported[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name


def test_packed_documents_give_each_document_its_own_logits():
    """The delta rule's state and the convolution restart at a document start; attention is
    masked to the document, positions restart: a document in a pack is the document alone."""
    args = get_flavor("qwen3.5", "debug")
    model = build_model(args)
    model.init_weights(seed=2)
    cuts = [0, 50, 51, 130, 700, 777]  # a one-token document; one crossing a kernel segment
    x = torch.randint(0, args.vocab_size, (1, cuts[-1]), generator=torch.Generator().manual_seed(3))
    documents = torch.zeros_like(x)
    for i, (start, stop) in enumerate(itertools.pairwise(cuts)):
        documents[:, start:stop] = i
    packed = model(x, documents=documents)
    for start, stop in itertools.pairwise(cuts):
        alone = model(x[:, start:stop])
        torch.testing.assert_close(packed[:, start:stop], alone, rtol=0, atol=2e-5)


def test_a_log_starts_finite_in_bf16():
    """A_log = log(U(0.01, 16)) is drawn in fp32 whatever the model dtype (bf16 sampling gave
    -inf heads in transformers)."""
    args = get_flavor("qwen3.5", "debug")
    model = build_model(args).to(torch.bfloat16)
    model.init_weights(seed=0)
    a_log = model.layers["0"].linear_attn.core.A_log.float()
    assert torch.isfinite(a_log).all() and a_log.min() >= torch.log(torch.tensor(0.01)) - 0.01
    assert a_log.max() <= torch.log(torch.tensor(16.0)) + 0.01


@pytest.mark.parametrize("flavor", [f for f in FLAVORS["qwen3.5"] if not f.startswith("debug")])
def test_flavor_text_model_is_about_its_named_size(flavor):
    """A size names the released vision-language model, rounded (its vision tower and MTP head
    add a few percent): the text model must be within 7% of it (0.8B: 0.75, 9B: 8.95,
    397B-A17B: 396.3); a wrong depth, width or head count is off by far more."""
    with torch.device("meta"):
        model = build_model(get_flavor("qwen3.5", flavor))
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(billions / float(flavor.split("B")[0]) - 1) <= 0.07


def test_every_flavor_builds_on_meta():
    for name, args in FLAVORS["qwen3.5"].items():
        with torch.device("meta"):
            model = build_model(args)
        assert (
            sum(args.mixer(i) == "gated_attention" for i in range(args.num_hidden_layers))
            == args.num_hidden_layers // 4
        ), name
        assert type(model).__name__ == "Qwen35"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"linear_num_value_heads": 5}, "not a multiple of model.linear_num_key_heads=4"),
        ({"layer_types": ("linear_attention",) * 3 + ("sliding",)}, "model.layer_types has 'sliding'"),
        ({"layer_types": ("linear_attention",)}, "lists 1 layers but num_hidden_layers=4"),
        ({"partial_rotary_factor": 0.1}, "model.partial_rotary_factor=0.1"),
    ],
)
def test_an_impossible_hybrid_shape_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_flavor("qwen3.5", "debug"), **fields).check()


def test_an_unknown_layer_type_in_config_json_is_one_line(tmp_path):
    hf = hf_model("dense-text")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][0] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"model\.layer_types has 'mamba'"):
        from_hf(tmp_path)


def test_fp8_leaves_the_decay_and_gate_projections_in_high_precision():
    """Qwen's own FP8 checkpoints keep in_proj_a, in_proj_b (one row per value head) and the
    shared expert's one-row gate in bf16; so does our conversion, whatever filter_fqns says."""
    pytest.importorskip("torchao")
    from autopar.config.sections import Float8
    from autopar.parallel.float8 import apply_float8

    with torch.device("meta"):
        model = build_model(get_flavor("qwen3.5", "debug-moe"))
    apply_float8(model, Float8(enable=True, backend="torchao", filter_fqns=[]), "cpu")
    kinds = {fqn: type(m).__name__ for fqn, m in model.named_modules()}
    kept = ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.shared_expert_gate")
    assert {kinds[f] for f in kinds if f.endswith(kept)} == {"Linear"}
    assert kinds["layers.0.linear_attn.in_proj_z"] == kinds["layers.3.self_attn.q_proj"] == "Float8Linear"
