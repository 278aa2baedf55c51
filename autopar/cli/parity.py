"""Plan parity: run one job under several parallel plans and compare each step's loss and
gradient norm with single-device eager, from the same weights on the same data.

    python -m autopar.parity --job.config train_configs/debug_model.toml \\
        --plans "dp_shard=2" "tp=2" "dp_shard=2,tp=2" --steps 5 [--rtol 1e-5]

A plan is comma-separated ``key=value``: the degrees ``dp_replicate, dp_shard, tp, cp, pp,
ep`` (unset ones are 1; ``ep`` borrows from dp_shard x cp), ``sp`` and ``loss_parallel`` (true/false), or any job field
(``compile.enable=true``). Plans of the same world size share one process group. Exits 1
if any step of any plan differs by more than the tolerance.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from dataclasses import dataclass

from autopar.cli.log import quiet, setup_logging
from autopar.config.errors import ConfigError
from autopar.config.parse import to_toml
from autopar.config.sections import JobConfig
from autopar.training.preflight import check_job
from autopar.training.resolve import derive_job, parse_job, short_run

logger = logging.getLogger("autopar")

SHORT_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "sp": "parallelism.enable_sequence_parallel",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "lb": "parallelism.context_parallel_load_balancer",
}
_DEGREES = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")


@dataclass(frozen=True)
class PlanRun:
    plan: str
    world_size: int
    losses: list[float]
    grad_norms: list[float]


class PlanFailed(AssertionError):
    """A plan's ranks failed or crashed: the check that reads its numbers fails with their text."""


@dataclass(frozen=True)
class FailedRun:
    """A plan whose ranks raised or died; reading its numbers raises ``PlanFailed``, so each
    check of it fails on its own while the other plans of its group are checked."""

    plan: str
    world_size: int
    text: str

    @property
    def losses(self) -> list[float]:
        raise PlanFailed(f"plan {self.plan!r} failed on its ranks:\n{self.text}")

    @property
    def grad_norms(self) -> list[float]:
        return self.losses


def plan_overrides(plan: str) -> list[str]:
    """A plan's ``key=value`` items as job overrides: short keys expanded, unset degrees 1."""
    overrides = [f"{SHORT_KEYS[key]}=1" for key in _DEGREES]
    for item in filter(None, (s.strip() for s in plan.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"plan {plan!r}: item {item!r} is not key=value")
        key, value = key.strip(), value.strip()
        if key == "loss_parallel":
            key, value = "parallelism.disable_loss_parallel", str(value.lower() != "true")
        overrides.append(f"{SHORT_KEYS.get(key, key)}={value}")
    return overrides


def plan_job(base: JobConfig, plan: str, steps: int, dump_folder: str) -> JobConfig:
    """``base`` with the plan's settings, logging every step, no checkpoints."""
    job = short_run(derive_job(base, plan_overrides(plan)), steps)
    job.metrics.log_freq = 1
    job.job.dump_folder = dump_folder
    return job


def world_size(job: JobConfig) -> int:
    degrees = job.parallelism
    return (
        degrees.data_parallel_replicate_degree
        * degrees.data_parallel_shard_degree
        * degrees.tensor_parallel_degree
        * degrees.context_parallel_degree
        * degrees.pipeline_parallel_degree
    )


def run_job(job: JobConfig) -> tuple[list[float], list[float]]:
    """Train ``job`` on the current process group (or alone); per-step losses and grad norms."""
    from autopar.parallel.world import init_world
    from autopar.training.trainer import Trainer

    world = init_world()
    records = Trainer(job, check_job(job, world.size), world).train()
    return [r.loss for r in records], [r.grad_norm for r in records]


def run_plan(plan: str, job: JobConfig) -> PlanRun:
    """Train ``job`` under ``plan`` on this rank's process group (or alone)."""
    with quiet():
        losses, norms = run_job(job)
    return PlanRun(plan, world_size(job), losses, norms)


def run_plans(jobs: list[tuple[str, JobConfig]], size: int) -> list[PlanRun | FailedRun]:
    """Each (plan, job) in turn: in this process for one rank, else on ``size`` spawned ranks
    sharing one process group, where a plan whose ranks fail or crash is a ``FailedRun``
    and fresh ranks go on with the plans after it."""
    from autopar.cli.spawn import RankFailure, run_each_on_ranks

    if size == 1:
        return [_in_this_process(run_plan, plan, job) for plan, job in jobs]
    outcomes = run_each_on_ranks(run_plan, size, jobs)
    return [
        FailedRun(plan, size, outcome.text) if isinstance(outcome, RankFailure) else outcome[0]
        for (plan, _), outcome in zip(jobs, outcomes, strict=True)
    ]


@dataclass(frozen=True)
class Case:
    """One plan applied to one base job; cases with equal base jobs share a reference run."""

    base: JobConfig
    plan: str


def run_cases(cases: list[Case], steps: int) -> list[tuple[PlanRun, PlanRun | FailedRun]]:
    """(single-device reference, plan run) per case. All plans of one world size run in one
    process group, whatever their base job; every job is validated before anything runs."""
    with tempfile.TemporaryDirectory(prefix="autopar-parity-") as tmp:
        keyed = [
            (to_toml(c.base), plan_job(c.base, c.plan, steps, f"{tmp}/case{i}")) for i, c in enumerate(cases)
        ]
        references: dict[str, JobConfig] = {}
        for case, (key, _) in zip(cases, keyed):
            if key not in references:
                dps = [_dp(job) for k, job in keyed if k == key]
                reference = plan_job(case.base, "", steps, f"{tmp}/reference{len(references)}")
                reference.training.global_batch_size = _common_global_batch(case.base, dps)
                references[key] = reference
        jobs = []
        for case, (key, job) in zip(cases, keyed):
            job.training.global_batch_size = references[key].training.global_batch_size
            try:
                check_job(job, world_size(job))
            except ConfigError as err:
                raise ConfigError(f"plan {case.plan!r}: {err}") from None
            jobs.append((key, job))
        reference_runs = {}
        for key, job in references.items():
            losses, norms = _in_this_process(run_job, job)
            reference_runs[key] = PlanRun("single device", 1, losses, norms)
        by_size: dict[int, list[int]] = {}
        for i, (_, job) in enumerate(jobs):
            by_size.setdefault(world_size(job), []).append(i)
        runs: dict[int, PlanRun | FailedRun] = {}
        for size, indices in sorted(by_size.items()):
            runs.update(zip(indices, run_plans([(cases[i].plan, jobs[i][1]) for i in indices], size)))
    return [(reference_runs[jobs[i][0]], runs[i]) for i in range(len(cases))]


def _in_this_process(fn, *args):  # type: ignore[no-untyped-def]
    """``fn(*args)`` here, leaving no process group behind: a one-process run makes one where
    FSDP needs it (CPU offload), and the caller's next fake or real group must start clean."""
    import torch.distributed as dist

    had_group = dist.is_initialized()
    try:
        return fn(*args)
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()


def _dp(job: JobConfig) -> int:
    return job.parallelism.data_parallel_replicate_degree * job.parallelism.data_parallel_shard_degree


def _common_global_batch(base: JobConfig, dps: list[int]) -> int:
    """The global batch a base job's plans share: the job's own, else local batch x the
    least common multiple of the plans' data-parallel degrees."""
    if base.training.global_batch_size > 0:
        return base.training.global_batch_size
    return base.training.local_batch_size * math.lcm(*dps)


def relative_deltas(values: list[float], reference: list[float]) -> list[float]:
    return [abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)]


def report(reference: PlanRun, runs: list[PlanRun | FailedRun], rtol: float) -> tuple[str, bool]:
    """A table of the largest per-step relative deltas; whether every plan is within rtol (a
    plan whose ranks failed says so, and why, beneath the table)."""
    header = f"{'plan':32} {'ranks':>5} {'max rel d(loss)':>16} {'max rel d(grad norm)':>21}  verdict"
    lines = [header, "-" * len(header)]
    lines.append(
        f"{reference.plan:32} {1:>5} {'(reference)':>16} {'':>21}  losses "
        + " ".join(f"{x:.5f}" for x in reference.losses)
    )
    ok, failures = True, []
    for run in runs:
        if isinstance(run, FailedRun):
            ok = False
            lines.append(f"{run.plan:32} {run.world_size:>5} {'(ranks failed)':>16} {'':>21}  FAIL")
            failures.append(f"\n{run.plan}: {run.text}")
            continue
        d_loss = max(relative_deltas(run.losses, reference.losses))
        d_norm = max(relative_deltas(run.grad_norms, reference.grad_norms))
        passed = d_loss <= rtol and d_norm <= rtol and len(run.losses) == len(reference.losses)
        ok &= passed
        lines.append(
            f"{run.plan:32} {run.world_size:>5} {d_loss:>16.2e} {d_norm:>21.2e}  {'ok' if passed else 'FAIL'}"
        )
    return "\n".join(lines + failures), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--plans", nargs="+", required=True, help='e.g. "dp_shard=2" "tp=2,sp=false"')
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance per step")
    known, job_argv = parser.parse_known_args(argv)
    setup_logging(0)
    try:
        with quiet():
            base = parse_job(job_argv)
            pairs = run_cases([Case(base, plan) for plan in known.plans], known.steps)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    table, ok = report(pairs[0][0], [run for _, run in pairs], known.rtol)
    print(table)
    print(f"\nall plans within rtol {known.rtol:g} of single device" if ok else "\nPARITY FAILED")
    return 0 if ok else 1


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
