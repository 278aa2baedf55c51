"""Check the planner's best plans by building them: each plan's dry run (its real parallelized
model and one training step under a fake process group, see ``dry_run.py``) before the
planner answers. A plan whose dry run fails, or whose measured peak with the runtime reserve
does not fit the GPU, is dropped with the reason, so a recommended plan is one that builds."""

from __future__ import annotations

import time
from dataclasses import dataclass

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import resolve_impl
from autopar.planner.devices import DeviceSpec
from autopar.planner.dry_run import RankMemory, compare, dry_run_job
from autopar.planner.memory import GIB, predict
from autopar.planner.search import Plan, runtime_reserve


@dataclass(frozen=True)
class Verified:
    """One plan's dry run: every rank role measured beside its prediction, or why it failed."""

    plan: Plan
    ranks: list[RankMemory]
    error: str | None
    fits: bool
    seconds: float

    @property
    def kept(self) -> bool:
        return self.error is None and self.fits

    def lines(self, index: int) -> list[str]:
        head = f"#{index} {self.plan.describe()}: "
        if self.error is not None:
            return [head + f"dropped, its dry run failed: {self.error}"]
        verdict = "built" if self.fits else "dropped, its measured peak does not fit"
        rows = [head + f"{verdict} ({self.seconds:.0f} s)"]
        for rank in self.ranks:
            rows.append(
                f"    rank {rank.rank:>4} {rank.role:<13} measured {rank.measured_peak_gib:6.2f} GiB, "
                f"predicted {rank.predicted_peak_gib or 0.0:6.2f} GiB (before the runtime reserve)"
            )
        return rows


def verify_plan(plan: Plan, job: JobConfig, args: ModelArgs, world_size: int, device: DeviceSpec) -> Verified:
    """Dry-run ``plan`` and judge its measured peak against the device, with the same runtime
    reserve (CUDA context, NCCL buffers, allocator slack) the prediction carries."""
    start = time.perf_counter()
    planned = plan.settings.apply(job)
    try:
        ranks = compare(planned, args, world_size)
    except Exception as err:  # any failure of the real code path drops the plan
        return Verified(plan, [], _root_cause(err), False, time.perf_counter() - start)
    worst = max(on_the_device(planned, args, world_size, ranks))
    fits = worst + runtime_reserve(worst, plan.dims) <= device.memory_gib * GIB
    return Verified(plan, ranks, None, fits, time.perf_counter() - start)


def on_the_device(job: JobConfig, args: ModelArgs, world_size: int, ranks: list[RankMemory]) -> list[float]:
    """Each rank's measured peak (bytes) as the GPU runs the plan: the dry run's context
    parallelism is the all-gather kind (gloo's), whose step mask (this rank's queries by every
    key) CUDA's ring attention does not hold; the planner's difference between the two is
    taken off (nothing without CP)."""
    measured = [rank.measured_peak_gib * GIB for rank in ranks]
    impl = resolve_impl(job.parallelism, "cuda")
    if job.parallelism.context_parallel_degree == 1 or impl == "allgather":
        return measured
    on_gpu = predict(args, dry_run_job(job), world_size, cp_impl=impl)
    return [
        m + gpu.peak - (rank.predicted_peak_gib or 0.0) * GIB
        for m, gpu, rank in zip(measured, on_gpu, ranks, strict=True)
    ]


def _root_cause(err: BaseException) -> str:
    """The innermost cause's type and first line (a pipeline stage wraps what failed in it)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def first_built(
    plans: list[Plan], tries: int, job: JobConfig, args: ModelArgs, world_size: int, device: DeviceSpec
) -> tuple[Plan | None, list[Verified]]:
    """The first of ``plans`` (best first, at most ``tries``) that builds and fits by its dry
    run, or None, with every dry run made."""
    made = []
    for plan in plans[:tries]:
        made.append(verify_plan(plan, job, args, world_size, device))
        if made[-1].kept:
            return plan, made
    return None, made


TRIES_PER_KEPT = 3
"""How many dry runs ``verify`` may spend per plan it is asked to keep."""


def verify(
    plans: list[Plan], count: int, job: JobConfig, args: ModelArgs, world_size: int, device: DeviceSpec
) -> list[Verified]:
    """Dry runs of ``plans`` (best first) until ``count`` of them build and fit, or
    ``TRIES_PER_KEPT * count`` were tried: a dropped plan's place goes to the next best."""
    made: list[Verified] = []
    for plan in plans[: TRIES_PER_KEPT * count]:
        made.append(verify_plan(plan, job, args, world_size, device))
        if sum(v.kept for v in made) == count:
            break
    return made
