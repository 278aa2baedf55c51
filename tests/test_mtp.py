"""Qwen3.5's multi-token-prediction head: its logits equal the serving engines' definition
(vLLM ``qwen3_5_mtp.py``) composed from transformers' own Qwen3.5 classes, dense and MoE, tied
and untied; ``mtp.*`` loads under its released names and goes back out exactly; packed
documents never leak into one another; a model without the head is unchanged."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from autopar.models import HFCheckpointError, build_model, from_hf, get_flavor, to_hf
from autopar.models.hf import save_hf_like
from autopar.models.qwen import split_output

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers >= 5.2 has the Qwen3.5 classes", allow_module_level=True)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer  # noqa: E402

from jobs import QWEN3_5_ODD, QWEN3_5_ODD_EXPERTS, QWEN3_5_VISION  # noqa: E402

TEXT = {
    **QWEN3_5_ODD,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
}
"""Odd sizes (as tests/test_qwen3_5.py): a transposed or mis-split weight cannot match by shape."""
MOE = {**TEXT, **QWEN3_5_ODD_EXPERTS}
VISION = {**QWEN3_5_VISION, "out_hidden_size": TEXT["hidden_size"]}
DENSE_NAMES = {
    "mtp.fc.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.pre_fc_norm_embedding.weight",
    *(
        f"mtp.layers.0.{n}.weight"
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
        )
    ),
}
"""The head's tensors in released Qwen3.5 checkpoints (as vLLM, Megatron-Bridge and NeMo read
them), besides the MLP's."""
MLP_NAMES = {f"mtp.layers.0.mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
MOE_NAMES = {
    "mtp.layers.0.mlp.gate.weight",
    "mtp.layers.0.mlp.experts.gate_up_proj",
    "mtp.layers.0.mlp.experts.down_proj",
    "mtp.layers.0.mlp.shared_expert_gate.weight",
    *(f"mtp.layers.0.mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")),
}
"""Released Qwen3.5-MoE files stack the head's experts as the trunk's (gate rows first)."""


class ReferenceHead(nn.Module):
    """vLLM's ``Qwen3_5MultiTokenPredictor`` from transformers' pieces: its tensor names are
    the released ``mtp.*`` names without the prefix."""

    def __init__(self, text_config, moe: bool) -> None:
        super().__init__()
        config = copy.deepcopy(text_config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config._attn_implementation = "sdpa"  # causal without a mask, as vLLM's layer
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        layer = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
        self.layers = nn.ModuleList([layer(config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)

    def logits(self, hf, x: torch.Tensor) -> torch.Tensor:
        """Position i: fc(cat[norm_e(embed(x[i+1])), norm_h(h[i])]) -> the layer at position
        i -> norm -> the model's own output head."""
        text = hf.model.language_model
        hidden = text(input_ids=x).last_hidden_state  # (B, S, H), final-normed
        embedded = text.embed_tokens(x[:, 1:])
        h = self.fc(
            torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden[:, :-1])], -1)
        )
        positions = torch.arange(x.shape[1] - 1)[None]
        rotary = text.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        return hf.lm_head(self.norm(h))


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' per-expert re-save in the released files' stacked layout."""
    out, per = {}, {}
    for name, tensor in tensors.items():
        found = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
        if found is None:
            out[name] = tensor
        else:
            per.setdefault(found[1], {}).setdefault(found[3], {})[int(found[2])] = tensor
    for prefix, weights in per.items():
        stack = {w: torch.stack([weights[w][e] for e in sorted(weights[w])]) for w in weights}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stack["gate"], stack["up"]), dim=1)
        out[f"{prefix}.down_proj"] = stack["down"]
    return out


def released_folder(folder, moe: bool, tied: bool):
    """A tiny vision-language Qwen3.5 saved as released checkpoints are: random weights,
    experts stacked, a random ``mtp.*`` head and ``mtp_num_hidden_layers`` 1.
    Returns (transformers model, reference head)."""
    fields = {**(MOE if moe else TEXT), "tie_word_embeddings": tied}
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    torch.manual_seed(0)
    hf = model_cls(config_cls(text_config=fields, vision_config=VISION, tie_word_embeddings=tied))
    head = ReferenceHead(hf.config.text_config, moe)
    with torch.no_grad():
        for name, p in itertools.chain(hf.named_parameters(), head.named_parameters()):
            if "visual" not in name and "A_log" not in name:
                p.copy_(torch.randn_like(p) * 0.2)
    hf, head = hf.float().eval(), head.float().eval()
    hf.save_pretrained(folder)
    tensors = fuse_experts(load_file(folder / "model.safetensors"))
    tensors.update({f"mtp.{n}": t.detach().clone() for n, t in head.state_dict().items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)  # as released
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return hf, head


def tokens(seqlen: int = 70) -> torch.Tensor:
    """Longer than one of the delta rule's 64-token chunks."""
    return torch.randint(0, 97, (2, seqlen), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=itertools.product(["dense", "moe"], ["untied", "tied"]), ids="-".join)
def released(request, tmp_path_factory):
    """(transformers model, reference head, folder, ours loaded with the head)."""
    kind, tie = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-{tie}")
    hf, head = released_folder(folder, kind == "moe", tie == "tied")
    return hf, head, folder, from_hf(folder, dtype=torch.float32, mtp=True)


def test_the_head_carries_the_released_tensor_names(released):
    _, _, folder, _ = released
    moe = "mtp.layers.0.mlp.gate.weight" in load_file(folder / "model.safetensors")
    on_disk = {n for n in load_file(folder / "model.safetensors") if n.startswith("mtp.")}
    assert on_disk == DENSE_NAMES | (MOE_NAMES if moe else MLP_NAMES)


def test_head_logits_match_the_serving_definition_from_transformers_pieces(released):
    hf, head, _, ours = released
    x = tokens()
    with torch.no_grad():
        theirs = head.logits(hf, x)
        mine = ours.mtp_logits(x)
    assert mine.shape == (2, x.shape[1] - 1, 97)
    # fp32, the same math in another order: weights at std 0.2 give logits up to about 6,
    # apart by at most 2.1e-5 (MoE, measured; 3.6e-6 of the largest); a swapped concat, a
    # plain-gain norm or a shifted position is off by O(1)
    assert (mine - theirs).abs().max().item() <= 2e-4 * theirs.abs().max().item()


def test_the_head_loaded_and_untrained_exports_exactly_the_source(released, tmp_path):
    _, _, folder, ours = released
    params = dict(ours.named_parameters())
    layout = {n: (p.shape, p.dtype) for n, p in params.items()}
    save_hf_like(layout, lambda names: {n: params[n] for n in names}, ours.args, tmp_path, folder)
    source = load_file(folder / "model.safetensors")
    exported = {}
    for file in tmp_path.glob("*.safetensors"):
        exported.update(load_file(file))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name


def test_a_trained_head_is_written_in_the_sources_names(released, tmp_path):
    _, _, folder, ours = released
    moved = {n: p.detach() + 1 if n.startswith("mtp.") else p.detach() for n, p in ours.named_parameters()}
    layout = {n: (p.shape, p.dtype) for n, p in moved.items()}
    save_hf_like(layout, lambda names: {n: moved[n] for n in names}, ours.args, tmp_path, folder)
    back = from_hf(tmp_path, dtype=torch.float32, mtp=True)
    for name, param in back.named_parameters():
        torch.testing.assert_close(param, moved[name], rtol=0, atol=0, msg=name)


def test_text_export_of_a_model_with_its_head_loads_back_with_it(released, tmp_path):
    _, _, _, ours = released
    to_hf(ours, tmp_path)
    back = from_hf(tmp_path, dtype=torch.float32, mtp=True)
    x = tokens(20)
    assert torch.equal(back.mtp_logits(x), ours.mtp_logits(x))


def test_a_text_folder_with_a_head_loads_without_it_and_an_export_carries_the_head(released, tmp_path):
    """A folder a head was trained into (text layout), reloaded for plain training or
    sampling: the head stays on disk, and an export from that folder keeps it unchanged."""
    _, _, _, ours = released
    to_hf(ours, tmp_path / "text")
    plain = from_hf(tmp_path / "text", dtype=torch.float32)
    assert plain.mtp is None
    x = tokens(20)
    assert torch.equal(split_output(plain(x))[0], split_output(ours(x))[0])
    layout = {n: (p.shape, p.dtype) for n, p in plain.named_parameters()}
    params = dict(plain.named_parameters())
    save_hf_like(
        layout, lambda names: {n: params[n] for n in names}, plain.args, tmp_path / "out", tmp_path / "text"
    )
    back = from_hf(tmp_path / "out", dtype=torch.float32, mtp=True)
    assert torch.equal(back.mtp_logits(x), ours.mtp_logits(x))


def test_packed_documents_give_each_document_its_own_head_logits():
    """The head's positions restart and its attention stays in the document; the embedding of
    a next document's first token is never read, so only a document's last position (whose
    target lies in another document) differs from the document alone."""
    args = dataclasses.replace(get_flavor("qwen3.5", "debug"), mtp_num_hidden_layers=1)
    model = build_model(args)
    model.init_weights(seed=2)
    with torch.no_grad():
        model.mtp.pre_fc_norm_embedding.weight.normal_()  # 0 at init would hide a swapped input
    cuts = [0, 30, 31, 90, 130]  # a one-token document
    x = torch.randint(0, args.vocab_size, (1, cuts[-1]), generator=torch.Generator().manual_seed(3))
    documents = torch.zeros_like(x)
    for i, (start, stop) in enumerate(itertools.pairwise(cuts)):
        documents[:, start:stop] = i
    with torch.no_grad():
        packed = model.mtp_logits(x, documents=documents)
        for start, stop in itertools.pairwise(cuts):
            if stop - start < 2:  # a one-token document has no position with a token after it
                continue
            alone = model.mtp_logits(x[:, start:stop])
            torch.testing.assert_close(packed[:, start : stop - 1], alone, rtol=0, atol=2e-5)
        other = x.clone()
        other[:, cuts[1]] = (x[:, cuts[1]] + 1) % args.vocab_size  # the next document's first token
        again = model.mtp_logits(other, documents=documents)
    assert torch.equal(again[:, : cuts[1]], packed[:, : cuts[1]])  # its last position included


def test_a_model_without_the_head_is_unchanged():
    args = get_flavor("qwen3.5", "debug")
    plain = build_model(args)
    assert plain.mtp is None and not any(n.startswith("mtp.") for n, _ in plain.named_parameters())
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        plain.mtp_logits(torch.zeros(1, 4, dtype=torch.long))


def test_asking_for_a_head_the_folder_lacks_is_one_line(tmp_path):
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT))
    hf.save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="no multi-token-prediction head"):
        from_hf(tmp_path, mtp=True)


def test_a_head_on_a_model_outside_qwen3_5_is_refused():
    args = dataclasses.replace(get_flavor("qwen3", "debug"), mtp_num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"model\.mtp_num_hidden_layers=1"):
        args.check()


def test_a_head_with_its_own_embedding_is_refused_in_one_line(released, tmp_path):
    _, _, folder, _ = released
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_use_dedicated_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="mtp_use_dedicated_embeddings=true"):
        from_hf(tmp_path, mtp=True)
