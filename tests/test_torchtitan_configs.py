"""torchtitan's Qwen3 job files run unchanged: their sections and field names are ours or
map onto ours (``tests/torchtitan_configs`` holds their v0.2.2 presets field for field)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autopar.cli.train import main
from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import parse_job

from jobs import TINY_MODEL, write_tiny_hf_folder

CONFIGS = Path(__file__).parent / "torchtitan_configs"
PRESETS = {"qwen3_0.6b": "Qwen3-0.6B", "qwen3_1.7b": "Qwen3-1.7B", "qwen3_32b": "Qwen3-32B"}
SHORT = ("--training.dataset", "autopar_corpus", "--training.seq_len", "32", "--training.steps", "2")
"""What a CPU test changes on the command line: the shipped corpus, short and quick."""


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory) -> Path:
    """A working folder laid out as torchtitan's download script leaves it, with tiny models
    under each preset's ``./assets/hf/<name>``."""
    cwd = tmp_path_factory.mktemp("torchtitan")
    first = cwd / "assets" / "hf" / "Qwen3-0.6B"
    first.mkdir(parents=True)
    write_tiny_hf_folder(first, TINY_MODEL)
    for name in PRESETS.values():
        if not (cwd / "assets" / "hf" / name).exists():
            shutil.copytree(first, cwd / "assets" / "hf" / name)
    return cwd


@pytest.mark.parametrize("preset", PRESETS)
def test_torchtitans_qwen3_job_file_trains_unchanged(hf_assets, monkeypatch, preset):
    monkeypatch.chdir(hf_assets)
    dump = hf_assets / "outputs"
    shutil.rmtree(dump, ignore_errors=True)
    assert main(["--job.config", str(CONFIGS / f"{preset}.toml"), *SHORT]) == 0
    steps = [r["step"] for r in read_metrics(dump / "metrics.jsonl")]
    assert steps == [1, 2]
    assert parse_job(["--job.config", str(dump / "config.toml")]).model.hf_assets_path == (
        f"./assets/hf/{PRESETS[preset]}"
    )


def test_torchtitans_c4_dataset_is_refused_with_the_way_to_local_files(hf_assets, monkeypatch, capsys):
    monkeypatch.chdir(hf_assets)
    assert main(["--job.config", str(CONFIGS / "qwen3_0.6b.toml"), "--training.steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "training.dataset='c4' is not built in" in err
    assert "autopar-prepare" in err and "training.dataset_path" in err


def test_their_float8_converter_and_section_keep_the_head_in_high_precision(hf_assets, monkeypatch):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from autopar.models import Qwen
    from autopar.parallel.float8 import apply_float8
    from autopar.training.resolve import model_args

    monkeypatch.chdir(hf_assets)
    job = parse_job(["--job.config", str(CONFIGS / "qwen3_0.6b.toml"), "--model.converters", "float8"])
    assert job.float8.enable and job.float8.filter_fqns == ["output"]
    model = Qwen(model_args(job))
    apply_float8(model, job.float8, "cpu")
    assert not isinstance(model.lm_head, Float8Linear)
    assert isinstance(model.layers["0"].mlp.down_proj, Float8Linear)


@pytest.fixture(scope="module")
def tokenizer_only_assets(hf_assets, tmp_path_factory) -> Path:
    """torchtitan's ``--assets tokenizer`` download: each ``./assets/hf/<name>`` holds only
    tokenizer.json and tokenizer_config.json, no config.json or weights."""
    cwd = tmp_path_factory.mktemp("torchtitan_tokenizer_only")
    for name in PRESETS.values():
        folder = cwd / "assets" / "hf" / name
        folder.mkdir(parents=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(hf_assets / "assets" / "hf" / name / file, folder / file)
    return cwd


@pytest.mark.parametrize("preset", PRESETS)
def test_a_tokenizer_only_assets_folder_trains_the_flavor_with_its_tokenizer(
    tokenizer_only_assets, monkeypatch, caplog, capsys, preset
):
    caplog.set_level("INFO", logger="autopar")  # another test's parity run may have quietened it
    monkeypatch.chdir(tokenizer_only_assets)
    dump = tokenizer_only_assets / "outputs"
    shutil.rmtree(dump, ignore_errors=True)
    tiny = [f"--model.{k}={v}" for k, v in TINY_MODEL.items()]
    argv = ["--job.config", str(CONFIGS / f"{preset}.toml"), *SHORT, "--model.flavor", "debug", *tiny]
    assert main(argv) == 0
    assert [r["step"] for r in read_metrics(dump / "metrics.jsonl")] == [1, 2]
    summary = capsys.readouterr().err  # train.py's own log handler writes to stderr
    assert "no config.json in ./assets/hf/" in summary and "shape from the flavor" in summary
    assert f"tokenizer: ./assets/hf/{PRESETS[preset]}" in summary


def test_a_named_flavor_that_differs_from_the_config_json_is_said_in_one_line(
    hf_assets, monkeypatch, caplog, capsys
):
    caplog.set_level("WARNING", logger="autopar")
    monkeypatch.chdir(hf_assets)
    shutil.rmtree(hf_assets / "outputs", ignore_errors=True)
    assert main(["--job.config", str(CONFIGS / "qwen3_0.6b.toml"), *SHORT]) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "different models" in line]
    assert (
        "model.flavor='0.6B'" in line and "hidden_size 1024 vs 64" in line and "model.tokenizer_path" in line
    )
