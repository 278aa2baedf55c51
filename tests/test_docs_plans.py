"""The planner page's examples (docs/planner.md): each shown best plan is the planner's answer today, and it
builds: its dry run at one layer per pipeline stage and one micro-batch per pipeline rank (the
same stage roles and schedule; ``--verify`` measures the full plan, in minutes)."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from autopar.cli.plan import split_options
from autopar.config import JobConfig
from autopar.config.parse import explicit_keys
from autopar.parallel.pipelining.schedule import num_stages
from autopar.planner.devices import device_spec
from autopar.planner.dry_run import dry_run
from autopar.planner.search import pinned_fields, search
from autopar.training.preflight import check_job
from autopar.training.resolve import derive_job, model_args, parse_job

ROOT = Path(__file__).resolve().parents[1]


def shown_plans() -> list[tuple[list[str], list[str]]]:
    """(planner argv, best plan's flags) of every docs/planner.md example that shows a best plan."""
    blocks = (ROOT / "docs" / "planner.md").read_text().split("```")[1::2]
    found = []
    for block in blocks:
        if "run the best plan with:" not in block:
            continue
        command = re.search(r"\$ python -m autopar\.plan (.*?)\n(?!\s{4})", block, re.S)
        assert command, block[:200]
        argv = shlex.split(command.group(1).replace("\\\n", " "))
        flags = block.split("run the best plan with:\n")[1].splitlines()[0].split()
        found.append((argv, flags))
    return found


SHOWN = shown_plans()


def test_the_planner_page_shows_best_plans():
    assert len(SHOWN) >= 2


@functools.cache
def best_plan(argv: tuple[str, ...]) -> tuple[JobConfig, list[str], int]:
    """(the job, the planner's best plan as flags, world size) of a shown planner command;
    searched once for both tests."""
    options, job_argv = split_options(
        [a if not a.startswith("train_configs") else str(ROOT / a) for a in argv]
    )
    job = parse_job(job_argv)
    world = int(options["--world-size"])
    device = device_spec(str(options.get("--device", "h100")), options.get("--gpu-memory-gib"))
    pinned = pinned_fields(job, *explicit_keys(job_argv))
    best = search(job, model_args(job), world, int(options.get("--gpus-per-node", 8)), device, pinned)[0]
    return job, best.overrides, world


def shown(heavy_from_world: int):
    """SHOWN as parameters; examples of ``heavy_from_world`` GPUs or more are marked heavy."""
    return [
        pytest.param(
            argv,
            flags,
            id=" ".join(argv[:4]),
            marks=[pytest.mark.heavy]
            if int(argv[argv.index("--world-size") + 1]) >= heavy_from_world
            else [],
        )
        for argv, flags in SHOWN
    ]


@pytest.mark.slow
@pytest.mark.parametrize("argv, flags", shown(heavy_from_world=64))  # 32B on 64: a 20 s search
def test_the_documented_best_plan_is_the_planners_answer(argv, flags):
    assert best_plan(tuple(argv))[1] == flags


@pytest.mark.slow
@pytest.mark.parametrize("argv, flags", shown(heavy_from_world=8))
def test_the_documented_best_plan_builds(argv, flags):
    """Its dry run at one layer per pipeline stage and one micro-batch per pipeline rank: half
    a minute (8B on 8) to a minute and a half (32B on 64) here, so heavy. In the default run
    the planner's answer is checked above, plans of both shapes are built by test_planner's
    grid (FSDP over 8 ranks of 8B) and its pp x cp x tp stage-role test."""
    job, _, world = best_plan(tuple(argv))
    chosen = derive_job(job, [f.removeprefix("--") for f in flags])
    stages = num_stages(chosen.parallelism, model_args(chosen).num_hidden_layers)
    chosen.model.num_hidden_layers = max(2, stages)
    if chosen.parallelism.pipeline_parallel_degree > 1:
        micro = chosen.parallelism.pipeline_parallel_microbatch_size
        chosen.training.local_batch_size = micro * chosen.parallelism.pipeline_parallel_degree
        chosen.training.global_batch_size = -1
    ranks = dry_run(chosen, check_job(chosen, world, "cuda"), world)
    assert ranks and all(r.measured_peak_gib > 0 for r in ranks)
