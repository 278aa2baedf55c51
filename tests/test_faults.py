"""Training that goes wrong: non-finite steps are skipped or stop the job, never saved, and
metrics.jsonl stays valid JSON with each step once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.distributed import single_process
from autopar.faults import TrainingStopped
from autopar.trainer import Trainer
from autopar.validate import validate

from jobs import TINY_FLAGS, tiny_job

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ("--checkpoint.enable", "true", "--checkpoint.interval", "1")


def trainer(folder, *flags: str) -> Trainer:
    job = tiny_job(folder, *flags)
    return Trainer(job, validate(job, 1), single_process())


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl parsed as JSON proper (Python's json accepts NaN; JSON does not)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def poison_gradients_at(run: Trainer, bad_steps: set[int]) -> None:
    """Make one gradient NaN at the given steps, as an overflow in backward would."""
    forward_backward = run.one_step.forward_backward

    def poisoned(batches):
        loss = forward_backward(batches)
        if run.step + 1 in bad_steps:
            next(run.parts[0].parameters()).grad[0] = float("nan")
        return loss

    run.one_step.forward_backward = poisoned


def test_a_nonfinite_step_is_skipped_without_touching_weights_or_optimizer(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "1", "--training.steps", "4")
    poison_gradients_at(run, {2})
    before = {}

    def snapshot_after_step_1(batches, forward_backward=run.one_step.forward_backward):
        if run.step == 1:
            before["params"] = [p.detach().clone() for p in run.parts[0].parameters()]
            before["adam_steps"] = [s["step"].clone() for s in run.optimizers[0].state.values()]
        return forward_backward(batches)

    run.one_step.forward_backward = snapshot_after_step_1
    apply = run.one_step.apply
    after = {}

    def capture_after_step_2(lr, norm):
        if run.step == 3:  # the first update after the skipped step 2
            after["params"] = [p.detach().clone() for p in run.parts[0].parameters()]
            after["adam_steps"] = [s["step"].clone() for s in run.optimizers[0].state.values()]
        apply(lr, norm)

    run.one_step.apply = capture_after_step_2
    records = run.train()
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before["adam_steps"], after["adam_steps"], strict=True))
    assert [r.step for r in records] == [1, 2, 3, 4]


def test_skipped_steps_are_logged_as_json_null_with_a_flag(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "1", "--training.steps", "3")
    poison_gradients_at(run, {2})
    run.train()
    rows = strict_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["skipped"]) for r in rows] == [(1, False), (2, True), (3, False)]
    assert rows[1]["grad_norm"] is None and rows[1]["loss"] is not None


def test_more_nonfinite_steps_in_a_row_than_allowed_stop_training(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "1", "--training.steps", "5", *CHECKPOINTS)
    poison_gradients_at(run, {2, 3})
    with pytest.raises(TrainingStopped, match=r"step 3: grad_norm not finite, 2 step\(s\) in a row"):
        run.train()
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["step-1", "step-2"]  # step 2 made no update: its weights are step 1's


def test_weights_that_are_not_finite_are_never_checkpointed(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "5", "--training.steps", "3", *CHECKPOINTS)
    apply = run.one_step.apply

    def overflow_at_step_2(lr, norm):
        apply(lr, norm)
        if run.step == 2:
            with torch.no_grad():
                next(run.parts[0].parameters())[0] = float("inf")

    run.one_step.apply = overflow_at_step_2
    with pytest.raises(TrainingStopped, match="step 2: weights are not finite, so no checkpoint"):
        run.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS).train()
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS, "--checkpoint.load_step", "2").train()
    assert [r["step"] for r in strict_records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_train_py_with_an_exploding_lr_exits_1_with_one_message(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config",
            "train_configs/debug_model.toml",
            *TINY_FLAGS,
            "--training.steps",
            "20",
            "--optimizer.lr",
            "1e6",
            "--job.dump_folder",
            str(tmp_path),
            *CHECKPOINTS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.count("training stopped: step") == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
