"""Training that goes wrong: non-finite steps are skipped or stop the job, never saved, and
metrics.jsonl stays valid JSON with each step once."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from autopar.cli.train import main as train_main
from autopar.data.chat import CHATML_TOKENIZER
from autopar.data.errors import DataError
from autopar.training.checkpointing.manifest import broken_file
from autopar.training.checkpointing.run_lock import LOCK_NAME, dump_folder_lock
from autopar.training.faults import TrainingStopped
from autopar.training.preflight import check_job
from autopar.training.trainer import Trainer

from jobs import CHAT_VOCAB, TINY_FLAGS, free_port, one_process_trainer, rank_env, tiny_job, train_py

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ("--checkpoint.enable", "true", "--checkpoint.interval", "1")


def trainer(folder, *flags: str) -> Trainer:
    job = tiny_job(folder, *flags)
    return one_process_trainer(job)


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl parsed as JSON proper (Python's json accepts NaN; JSON does not)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def poison_gradients_at(run: Trainer, bad_steps: set[int]) -> None:
    """Make one gradient NaN at the given steps, as an overflow in backward would."""
    forward_backward = run.train_step.forward_backward

    def poisoned(batches):
        loss = forward_backward(batches)
        if run.step + 1 in bad_steps:
            next(run.parts[0].parameters()).grad[0] = float("nan")
        return loss

    run.train_step.forward_backward = poisoned


def test_a_nonfinite_step_is_skipped_without_touching_weights_or_optimizer(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "1", "--training.steps", "4")
    poison_gradients_at(run, {2})
    before = {}

    def snapshot_after_step_1(batches, forward_backward=run.train_step.forward_backward):
        if run.step == 1:
            before["params"] = [p.detach().clone() for p in run.parts[0].parameters()]
            before["adam_steps"] = [s["step"].clone() for s in run.optimizers[0].state.values()]
        return forward_backward(batches)

    run.train_step.forward_backward = snapshot_after_step_1
    apply = run.train_step.apply
    after = {}

    def capture_after_step_2(lr, norm):
        if run.step == 3:  # the first update after the skipped step 2
            after["params"] = [p.detach().clone() for p in run.parts[0].parameters()]
            after["adam_steps"] = [s["step"].clone() for s in run.optimizers[0].state.values()]
        apply(lr, norm)

    run.train_step.apply = capture_after_step_2
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
    with pytest.raises(
        TrainingStopped,
        match=r"step 3: grad_norm not finite \(gradients on rank\(s\) \[0\]\), 2 step\(s\) in a row",
    ):
        run.train()
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["step-1", "step-2"]  # step 2 made no update: its weights are step 1's


def test_weights_that_are_not_finite_are_never_checkpointed(tmp_path):
    run = trainer(tmp_path, "--training.max_skipped_steps", "5", "--training.steps", "3", *CHECKPOINTS)
    apply = run.train_step.apply

    def overflow_at_step_2(lr, norm):
        apply(lr, norm)
        if run.step == 2:
            with torch.no_grad():
                next(run.parts[0].parameters())[0] = float("inf")

    run.train_step.apply = overflow_at_step_2
    with pytest.raises(TrainingStopped, match="step 2: weights are not finite, so no checkpoint"):
        run.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS).train()
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS, "--checkpoint.load_step", "2").train()
    assert [r["step"] for r in strict_records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_run_restarted_before_any_checkpoint_logs_each_step_once(tmp_path):
    trainer(tmp_path, "--training.steps", "3").train()
    trainer(tmp_path, "--training.steps", "3").train()
    assert [r["step"] for r in strict_records(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_metrics_line_cut_off_mid_write_is_dropped_on_resume_and_said(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 2.7')  # a kill or a full disk while appending step 3
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS).train()
    assert [r["step"] for r in strict_records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert "metrics.jsonl: dropped its last line, a record a stopped run cut off mid-write" in caplog.text


def test_metrics_that_cannot_be_written_stop_training_with_one_message(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()  # appending to it fails as a full disk or read-only file would
    with pytest.raises(TrainingStopped, match=r"could not write after step 1: .*metrics\.jsonl"):
        trainer(tmp_path, "--training.steps", "2").train()


@pytest.mark.slow
def test_train_py_with_an_exploding_lr_exits_1_with_one_message(tmp_path):
    result = subprocess.run(
        train_py(tmp_path, "--training.steps", "20", "--optimizer.lr", "1e6", *CHECKPOINTS),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.count("training stopped: step") == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def start_long_run(folder: Path) -> subprocess.Popen:
    """train.py on the tiny job for many steps, checkpointing rarely; returns once step 1 is
    logged."""
    proc = subprocess.Popen(
        train_py(
            folder,
            "--training.steps",
            "100000",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "100000",
            "--metrics.log_freq",
            "1",
        ),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "step 1 " in line:
            return proc
    raise AssertionError(f"train.py ended before step 1: {proc.wait()}")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_saves_the_current_step_and_exits_0(tmp_path, signum):
    proc = start_long_run(tmp_path)
    proc.send_signal(signum)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, rest[-2000:]
    last = strict_records(tmp_path / "metrics.jsonl")[-1]["step"]
    assert f"stopped by {signal.Signals(signum).name} after step {last} and saved it" in rest
    assert (tmp_path / "checkpoint" / f"step-{last}").is_dir()


def test_a_second_stop_signal_exits_at_once():
    script = """
import os, signal, torch
from autopar.training.faults import StopRequest
with StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGUSR1)
    print("requested", stop.requested(torch.device("cpu")), flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    print("still running", flush=True)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout == "requested True\n"
    assert result.returncode == -signal.SIGUSR1


def train_with_rank_1_signalled_at_step_2(job) -> int:
    """Train ``job`` on this rank; rank 1 alone receives SIGUSR1 after step 2."""
    from autopar.parallel.world import init_world

    world = init_world()
    run = Trainer(job, check_job(job, world.size), world)
    run_step = run.run_step

    def step_then_signal():
        result = run_step()
        if run.step == 2 and world.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return result

    run.run_step = step_then_signal
    run.train()
    return run.step


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    from autopar.cli.spawn import run_on_ranks

    job = tiny_job(
        tmp_path,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.steps",
        "10",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "100",
    )
    assert run_on_ranks(train_with_rank_1_signalled_at_step_2, 2, job, timeout_s=120) == [2, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


def train_with_rank_1_overflowing_at_step_2(job) -> str:
    """Train ``job`` on this rank; rank 1's logits overflow at step 2. The stop message."""
    from autopar.parallel.world import init_world

    world = init_world()
    run = Trainer(job, check_job(job, world.size), world)
    if world.rank == 1:
        run.parts[0].register_forward_hook(lambda _m, _i, out: out * float("inf") if run.step == 1 else None)
    with pytest.raises(TrainingStopped) as stopped:
        run.train()
    return str(stopped.value)


@pytest.mark.slow
def test_a_nonfinite_step_names_the_rank_whose_loss_went_bad(tmp_path):
    from autopar.cli.spawn import run_on_ranks

    job = tiny_job(tmp_path, "--parallelism.data_parallel_shard_degree", "2")
    messages = run_on_ranks(train_with_rank_1_overflowing_at_step_2, 2, job, timeout_s=120)
    assert messages[0] == messages[1]
    assert (
        "step 2: loss and grad_norm not finite (loss on rank(s) [1]; gradients on rank(s) [0, 1])"
        in messages[0]
    )


def saved_steps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoint").iterdir())


def shard_of(folder: Path, step: int) -> Path:
    return next((folder / "checkpoint" / f"step-{step}").glob("*.distcp"))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_a_byte])
def test_resume_skips_a_broken_latest_checkpoint_for_the_newest_intact_one(tmp_path, caplog, damage):
    trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS).train()
    damage(shard_of(tmp_path, 3))
    resumed = trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS)
    assert resumed.checkpointer.resume_step() == 2
    assert f"checkpoint step-3 is broken ({shard_of(tmp_path, 3)}" in caplog.text


@pytest.mark.parametrize(
    "manifest", ["{not json", "  \n", '{"files": ["a list"]}'], ids=["syntax", "blank", "shape"]
)
def test_resume_skips_a_checkpoint_whose_manifest_is_damaged_for_the_one_before(tmp_path, caplog, manifest):
    trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS).train()
    damaged = tmp_path / "checkpoint" / "step-3" / "manifest.json"
    damaged.write_text(manifest)
    resumed = trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS)
    assert resumed.checkpointer.resume_step() == 2
    assert f"checkpoint step-3 is broken ({damaged} is damaged" in caplog.text


def test_an_explicit_load_step_that_is_broken_is_refused(tmp_path):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    flip_a_byte(shard_of(tmp_path, 2))
    resumed = trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS, "--checkpoint.load_step", "2")
    with pytest.raises(
        TrainingStopped, match=r"checkpoint\.load_step=2 is broken: .* does not match the checksum"
    ):
        resumed.train()


def test_resuming_another_model_shape_is_refused_naming_the_difference(tmp_path):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, "--checkpoint.interval", "2").train()
    other = trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS, "--model.num_hidden_layers", "1")
    with pytest.raises(
        TrainingStopped, match=r"layers\.1\.input_layernorm\.weight is in the checkpoint but not in"
    ):
        other.train()
    assert saved_steps(tmp_path) == ["step-2"]


def test_a_save_removes_what_interrupted_saves_left(tmp_path):
    leftover = tmp_path / "checkpoint" / ".step-7.partial"
    leftover.mkdir(parents=True)
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, "--checkpoint.interval", "2").train()
    assert saved_steps(tmp_path) == ["step-2"]


@pytest.mark.slow
def test_a_rank_that_stops_participating_ends_the_job_within_the_train_timeout(tmp_path):
    argv = train_py(
        tmp_path,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.steps",
        "100000",
        "--metrics.log_freq",
        "1",
        "--comm.train_timeout_seconds",
        "3",
    )
    port = free_port()
    rank1 = subprocess.Popen(argv, cwd=ROOT, env=rank_env(1, port), stderr=subprocess.DEVNULL)
    rank0 = subprocess.Popen(argv, cwd=ROOT, env=rank_env(0, port), stderr=subprocess.PIPE, text=True)
    try:
        for line in rank0.stderr:
            if "step 3 " in line:
                break
        rank1.send_signal(signal.SIGSTOP)  # alive but silent, as a hung rank is
        stopped_at = time.monotonic()
        _, rest = rank0.communicate(timeout=60)
        assert rank0.returncode == 1
        assert time.monotonic() - stopped_at < 3 + 20  # the timeout, and a step's slack
    finally:
        rank1.kill()
        rank0.kill()
    assert "training stopped: rank 0: a collective failed" in rest, rest[-2000:]
    assert "comm.train_timeout_seconds=3" in rest
    assert "Traceback" not in rest


def test_a_rank_that_never_joins_ends_the_job_within_the_init_timeout(tmp_path):
    argv = train_py(
        tmp_path / "out", "--parallelism.data_parallel_shard_degree", "2", "--comm.init_timeout_seconds", "2"
    )
    result = subprocess.run(
        argv, cwd=ROOT, env=rank_env(0, free_port()), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "comm error: rank 0: not every rank joined within comm.init_timeout_seconds=2:"
    )
    assert "1/2 clients joined" in result.stderr
    assert not (tmp_path / "out").exists()


def limit_file_size(max_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` under which the child cannot grow a file past ``max_bytes``: its
    writes fail as on a full disk (Python ignores the SIGXFSZ that comes with them)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_stops_with_a_message_and_keeps_the_last_one(tmp_path):
    flags = ("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "1")
    first = subprocess.run(train_py(tmp_path, "--training.steps", "2", *flags), cwd=ROOT, capture_output=True)
    assert first.returncode == 0
    result = subprocess.run(
        train_py(tmp_path, "--training.steps", "4", *flags),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size(100_000),
    )
    assert result.returncode == 1
    assert "training stopped: rank 0 could not write checkpoint step-4" in result.stderr, result.stderr[
        -2000:
    ]
    assert "GiB free there" in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-2"]
    assert broken_file(tmp_path / "checkpoint" / "step-2") is None


def test_a_second_run_on_a_dump_folder_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    with dump_folder_lock(tmp_path):
        code = train_main(["--job.config", "debug_model", *TINY_FLAGS, "--job.dump_folder", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"job.dump_folder={str(tmp_path)!r} is in use by another run (pid {os.getpid()} on" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the holder's lock went with it


def test_a_disk_already_full_at_start_is_one_line_exit_2_leaving_nothing(tmp_path):
    result = subprocess.run(
        train_py(tmp_path / "out", "--training.steps", "1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size(0),
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(
        f"config error: job.dump_folder={str(tmp_path / 'out')!r}: cannot write its run lock"
    )
    assert not (tmp_path / "out").exists()


def test_a_lock_file_left_by_a_dead_run_does_not_block_the_next(tmp_path):
    (tmp_path / LOCK_NAME).write_text("pid 999999 on a host that died")  # no process holds it
    code = train_main(
        [
            "--job.config",
            "debug_model",
            *TINY_FLAGS,
            "--training.steps",
            "1",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    assert code == 0 and not (tmp_path / LOCK_NAME).exists()


def test_resuming_with_another_tokenizer_is_refused_before_training(tmp_path):
    vocab = ("--model.vocab_size", str(CHAT_VOCAB))
    trainer(tmp_path, "--training.steps", "2", *vocab, *CHECKPOINTS).train()
    with pytest.raises(
        DataError, match=r"trained with tokenizer the built-in byte tokenizer, this job uses .*chatml"
    ):
        trainer(
            tmp_path,
            "--training.steps",
            "4",
            *vocab,
            *CHECKPOINTS,
            "--model.tokenizer_path",
            str(CHATML_TOKENIZER),
        )


def test_resuming_on_other_data_warns_naming_both(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    other = tmp_path / "other.txt"
    other.write_text("other words for another run, long enough for a few samples. " * 40)
    trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS, "--training.dataset_path", str(other)).train()
    assert "resuming step 2 on other data" in caplog.text and "other.txt" in caplog.text


def test_resuming_a_checkpoint_without_its_manifest_says_it_is_unverified(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    (tmp_path / "checkpoint" / "step-2" / "manifest.json").unlink()
    trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS).train()
    assert "checkpoint step-2 has no manifest.json" in caplog.text and "without verifying" in caplog.text


def test_running_out_of_memory_stops_with_one_message_naming_the_batch(tmp_path):
    run = trainer(tmp_path, "--training.steps", "3")

    def allocate_too_much(module, args):
        if run.step == 1:  # the second step asks the real allocator for 16 TiB
            torch.empty(2**42)

    run.parts[0].register_forward_pre_hook(allocate_too_much)
    with pytest.raises(TrainingStopped, match=r"out of memory in step 2 .*local_batch_size \(now 2\)"):
        run.train()


def test_the_run_ends_with_a_summary_line_naming_its_outputs(tmp_path, caplog):
    caplog.set_level("INFO", logger="autopar")
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    last = caplog.records[-1].getMessage()
    assert last.startswith("finished at step 2 of 2: 2 step(s) in ")
    assert f"metrics {tmp_path / 'metrics.jsonl'}, checkpoint {tmp_path / 'checkpoint' / 'step-2'}" in last


@pytest.mark.slow
def test_an_hf_export_onto_a_full_disk_stops_with_a_message_and_leaves_no_folder(tmp_path):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    result = subprocess.run(
        train_py(tmp_path, "--training.steps", "2", *CHECKPOINTS, "--checkpoint.last_save_in_hf", "true"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size(100_000),
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"could not write the HF export {tmp_path / 'hf' / 'step-2'}" in result.stderr
    assert "Traceback" not in result.stderr
    assert list((tmp_path / "hf").iterdir()) == []
    assert broken_file(tmp_path / "checkpoint" / "step-2") is None


def test_a_stop_signal_writes_the_hf_export_the_job_asked_for_and_says_so(tmp_path, caplog):
    run = trainer(tmp_path, "--training.steps", "5", "--checkpoint.last_save_in_hf", "true")
    run_step = run.run_step

    def step_then_signal():
        result = run_step()
        if run.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    run.run_step = step_then_signal
    run.train()
    assert run.step == 2 and (tmp_path / "hf" / "step-2" / "model.safetensors").is_file()
    assert "SIGTERM: stopping after this step (checkpointing is off; its HF export is written)" in caplog.text
    assert "nothing is saved" not in caplog.text
