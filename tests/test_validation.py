"""``[validation]``: a held-out loss under the training plan, equal to evaluating the same
weights on the same data by hand, and the same under every plan."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autopar.cli.parity import run_plans
from autopar.config import ConfigError
from autopar.data.tokenizer import build_tokenizer
from autopar.data.tokens import BUILTIN_DATASETS, load_tokens
from autopar.parallel.world import single_process
from autopar.training.metrics.logger import read_metrics
from autopar.training.preflight import check_job
from autopar.training.trainer import Trainer

from jobs import one_process_trainer, tiny_job

HELD_OUT = BUILTIN_DATASETS["autopar_corpus"] / "c_everyday.txt"


def val_records(folder) -> list[dict]:
    return [r for r in read_metrics(folder / "metrics.jsonl") if "val_loss" in r]


def validation_job(folder, *flags: str):
    return tiny_job(
        folder,
        "--training.steps",
        "4",
        "--validation.enable",
        "true",
        "--validation.dataset_path",
        str(HELD_OUT),
        "--validation.freq",
        "2",
        *flags,
    )


def test_val_loss_equals_evaluating_the_same_weights_on_the_same_data(tmp_path):
    job = validation_job(tmp_path, "--validation.local_batch_size", "1")
    trainer = one_process_trainer(job)
    trainer.train()
    records = val_records(tmp_path)
    assert [r["step"] for r in records] == [2, 4]
    tokens = load_tokens(HELD_OUT, build_tokenizer(None))
    seq = job.training.seq_len
    windows = [tokens[k * seq : k * seq + seq + 1] for k in range((tokens.size - 1) // seq)]
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    with torch.no_grad():
        logits = trainer.parts[0](batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()
    assert records[-1]["val_tokens"] == batch[:, 1:].numel()
    assert records[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert records[0]["val_loss"] != records[-1]["val_loss"]  # the weights moved in between


def test_validation_leaves_training_untouched(tmp_path):
    plain = Trainer(
        job := tiny_job(tmp_path / "a", "--training.steps", "4"), check_job(job, 1), single_process()
    )
    checked = Trainer(job := validation_job(tmp_path / "b"), check_job(job, 1), single_process())
    assert [r.loss for r in checked.train()] == [r.loss for r in plain.train()]


PLANS = {
    "fsdp": ("--parallelism.data_parallel_shard_degree", "2", "--validation.steps", "2"),
    "tp": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"),
    "pp": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"),
    "cp": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"),
}
"""Two ranks each; every plan validates the same 8 held-out sequences (FSDP: 2 steps of 2 x 2)."""


@pytest.fixture(scope="module")
def plan_val_losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("val")
    same = (
        "--training.global_batch_size",
        "4",
        "--validation.local_batch_size",
        "2",
        "--validation.steps",
        "4",
    )
    reference = validation_job(tmp / "one", *same)
    one_process_trainer(reference).train()
    jobs = [
        (
            plan,
            validation_job(tmp / plan, *same, *flags),
        )
        for plan, flags in PLANS.items()
    ]
    ran = {run.plan: run for run in run_plans(copy.deepcopy(jobs), 2)}
    return val_records(tmp / "one"), {plan: (ran[plan], val_records(tmp / plan)) for plan in PLANS}


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_val_loss_under_a_plan_equals_one_device(plan_val_losses, plan):
    reference, runs = plan_val_losses
    run, records = runs[plan]
    assert run.losses  # a plan whose ranks failed raises here, with their text
    assert [r["step"] for r in records] == [2, 4]
    for ours, theirs in zip(records, reference):
        assert ours["val_tokens"] == theirs["val_tokens"]
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)


HELD_OUT_PP2 = (
    *("--validation.dataset_path", str(HELD_OUT)),
    *("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
)
"""Validation on the held-out file under a two-stage pipeline."""


@pytest.mark.parametrize(
    "flags, message",
    [
        ((), "validation.enable=true needs validation.dataset_path"),
        (
            ("--validation.dataset_path", "/nonexistent"),
            "validation.dataset_path='/nonexistent': no such file",
        ),
        (("--validation.dataset", "c4_validation"), "validation.dataset='c4_validation' is not built in"),
        (
            ("--validation.dataset_path", str(HELD_OUT), "--validation.freq", "0"),
            "validation.freq=0 must be >= 1",
        ),
        (
            (*HELD_OUT_PP2, "--validation.local_batch_size", "4"),
            "validation.local_batch_size=4 and seq_len=32 under pipeline_parallel_degree=2",
        ),
        (  # torch's eval of a V schedule runs its backward actions: the run died at its first validation
            (
                *HELD_OUT_PP2,
                *("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"),
                *("--validation.local_batch_size", "2"),
            ),
            "validation.enable=true under parallelism.pipeline_parallel_schedule='ZBVZeroBubble': it needs a "
            "forward-only pass",
        ),
        (
            (
                "--validation.dataset_path",
                str(HELD_OUT),
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--validation.seq_len",
                "30",
            ),
            "^validation.seq_len=30 is not divisible by 4 = 2 x context_parallel_degree=2",
        ),
    ],
)
def test_bad_validation_settings_are_refused_naming_the_field(tmp_path, flags, message):
    job = tiny_job(tmp_path, "--validation.enable", "true", *flags)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        check_job(job, 2)


def test_held_out_data_smaller_than_one_batch_is_refused_before_the_model_is_built(
    tmp_path, model_never_built
):
    from autopar.data.errors import DataError

    job = validation_job(tmp_path, "--validation.local_batch_size", "100000")
    with pytest.raises(
        DataError, match=r"fewer than one batch .* = 100000; .* lower validation.local_batch_size"
    ):
        one_process_trainer(job)
    assert not (tmp_path / "metrics.jsonl").exists()
