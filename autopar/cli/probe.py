"""Measure this machine for the planner: ``[torchrun --nproc-per-node N] -m autopar.probe
[--output FILE] [--cache] [--job.config FILE [--section.field VALUE ...]]`` (also
``autopar-probe``).

Times matmuls in float32 and bfloat16 (and float8 on GPUs with FP8 tensor cores) at a few
sizes and, with a job, at that job's own GEMM shapes; a large copy on the device; host-to-GPU
copies (CUDA only); and, under torchrun (NCCL on GPUs, gloo on CPU), all-gather,
reduce-scatter, all-reduce, all-to-all and send/recv per group size at a few message sizes.
Writes the device profile as JSON to ``--output`` (default ``device_profile.json``) and, with
``--cache``, where ``parallelism.auto`` looks for this machine's profile. Plan with it:
``python -m autopar.plan --device-profile FILE``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.cli.spawn import run_on_ranks
from autopar.config import ConfigError
from autopar.config.checks import check_output_file
from autopar.planner.machine import cache_path
from autopar.planner.probe import (
    CPU_MESSAGES,
    CUDA_MESSAGES,
    probe_collectives,
    probe_fsdp_call,
    probe_plan_overheads,
    run_probe,
)
from autopar.planner.profile import COLLECTIVES, DeviceProfile, gemm_shapes
from autopar.training.resolve import model_args, parse_job


def _options(argv: list[str]) -> tuple[Path, bool, list[str]]:
    """(--output, --cache, the job's flags)."""
    output, cache, rest = Path("device_profile.json"), False, []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name == "--output":
            value = value if eq else next(args, "")
            if not value:
                raise ConfigError("--output needs a file name: --output device_profile.json")
            output = Path(value)
        elif arg == "--cache":
            cache = True
        else:
            rest.append(arg)
    return output, cache, rest


STEP_BATCH = 4
"""Sequences in the probe's larger timed step of the job's whole model (at most the job's
local batch): enough rows that its elementwise work, not its dispatch, sets the time. It is
timed at one sequence too, a pipeline's smallest micro-batch."""


def job_shapes(job_argv: list[str]) -> tuple[list, list, list, tuple | None]:
    """The job's linears (m, n, k), attention (batch, heads, seq, head_dim[, cp]) and, for a hybrid
    model, gated delta rule (batch, seq, key heads, value heads, dk, dv) at its micro-batch,
    and its model step (arguments, batches, seq, compiled); none without a job's flags (``--job.config``
    or any ``--section.field``)."""
    if not job_argv:
        return [], [], [], None
    job = parse_job(job_argv)
    args, batch, seq = model_args(job), job.training.local_batch_size, job.training.seq_len
    gemms = sorted({(m, n, k) for m, n, k, _ in gemm_shapes(args, batch * seq)})
    # one sequence and the local batch: a pipeline's micro-batches run between the two, and a
    # small call's kernels run far below a large one's; the recurrence at half the sequence
    # too, what each rank runs under CP 2
    # and as an all-gather CP rank of two calls it (CP's default on a CPU)
    attention = [
        (b, args.num_attention_heads, seq, args.head_dim, *cp)
        for b in sorted({1, batch})
        for cp in ((), (2,))
    ]
    heads = (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim)
    recurrence = [
        (b, s, *heads, args.linear_value_head_dim)
        for b in sorted({1, batch})
        for s in sorted({seq // 2, seq})
        if args.hybrid and s
    ]
    step_batches = tuple(sorted({1, min(batch, STEP_BATCH)}))
    return gemms, attention, recurrence, (args, step_batches, seq, job.compile.enable)


def describe(profile: DeviceProfile) -> str:
    """A few lines a person reads: the device, the best matmul per dtype, the bandwidths."""
    lines = [
        f"{profile.device} ({profile.device_type}), torch {profile.torch}, "
        f"world {profile.world_size} ({profile.local_world_size} per node)"
    ]
    for dtype in sorted({p.dtype for p in profile.matmul}):
        best = max((p for p in profile.matmul if p.dtype == dtype), key=lambda p: p.flops_per_s)
        lines.append(
            f"  matmul {dtype:9} up to {best.flops_per_s / 1e12:8.3f} TFLOP/s ({best.m}x{best.n}x{best.k})"
        )
    for dtype in sorted({a.dtype for a in profile.attention}):
        best = max((a for a in profile.attention if a.dtype == dtype), key=lambda a: a.flops_per_s)
        lines.append(
            f"  attention {dtype:6} up to {best.flops_per_s / 1e12:8.3f} TFLOP/s (seq {best.seq}, fwd+bwd)"
        )
    for a in (a for a in profile.attention if a.cp > 1):
        lines.append(
            f"  attention {a.dtype:6} {a.flops_per_s / 1e12:8.3f} TFLOP/s as CP rank of {a.cp} "
            f"({a.batch} x {a.seq} tokens, fwd+bwd)"
        )
    for r in profile.recurrence:
        lines.append(f"  delta rule {r.dtype:5} {r.flops_per_s / 1e12:8.3f} TFLOP/s (seq {r.seq}, fwd+bwd)")
    lines.append(f"  elementwise     {profile.memory_bytes_per_s / 1e9:8.1f} GB/s")
    for m in profile.model_steps:
        mode = "compiled" if m.compiled else "eager"
        lines.append(
            f"  job's model     {m.seconds * 1e3:8.1f} ms a step ({m.batch} x {m.seq} tokens, {m.dtype}, {mode})"
        )
    host = "n/a (CPU)" if profile.host_bytes_per_s is None else f"{profile.host_bytes_per_s / 1e9:.1f} GB/s"
    lines.append(f"  host -> device  {host}")
    if profile.op_overhead_s is not None:
        per_op = [("eager", profile.op_overhead_s), *profile.plan_op_overhead_s]
        lines.append("  per op          " + ", ".join(f"{plan} {s * 1e6:.1f} us" for plan, s in per_op))
    if profile.fsdp_call_s is not None:
        lines.append(f"  FSDP per call   {profile.fsdp_call_s * 1e3:.2f} ms beyond its traffic")
    if profile.checkpoint_op_overhead_s:
        lines.append(
            "  per op, checkpointed "
            + ", ".join(f"{mode} {s * 1e6:.1f} us" for mode, s in profile.checkpoint_op_overhead_s)
        )
    for op in COLLECTIVES:
        best = [c for c in profile.collectives if c.op == op]
        if best:
            top = max(best, key=lambda c: c.bus_bytes_per_s)
            lines.append(f"  {op:15} up to {top.bus_bytes_per_s / 1e9:8.2f} GB/s bus (group {top.group})")
    if not profile.collectives:
        lines.append("  collectives: not measured (one process; run under torchrun to measure them)")
    return "\n".join(lines)


def _collectives_on_rank() -> tuple[list, tuple]:
    """This rank's part of the collectives probe and of the plans' per-op overheads
    (``run_on_ranks`` has joined the group)."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    messages = CUDA_MESSAGES if device.type == "cuda" else CPU_MESSAGES
    return (
        probe_collectives(device, messages, COLLECTIVES),
        probe_plan_overheads(device),
        probe_fsdp_call(device),
    )


def machine_probe(device: torch.device, local_world: int) -> DeviceProfile:
    """What ``parallelism.auto`` probes on the first local rank before any process group
    exists: this device, and the collectives among ``local_world`` processes it starts for
    them (the same backend training uses)."""
    profile = run_probe(device, local_world=local_world)
    if local_world < 2:
        return profile
    points, overheads, fsdp_call = run_on_ranks(_collectives_on_rank, local_world, timeout_s=300)[0]
    return dataclasses.replace(
        profile,
        collectives=tuple(points),
        plan_op_overhead_s=overheads,
        fsdp_call_s=fsdp_call,
        world_size=local_world,
    )


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        output, cache, job_argv = _options(argv)
        check_output_file(output, "--output", "device_profile.json")
        shapes, attention, recurrence, step = job_shapes(job_argv)
    except ConfigError as err:
        print(f"probe error: {err}", file=sys.stderr)
        return 2
    from autopar.parallel.world import init_world, single_process

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    world = init_world() if launched else single_process("cuda" if torch.cuda.is_available() else "cpu")
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        kernel = parse_job(job_argv).training.delta_rule_kernel if job_argv else "auto"
        profile = run_probe(
            world.device, shapes, COLLECTIVES if launched else (), local, attention, recurrence, step, kernel
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if world.rank == 0:
        profile.save(output)
        print(describe(profile))
        print(f"wrote {output}")
        if cache:
            path = cache_path(profile.device, profile.world_size, profile.local_world_size)
            profile.save(path)
            print(f"cached for parallelism.auto at {path}")
    return 0


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
