"""torchtitan's Qwen3 job files run unchanged: their sections and field names are ours or
map onto ours (``tests/torchtitan_configs`` holds their v0.2.2 presets field for field)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autopar.job import parse_job
from autopar.metrics import read_metrics
from autopar.train import main

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

    from autopar.job import model_args
    from autopar.models import Qwen
    from autopar.plans.float8 import apply_float8

    monkeypatch.chdir(hf_assets)
    job = parse_job(["--job.config", str(CONFIGS / "qwen3_0.6b.toml"), "--model.converters", "float8"])
    assert job.float8.enable and job.float8.filter_fqns == ["output"]
    model = Qwen(model_args(job))
    apply_float8(model, job.float8, "cpu")
    assert not isinstance(model.lm_head, Float8Linear)
    assert isinstance(model.layers["0"].mlp.down_proj, Float8Linear)
