"""Benchmark one job under several variants (eager, compiled, FP8, AC...) in one invocation.

    python -m autopar.bench --job.config train_configs/qwen3_0.6b.toml \\
        --variants eager compiled fp8 [--nproc 1] [--warmup 3] [--steps 10] [--json out.json]

Each variant runs in fresh processes (so peak memory and compile caches are its own), trains
``warmup + steps`` optimizer steps, and is timed on the median of the last ``steps``. The
table gives tokens/s per device, MFU, peak memory and the speed ratio to the first variant;
each variant's steps go to ``<job.dump_folder>/bench/<variant>/metrics.jsonl`` so that
``python -m autopar.plot`` overlays their loss curves.
A variant is a name below or ``name:key=value,...`` with any job field
(``fp8_rowwise:float8.enable=true,float8.recipe=rowwise,compile.enable=true``), and
``nproc=N`` to run that variant on its own number of processes
(``cp4:nproc=4,parallelism.context_parallel_degree=4``). The variant
``torchtitan`` (or ``torchtitan:key=value,...``) runs torchtitan's trainer on the same job
(``bench_torchtitan``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from autopar.cli.bench_torchtitan import check_torchtitan_job, torchtitan_on_rank, write_torchtitan_job
from autopar.config.checks import check_output_file
from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.parallel.mesh import ParallelDims
from autopar.training.metrics.flops import flops_per_token, mfu_percent
from autopar.training.preflight import check_job
from autopar.training.resolve import derive_job, model_args, parse_job, short_run

TORCHTITAN_VARIANT = "torchtitan"
NAMED_VARIANTS = {
    "eager": "compile.enable=false,float8.enable=false",
    "compiled": "compile.enable=true,float8.enable=false",
    "fp8": "compile.enable=true,float8.enable=true,float8.backend=torchao",
    "fp8_eager": "compile.enable=false,float8.enable=true,float8.backend=torchao",
    "fp8_te": "compile.enable=false,float8.enable=true,float8.backend=te",
    "ac_none": "compile.enable=true,activation_checkpoint.mode=none",
    "ac_full": "compile.enable=true,activation_checkpoint.mode=full",
    "ac_op": "compile.enable=true,activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=op",
    "chunked_loss": "compile.enable=true,float8.enable=false,training.loss_chunk_tokens=4096",
    "experts_grouped": "compile.enable=true,training.expert_kernel=grouped",
    "experts_loop": "compile.enable=true,training.expert_kernel=loop",
    "cpu_offload": "compile.enable=true,float8.enable=false,training.enable_cpu_offload=true",
    "attn_flash": "compile.enable=true,float8.enable=false,training.sdpa_backend=flash",
    "attn_efficient": "compile.enable=true,float8.enable=false,training.sdpa_backend=efficient",
    "attn_cudnn": "compile.enable=true,float8.enable=false,training.sdpa_backend=cudnn",
    "attn_math": "compile.enable=true,float8.enable=false,training.sdpa_backend=math",
    "fla": "compile.enable=true,float8.enable=false,training.delta_rule_kernel=fla",
    "triton": "compile.enable=true,float8.enable=false,training.delta_rule_kernel=triton",
    "delta_rule_autopar": "compile.enable=true,float8.enable=false,training.delta_rule_kernel=autopar",
    "fla_fp8": "compile.enable=true,float8.enable=true,float8.backend=torchao,training.delta_rule_kernel=fla",
    "lora": "compile.enable=true,float8.enable=false,lora.enable=true",
    "lora_eager": "compile.enable=false,float8.enable=false,lora.enable=true",
    "lora_fp8": "compile.enable=true,float8.enable=true,float8.backend=torchao,lora.enable=true",
}
"""Each name is shorthand for its overrides; everything else comes from the job."""


@dataclass
class VariantResult:
    variant: str
    overrides: str
    nproc: int
    step_seconds: float
    tokens_per_second_per_device: float
    mfu: float | None
    peak_memory_gib: float
    first_loss: float
    """Loss of step 1: same weights and data in every variant, so it should agree closely."""
    final_loss: float


@dataclass
class Variant:
    name: str
    overrides: str
    job: JobConfig
    nproc: int


def variant_job(base: JobConfig, spec: str, steps: int, nproc: int) -> Variant:
    """A variant spec's job (writing under ``bench/<name>``) and process count (``nproc``
    unless the spec sets its own)."""
    name, _, overrides = spec.partition(":")
    if not overrides and name != TORCHTITAN_VARIANT:
        if name not in NAMED_VARIANTS:
            raise ConfigError(
                f"variant {name!r} is unknown; use one of {list(NAMED_VARIANTS)} or name:key=value,..."
            )
        overrides = NAMED_VARIANTS[name]
    fields = [item for item in overrides.split(",") if item and not item.startswith("nproc=")]
    for item in overrides.split(","):
        if item.startswith("nproc="):
            value = item.partition("=")[2]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"variant {spec!r}: nproc={value!r} must be a whole number >= 1")
            nproc = int(value)
    try:
        job = short_run(derive_job(base, fields), steps)
    except ConfigError as err:
        raise ConfigError(f"variant {spec!r}: {err}") from None
    job.metrics.log_freq = steps + 1
    job.job.dump_folder = str(Path(base.job.dump_folder) / "bench" / name)
    return Variant(name, overrides, job, nproc)


def _bench_on_rank(job: JobConfig, warmup: int) -> dict:
    from autopar.parallel.world import init_world
    from autopar.training.metrics.flops import peak_memory_gib
    from autopar.training.trainer import Trainer

    world = init_world()
    logging.getLogger("autopar").setLevel(logging.WARNING)  # the table says it; the steps go to metrics.jsonl
    trainer = Trainer(job, check_job(job, world.size), world)
    trainer.metrics.forget_after(0)  # each bench starts the variant's file afresh
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    times, losses, tokens = [], [], []
    for _ in range(job.training.steps):
        start = time.perf_counter()
        outcome, norm_t = trainer.run_step()
        losses.append(outcome.loss.item())  # waits for the step, so the timer sees all of it
        times.append(time.perf_counter() - start)
        tokens.append(  # packed pairs: steps differ in size
            int(outcome.tokens)
            if outcome.tokens is not None
            else trainer.loader.global_batch * job.training.seq_len
        )
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        trainer.metrics.record(trainer.step, losses[-1], norm_t.item(), lr, 1, times[-1], bool(trainer.bad))
    return {
        "step_seconds": statistics.median(times[warmup:]),
        "peak_memory_gib": peak_memory_gib(world.device),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "tokens_per_step": statistics.mean(tokens[warmup:]),
        "peak_flops": trainer.metrics.peak,
        "flops_per_token": trainer.metrics.flops_per_token,
        "device": torch.cuda.get_device_name(world.device)
        if world.device.type == "cuda"
        else platform.processor() or "cpu",
    }


def run_variant(name: str, job: JobConfig, nproc: int, warmup: int) -> list[dict]:
    from autopar.cli.spawn import run_on_ranks

    if name != TORCHTITAN_VARIANT:
        return run_on_ranks(_bench_on_rank, nproc, job, warmup)
    ranks = run_on_ranks(torchtitan_on_rank, nproc, str(write_torchtitan_job(job)), warmup)
    training, dims = job.training, ParallelDims.resolve(job.parallelism, nproc)
    sequences = training.global_batch(dims.dp)
    args = model_args(job)
    for rank in ranks:  # what ours reports from its own trainer, for the same job
        rank["tokens_per_step"] = sequences * training.seq_len
        rank["flops_per_token"] = flops_per_token(args, job.training.seq_len, job.lora.enable)
    return ranks


def summarize(name: str, overrides: str, ranks: list[dict], nproc: int) -> VariantResult:
    r0 = ranks[0]
    step = max(r["step_seconds"] for r in ranks)
    tps = r0["tokens_per_step"] / step / nproc
    mfu = mfu_percent(tps, r0["flops_per_token"], r0["peak_flops"])
    memory = max(r["peak_memory_gib"] for r in ranks)
    return VariantResult(name, overrides, nproc, step, tps, mfu, memory, r0["first_loss"], r0["final_loss"])


def source_commit() -> str:
    """The commit the benchmarked code comes from, ``+dirty`` when it has uncommitted
    changes (figures from such a run do not belong in BENCHMARKS.md). ``AUTOPAR_SOURCE_COMMIT``
    wins where the sender of a copied tree (a GPU machine's, whose ``.git`` may be older than
    the files) sets it; ``unknown`` outside git."""
    if "AUTOPAR_SOURCE_COMMIT" in os.environ:
        return os.environ["AUTOPAR_SOURCE_COMMIT"]
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def table(results: list[VariantResult]) -> str:
    base = results[0].tokens_per_second_per_device
    header = (
        f"{'variant':14} {'ranks':>5} {'tokens/s/dev':>13} {'MFU':>7} {'peak mem':>10} {'step ms':>9} "
        f"{'vs ' + results[0].variant:>12} {'loss@1':>8} {'loss@end':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        mfu = "n/a" if r.mfu is None else f"{r.mfu:.1f}%"
        lines.append(
            f"{r.variant:14} {r.nproc:>5} {r.tokens_per_second_per_device:>13,.0f} {mfu:>7} {r.peak_memory_gib:>8.2f}GiB "
            f"{1000 * r.step_seconds:>9.1f} {r.tokens_per_second_per_device / base:>11.2f}x "
            f"{r.first_loss:>8.4f} {r.final_loss:>9.4f}"
        )
    return "\n".join(lines)


def parse_bench_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the benchmark's own options, the job's flags)."""
    parser = argparse.ArgumentParser(
        prog="python -m autopar.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--variants", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    known, job_argv = parse_bench_args(argv)
    from autopar.cli.log import setup_logging

    setup_logging(0)
    try:
        base, jobs = _checked_variants(known, job_argv)
        if known.json:  # before the variants run, not after
            check_output_file(Path(known.json), "--json", "bench.json")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    results, device = [], "cpu"
    curves = [str(Path(v.job.job.dump_folder) / "metrics.jsonl") for v in jobs]
    command = " ".join(["python -m autopar.bench"] + (argv if argv is not None else sys.argv[1:]))
    for v in jobs:
        ranks = run_variant(v.name, v.job, v.nproc, known.warmup)
        device = ranks[0]["device"]
        results.append(summarize(v.name, v.overrides, ranks, v.nproc))
        if known.json:  # after each variant: a run cut off by a time limit keeps the rows it has
            payload = {
                "device": device,
                "nproc": known.nproc,
                "torch": torch.__version__,
                "commit": source_commit(),
                "command": command,
                "results": [asdict(r) for r in results],
                "metrics": curves[: len(results)],
            }
            Path(known.json).parent.mkdir(parents=True, exist_ok=True)
            Path(known.json).write_text(json.dumps(payload, indent=2))
    print(
        f"device: {device}, torch {torch.__version__}, "
        f"seq_len {base.training.seq_len}, timed steps {known.steps} after {known.warmup} warm-up"
    )
    print(table(results))
    needs = "" if importlib.util.find_spec("matplotlib") else " (needs matplotlib: pip install matplotlib)"
    print(f"loss curves: python -m autopar.plot {' '.join(curves)} -o bench_loss.png{needs}")
    return 0


def _checked_variants(known: argparse.Namespace, job_argv: list[str]) -> tuple[JobConfig, list[Variant]]:
    """The base job and every variant, each checked before any runs."""
    for flag, value, least in (
        ("--steps", known.steps, 1),
        ("--warmup", known.warmup, 0),
        ("--nproc", known.nproc, 1),
    ):
        if value < least:
            raise ConfigError(f"{flag} {value} must be >= {least}")
    base = parse_job(job_argv)
    jobs = [variant_job(base, spec, known.warmup + known.steps, known.nproc) for spec in known.variants]
    names = [v.name for v in jobs]
    if len(set(names)) < len(names):
        raise ConfigError(f"variants {names} repeat a name; give each its own (name:key=value,...)")
    for v in jobs:
        try:
            check_job(v.job, v.nproc)
            if v.name == TORCHTITAN_VARIANT:
                check_torchtitan_job(v.job)
        except ConfigError as err:
            raise ConfigError(f"variant {v.name!r}: {err}") from None
    return base, jobs


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
