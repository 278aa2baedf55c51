"""``[parallelism] auto = true``: the planner fills in the plan settings a job leaves open, before
anything is built, and the run's own measurements land beside the prediction in
``<dump_folder>/plan.json``, so every real run is a calibration point for the planner."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from autopar.config.errors import ConfigError
from autopar.config.parse import explicit_keys
from autopar.config.sections import JobConfig
from autopar.planner.devices import DeviceSpec
from autopar.planner.machine import auto_probe, probed_device
from autopar.planner.profile import DeviceProfile
from autopar.planner.search import Plan, no_fit_message, pinned_fields, search
from autopar.planner.verify import Verified, first_built
from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import model_args

AUTO_VERIFY_TRIES = 3
"""Plans auto dry-runs, best first, before it gives up."""


def auto_job(
    job: JobConfig,
    argv: list[str],
    world_size: int,
    device_type: str,
    gpus_per_node: int,
    probe: Callable[[torch.device, int], DeviceProfile] = auto_probe,
    cache: Path | None = None,
) -> tuple[JobConfig, Plan, DeviceSpec, list[Verified]]:
    """The job with the best plan that fits this machine's devices, built by its dry run first
    unless ``parallelism.auto_verify`` is off (the dry runs made come back for the log);
    ConfigError when none fits or builds. The devices' figures are this machine's, measured
    by ``probe`` once and cached (``planner/machine.py``; ``cache`` overrides the folder), so
    a device without a preset is planned with its own figures, never another's. Every rank
    of a node computes the same answer."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    here = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    device = probed_device(here, world_size, gpus_per_node, probe, cache)
    pinned = pinned_fields(job, *explicit_keys(argv))
    args = model_args(job)
    plans = search(job, args, world_size, gpus_per_node, device, pinned, device_type, keep=AUTO_VERIFY_TRIES)
    if not plans[0].fits:
        raise ConfigError(no_fit_message(plans[0], device, world_size, pinned))
    best: Plan | None = plans[0]
    made: list[Verified] = []
    if job.parallelism.auto_verify:
        fitting = [p for p in plans if p.fits]
        best, made = first_built(fitting, AUTO_VERIFY_TRIES, job, args, world_size, device)
    if best is None:
        reasons = "; ".join(f"{v.plan.describe()}: {v.error or 'does not fit as measured'}" for v in made)
        raise ConfigError(
            f"parallelism.auto: none of the {len(made)} best plans built by its dry run ({reasons}); "
            "pin plan settings, or set --parallelism.auto_verify false to train the predicted best"
        )
    return copy.deepcopy(best.settings.apply(job)), best, device, made


def write_plan(path: Path, plan: Plan, device: DeviceSpec, world_size: int) -> None:
    """The prediction, before the run."""
    spec = {k: v for k, v in dataclasses.asdict(device).items() if k != "profile"}
    profile = device.profile.to_json() if device.profile else None
    record = {"world_size": world_size, "device": spec, "device_profile": profile, "plan": plan.to_json()}
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


def measured_line(plan: Plan, measured: dict[str, float], path: Path) -> str:
    """The run's last word on its plan: predicted beside measured throughput and peak."""
    error = plan.tokens_per_s / measured["tokens_per_s"] - 1
    return (
        f"auto plan: predicted {plan.tokens_per_s:,.0f} tokens/s per device, measured "
        f"{measured['tokens_per_s']:,.0f} ({100 * error:+.0f}%); peak predicted {plan.peak_gib:.2f} GiB, "
        f"measured {measured['peak_gib']:.2f} GiB ({path})"
    )
