"""Qwen3.5 jobs end to end: fine-tuning a vision-language checkpoint exports a
vision-language checkpoint (its vision tower and MTP head carried through unchanged), and
packed documents train as documents alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from autopar.models import from_hf

from jobs import one_process_trainer, tiny_job

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers >= 5.2 has the Qwen3.5 classes", allow_module_level=True)

TEXT = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
}
VISION = {
    "depth": 1,
    "hidden_size": 16,
    "num_heads": 2,
    "intermediate_size": 16,
    "out_hidden_size": 64,
    "patch_size": 2,
    "temporal_patch_size": 1,
    "spatial_merge_size": 1,
}


def vision_language_folder(folder) -> None:
    """A tiny Qwen3.5 as released: the vision-language model, plus an MTP head's tensors
    (transformers ignores ``mtp.*``; a real export must keep them)."""
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.norm.weight"] = torch.randn(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(source folder, run folder) of 3 steps from a vision-language checkpoint."""
    tmp = tmp_path_factory.mktemp("vl")
    source = tmp / "Qwen3.5-tiny"
    vision_language_folder(source)
    job = tiny_job(
        tmp / "run",
        "--model.hf_assets_path",
        str(source),
        "--checkpoint.initial_load_path",
        str(source),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
        "--training.steps",
        "3",
        name="qwen3.5",
    )
    job.model.overrides.clear()  # the shape is the checkpoint's
    trainer = one_process_trainer(job)
    trainer.train()
    return source, tmp / "run" / "hf" / "step-3", trainer


def test_vision_language_export_carries_the_untrained_tensors_through(finetuned):
    source, exported, _ = finetuned
    original = load_file(source / "model.safetensors")
    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    carried = [n for n in original if n.startswith(("model.visual.", "mtp."))]
    assert carried and "mtp.fc.weight" in carried
    for name in carried:
        with safe_open(exported / index[name], "pt") as f:
            assert torch.equal(f.get_tensor(name), original[name]), name
    assert json.loads((exported / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )


def test_vision_language_export_holds_the_trained_text_model(finetuned):
    source, exported, trainer = finetuned
    trained = dict(trainer.parts[0].named_parameters())
    ours = from_hf(exported, dtype=torch.float32)
    before = from_hf(source, dtype=torch.float32)
    moved = [n for n, p in ours.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])]
    assert moved  # it trained
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, trained[name].detach(), rtol=0, atol=0)  # fp32 export


def test_vision_language_export_loads_in_transformers_as_the_whole_model(finetuned):
    _, exported, trainer = finetuned
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = trainer.parts[0](tokens)
    theirs = model(input_ids=tokens).logits
    # fp32 both; the same math summed in another order (see test_qwen3_5.py)
    assert (theirs - ours).abs().max().item() <= 2e-4 * ours.abs().max().item()
