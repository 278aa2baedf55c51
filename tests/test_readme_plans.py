"""The README's "Which plan?" examples: each shown best plan is the planner's answer today, and it
builds: its dry run at one layer per pipeline stage and one micro-batch per pipeline rank (the
same stage roles and schedule; ``--verify`` measures the full plan, in minutes)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from autopar.config.parse import explicit_keys
from autopar.job import derive_job, model_args, parse_job
from autopar.pipelining.schedule import num_stages
from autopar.plan import split_options
from autopar.planner.devices import device_spec
from autopar.planner.dry_run import dry_run
from autopar.planner.search import pinned_fields, search
from autopar.validate import validate

ROOT = Path(__file__).resolve().parents[1]


def shown_plans() -> list[tuple[list[str], list[str]]]:
    """(planner argv, best plan's flags) of every README example that shows a best plan."""
    blocks = (ROOT / "README.md").read_text().split("```")[1::2]
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


def test_the_readme_shows_best_plans():
    assert len(SHOWN) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("argv, flags", SHOWN, ids=[" ".join(a[:4]) for a, _ in SHOWN])
def test_the_readme_best_plan_is_the_planners_answer_and_builds(argv, flags):
    options, job_argv = split_options(
        [a if not a.startswith("train_configs") else str(ROOT / a) for a in argv]
    )
    job = parse_job(job_argv)
    world = int(options["--world-size"])
    device = device_spec(str(options.get("--device", "h100")), options.get("--gpu-memory-gib"))
    pinned = pinned_fields(job, *explicit_keys(job_argv))
    best = search(job, model_args(job), world, int(options.get("--gpus-per-node", 8)), device, pinned)[0]
    assert best.overrides == flags
    chosen = derive_job(job, [f.removeprefix("--") for f in flags])
    stages = num_stages(chosen.parallelism, model_args(chosen).num_hidden_layers)
    chosen.model.num_hidden_layers = max(2, stages)
    if chosen.parallelism.pipeline_parallel_degree > 1:
        micro = chosen.parallelism.pipeline_parallel_microbatch_size
        chosen.training.local_batch_size = micro * chosen.parallelism.pipeline_parallel_degree
        chosen.training.global_batch_size = -1
    ranks = dry_run(chosen, validate(chosen, world, "cuda"), world)
    assert ranks and all(r.measured_peak_gib > 0 for r in ranks)
