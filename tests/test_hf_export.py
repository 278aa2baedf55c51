"""An HF export is what transformers reads: ``model.safetensors`` alone, or numbered shards and
an index naming every tensor. Exported from a Qwen3.5 vision-language folder (dense, sharded,
tied, MoE, bf16; a fine-tune and a LoRA merge) it loads in transformers' own class with no
missing or unexpected key, and every tensor of the loaded model equals the source's (the
vision tower and MTP head carried through untouched, the text model as trained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autopar.models import from_hf
from autopar.models.hf import save_hf_like

from jobs import QWEN3_5_TEXT as TEXT
from jobs import QWEN3_5_VISION as VISION
from jobs import hf_folder_flags, one_process_trainer, tiny_job

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers >= 5.2 has the Qwen3.5 classes", allow_module_level=True)

MOE = {**TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MOE.update(shared_expert_intermediate_size=32)
SOURCES = {
    "dense": {},
    "sharded": {"max_shard_size": "100KB"},
    "tied": {"tied": True},
    "moe": {"moe": True},
    "bf16": {"dtype": torch.bfloat16},
}
"""Vision-language source folders as users bring them (what the sweep exported from)."""


def vl_class(moe: bool):
    return (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )


def vl_folder(folder: Path, moe=False, tied=False, dtype=torch.float32, max_shard_size="5GB") -> Path:
    """A tiny Qwen3.5 as released: transformers' vision-language model (every weight drawn,
    so a re-initialized one cannot pass for loaded), plus the MTP head's tensors beside the
    text norm (transformers ignores ``mtp.*``; an export must keep them)."""
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_cls(text_config=MOE if moe else TEXT, vision_config=VISION, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = vl_class(moe)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    file = folder / (weight_map["model.language_model.norm.weight"] if weight_map else "model.safetensors")
    mtp = {"mtp.fc.weight": torch.randn(64, 128).to(dtype), "mtp.norm.weight": torch.randn(64).to(dtype)}
    save_file({**load_file(file), **mtp}, file, metadata={"format": "pt"})
    if weight_map:
        weight_map.update(dict.fromkeys(mtp, file.name))
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def assert_transformers_reads_every_tensor(exported: Path) -> dict[str, torch.Tensor]:
    """The folder is one scheme, its index (if any) names every tensor of every file, and
    transformers loads it with no key missing, unexpected or mismatched. Returns what
    transformers loaded (its state dict) and the MTP tensors it leaves on disk."""
    files = sorted(p.name for p in exported.glob("*.safetensors"))
    index = exported / "model.safetensors.index.json"
    if files == ["model.safetensors"]:
        assert not index.is_file()
    else:
        assert "model.safetensors" not in files
        assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
        weight_map = json.loads(index.read_text())["weight_map"]
        held = {n: f for f in files for n in load_file(exported / f)}
        assert weight_map == held
    model_type = json.loads((exported / "config.json").read_text())["model_type"]
    assert model_type in (
        "qwen3_5",
        "qwen3_5_moe",
    )  # the whole model's (a text config would load at full size)
    moe = model_type == "qwen3_5_moe"
    model, info = vl_class(moe).from_pretrained(exported, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    on_disk = {n: t for f in files for n, t in load_file(exported / f).items()}
    return {**model.state_dict(), **{n: t for n, t in on_disk.items() if n.startswith("mtp.")}}


def assert_equal_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("kind", SOURCES, ids=list(SOURCES))
@pytest.mark.parametrize("export_shard_bytes", [5 * 2**30, 150_000], ids=["one-file", "shards"])
def test_an_export_from_a_vision_language_folder_is_that_folder_in_transformers(
    kind, export_shard_bytes, tmp_path
):
    """The text model loaded and written back (fp32, as a job exports) with the source's
    vision tower and MTP head: transformers reads every tensor, each equal to the source's."""
    options = dict(SOURCES[kind])
    shard = options.pop("max_shard_size", "5GB")
    source = vl_folder(tmp_path / "source", max_shard_size=shard, **options)
    model = from_hf(source, dtype=torch.float32)
    state = dict(model.named_parameters())
    layout = {n: (p.shape, torch.float32) for n, p in state.items()}
    out = tmp_path / "export"
    save_hf_like(
        layout, lambda names: {n: state[n] for n in names}, model.args, out, source, export_shard_bytes
    )
    exported = assert_transformers_reads_every_tensor(out)
    theirs = assert_transformers_reads_every_tensor(source)
    # transformers loads in the config's dtype: the export's is fp32, a bf16 source's values
    # exactly; the MTP head it leaves on disk is the source's bit for bit
    assert_equal_tensors(exported, {n: t if n.startswith("mtp.") else t.float() for n, t in theirs.items()})
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def vl_job(source: Path, run: Path, *flags: str):
    job = tiny_job(
        run,
        *hf_folder_flags(source),
        "--training.steps",
        "2",
        *flags,
        name="qwen3.5",
    )
    job.model.overrides.clear()  # the shape is the checkpoint's
    return job


@pytest.mark.parametrize("lora", [False, True], ids=["fine-tune", "lora-merged"])
def test_a_job_from_a_vision_language_folder_exports_the_whole_model(lora, tmp_path):
    """What a job writes (a full fine-tune, or a LoRA run's merged export) is the source in
    transformers but for the text model, which is the trained one (its logits ours)."""
    source = vl_folder(tmp_path / "source")
    flags = ("--lora.enable", "true", "--lora.rank", "4", "--lora.merge_on_export", "true") if lora else ()
    trainer = one_process_trainer(vl_job(source, tmp_path / "run", *flags))
    trainer.train()
    out = tmp_path / "run" / "hf" / ("step-2-merged" if lora else "step-2")
    exported = assert_transformers_reads_every_tensor(out)
    theirs = assert_transformers_reads_every_tensor(source)
    untrained = [n for n in theirs if ".language_model." not in n and n != "lm_head.weight"]
    assert any(n.startswith("model.visual.") for n in untrained) and "mtp.fc.weight" in untrained
    assert_equal_tensors({n: exported[n] for n in untrained}, {n: theirs[n] for n in untrained})
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    model = vl_class(False).from_pretrained(out, dtype=torch.float32)
    ours, before = trainer.parts[0](tokens), vl_class(False).from_pretrained(source)(input_ids=tokens).logits
    theirs_logits = model(input_ids=tokens).logits
    # fp32 both; the same math summed in another order (see test_qwen3_5.py)
    assert (theirs_logits - ours).abs().max().item() <= 2e-4 * ours.abs().max().item()
    assert not torch.allclose(theirs_logits, before, atol=1e-4)  # it trained
