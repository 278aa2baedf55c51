"""The GPU sitting script and its tables, proven on CPU before any GPU time is spent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from autopar.cli.bench import parse_bench_args, variant_job
from autopar.cli.bench_tables import tables
from autopar.cli.plan import split_options
from autopar.cli.sitting import PLANS, sit
from autopar.training.preflight import check_plan
from autopar.training.resolve import model_args, parse_job

ROOT = Path(__file__).resolve().parents[1]


def test_a_sitting_records_commit_device_and_each_steps_table(tmp_path):
    sitting = sit("cpu", tmp_path, budget_s=300, only=["debug_bench"])
    record = json.loads((tmp_path / "sitting.json").read_text())
    assert record["commit"] == sitting.commit and len(record["commit"]) >= 40
    assert record["device"] == "cpu"
    (step,) = record["steps"]
    assert step["status"] == "ok", (tmp_path / "sitting.log").read_text()[-2000:]
    (row,) = step["result"]["results"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sitting.json", "sitting.log"]
    markdown = tables(record)
    assert f"| eager | 1 | {row['tokens_per_second_per_device']:,.0f} |" in markdown
    assert f"| {row['first_loss']:.3f} | {row['final_loss']:.3f} |" in markdown  # loss beside speed


def test_a_step_whose_estimate_does_not_fit_the_budget_is_skipped(tmp_path):
    sitting = sit("cpu", tmp_path, budget_s=5)
    assert [s.status for s in sitting.steps] == ["skipped", "skipped"]


def test_tables_reproduce_the_recorded_h100_figures():
    record = json.loads((ROOT / "benchmarks/h100_qwen3_1.7b_bs2.json").read_text())
    markdown = tables(record)
    assert "| compiled | 1 | 36,037 | 47.9% | 45.0 GiB | 227.3 | 1.63x | n/a | 4.628 |" in markdown
    assert "Device NVIDIA H100 80GB HBM3, torch 2.11.0+cu130" in markdown


@pytest.mark.parametrize("step", PLANS["gpu"] + PLANS["planner"], ids=lambda s: s.name)
def test_every_gpu_step_names_what_exists_and_its_jobs_pass_the_cuda_checks(step):
    """A typo in the sitting costs GPU minutes: modules, files and every benchmark variant's
    or planned job are checked here, for CUDA."""
    assert importlib.util.find_spec(step.argv[0]) is not None
    for arg in step.argv:
        if arg.endswith((".py", ".toml")):
            assert (ROOT / arg).exists(), arg
    if step.argv[0] == "autopar.plan":
        options, job_argv = split_options([a for a in step.argv[1:] if a not in ("--json", "{json}")])
        job = parse_job(job_argv)
        check_plan(job, model_args(job), int(options["--world-size"]), "cuda")
    if step.argv[0] != "autopar.bench":
        return
    known, job_argv = parse_bench_args(list(step.argv[1:]))
    for spec in known.variants:
        job = variant_job(parse_job(job_argv), spec, known.warmup + known.steps, known.nproc).job
        check_plan(job, model_args(job), known.nproc, "cuda")
