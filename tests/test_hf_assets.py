"""An HF folder is the model: ``model.hf_assets_path`` gives the shape (config.json) and the
tokenizer (tokenizer.json); ``[model]`` overrides still win."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch

from autopar.config import ConfigError
from autopar.data import ByteTokenizer, build_tokenizer
from autopar.data.tokens import BUILTIN_DATASETS, load_tokens
from autopar.training.resolve import model_args, parse_job, tokenizer_path

from jobs import TINY_FLAGS, TINY_MODEL, one_process_trainer, tiny_job, write_tiny_hf_folder

HF_ARGS = {**TINY_MODEL, "max_position_embeddings": 1234, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    return folder, write_tiny_hf_folder(folder, HF_ARGS)


def hf_job(folder, *flags: str):
    return parse_job(
        [
            "--model.hf_assets_path",
            str(folder),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
            "--training.mixed_precision_param",
            "float32",
            *flags,
        ]
    )


def test_the_hf_folder_gives_the_model_shape_and_the_tokenizer(hf_folder):
    folder, args = hf_folder
    job = hf_job(folder)
    assert model_args(job) == args  # max_position_embeddings and rope_theta included
    assert tokenizer_path(job) == str(folder)


def test_model_overrides_win_over_the_hf_config(hf_folder):
    folder, args = hf_folder
    assert model_args(hf_job(folder, "--model.num_hidden_layers", "1")) == dataclasses.replace(
        args, num_hidden_layers=1
    )


def test_an_hf_folder_of_the_other_family_is_refused(hf_folder):
    folder, _ = hf_folder
    with pytest.raises(ConfigError, match=r"model.name='qwen2.5', but .* is a qwen3 model"):
        model_args(hf_job(folder, "--model.name", "qwen2.5"))


def test_training_from_an_hf_folder_tokenizes_with_its_tokenizer(hf_folder, tmp_path, caplog):
    folder, _ = hf_folder
    job = hf_job(folder, "--job.dump_folder", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="autopar"):
        trainer = one_process_trainer(job)
    assert f"tokenizer: {folder} " in caplog.text
    as_bytes = load_tokens(BUILTIN_DATASETS["autopar_corpus"], ByteTokenizer())
    assert trainer.loader.samples.tokens.size < as_bytes.size / 2  # BPE ids, not bytes
    assert len(trainer.train()) == 2


def test_the_export_is_a_complete_hf_folder_that_transformers_loads(hf_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, _ = hf_folder
    job = hf_job(
        folder,
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
    )
    one_process_trainer(job).train()
    out = tmp_path / "hf" / "step-2"
    config = json.loads((out / "config.json").read_text())
    source = json.loads((folder / "config.json").read_text())
    for key in ("max_position_embeddings", "rope_theta", "bos_token_id", "eos_token_id"):
        assert config[key] == source[key], key
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == source["eos_token_id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.max_position_embeddings == HF_ARGS["max_position_embeddings"]
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = build_tokenizer(str(folder))
    text = "the model trains on its own words"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def test_the_readme_hf_finetune_preset_takes_an_hf_folder_in_and_gives_one_back(hf_folder, tmp_path):
    folder, _ = hf_folder
    job = parse_job(
        [
            "--job.config",
            "hf_finetune",
            "--model.hf_assets_path",
            str(folder),
            "--checkpoint.initial_load_path",
            str(folder),
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "2",
            "--training.seq_len",
            "32",
        ]
    )
    assert job.checkpoint.initial_load_in_hf and job.checkpoint.last_save_in_hf
    one_process_trainer(job).train()
    assert (tmp_path / "hf" / "step-2" / "model.safetensors").is_file()


def _index(folder) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _rewrite_index(folder, change) -> None:
    index = _index(folder)
    change(index)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_of(folder, name: str = "model.norm.weight") -> str:
    return _index(folder)["weight_map"][name]


def _point_norm_at_another_shard(folder) -> None:
    other = _shard_of(folder, "model.embed_tokens.weight")
    _rewrite_index(folder, lambda i: i["weight_map"].update({"model.norm.weight": other}))


def _shard_outside(folder, outside: str) -> None:
    shard = _shard_of(folder)
    shutil.copyfile(folder / shard, folder.parent / shard)  # a real file there: it must not be read
    target = f"../{shard}" if outside == "dotdot" else str(folder.parent / shard)
    _rewrite_index(folder, lambda i: i["weight_map"].update({"model.norm.weight": target}))


def _truncate(folder) -> None:
    shard = folder / _shard_of(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


DAMAGED_FOLDERS = {
    "index names a shard that lacks the tensor": (
        _point_norm_at_another_shard,
        "model.safetensors.index.json: names model-0000",
        "for 'model.norm.weight', but that file does not hold it",
    ),
    "index shard path with ../": (
        lambda f: _shard_outside(f, "dotdot"),
        "model.safetensors.index.json: shard '../model-",
        "is outside the model's folder",
    ),
    "index shard path absolute": (
        lambda f: _shard_outside(f, "absolute"),
        "model.safetensors.index.json: shard '/",
        "is outside the model's folder",
    ),
    "missing shard": (
        lambda f: (f / _shard_of(f)).unlink(),
        "model.safetensors.index.json: shard 'model-0000",
        "is not in",
    ),
    "weight_map a list": (
        lambda f: _rewrite_index(f, lambda i: i.update(weight_map=list(i["weight_map"]))),
        "model.safetensors.index.json: weight_map is a list, not an object",
        "download the model again",
    ),
    "weight_map entry not a file name": (
        lambda f: _rewrite_index(f, lambda i: i["weight_map"].update({"model.norm.weight": 3})),
        "model.safetensors.index.json: weight_map['model.norm.weight'] is 3, not a shard file name",
        "download the model again",
    ),
    "truncated shard": (
        _truncate,
        ".safetensors: not a readable safetensors file",
        "download the model again",
    ),
    "pytorch .bin weights only": (
        lambda f: [p.unlink() for p in f.glob("model*")] + [(f / "pytorch_model.bin").write_bytes(b"")],
        "holds PyTorch .bin weights",
        "autopar reads safetensors",
    ),
}
"""A sharded HF folder as downloads and hands damage it, each once."""


@pytest.mark.parametrize("case", DAMAGED_FOLDERS, ids=list(DAMAGED_FOLDERS))
def test_a_damaged_hf_folder_is_one_line_naming_its_file_and_the_fix(case, tmp_path, capsys):
    from autopar.cli.train import main as train_main
    from autopar.models import Qwen, save_hf

    damage, where, fix = DAMAGED_FOLDERS[case]
    folder = tmp_path / "model"
    model = Qwen(model_args(tiny_job(tmp_path / "unused")))
    model.init_weights()
    save_hf(dict(model.named_parameters()), model.args, folder, max_shard_bytes=60_000)
    damage(folder)
    code = train_main(
        [
            *("--job.config", "train_configs/debug_model.toml", *TINY_FLAGS, "--training.steps", "2"),
            *("--job.dump_folder", str(tmp_path / "out"), "--checkpoint.initial_load_path", str(folder)),
            *("--checkpoint.initial_load_in_hf", "true"),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith(f"config error: checkpoint.initial_load_path: {folder}")
    assert where in lines[0] and fix in lines[0]
    assert not (tmp_path / "out").exists()


def test_hf_assets_path_naming_a_file_is_one_line_naming_its_folder(hf_folder):
    folder, _ = hf_folder
    with pytest.raises(
        ConfigError, match=rf"config.json' is a file; name the model's folder \(here {folder}\)"
    ):
        model_args(hf_job(folder / "config.json"))


def test_from_hf_given_a_file_names_its_folder(hf_folder):
    from autopar.models import HFCheckpointError, from_hf

    folder, _ = hf_folder
    with pytest.raises(
        HFCheckpointError, match=rf"model.safetensors: a file, not a folder; .* here {folder}\)"
    ):
        from_hf(folder / "model.safetensors")


def test_a_hub_cache_folder_of_links_to_its_blobs_loads(tmp_path):
    """The hub cache's snapshot folders hold links into ``../../blobs``: a shard reached through
    a link is inside the folder (only the index's own entries are held to it)."""
    from autopar.models import Qwen, from_hf, save_hf

    model = Qwen(model_args(tiny_job(tmp_path / "unused")))
    model.init_weights()
    save_hf(dict(model.named_parameters()), model.args, tmp_path / "written", max_shard_bytes=60_000)
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted((tmp_path / "written").iterdir())):
        shutil.move(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    loaded = from_hf(snapshot)
    for name, param in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name
