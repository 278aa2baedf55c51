"""Chaos: train.py killed with SIGKILL at random moments, one of them inside a checkpoint
save, then rerun until done, must log exactly the losses of a run never interrupted.

A one-process job and a two-rank FSDP job (where one rank is killed and the other must
notice and exit by itself), each with a few seeds for the kill moments.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from autopar.training.metrics.logger import read_metrics

from jobs import free_port, rank_env, train_py

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
FLAGS = (
    "--training.steps",
    str(STEPS),
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "2",
    "--metrics.log_freq",
    "1",
    "--comm.train_timeout_seconds",
    "20",
)
TWO_RANKS = ("--parallelism.data_parallel_shard_degree", "2")
KILLS = ("random", "in a save", "random")


def start(folder: Path, ranks: int) -> list[subprocess.Popen]:
    """The job's processes: plain train.py, or two ranks started as torchrun would."""
    argv = train_py(folder, *FLAGS, *(TWO_RANKS if ranks == 2 else ()))
    if ranks == 1:
        envs = [{**os.environ, "OMP_NUM_THREADS": "1"}]
    else:
        port = free_port()
        envs = [{**rank_env(rank, port), "OMP_NUM_THREADS": "1"} for rank in range(ranks)]
    return [
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]


def logged_steps(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_for(condition, procs: list[subprocess.Popen], timeout_s: float = 120) -> bool:
    """Poll ``condition`` until it holds (True) or a process ended first (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.001)
    raise AssertionError("the job neither progressed nor ended")


def losses(folder: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(folder / "metrics.jsonl")]


def run_to_the_end(folder: Path, ranks: int) -> None:
    procs = start(folder, ranks)
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]


def interrupted_run(folder: Path, ranks: int, seed: int) -> None:
    """Kill one process of the job at each moment of ``KILLS``, restarting it each time."""
    rng = random.Random(seed)
    for moment in KILLS:
        before = logged_steps(folder)
        procs = start(folder, ranks)
        if moment == "in a save":
            reached = wait_for(lambda: any((folder / "checkpoint").glob(".step-*.partial")), procs)
        else:
            reached = wait_for(lambda: logged_steps(folder) > before, procs)  # noqa: B023
            time.sleep(rng.uniform(0, 0.6))
        if reached:
            rng.choice(procs).kill()
        for proc in procs:  # a surviving rank notices its peer is gone and exits by itself
            _, err = proc.communicate(timeout=120)
            assert proc.returncode in (0, -9) or "another rank died" in err, err[-3000:]
            assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "seed"),
    [(1, 0), pytest.param(1, 1, marks=pytest.mark.heavy), pytest.param(2, 0, marks=pytest.mark.heavy)],
)  # more seeds and two ranks (a survivor noticing its peer died: also test_faults): python -m pytest -m heavy
def test_kill_9_at_random_moments_then_rerun_logs_the_uninterrupted_losses(tmp_path, ranks, seed):
    run_to_the_end(tmp_path / "reference", ranks)
    reference = losses(tmp_path / "reference")
    assert [step for step, _ in reference] == list(range(1, STEPS + 1))

    interrupted_run(tmp_path / "chaos", ranks, seed)
    run_to_the_end(tmp_path / "chaos", ranks)
    assert losses(tmp_path / "chaos") == reference
    assert not list((tmp_path / "chaos" / "checkpoint").glob(".step-*"))  # leftovers cleaned up
