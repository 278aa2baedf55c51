"""An HF folder is the model: ``model.hf_assets_path`` gives the shape (config.json) and the
tokenizer (tokenizer.json); ``[model]`` overrides still win."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from autopar.config import ConfigError
from autopar.data import ByteTokenizer, build_tokenizer
from autopar.data.tokens import BUILTIN_DATASETS, load_tokens
from autopar.training.resolve import model_args, parse_job, tokenizer_path

from jobs import TINY_MODEL, one_process_trainer, write_tiny_hf_folder

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
