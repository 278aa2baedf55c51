"""``[parallelism] auto = true``: the planner fills in the plan settings a job leaves open, before
anything is built, and the run's own measurements land beside the prediction in
``<dump_folder>/plan.json``, so every real run is a calibration point for the planner."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from pathlib import Path

from autopar.config.errors import ConfigError
from autopar.config.job import JobConfig
from autopar.config.parse import explicit_keys
from autopar.job import model_args
from autopar.metrics import read_metrics
from autopar.planner.devices import DeviceSpec, this_machine
from autopar.planner.search import Plan, no_fit_message, pinned_fields, search, with_settings


def auto_job(
    job: JobConfig, argv: list[str], world_size: int, device_type: str, gpus_per_node: int
) -> tuple[JobConfig, Plan, DeviceSpec]:
    """The job with the best plan that fits this machine's devices; ConfigError when none does."""
    device = this_machine(device_type, gpus_per_node)
    pinned = pinned_fields(job, *explicit_keys(argv))
    plans = search(job, model_args(job), world_size, gpus_per_node, device, pinned, device_type)
    best = plans[0]
    if not best.fits:
        raise ConfigError(no_fit_message(best, device, world_size, pinned))
    return copy.deepcopy(with_settings(job, best.settings)), best, device


def write_plan(path: Path, plan: Plan, device: DeviceSpec, world_size: int) -> None:
    """The prediction, before the run."""
    record = {"world_size": world_size, "device": dataclasses.asdict(device), "plan": plan.to_json()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


def record_measured(path: Path, metrics_path: Path, logged: int) -> dict[str, float]:
    """Add the run's measured peak memory and tokens/s per GPU (median over its logged steps
    after the first, which includes warm-up) to ``plan.json``; the run logged the last
    ``logged`` rows of ``metrics.jsonl``. Returns the measured figures."""
    rows = read_metrics(metrics_path)[-logged:] if metrics_path.is_file() and logged else []
    if not rows:
        return {}
    steady = rows[1:] or rows
    measured = {
        "peak_gib": max(r["memory_gib"] for r in rows),  # max allocated on CUDA, max RSS on CPU
        "tokens_per_s": statistics.median(r["tps"] for r in steady),
        "steps_logged": len(rows),
    }
    record = json.loads(path.read_text())
    record["measured"] = measured
    path.write_text(json.dumps(record, indent=2))
    return measured
