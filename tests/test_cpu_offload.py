"""``training.enable_cpu_offload``: FSDP2 keeps the master weights, their gradients and AdamW's
state in host memory, on one rank too, and training is unchanged by it. (On a CPU machine the
host is the device, so what these tests can see is the mechanism and the numbers; the GPU
memory it saves is the planner's and the dry run's to show.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from autopar.cli.parity import Case, run_cases
from autopar.parallel.materialize import seeded_values
from autopar.parallel.mesh import ParallelDims, build_meshes
from autopar.parallel.parallelize import build_parts
from autopar.planner.devices import PRESETS
from autopar.planner.memory import predict
from autopar.planner.search import evaluate
from autopar.training.preflight import check_plan
from autopar.training.resolve import model_args, parse_job

from jobs import assert_fp32_parity, moe_job, tiny_job, train_py

ROOT = Path(__file__).resolve().parents[1]
OFFLOAD = "training.enable_cpu_offload=true"
PLANS = [f"dp_shard=2,{OFFLOAD}", f"tp=2,{OFFLOAD}", f"pp=2,{OFFLOAD}"]


def test_offload_hands_every_weight_to_fsdp_in_host_memory_on_one_rank(tmp_path):
    job = tiny_job(tmp_path, "--training.enable_cpu_offload", "true")
    args = model_args(job)
    try:
        meshes = build_meshes(ParallelDims.resolve(job.parallelism, 1), "cpu", always_fsdp=True)
        built = build_parts(
            args, job, meshes, torch.device("cpu"), seeded_values(args, 0, torch.device("cpu"))
        )
        groups = [
            m._get_fsdp_state()._fsdp_param_group
            for m in built.parts[0].modules()
            if isinstance(m, FSDPModule)
        ]
        groups = [g for g in groups if g is not None]
        managed = {id(p.sharded_param) for g in groups for p in g.fsdp_params}
        assert managed >= {id(p) for p in built.parts[0].parameters()}
        assert all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
    finally:
        dist.destroy_process_group()


def _losses(folder) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _train(folder, *flags: str) -> str:
    """train.py's log of the tiny job in ``folder``."""
    out = subprocess.run(train_py(folder, *flags), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.slow
def test_one_process_with_offload_trains_like_one_device_and_resumes_without_it(tmp_path):
    flags = ["--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    flags += ["--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]
    _train(tmp_path / "plain", *flags)
    _train(tmp_path / "offload", *flags, "--training.enable_cpu_offload", "true")
    assert _losses(tmp_path / "offload") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-6)
    shutil.rmtree(tmp_path / "offload" / "checkpoint" / "step-4")  # as if it died after step 2
    resumed = _train(tmp_path / "offload", *flags)  # without offload
    assert "resumed from" in resumed and "step-2" in resumed
    assert _losses(tmp_path / "offload") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-6)


MOE_PLAN = f"dp_shard=2,ep=2,{OFFLOAD}"  # the experts' own FSDP group offloads too


@pytest.fixture(scope="module")
def offload_parity(tmp_path_factory):
    """plan -> (one device, plan run): the dense plans and a mixture of experts under EP, in
    one process group."""
    dense, moe = tiny_job(tmp_path_factory.mktemp("dense")), moe_job(tmp_path_factory.mktemp("moe"))
    cases = [Case(dense, plan) for plan in PLANS] + [Case(moe, MOE_PLAN)]
    return dict(zip([*PLANS, MOE_PLAN], run_cases(cases, steps=4), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("plan", [*PLANS, MOE_PLAN])
def test_offload_under_a_plan_matches_one_device(offload_parity, plan):
    reference, run = offload_parity[plan]
    assert_fp32_parity(run, reference)


def test_the_planner_moves_weights_gradients_and_optimizer_state_to_the_host():
    flags = ["--model.flavor=8B", "--training.seq_len=4096", "--training.local_batch_size=1"]
    plain_job, offload_job = parse_job(flags), parse_job([*flags, "--training.enable_cpu_offload=true"])
    plain = predict(model_args(plain_job), plain_job, 8)[0]
    offload = predict(model_args(offload_job), offload_job, 8)[0]
    host = {"params", "optimizer", "grads"}
    assert set(offload.host) == host and not host & set(offload.parts)
    assert offload.parts == {k: v for k, v in plain.parts.items() if k not in host}


def test_qwen3_8b_fits_one_h100_only_with_offload_and_pays_for_it_in_time():
    preset = [
        "--job.config",
        str(ROOT / "train_configs" / "qwen3_8b.toml"),
        "--activation_checkpoint.mode=full",
    ]
    plans = {}
    for offload in ("false", "true"):
        job = parse_job([*preset, f"--training.enable_cpu_offload={offload}"])
        args = model_args(job)
        plans[offload] = evaluate(args, job, check_plan(job, args, 1, "cuda"), PRESETS["h100"], 8)
    assert not plans["false"].fits and plans["true"].fits
    assert plans["true"].time.host_optimizer > 0 and "host" in plans["true"].time.comm_by_dim


def test_the_plan_command_says_how_much_host_memory_offload_takes():
    flags = ["--world-size", "1", "--top", "1", "--training.enable_cpu_offload", "true"]
    out = subprocess.run(
        [sys.executable, "-m", "autopar.plan", "--job.config", "train_configs/qwen3_8b.toml", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # 8.19B fp32 weights, their gradients and two AdamW moments: 16 bytes a parameter
    host = float(re.search(r"CPU offload keeps ([\d.]+) GiB per GPU in host memory", out.stdout).group(1))
    assert host == pytest.approx(8.19e9 * 16 / 2**30, rel=0.01)
