"""The bench's ``torchtitan`` variant: our job as torchtitan's job file, and a job torchtitan
cannot run as written refused before anything starts. (torchtitan itself runs on CUDA only;
its run is in BENCHMARKS.md when a GPU is lent.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.cli import bench, bench_torchtitan
from autopar.cli.bench_torchtitan import (
    check_torchtitan_job,
    to_toml,
    torchtitan_config,
    write_torchtitan_job,
)
from autopar.config import ConfigError
from autopar.config.parse import tomllib
from autopar.data.tokens import BUILTIN_DATASETS
from autopar.training.resolve import parse_job


def qwen3_1_7b(*flags: str):
    return parse_job(["--job.config", "train_configs/qwen3_1.7b.toml", *flags])


def test_the_job_file_carries_model_batch_precision_and_plan():
    job = qwen3_1_7b("--training.local_batch_size", "2", "--activation_checkpoint.mode", "full")
    sections = tomllib.loads(to_toml(torchtitan_config(job)))
    assert sections["model"]["name"] == "qwen3" and sections["model"]["flavor"] == "1.7B"
    training = sections["training"]
    assert (training["local_batch_size"], training["seq_len"]) == (2, 4096)
    assert training["mixed_precision_param"] == "bfloat16"
    assert training["dataset_path"] == str(BUILTIN_DATASETS["autopar_corpus"])
    assert sections["activation_checkpoint"]["mode"] == "full"
    assert sections["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert sections["metrics"]["log_freq"] == 1  # every step ends in its loss's host sync


def test_the_job_file_is_written_beside_the_variants_outputs_and_reads_back(tmp_path):
    job = qwen3_1_7b("--job.dump_folder", str(tmp_path / "bench" / "torchtitan"))
    path = write_torchtitan_job(job)
    assert path == tmp_path / "bench" / "torchtitan" / "torchtitan.toml"
    assert tomllib.loads(path.read_text()) == torchtitan_config(job)


def test_torchtitan_reads_a_tokenizer_json_from_the_assets_folder():
    folder = torchtitan_config(qwen3_1_7b())["model"]["hf_assets_path"]
    assert (Path(folder) / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--float8.enable", "true"], "float8.enable"),
        (["--training.loss_chunk_tokens", "1024"], "training.loss_chunk_tokens"),
        (["--training.sdpa_backend", "cudnn"], "training.sdpa_backend"),
        (["--model.num_hidden_layers", "4"], "num_hidden_layers"),
        (["--model.flavor", "debug"], "qwen3/debug"),
    ],
)
def test_a_job_torchtitan_cannot_run_as_written_is_a_config_error_naming_it(flags, named):
    with pytest.raises(ConfigError, match=named):
        check_torchtitan_job(qwen3_1_7b(*flags))


def test_without_torchtitan_the_bench_says_how_to_install_it_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_torchtitan.importlib.util, "find_spec", lambda name: None)
    code = bench.main(
        [
            "--job.config",
            "train_configs/qwen3_1.7b.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--variants",
            "torchtitan",
        ]
    )
    assert code == 2
    assert "variant 'torchtitan': needs torchtitan==0.2.2 installed" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
