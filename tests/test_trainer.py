"""The single-process training loop: accumulation, exact resume, safe saves, metrics, HF out."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from autopar.config.sections import LRScheduler
from autopar.data.loader import Batch
from autopar.models import Qwen, from_hf, get_flavor
from autopar.training.checkpointing.dcp_state import complete_steps
from autopar.training.faults import TrainingStopped
from autopar.training.metrics.logger import read_metrics
from autopar.training.optim import lr_factor

from jobs import TINY_MODEL, chat_job, one_process_trainer, tiny_job


def train(job):
    return one_process_trainer(job).train()


def test_same_job_twice_is_bit_identical(tmp_path):
    first = train(tiny_job(tmp_path / "a"))
    second = train(tiny_job(tmp_path / "b"))
    assert [r.loss for r in first] == [r.loss for r in second]
    assert [r.grad_norm for r in first] == [r.grad_norm for r in second]


def test_accumulating_four_micro_batches_of_two_equals_one_batch_of_eight(tmp_path):
    step = one_process_trainer(tiny_job(tmp_path)).train_step
    model = step.parts[0]
    tokens = torch.randint(0, 320, (8, 33), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # uneven targets per micro-batch: normalization must be global
    whole = [Batch(tokens[:, :-1], labels)]
    split = [Batch(tokens[i : i + 2, :-1], labels[i : i + 2]) for i in range(0, 8, 2)]
    results = []
    for batches in (whole, split):
        model.zero_grad()
        loss = step.forward_backward(batches).loss
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss8, grads8), (loss4x2, grads4x2) = results
    # fp32; only the order of summation differs
    torch.testing.assert_close(loss4x2, loss8, rtol=1e-6, atol=0)
    for name, grad in grads8.items():
        torch.testing.assert_close(grads4x2[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_global_batch_accumulation_matches_one_big_local_batch(tmp_path):
    accumulated = train(tiny_job(tmp_path / "a", "--training.global_batch_size", "8"))
    direct = train(tiny_job(tmp_path / "b", "--training.local_batch_size", "8"))
    for a, b in zip(accumulated, direct):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)  # fp32, 5 steps: summation order only


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    uninterrupted = train(tiny_job(tmp_path / "run", *flags))
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3, 6]
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")  # as if it died after step 3
    resumed = train(tiny_job(tmp_path / "run", *flags))
    assert [r.step for r in resumed] == [4, 5, 6]
    assert [r.loss for r in resumed] == [r.loss for r in uninterrupted[3:]]
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in uninterrupted[3:]]


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_background_save_resumes_like_a_blocking_one(tmp_path, mode):
    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    blocking = train(tiny_job(tmp_path / "blocking", *flags))
    background = train(tiny_job(tmp_path / "run", *flags, "--checkpoint.async_mode", mode))
    assert [r.loss for r in background] == [r.loss for r in blocking]
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3, 6]
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    resumed = train(tiny_job(tmp_path / "run", *flags, "--checkpoint.async_mode", mode))
    assert [r.loss for r in resumed] == [r.loss for r in blocking[3:]]
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in blocking[3:]]


def test_last_save_model_only_leaves_the_optimizer_out_of_the_final_checkpoint(tmp_path):
    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    job = tiny_job(tmp_path, *flags, "--checkpoint.last_save_model_only", "true")
    trainer = one_process_trainer(job)
    trainer.train()
    assert trainer.checkpointer.model_only(6) and not trainer.checkpointer.model_only(3)
    started = tiny_job(
        tmp_path / "next", "--checkpoint.initial_load_path", str(tmp_path / "checkpoint" / "step-6")
    )
    loaded = one_process_trainer(started)
    loaded.restore()
    for (name, trained), (_, initial) in zip(
        trainer.parts[0].named_parameters(), loaded.parts[0].named_parameters()
    ):
        assert torch.equal(initial, trained), name


def test_a_finished_run_whose_last_save_is_model_only_reruns_as_done(tmp_path):
    flags = (
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.last_save_model_only",
        "true",
    )
    train(tiny_job(tmp_path, *flags))
    assert train(tiny_job(tmp_path, *flags)) == []


def test_training_on_from_a_model_only_checkpoint_is_refused_naming_the_ways_on(tmp_path):
    flags = (
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "true",
    )
    train(tiny_job(tmp_path, *flags, "--training.steps", "4"))
    with pytest.raises(TrainingStopped, match=r"holds the model only.*initial_load_path.*load_step.*\[2\]"):
        train(tiny_job(tmp_path, *flags, "--training.steps", "6"))


@pytest.mark.parametrize(
    "changed, named",
    [
        (("--training.seq_len", "16"), "seq_len 32 -> 16"),
        (("--training.local_batch_size", "4"), "global_batch_size 2 -> 4"),
    ],
)
def test_resuming_with_another_seq_len_or_batch_warns(tmp_path, caplog, changed, named):
    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    train(tiny_job(tmp_path, *flags))
    for again in ((), changed):
        shutil.rmtree(tmp_path / "checkpoint" / "step-6")
        caplog.clear()
        train(tiny_job(tmp_path, *flags, *again))
    assert f"resuming step 3 with {named} since the checkpoint" in caplog.text


def test_resuming_with_the_same_data_shape_says_nothing_about_it(tmp_path, caplog):
    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    train(tiny_job(tmp_path, *flags))
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    train(tiny_job(tmp_path, *flags))
    assert "since the checkpoint" not in caplog.text


def test_interrupted_save_keeps_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    import autopar.training.checkpointing.checkpoint as checkpoint

    flags = ("--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "3")
    job = tiny_job(tmp_path / "run", *flags)
    trainer = one_process_trainer(job)
    real_save = checkpoint.dcp.save
    calls = []

    def crash_on_second_save(state, checkpoint_id, **kwargs):
        calls.append(checkpoint_id)
        if len(calls) == 2:
            real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # files land, then the crash
            raise KeyboardInterrupt("killed mid-save")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(checkpoint.dcp, "save", crash_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    folder = tmp_path / "run" / "checkpoint"
    assert complete_steps(folder) == [3]
    assert (folder / ".step-6.partial").is_dir()  # the torn save is ignored, not deleted by hand
    monkeypatch.setattr(checkpoint.dcp, "save", real_save)
    resumed = train(tiny_job(tmp_path / "run", *flags))
    assert [r.step for r in resumed] == [4, 5, 6]
    assert complete_steps(folder) == [3, 6]


def test_keep_latest_k_prunes_only_complete_older_checkpoints(tmp_path):
    train(
        tiny_job(
            tmp_path,
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "2",
        )
    )
    assert complete_steps(tmp_path / "checkpoint") == [4, 5]


def test_metrics_jsonl_has_the_contract_keys_every_log_step(tmp_path):
    train(tiny_job(tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_gib"} <= record.keys()
        assert record["mfu"] is None  # no CPU peak is invented
        assert record["tps"] > 0 and record["memory_gib"] > 0


def test_hf_in_trains_and_hf_out_loads_back(tmp_path):
    from autopar.models import to_hf

    model = Qwen(get_flavor("qwen2.5", "debug", **TINY_MODEL))
    model.init_weights(seed=9)
    to_hf(model, tmp_path / "start")
    job = tiny_job(
        tmp_path / "run",
        "--checkpoint.initial_load_path",
        str(tmp_path / "start"),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
        "--optimizer.lr",
        "0",
        name="qwen2.5",
    )
    train(job)
    exported = from_hf(tmp_path / "run" / "hf" / "step-5")
    for (name, before), (_, after) in zip(model.named_parameters(), exported.named_parameters()):
        torch.testing.assert_close(after, before, rtol=0, atol=0, msg=name)  # lr 0: unchanged


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_lr_warms_up_then_decays_to_the_floor(decay_type):
    cfg = LRScheduler(warmup_steps=10, decay_type=decay_type, min_lr_factor=0.1)
    factors = [lr_factor(s, cfg, 100) for s in range(1, 101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[9:]))
    assert factors[-1] == pytest.approx(0.1)


def test_wsd_holds_the_peak_until_the_decay_phase():
    cfg = LRScheduler(warmup_steps=10, decay_ratio=0.2, decay_type="linear")
    assert lr_factor(80, cfg, 100) == 1.0
    assert lr_factor(90, cfg, 100) == pytest.approx(0.5)
    assert lr_factor(100, cfg, 100) == pytest.approx(0.0)


def test_a_warmup_longer_than_the_run_is_cut_to_the_run():
    cfg = LRScheduler(warmup_steps=200, decay_type="linear")
    assert [lr_factor(s, cfg, 4) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_hf_export_casts_to_the_export_dtype(tmp_path):
    from safetensors.torch import load_file

    job = tiny_job(
        tmp_path,
        "--checkpoint.last_save_in_hf",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--training.steps",
        "2",
    )
    trainer = one_process_trainer(job)
    trainer.train()
    exported = load_file(tmp_path / "hf" / "step-2" / "model.safetensors")
    for name, param in trainer.parts[0].named_parameters():
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        assert exported[hf_name].dtype == torch.bfloat16
        assert torch.equal(exported[hf_name], param.detach().to(torch.bfloat16)), name


def test_a_step_with_no_learned_token_says_so_in_its_line_its_record_and_the_summary(tmp_path, caplog):
    # answers of one token after prompts longer than a row: most 2 x 32-token batches learn nothing
    talk = {
        "messages": [{"role": "user", "content": "tell me " * 40}, {"role": "assistant", "content": "ok"}]
    }
    (tmp_path / "chat.jsonl").write_text((json.dumps(talk) + "\n") * 8)
    caplog.set_level("INFO", logger="autopar")
    data = ("--training.dataset_path", str(tmp_path / "chat.jsonl"), "--training.steps", "8")
    one_process_trainer(chat_job(tmp_path / "run", *data)).train()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    nothing = [r["step"] for r in records if r.get("no_learned_tokens")]
    assert 0 < len(nothing) < 8 and all(
        r["no_learned_tokens"] is True for r in records if r["step"] in nothing
    )
    assert all((r["loss"] == 0) == (r["step"] in nothing) for r in records)
    said = [r.getMessage() for r in caplog.records]
    marked = [int(m.split()[1]) for m in said if m.endswith("(no learned token in this step)")]
    assert marked == nothing
    assert sum("no learned token in this step's batch" in m for m in said) == 1  # explained once
    assert f", {len(nothing)} with no learned token (loss 0) |" in said[-1]
