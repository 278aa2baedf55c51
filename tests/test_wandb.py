"""Weights & Biases (``metrics.enable_wandb``) gets what metrics.jsonl gets: an offline run,
read back from the file it wrote, holds every record at its step, and the job as its config.
A setting W&B would refuse is one line naming it and its fix, before any work where it can be."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autopar.config import ConfigError
from autopar.training.metrics.logger import read_metrics
from autopar.training.metrics.sinks import WANDB_RUN_ID, WandbSink
from autopar.training.preflight import check_job

from jobs import one_process_trainer, tiny_job, train_py

ROOT = Path(__file__).resolve().parents[1]
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the wandb package")


@pytest.fixture(autouse=True)
def fresh_wandb():
    """W&B reads its environment once per process (``wandb.setup``): each test starts it anew,
    so the variables a test sets are the ones W&B sees."""
    try:
        import wandb
    except ImportError:  # the tests that need it skip themselves
        yield
        return
    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture
def offline(monkeypatch):
    """W&B installed, offline (no account, no network) and quiet."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


_BLOCK, _HEADER = 32768, 7
"""The run file is a LevelDB-style log: 32 KiB blocks of records, each behind a 7-byte header
(crc32, length, type), after a 7-byte ':W&B' file header; a record's payload is a protobuf
``Record``, split over blocks as FIRST, MIDDLE... LAST pieces (types 2, 3, 4; 1 is whole)."""


def offline_records(run_file: Path) -> list[Any]:
    """The protobuf records of an offline run's ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, payload, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        payload += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def run_files(folder: Path) -> list[Path]:
    """The offline runs' files under ``folder``, oldest first, once W&B has written them out:
    ``run.finish()`` returns before W&B's service has flushed the file (it was read with its
    header alone about one time in four), so stop the service first."""
    import wandb

    wandb.teardown()
    return sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))


def history(records: list[Any]) -> dict[int, dict[str, Any]]:
    """step -> the keys logged at it (W&B's own ``_runtime``, ``_timestamp`` left out)."""
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def test_an_offline_wandb_runs_history_equals_metrics_jsonl(tmp_path, offline):
    dump = tmp_path / "run"
    job = tiny_job(
        dump,
        *("--training.steps", "4", "--metrics.log_freq", "1", "--metrics.enable_wandb", "true"),
        *("--metrics.wandb_run_name", "tiny", "--validation.enable", "true", "--validation.freq", "2"),
        *("--validation.dataset", "autopar_corpus", "--validation.steps", "1"),
    )
    one_process_trainer(job).train()  # finishes the W&B run as it closes metrics.jsonl
    (run_file,) = run_files(dump)
    records = offline_records(run_file)

    expected: dict[int, dict[str, Any]] = {}
    for record in read_metrics(dump / "metrics.jsonl"):
        step = record.pop("step")
        expected.setdefault(step, {}).update(record)  # a step's training and validation records
    assert sorted(expected) == [1, 2, 3, 4] and "val_loss" in expected[2]
    assert history(records) == expected

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("autopar", "tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["steps"] == 4 and config["metrics"]["wandb_run_name"] == "tiny"


def test_without_wandb_enable_wandb_is_refused_with_the_line_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    job = tiny_job(tmp_path, "--metrics.enable_wandb", "true")
    with pytest.raises(
        ConfigError,
        match=r"^metrics.enable_wandb=true needs the wandb package: pip install 'autopar\[wandb\]'",
    ):
        check_job(job, 1)


def test_a_resumed_job_continues_its_wandb_run(tmp_path, offline):
    dump = tmp_path / "run"
    flags = ("--metrics.log_freq", "1", "--metrics.enable_wandb", "true", "--checkpoint.enable", "true")
    one_process_trainer(tiny_job(dump, *flags, "--training.steps", "4", "--checkpoint.interval", "2")).train()
    shutil.rmtree(dump / "checkpoint" / "step-4")  # as if killed after logging step 4, before saving it
    one_process_trainer(tiny_job(dump, *flags, "--training.steps", "4", "--checkpoint.interval", "2")).train()
    first, second = run_files(dump)
    assert first.name == second.name  # run-<id>.wandb: one W&B run
    assert sorted(history(offline_records(second))) == [3, 4]


def test_a_job_started_afresh_in_a_used_folder_starts_a_new_wandb_run(tmp_path, offline):
    dump = tmp_path / "run"
    flags = ("--metrics.log_freq", "1", "--metrics.enable_wandb", "true", "--training.steps", "2")
    one_process_trainer(tiny_job(dump, *flags)).train()
    one_process_trainer(tiny_job(dump, *flags, "--job.overwrite_dump_folder", "true")).train()
    first, second = run_files(dump)
    assert first.name != second.name


@needs_wandb
def test_a_wandb_mode_wandb_does_not_know_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    job = tiny_job(tmp_path / "run", "--metrics.enable_wandb", "true")
    with pytest.raises(
        ConfigError, match=r"^WANDB_MODE='bogus' is not a W&B mode .*: set it to online, offline"
    ):
        check_job(job, 1)
    assert not (tmp_path / "run").exists()


@needs_wandb
@pytest.mark.parametrize("project", ["team/project", "a:b", "p" * 129])
def test_a_project_name_wandb_refuses_is_refused_before_any_work(tmp_path, project):
    job = tiny_job(tmp_path, "--metrics.enable_wandb", "true", "--metrics.wandb_project", project)
    with pytest.raises(
        ConfigError,
        match=r"^metrics.wandb_project='.*': Invalid project name .*; choose another project name$",
    ):
        check_job(job, 1)


@needs_wandb
def test_the_run_goes_under_wandb_dir_when_it_is_set(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    dump = tmp_path / "run"
    job = tiny_job(dump, "--metrics.enable_wandb", "true")
    check_job(job, 1)
    sink = WandbSink(job)
    sink.write({"step": 1, "loss": 2.5})
    sink.close()
    assert len(run_files(tmp_path / "elsewhere")) == 1
    assert not (dump / "wandb").exists()
    assert (dump / WANDB_RUN_ID).read_text().strip() == sink.run.id  # the id stays with the job


@needs_wandb
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_wandb_dir_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, where):
    (tmp_path / "file").write_text("")
    wandb_dir = tmp_path / "file" if where == "a file" else tmp_path / "file" / "wandb"
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    job = tiny_job(tmp_path / "run", "--metrics.enable_wandb", "true")
    with pytest.raises(
        ConfigError,
        match=r"^WANDB_DIR='.*': cannot write the W&B run there: .* is a file, not a folder; point it",
    ):
        check_job(job, 1)


@needs_wandb
@pytest.mark.parametrize("damage", [b"", b"\x00\xff\xfe\x01", b"abc:def\n", b"  \n\n"])
def test_a_damaged_run_id_file_starts_a_new_run_and_says_so(tmp_path, offline, caplog, damage):
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / WANDB_RUN_ID).write_bytes(damage)
    sink = WandbSink(tiny_job(dump, "--metrics.enable_wandb", "true"), resuming=True)
    sink.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"{dump / WANDB_RUN_ID} is damaged (") and "starts a new W&B run" in warning
    assert (dump / WANDB_RUN_ID).read_text() == sink.run.id + "\n"


def offline_wandb_home(tmp_path: Path) -> dict[str, str]:
    """An environment where W&B runs online with no API key anywhere, and would reach only a
    closed port on this machine if it tried the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return env | {
        "HOME": str(tmp_path / "home"),  # no ~/.netrc, no ~/.config/wandb
        "NETRC": str(tmp_path / "home" / ".netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "home" / "wandb"),
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # the discard port: nothing leaves the machine
        "WANDB_INIT_TIMEOUT": "30",
        "PYTHONPATH": str(ROOT),
    }


@needs_wandb
def test_online_with_no_api_key_is_one_line_naming_the_fixes(tmp_path):
    result = subprocess.run(
        [*train_py(tmp_path / "run", "--training.steps", "1", "--metrics.enable_wandb", "true")],
        cwd=ROOT,
        env=offline_wandb_home(tmp_path),
        stdin=subprocess.DEVNULL,  # no terminal: W&B cannot prompt for a key
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "config error: metrics.enable_wandb=true: W&B did not start the run (UsageError: No API key configured"
    ), result.stderr[-3000:]
    assert last.endswith("or turn W&B off (--metrics.enable_wandb false)")
    assert "Traceback" not in result.stderr
    assert "step 1 " not in result.stderr  # refused before the first step
