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

from jobs import QWEN3_5_TEXT as TEXT
from jobs import QWEN3_5_VISION as VISION
from jobs import hf_folder_flags, one_process_trainer, tiny_job

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers >= 5.2 has the Qwen3.5 classes", allow_module_level=True)


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
        *hf_folder_flags(source),
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


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", id="default"),
        pytest.param("in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,o_proj,down_proj", id="deltanet"),
    ],
)
def test_lora_adapters_export_as_a_peft_folder_that_loads_on_the_hf_model(tmp_path, targets):
    """Adapters on the attention and MLP linears (the default targets), or by HF name on the
    Gated DeltaNet projections (HF's fused in_proj_qkv: our three pieces share one A, their
    Bs stacked, peft's own parametrization): the folder is peft's, and peft over transformers'
    Qwen3.5 gives our trained model's logits."""
    peft = pytest.importorskip("peft")
    source = tmp_path / "Qwen3.5-tiny-text"
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)).save_pretrained(source)
    job = tiny_job(
        tmp_path / "run",
        *hf_folder_flags(source),
        "--lora.enable",
        "true",
        "--lora.rank",
        "4",
        "--lora.target_modules",
        targets,
        "--training.steps",
        "3",
        name="qwen3.5",
    )
    job.model.overrides.clear()
    trainer = one_process_trainer(job)
    trainer.train()
    base = transformers.Qwen3_5ForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    before = base(input_ids=tokens).logits
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "hf" / "step-3")  # wraps base in place
    ours = trainer.parts[0](tokens)
    theirs = adapted(input_ids=tokens).logits
    assert (theirs - ours).abs().max().item() <= 2e-4 * ours.abs().max().item()
    assert not torch.allclose(theirs, before, atol=1e-4)  # the adapters moved it


def test_a_piece_of_a_fused_hf_linear_is_not_a_target_of_its_own(tmp_path):
    from autopar.config.errors import ConfigError
    from autopar.training.preflight import check_job

    job = tiny_job(tmp_path, "--lora.enable", "true", "--lora.target_modules", "in_proj_k", name="qwen3.5")
    with pytest.raises(ConfigError, match="split of HF's in_proj_qkv; name 'in_proj_qkv'"):
        check_job(job, 1, "cpu")
