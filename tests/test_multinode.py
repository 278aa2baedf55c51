"""Several nodes, tested on one machine: two ``torchrun --nnodes 2`` launchers meeting at a c10d
rendezvous on localhost, as two machines would (docs/multinode.md), train as one device does,
and resume under another plan; a launch whose ranks per node are not the plan's is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopar.cli.train import main
from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import parse_job

from jobs import TINY_FLAGS, assert_fp32_parity, free_port, one_process_trainer

ROOT = Path(__file__).resolve().parents[1]
JOB = ("--job.config", str(ROOT / "train_configs" / "debug_model.toml"), *TINY_FLAGS)
STEPS = (
    *("--training.global_batch_size", "4", "--metrics.log_freq", "1"),
    *("--checkpoint.enable", "true", "--checkpoint.interval", "3", "--lr_scheduler.min_lr_factor", "1"),
)
"""Four sequences a step (one micro-step of 2 on each of 2 data-parallel ranks, or two of 2 on
one device); a learning rate that does not decay, so a run of 3 steps resumed to 5 is one of 5."""
REPLICATE_ACROSS_NODES_TP_WITHIN = (
    *("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    *("--parallelism.tensor_parallel_degree", "2"),
)
HSDP_SHARD_WITHIN_NODES = (
    *("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"),
    *("--training.local_batch_size", "1"),
)


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]


def launch_two_nodes(dump: Path, *flags: str, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Two launchers of two ranks each, node 0 hosting the rendezvous, as on two machines
    (there: the same command with --rdzv-endpoint naming node 0's host)."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launchers = []
    for node in (0, 1):
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)),
            *("--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
            *(
                "--rdzv-id",
                "two-nodes",
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "--local-addr",
                "127.0.0.1",
            ),
            *("train.py", *JOB),
            *("--job.dump_folder", str(dump), *flags),
        ]
        launchers.append(
            subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for launcher in launchers:
        out, err = launcher.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err))
    return results


@pytest.mark.slow
def test_two_nodes_train_as_one_device_and_resume_under_another_plan(tmp_path):
    dump = tmp_path / "two_nodes"
    first = launch_two_nodes(dump, *STEPS, "--training.steps", "3", *REPLICATE_ACROSS_NODES_TP_WITHIN)
    assert all(r.returncode == 0 for r in first), first[0].stderr[-3000:] + first[1].stderr[-3000:]
    assert (dump / "checkpoint" / "step-3" / ".metadata").is_file()
    second = launch_two_nodes(dump, *STEPS, "--training.steps", "5", *HSDP_SHARD_WITHIN_NODES)
    assert all(r.returncode == 0 for r in second), second[0].stderr[-3000:] + second[1].stderr[-3000:]
    assert "resumed from" in second[0].stderr + second[1].stderr

    records = read_metrics(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    one_device = parse_job(
        [*JOB, *STEPS, "--training.steps", "5", "--job.dump_folder", str(tmp_path / "one")]
    )
    reference = one_process_trainer(one_device).train()
    # fp32, 5 steps, two plans: only the order of sums differs from one device
    assert_fp32_parity(
        Run([r["loss"] for r in records], [r["grad_norm"] for r in records]),
        Run([r.loss for r in reference], [r.grad_norm for r in reference]),
    )


def test_a_launch_of_other_ranks_per_node_than_planned_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nproc_per_node 2
    argv = [*JOB, "--job.dump_folder", str(tmp_path / "out")]
    assert main([*argv, "--parallelism.gpus_per_node", "8"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "config error: parallelism.gpus_per_node=8 (the planner's --gpus-per-node), but this launch runs "
        "LOCAL_WORLD_SIZE=2 ranks per node (torchrun --nproc_per_node); launch 8 per node, or plan again "
        "with python -m autopar.plan --gpus-per-node 2"
    )
    assert not (tmp_path / "out").exists()
