"""The commands users type: train.py (plain and under torchrun), parity, bench, plot."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import parse_job

from jobs import TINY_FLAGS, free_port, rank_env, train_py

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def parity(*argv: str) -> subprocess.CompletedProcess:
    """``python -m autopar.parity`` on the debug job with ``argv``."""
    return run(
        sys.executable, "-m", "autopar.parity", "--job.config", "train_configs/debug_model.toml", *argv
    )


def test_train_py_trains_the_debug_job_and_writes_metrics(tmp_path):
    result = run(
        sys.executable,
        "train.py",
        "--job.config",
        "train_configs/debug_model.toml",
        "--training.steps",
        "20",
        "--metrics.log_freq",
        "10",
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable",
        "false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 10, 20]
    assert records[-1]["loss"] < records[0]["loss"] - 2.0  # learned: 6.27 -> 2.95 on AMD EPYC (AVX2)
    assert "step 20  loss" in result.stderr
    saved = parse_job(["--job.config", str(tmp_path / "config.toml")])  # the resolved job, runnable
    assert (saved.training.steps, saved.checkpoint.enable, saved.job.print_config) == (20, False, False)


def test_train_py_reports_a_config_error_and_touches_nothing(tmp_path):
    result = run(
        sys.executable,
        "train.py",
        "--job.config",
        "train_configs/debug_model.toml",
        "--parallelism.tensor_parallel_degree",
        "3",
        "--job.dump_folder",
        str(tmp_path / "out"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error: world size 1 is not divisible")
    assert not (tmp_path / "out").exists()


def test_print_config_shows_overrides(capsys, monkeypatch):
    from autopar.cli.train import main as train_main

    monkeypatch.chdir(ROOT)
    argv = ["--job.config", "train_configs/qwen3_8b.toml", "--parallelism.tensor_parallel_degree", "4"]
    assert train_main([*argv, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert 'flavor = "8B"' in out and "tensor_parallel_degree = 4" in out
    assert "print_config" not in out  # a command, not a setting of the job


@pytest.mark.slow
def test_torchrun_trains_and_checkpoints_fsdp_on_two_cpu_ranks(tmp_path):
    # two ranks: four processes on two cores took 19 s for what each plan's parity test shows
    result = run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port=29631",
        "train.py",
        "--job.config",
        "train_configs/debug_model.toml",
        *TINY_FLAGS,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.steps",
        "3",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "checkpoint" / "step-3" / ".metadata").is_file()


@pytest.mark.slow
def test_torchrun_prints_a_config_error_once_not_once_per_rank(tmp_path):
    result = run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port=29632",
        "train.py",
        "--job.config",
        "train_configs/debug_model.toml",
        "--training.seq_len",
        "1",
        "--job.dump_folder",
        str(tmp_path / "out"),
    )
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert said == ["config error: training.seq_len=1 must be >= 2"], result.stderr[-3000:]
    # torchrun's own closing report (its ChildFailedError traceback) names that line as the cause
    root_cause = result.stderr[result.stderr.index("Root Cause") :]
    assert "exitcode  : 2" in root_cause and "traceback : config error: training.seq_len=1" in root_cause
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_refusal_that_rank_0_does_not_say_is_said_by_the_rank_that_found_it(tmp_path):
    # rank 1 alone (its rank 0 never starts): today's code exited 2 without a word
    result = subprocess.run(
        train_py(tmp_path / "out", "--training.seq_len", "1"),
        cwd=ROOT,
        env=rank_env(1, free_port()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines == ["config error: rank 1: training.seq_len=1 must be >= 2"], (
        lines
    )
    assert not (tmp_path / "out").exists()


def processes_writing_to(folder: Path) -> list[int]:
    """The pids of the processes whose command line names ``folder`` (this test's workers)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if str(folder).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


@pytest.mark.slow
def test_workers_stop_within_seconds_when_their_torchrun_launcher_is_killed(tmp_path):
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    launcher = subprocess.Popen(
        [*torchrun, *train_py(tmp_path, "--training.steps", "100000", "--metrics.log_freq", "1")[1:]],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        launcher.kill()
        # the workers hold the launcher's stderr: it ends when the last of them has exited
        _, err = launcher.communicate(timeout=120)
    finally:  # workers left behind (torchrun starts each in a session of its own) are ended
        for pid in processes_writing_to(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "the torchrun launcher" in err and "is gone; stopping this worker" in err, err[-3000:]
    assert "stopped by SIGTERM after step" in err, err[-3000:]


TWO_STEPS = ("--training.steps", "2", "--checkpoint.enable", "false", "--job.dump_folder", "out")


@pytest.mark.slow
def test_a_wheel_trains_a_preset_by_name_outside_the_repository(tmp_path):
    built = run(
        sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)
    )
    assert built.returncode == 0, built.stderr[-3000:]
    site = tmp_path / "site"
    with zipfile.ZipFile(next(tmp_path.glob("autopar-*.whl"))) as wheel:
        wheel.extractall(site)
        entry_points = wheel.read(
            next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
        ).decode()
    assert "autopar-train = autopar.cli.train:cli" in entry_points
    shipped = (
        "templates/qwen2.5.jinja",
        "templates/qwen3.jinja",
        "templates/qwen3.5.jinja",
        "tokenizers/chatml/tokenizer.json",
    )
    assert all((site / "autopar" / "data" / path).is_file() for path in shipped)
    result = subprocess.run(
        [sys.executable, "-m", "autopar.train", "--job.config", "debug_model", *TINY_FLAGS, *TWO_STEPS],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data: {site}" in result.stderr  # the wheel's own corpus, not the repository's
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_parity_cli_prints_the_table_and_passes(tmp_path):
    result = parity(
        *TINY_FLAGS, "--plans", "tp=2,sp=false", "--steps", "3"
    )  # plans' numbers: test_parallel_parity
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all plans within rtol 1e-05 of single device" in result.stdout
    assert "tp=2,sp=false" in result.stdout


def test_parity_cli_refuses_an_impossible_plan():
    result = parity("--plans", "tp=3")
    assert result.returncode == 2
    assert "plan 'tp=3': parallelism.tensor_parallel_degree=3 does not divide" in result.stderr


def test_bench_json_to_a_folder_is_one_line_before_any_variant_runs(tmp_path, capsys):
    from autopar.cli.bench import main as bench_main

    code = bench_main(["--job.config", "train_configs/debug_model.toml", "--json", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert (
        err.strip()
        == f"config error: --json {tmp_path} is a folder; name a file in it, e.g. --json {tmp_path / 'bench.json'}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "second",
    [
        "full_ac:activation_checkpoint.mode=full",
        pytest.param("compiled", marks=pytest.mark.heavy),  # compiling on CPU: ~12 s more
    ],
)
def test_bench_prints_the_table_and_writes_json(tmp_path, second):
    out = tmp_path / "bench.json"
    result = run(
        sys.executable,
        "-m",
        "autopar.bench",
        "--job.config",
        "train_configs/debug_model.toml",
        *TINY_FLAGS,
        "--variants",
        "eager",
        second,
        "--warmup",
        "1",
        "--steps",
        "2",
        "--json",
        str(out),
        "--job.dump_folder",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s/dev" in result.stdout and "vs eager" in result.stdout
    payload = json.loads(out.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", payload["commit"]), payload["commit"]
    results = payload["results"]
    assert [r["variant"] for r in results] == ["eager", second.split(":")[0]]
    assert results[1]["first_loss"] == pytest.approx(results[0]["first_loss"], rel=1e-4)
    for variant in results:  # each variant's curve, ready for autopar.cli.plot
        curve = read_metrics(tmp_path / "bench" / variant["variant"] / "metrics.jsonl")
        assert [r["step"] for r in curve] == [1, 2, 3]
        assert curve[-1]["loss"] == pytest.approx(variant["final_loss"])
    assert f"python -m autopar.plot {tmp_path / 'bench' / 'eager' / 'metrics.jsonl'} " in result.stdout


def test_plot_overlays_runs(tmp_path):
    pytest.importorskip("matplotlib")
    for name, losses in (("a", [3.0, 2.0, 1.5]), ("b", [3.1, 2.2, 1.4])):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": i + 1, "loss": loss}) for i, loss in enumerate(losses)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    from autopar.cli.plot import main as plot_main

    out = tmp_path / "curves.png"
    assert (
        plot_main(
            [str(tmp_path / "a" / "metrics.jsonl"), str(tmp_path / "b" / "metrics.jsonl"), "-o", str(out)]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    from autopar.cli.plot import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "metrics.jsonl"), "-o", str(tmp_path / "curves.png")])
    assert exit_.value.code == 2
    assert "plotting needs matplotlib: pip install matplotlib" in capsys.readouterr().err
