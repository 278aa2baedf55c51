"""Qwen3.5's multi-token-prediction head under context parallelism equals one device (issue 55).

A CP rank holds parts of each sequence (two ranges of it, head-tail), but the head at position
i reads token i+1 and learns token i+2, which at a range's end lie in another rank's part, and
under packed documents whether token i+1 is of i's document: the step builds those on the whole
sequences and splits them as the tokens (``LanguageModel.per_position``), and the head's attention
gathers k/v as the trunk's. Each case trains two steps on two gloo ranks (all-gather CP,
the one that runs on CPU) and once on one device, from the same weights on the same data, and
compares every step's loss, gradient norm, ``mtp_loss`` and ``mtp_acceptance``, the held-out
ones, and the first step's gradients.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_mtp_training import MOE, head_job, text_head_job

from autopar.cli.parity import plan_job, world_size
from autopar.config.sections import JobConfig
from autopar.data.chat import CHAT_EXAMPLE
from autopar.training.metrics.logger import read_metrics

from jobs import FP32_LOSS_RTOL, FP32_NORM_RTOL, Crashed, each_on_ranks, one_process_trainer

STEPS = 2
HELD_OUT = (
    *("--validation.enable", "true", "--validation.dataset_path", str(CHAT_EXAMPLE)),
    *("--validation.local_batch_size", "2", "--validation.steps", "2", "--validation.freq", str(STEPS)),
)
"""Validation after the last step, on the shipped conversations (packed as the training rows)."""
FAST_HEAD = ("--mtp.only", "true", "--optimizer.lr", "0.05", "--lr_scheduler.warmup_steps", "1")
"""The head alone at a high rate: it accepts some targets from the second step on (measured
1-4%), so an acceptance counted at the wrong positions shows."""
CASES = {
    "documents": (head_job, HELD_OUT, "cp=2"),
    "documents-in-order-head-only": (head_job, FAST_HEAD, "cp=2,lb=none"),
    "one-document-detached": (text_head_job, ("--mtp.detach", "true"), "cp=2"),
}
"""The shipped conversations packed as documents (``training.document_masking``: documents
start inside ranges and cross ranks), head-tail with validation and in order training the head
alone; and plain text, one causal sequence per row, the head detached."""
HEAVY_CASES = {
    "documents-fsdp": (head_job, (), "cp=2,dp_shard=2"),
    "documents-tp": (head_job, (), "cp=2,tp=2"),
    "documents-moe-fsdp": (functools.partial(head_job, **MOE), (), "cp=2,dp_shard=2"),
}
"""CP over FSDP and under tensor parallelism with sequence and loss parallel (four ranks), and
a mixture's head over FSDP (its router's counts summed over the CP ranks with the trunk's)."""
METRICS = (
    "loss",
    "grad_norm",
    "mtp_loss",
    "mtp_acceptance",
    "val_loss",
    "val_mtp_loss",
    "val_mtp_acceptance",
)


def train_recording_gradients(trainer) -> dict[str, np.ndarray]:
    """Train ``trainer`` (collective); the first step's gradients as the optimizer sees them,
    whole, by parameter (as arrays: a tensor would pass to a parent process by a handle into
    the exiting child)."""
    from torch.distributed.tensor import DTensor

    from autopar.models.qwen import canonical_name

    steps = []
    named = list(trainer.parts[0].named_parameters())

    def record(*_: object) -> None:
        if steps:
            return
        steps.append(
            {
                canonical_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                .numpy()
                .copy()
                for n, p in named
                if p.grad is not None
            }
        )

    (optimizer,) = trainer.optimizers
    optimizer.register_step_pre_hook(record)
    trainer.train()
    return steps[0]


def train_plan(job: JobConfig) -> dict[str, np.ndarray]:
    """``train_recording_gradients`` of ``job`` on this rank's process group."""
    from autopar.parallel.world import init_world
    from autopar.training.preflight import check_job
    from autopar.training.trainer import Trainer

    world = init_world()
    return train_recording_gradients(Trainer(job, check_job(job, world.size), world))


def cp_runs(folder, cases: dict) -> dict[str, tuple[tuple, tuple]]:
    """case -> ((one device's metrics by name, its first step's gradients), (the plan's)),
    the plans in one process group."""
    plans, references = [], []
    for i, (build, flags, plan) in enumerate(cases.values()):
        base = build(folder / f"base{i}", *flags)
        job = plan_job(base, plan, STEPS, str(folder / f"plan{i}"))
        reference = plan_job(base, "", STEPS, str(folder / f"reference{i}"))
        dp = job.parallelism.data_parallel_replicate_degree * job.parallelism.data_parallel_shard_degree
        reference.training.global_batch_size = job.training.global_batch_size = (
            dp * base.training.local_batch_size
        )
        plans.append(job)
        references.append(reference)
    (size,) = {world_size(job) for job in plans}
    plan_grads = each_on_ranks(train_plan, size, [(job,) for job in plans])
    runs = {}
    for case, job, reference, grads in zip(cases, plans, references, plan_grads):
        reference_grads = train_recording_gradients(one_process_trainer(reference))
        ran = grads if isinstance(grads, Crashed) else (metrics_of(job), grads)
        runs[case] = ((metrics_of(reference), reference_grads), ran)
    return runs


def metrics_of(job: JobConfig) -> dict[str, list[float]]:
    """Every logged value of ``METRICS`` in the job's metrics.jsonl, by name, in step order."""
    records = read_metrics(f"{job.job.dump_folder}/metrics.jsonl")
    return {name: [r[name] for r in records if name in r] for name in METRICS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return cp_runs(tmp_path_factory.mktemp("mtp_cp"), CASES)


@pytest.fixture(scope="module")
def heavy_runs(tmp_path_factory):
    return cp_runs(tmp_path_factory.mktemp("mtp_cp_heavy"), HEAVY_CASES)


GRAD_RTOL = 1e-4
"""fp32, a gradient's largest gap over its largest value: measured at most 2.6e-5; a lost or
doubled term is O(1)."""
DECAY = ("core.A_log", "core.dt_bias", "in_proj_a.weight")
DECAY_RTOL = 1e-2
"""The Gated DeltaNet's decay and its input projection: their fp32 gradients are cancelling
sums (``test_mtp_training.assert_same_grad``) whose order state passing changes: measured
1.7e-3 under CP, 5.7e-4 without the head on the same job, so the trunk's, not the head's."""


def assert_cp_parity(run, reference) -> None:
    """fp32 on CPU, the plan differs from one device in the order of sums only (measured at
    most 6e-7 in the losses, 2.2e-6 in the gradient norm); a head reading a rank's own next
    tokens at a range's end moves ``mtp_loss`` by 1e-3 and more."""
    (metrics, grads), (ref_metrics, ref_grads) = run, reference
    assert len(ref_metrics["mtp_loss"]) == STEPS
    for name, values in ref_metrics.items():
        assert len(metrics[name]) == len(values), name
        rtol = FP32_NORM_RTOL if name == "grad_norm" else FP32_LOSS_RTOL
        if name.endswith("acceptance"):  # a share of ~500 targets: an argmax flipped by a tie is 2e-3
            torch.testing.assert_close(metrics[name], values, rtol=0, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(metrics[name], values, rtol=rtol, atol=0, msg=name)
    # the first step's: later ones differ by 1e-3 in every weight (CP x FSDP), as Adam turns
    # the decay's gap below into a different step for its near-zero gradients (the trunk's)
    assert grads.keys() == ref_grads.keys() and any(n.startswith("mtp.") for n in ref_grads)
    for name, grad in ref_grads.items():
        gap = np.abs(grads[name] - grad).max() / np.abs(grad).max()
        assert gap <= (DECAY_RTOL if name.endswith(DECAY) else GRAD_RTOL), (name, gap)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_head_under_context_parallel_trains_as_on_one_device(runs, case):
    reference, run = runs[case]
    assert_cp_parity(run, reference)


@pytest.mark.heavy
@pytest.mark.parametrize("case", HEAVY_CASES)
def test_the_head_under_context_parallel_with_fsdp_or_tp_trains_as_on_one_device(heavy_runs, case):
    reference, run = heavy_runs[case]
    assert_cp_parity(run, reference)
