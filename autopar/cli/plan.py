"""Choose a parallel plan before launch: ``python -m autopar.plan --job.config FILE --world-size N
[--gpus-per-node 8] [--device h100 | --device-profile FILE] [--gpu-memory-gib G] [--top 10]
[--json PATH] [--verify K] [--check N [--steps S] [--rounds R]] [--profile-search]
[--section.field VALUE ...]``.

Prints the best plans that fit (degrees, schedule, activation checkpointing, batch, predicted
peak memory and its largest parts, tokens/s per GPU, MFU and where the time goes), the flags
that run the best one, and how the job's own plan compares. Plan settings given as flags are
held fixed. ``--verify K`` dry-runs the K best plans first (``planner/verify.py``), prints each
rank role's measured peak beside the predicted one, and drops any plan that fails to build or
does not fit as measured. ``--device-profile FILE`` plans with the figures
``python -m autopar.probe`` measured instead of a preset's. ``--check N`` then trains the N
best plans for a few steps on this machine (run it under no launcher: it starts
``--world-size`` processes itself) and prints predicted beside measured tokens/s
(``planner_check.py``). The search scores only the candidates whose bounds can reach the
plans shown (``planner/prune.py``; ``--check`` scores every one); ``--profile-search`` prints
how many were scored and pruned, and the search's seconds. Exit 2 with one paragraph when no
plan fits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from autopar.config import ConfigError
from autopar.config.checks import check_output_file, inert_float8
from autopar.config.parse import explicit_keys
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.planner.devices import DeviceSpec, device_spec
from autopar.planner.machine import spec_from_profile
from autopar.planner.params import param_shapes
from autopar.planner.profile import load_profile
from autopar.planner.search import Plan, evaluate, no_fit_message, pinned_fields, search_counted
from autopar.planner.settings import setting_names
from autopar.planner.space import checkpointing_saves_nothing
from autopar.planner.verify import TRIES_PER_KEPT, verify
from autopar.training.preflight import check_plan
from autopar.training.resolve import model_args, model_source, parse_job

MAX_WORLD = 131072
"""The largest world the planner searches (its divisor walk grows with the world size)."""

OPTIONS = {
    "--world-size": int,
    "--gpus-per-node": int,
    "--device": str,
    "--gpu-memory-gib": float,
    "--top": int,
    "--json": str,
    "--verify": int,
    "--device-profile": str,
    "--check": int,
    "--steps": int,
    "--rounds": int,
}
FLAGS = ("--profile-search",)
"""The planner's own options that take no value."""


def split_options(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    """The planner's own options (typed) and the job's flags."""
    found: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if argv[i] in FLAGS:
            found[argv[i]] = True
            i += 1
            continue
        if name in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            try:
                found[name] = OPTIONS[name](value)
            except ValueError:
                raise ConfigError(f"{name} {value!r} is not a valid {OPTIONS[name].__name__}") from None
            i += 1
            continue
        rest.append(argv[i])
        i += 1
    if "--world-size" not in found:
        raise ConfigError("--world-size N is required: the number of GPUs to plan for")
    if "--device" in found and "--device-profile" in found:
        raise ConfigError("give --device (a preset) or --device-profile (a measured machine), not both")
    for name in ("--world-size", "--gpus-per-node", "--top", "--verify", "--check", "--steps", "--rounds"):
        if name in found and found[name] < 1:
            raise ConfigError(f"{name} {found[name]} must be >= 1")
    world, per_node = int(found["--world-size"]), int(found.get("--gpus-per-node", 8))
    if world > MAX_WORLD:
        raise ConfigError(
            f"--world-size {world} is more GPUs than the planner searches; use at most {MAX_WORLD}"
        )
    if world > per_node and world % per_node:
        divisors = [d for d in range(1, per_node + 1) if world % d == 0]
        raise ConfigError(
            f"--gpus-per-node {per_node} does not divide --world-size {world} into whole nodes; "
            f"use one of {divisors} or another world size"
        )
    return found, rest


def table(plans: list[Plan]) -> str:
    experts = any(p.dims.ep > 1 for p in plans)  # a column for expert parallelism when it is used
    parts = ("compute", "exposed_comm", "bubble", "recompute", "host_optimizer", "memory_bound", "overhead")
    head = (
        "| # | dp_rep | dp_shard | tp | cp | pp |"
        + (" ep |" if experts else "")
        + " schedule/mbs | AC | reshard | local batch | peak GiB (largest parts) | tokens/s/GPU | MFU |"
        + " compute/comm/bubble/recompute/host optimizer/memory/op overhead |"
    )
    rows = [head, "|" + "---|" * (14 + experts)]
    for i, p in enumerate(plans, 1):
        d, s = p.dims, p.settings
        pipe = f"{s.schedule}/{s.microbatch}" if d.pp > 1 else "-"
        if d.pp > 1 and s.layers_per_stage is not None:
            pipe += f" ({s.layers_per_stage} layers/stage)"
        largest = sorted(p.memory.gib().items(), key=lambda kv: -kv[1])[:2]
        biggest = ", ".join(f"{k} {v:.1f}" for k, v in largest)
        split = p.time.split() if p.time else {}
        shares = "/".join(f"{100 * split.get(k, 0):.0f}" for k in parts)
        rows.append(
            f"| {i} | {d.dp_replicate} | {d.dp_shard} | {d.tp} | {d.cp} | {d.pp} | "
            + (f"{d.ep} | " if experts else "")
            + f"{pipe} | {s.ac} | "
            f"{s.reshard} | {s.local_batch} | {p.peak_gib:.1f} ({biggest}) | {p.tokens_per_s:,.0f} | "
            f"{100 * p.mfu:.1f}% | {shares} |"
        )
    return "\n".join(rows)


def model_label(job: JobConfig, args: ModelArgs) -> str:
    """The model as the first line names it: its flavor, or, for a config.json (which wins over
    the flavor), the size that config gives, counted from its args."""
    source = model_source(job)
    if not source.endswith("config.json"):
        return f"{job.model.name} {job.model.flavor}"
    total = sum(math.prod(shape) for shape in param_shapes(args).values())
    size = f"{total / 1e9:.3g}B" if total >= 1e9 else f"{total / 1e6:.3g}M"
    return f"{job.model.name} {size} ({source})"


def _wrote_json(path: Path, top: list) -> bool:
    """``--json``: the top plans written, or one line saying why not (checked before the
    search, so this is what changed since: a full disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"plans": [p.to_json() for p in top]}, indent=2))
    except OSError as err:
        print(f"plan error: --json {path}: cannot write it: {err.strerror}", file=sys.stderr)
        return False
    return True


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        options, job_argv = split_options(argv)
        if "--json" in options:  # before the search, not after it
            check_output_file(Path(str(options["--json"])), "--json", "plans.json")
        job = parse_job(job_argv)
        args = model_args(job)
        world = int(options["--world-size"])
        gpus_per_node = int(options.get("--gpus-per-node", 8))
        device = planned_device(options)
        if "--check" in options:  # before the search and the training, not after them
            from autopar.cli.plan_check import check_comparable

            check_comparable(options, device, world)
        pinned = pinned_fields(job, *explicit_keys(job_argv))
        start, cpu = time.perf_counter(), time.process_time()
        searched = search_counted(
            job, args, world, gpus_per_node, device, pinned, device.device_type, plans_needed(options)
        )
    except ConfigError as err:
        print(f"plan error: {err}", file=sys.stderr)
        return 2
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    plans = searched.plans
    fitting = [p for p in plans if p.fits]
    for note in plan_notes(job, options, device, world, pinned):
        print(f"plan note: {note}", file=sys.stderr)
    print(
        f"{model_label(job, args)}, seq_len {job.training.seq_len}, on {world} x {device.name} "
        f"({device.memory_gib:.1f} GiB, {gpus_per_node} per node): {searched.valid} valid plans, "
        f"{searched.scored} scored ({elapsed:.2f} s)"
    )
    if "--profile-search" in options:
        print(
            f"search: {searched.candidates} candidates, {searched.valid} valid, {searched.scored} scored, "
            f"{searched.valid - searched.scored} pruned by their bounds; {elapsed:.2f} s ({cpu:.2f} s of CPU)"
        )
    if "--verify" in options:
        fitting = verified_plans(fitting, int(options["--verify"]), job, args, world, device)
    top = fitting[: int(options.get("--top", 10))]
    if "--json" in options and not _wrote_json(Path(str(options["--json"])), top):
        return 2
    if not top:
        print(no_fit_message(plans[0], device, world, pinned), file=sys.stderr)
        if job.compile.enable:
            print(COMPILED_PEAKS, file=sys.stderr)
        return 2
    print(table(top))
    print(best_plan_lines(job, top[0], world, gpus_per_node))
    print(own_plan_line(job, args, world, gpus_per_node, device, top[0]))
    if "--check" in options:
        from autopar.cli.plan_check import check_plans

        return check_plans(fitting, job, world, options, device)
    return 0


COMPILED_PEAKS = (
    "compile.enable: the blocks are counted as the compiler's partitioner saves them and the loss as "
    "inductor fuses it (loss parallel's stays eager); LoRA's frozen blocks and Gated DeltaNets with "
    "FLA's kernel as eager saves them, a bound (docs/planner.md)"
)
"""What of a compiled job the memory model counts as compiled and what as eager (more)."""


def plans_needed(options: dict[str, object]) -> int | None:
    """How many of the best plans the command shows or dry-runs (``--verify`` may drop some
    and take the next), so the search scores only what can reach them; None (every plan) for
    ``--check``, which picks plans of distinct shapes from anywhere in the ranking."""
    if "--check" in options:
        return None
    return int(options.get("--top", 10)) + TRIES_PER_KEPT * int(options.get("--verify", 0))


def best_plan_lines(job: JobConfig, best: Plan, world: int, gpus_per_node: int) -> str:
    """What to know of the best plan beyond the table, and how to launch it."""
    lines = [f"\n{COMPILED_PEAKS}"] if job.compile.enable else []
    if best.memory.host:
        host = sum(best.memory.host.values()) / 2**30
        lines.append(
            f"\nCPU offload keeps {host:.1f} GiB per GPU in host memory (weights, gradients, AdamW state)"
        )
    lines.append("\nrun the best plan with:\n  " + " ".join(best.overrides))
    if world > gpus_per_node:
        lines.append(
            f"on {world // gpus_per_node} nodes (torchrun --nnodes {world // gpus_per_node} --nproc-per-node "
            f"{gpus_per_node}), with --parallelism.gpus_per_node={gpus_per_node}: a launch of another shape "
            "is then refused before any work (docs/multinode.md)"
        )
    return "\n".join(lines)


def planned_device(options: dict[str, object]) -> DeviceSpec:
    """The device to plan for: a measured profile's, or a preset's (h100 by default), with
    ``--gpu-memory-gib`` replacing its memory."""
    memory = options.get("--gpu-memory-gib")
    if "--device-profile" not in options:
        return device_spec(str(options.get("--device", "h100")), memory)
    device = spec_from_profile(load_profile(Path(str(options["--device-profile"]))))
    if memory is None:
        return device
    checked = device_spec("h100", float(memory))  # the same check as for a preset
    return dataclasses.replace(device, memory_gib=checked.memory_gib)


def plan_notes(
    job: JobConfig, options: dict[str, object], device: DeviceSpec, world: int, pinned: set[str]
) -> list[str]:
    """What to tell the user before the plans: settings that do nothing, figures not measured
    or not modelled."""
    notes = (
        inert_float8(job),
        unmeasured_collectives(options, device, world),
        unmodelled_checkpointing(job, pinned),
    )
    return [note for note in notes if note]


def unmodelled_checkpointing(job: JobConfig, pinned: set[str]) -> str | None:
    """What to say where the job pins a split-backward schedule and checkpointing together
    (the search never pairs them: ``space.checkpointing_saves_nothing``): torch's split backward
    keeps the blocks the input pass recomputed until the weight pass, which the memory model
    does not follow, so the peaks shown can be several times too low."""
    schedule, mode = job.parallelism.pipeline_parallel_schedule, job.activation_checkpoint.mode
    names = setting_names(pinned)
    if not {"schedule", "ac_mode"} <= names or not checkpointing_saves_nothing(schedule, mode, set()):
        return None
    if "pp" in names and job.parallelism.pipeline_parallel_degree == 1:
        return None
    return (
        f"pipeline_parallel_schedule={schedule} with activation_checkpoint.mode={mode}: its peaks are not "
        "modelled (the split backward keeps each recomputed block until its weight pass: a Qwen3.5-27B "
        "stage measured 86.8 GiB where 16.7 was predicted, and 22.2 without checkpointing; docs/planner.md); "
        "use --activation_checkpoint.mode none or --verify the plans"
    )


def unmeasured_collectives(options: dict[str, object], device: DeviceSpec, world: int) -> str | None:
    """What to say of a profile probed on one process pricing plans over several ranks: their
    collectives move at a link figure that was not measured, with no latency per call."""
    profile = device.profile
    if profile is None or world == 1 or profile.collectives:
        return None
    return (
        f"--device-profile {options['--device-profile']} was measured on one process: no collective was "
        f"timed, so the plans over {world} ranks price theirs at {device.intra_node_bytes_per_s / 1e9:.3g} GB/s "
        "(not measured; no latency per call), which favours TP and CP; probe under torchrun "
        f"--nproc-per-node {min(world, int(options.get('--gpus-per-node', 8)))} -m autopar.probe to measure them"
    )


def verified_plans(
    fitting: list[Plan], count: int, job: JobConfig, args: ModelArgs, world: int, device: DeviceSpec
) -> list[Plan]:
    """The ``count`` best of ``fitting`` whose dry runs build and fit (a dropped plan's place
    goes to the next best), then the plans not dry-run; prints each dry run."""
    print(f"\nverifying the {min(count, len(fitting))} best plans by their dry runs:")
    checked = verify(fitting, count, job, args, world, device)
    for i, result in enumerate(checked, 1):
        print("\n".join(result.lines(i)))
    kept = sum(r.kept for r in checked)
    if kept < count:
        print(f"only {kept} of the {len(checked)} plans dry-run built and fit")
    print()
    return [r.plan for r in checked if r.kept] + fitting[len(checked) :]


def own_plan_line(
    job: JobConfig, args: ModelArgs, world: int, gpus_per_node: int, device: DeviceSpec, best: Plan
) -> str:
    """How the job's plan as written compares with the best."""
    try:
        dims = check_plan(job, args, world, "cuda")
    except ConfigError as err:
        return f"the job's own plan cannot run on {world} GPUs: {err}"
    own = evaluate(args, job, dims, device, gpus_per_node)
    if not own.fits:
        return (
            f"the job's own plan ({own.describe()}) does not fit: predicted peak {own.peak_gib:.1f} GiB "
            f"> {device.memory_gib:.1f} GiB"
        )
    ratio = best.tokens_per_s / own.tokens_per_s
    return (
        f"the job's own plan ({own.describe()}): peak {own.peak_gib:.1f} GiB, "
        f"{own.tokens_per_s:,.0f} tokens/s/GPU; the best is {ratio:.2f}x"
    )


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
