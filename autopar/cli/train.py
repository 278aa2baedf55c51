"""Train a Qwen model: ``[torchrun --nproc_per_node=N] -m autopar.train --job.config FILE
[--section.field VALUE ...]`` (also ``autopar-train``, or the repository's ``train.py``). FILE
is a TOML path or the name of a preset shipped in ``autopar/train_configs`` (``qwen3_8b``).

``--dry-run --world-size N`` builds the job for N GPUs under fake tensors and a fake process
group on this machine, runs one step per distinct rank role and reports its peak memory.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.cli.log import setup_logging, warn_if_untested_torch
from autopar.cli.probe import machine_probe
from autopar.config import ConfigError, JobConfig, help_text, to_toml
from autopar.data import DataError
from autopar.models.args import ModelArgs
from autopar.parallel.world import init_world, ranks_per_node_from_env, world_size_from_env
from autopar.planner.auto import auto_job, measured_line, record_measured, write_plan
from autopar.planner.devices import DeviceSpec
from autopar.planner.dry_run import compare, report, title, write_dry_run
from autopar.planner.search import Plan
from autopar.planner.verify import Verified
from autopar.training.checkpointing.previous_run import check_previous_run, write_config
from autopar.training.checkpointing.run_lock import dump_folder_lock
from autopar.training.faults import TrainingStopped, end_with_launcher, tell_launcher
from autopar.training.preflight import check_job, check_nodes
from autopar.training.resolve import parse_job
from autopar.training.trainer import Trainer


def _dry_run_flags(argv: list[str]) -> tuple[list[str], int | None]:
    """argv without ``--dry-run --world-size N``, and N (None when not a dry run)."""
    if "--dry-run" not in argv:
        return argv, None
    rest = [a for a in argv if a != "--dry-run"]
    if "--world-size" not in rest or rest.index("--world-size") + 1 >= len(rest):
        raise ConfigError("--dry-run needs --world-size N: the number of GPUs to simulate")
    i = rest.index("--world-size")
    value = rest[i + 1]
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--world-size {value!r} must be a positive integer")
    return rest[:i] + rest[i + 2 :], int(value)


def dry_run_main(argv: list[str], world_size: int) -> int:
    job = parse_job(argv)
    args = check_job(job, world_size, device_type="cuda")
    setup_logging(0)
    warn_if_untested_torch()
    ranks = compare(job, args, world_size)
    print(title(job, world_size))
    print(report(ranks))
    path = Path(job.job.dump_folder) / "dry_run.json"
    write_dry_run(path, ranks)
    print(f"wrote {path}")
    return 0


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    end_with_launcher()
    try:
        argv, dry_world = _dry_run_flags(argv)
        if dry_world is not None:
            return dry_run_main(argv, dry_world)
        job = parse_job(argv)
        auto: tuple[Plan, DeviceSpec, list[Verified]] | None = None
        if job.parallelism.auto:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            gpus_per_node = ranks_per_node_from_env() or 1
            job, plan, device, verified = auto_job(
                job, argv, world_size_from_env(), device_type, gpus_per_node, machine_probe
            )
            auto = (plan, device, verified)
        if job.job.print_config:
            print(to_toml(job))
            return 0
        args = check_job(job, world_size_from_env())
        check_nodes(job, world_size_from_env(), ranks_per_node_from_env())
        check_previous_run(job, args)  # what an earlier run in the dump folder left
    except ConfigError as err:
        return _refuse("config error", err)
    try:
        with ExitStack() as held:
            if os.environ.get("RANK", "0") == "0":  # the first rank speaks for the job
                held.enter_context(dump_folder_lock(Path(job.job.dump_folder)))
            return _run(job, args, auto)
    except ConfigError as err:
        return _refuse("config error", err)


def _run(job: JobConfig, args: ModelArgs, auto: tuple[Plan, DeviceSpec, list[Verified]] | None) -> int:
    """Join the world, build this rank's part of the job and train it; the exit code."""
    try:
        world = init_world(job.comm.init_timeout_seconds)
    except dist.DistError as err:  # every rank says so: the one that is missing cannot
        rank = os.environ.get("RANK", "0")
        timeout = job.comm.init_timeout_seconds
        message = f"rank {rank}: not every rank joined within comm.init_timeout_seconds={timeout}: {err}"
        print(f"comm error: {message}", file=sys.stderr)
        tell_launcher(f"comm error: {message}")
        return 1
    setup_logging(world.rank)
    if world.is_main:
        warn_if_untested_torch()
    dump = Path(job.job.dump_folder)
    try:
        trainer = Trainer(job, args, world)
        if world.is_main:  # the resolved job, runnable as is: --job.config <dump_folder>/config.toml
            write_config(job, trainer.checkpointer.resume_candidate())
        if auto and world.is_main:
            _announce_auto(*auto, dump, world.size)
        records = trainer.train()
    except DataError as err:
        return _refuse("data error", err)
    except TrainingStopped as err:
        logging.getLogger("autopar").error("training stopped: %s", err)
        tell_launcher(f"training stopped: {err}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if auto and world.is_main:
        measured = record_measured(dump / "plan.json", dump / "metrics.jsonl", len(records))
        if measured:
            logging.getLogger("autopar").info(measured_line(auto[0], measured, dump / "plan.json"))
    return 0


def _announce_auto(
    plan: Plan, device: DeviceSpec, verified: list[Verified], dump: Path, world_size: int
) -> None:
    """Log the plan parallelism.auto chose (and its dry runs) and write plan.json."""
    log = logging.getLogger("autopar")
    for i, result in enumerate(verified, 1):
        log.info("auto plan dry run %s", "\n".join(result.lines(i)))
    log.info(
        "auto plan: %s; predicted peak %.1f GiB of %.1f, %.0f tokens/s per device",
        plan.describe(),
        plan.peak_gib,
        device.memory_gib,
        plan.tokens_per_s,
    )
    write_plan(dump / "plan.json", plan, device, world_size)


REFUSAL_GRACE_S = 5.0
"""How long a rank other than the first waits before it says a refusal itself."""


def _refuse(kind: str, err: object) -> int:
    """Print ``kind: err``; the exit code of bad input. Under torchrun every rank usually
    finds the same mistake: the first says it at once, the others wait ``REFUSAL_GRACE_S``
    first, so torchrun (which ends the others when one exits) ends them before they repeat
    it, and never ends the first before it spoke. A mistake only another rank finds (a file
    missing on one node) is said by that rank after the wait, naming it."""
    launched = "MASTER_ADDR" in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    rank = os.environ.get("RANK", "0")
    line = f"{kind}: {err}" if rank == "0" or not launched else f"{kind}: rank {rank}: {err}"
    if rank != "0" and launched:
        time.sleep(REFUSAL_GRACE_S)
    print(line, file=sys.stderr, flush=True)
    tell_launcher(line)
    return 2


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
