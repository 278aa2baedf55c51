"""``python -m autopar.plan ... --check N``: train the N best plans of distinct shapes (the
best of each combination of degrees, pipeline schedule and checkpointing mode, so the check
spans FSDP, DDP, TP, CP, PP and AC rather than N local batches of one plan) for a few steps
each on this machine (``autopar.bench``'s machinery: fresh processes per plan, the median step after
warm-up) and print predicted beside measured tokens/s per device, each plan's error, the
median and worst error, and the Spearman rank correlation of predicted and measured order.
``--rounds R`` measures every plan R times, one round of all plans after another, and keeps
each plan's fastest: on a shared machine a run is only ever slowed by what else runs, and
rounds spread a slow spell over all plans rather than the few that ran in it.
With ``--json FILE`` the results, the commit and the command join the ranked plans there.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from autopar.cli.bench import run_variant, source_commit, summarize, variant_job
from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.planner.devices import DeviceSpec
from autopar.planner.search import Plan

CHECK_WARMUP = 2
"""Untimed steps of each plan (the first builds caches and, compiled, the graph)."""
CHECK_STEPS = 4
"""Timed steps of each plan, unless ``--steps`` says otherwise."""


FAR_OFF = 2.0
"""A plan whose prediction and measurement differ by more than this factor (either way) is
flagged: the planner's checked errors on this machine are within 30% (BENCHMARKS.md), so a
factor of 2 says the figures priced were not this machine's as it ran."""


def check_comparable(options: dict, device: DeviceSpec, world: int) -> None:
    """``--check`` trains the plans here and compares with their prices: refused, before the
    search, where those prices are not this machine's (a preset of another device, another
    device's profile, or a one-process profile for a multi-rank check, whose collectives
    were never timed)."""
    import torch

    from autopar.planner.probe import device_name

    here_device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    here = device_name(here_device)
    probe = "python -m autopar.probe --output device_profile.json --job.config <your job>"
    if world > 1:
        probe = f"torchrun --nproc-per-node {world} -m autopar.probe --output device_profile.json --job.config <your job>"
    fix = f"probe this machine ({probe}) and plan with --device-profile device_profile.json"
    profile = device.profile
    if profile is None:
        preset = str(options.get("--device", "h100"))
        if here_device.type == "cuda" and preset.lower() in here.lower():
            return
        default = "" if "--device" in options else " (the default)"
        raise ConfigError(
            f"--check trains the plans on this machine ({here}), and they were priced for --device "
            f"{preset}{default}: the errors would compare two machines; {fix}"
        )
    named = f"--device-profile {options['--device-profile']}"
    if profile.device != here:
        raise ConfigError(
            f"--check trains the plans on this machine ({here}), and {named} was measured on "
            f"{profile.device}: the errors would compare two machines; {fix}"
        )
    if world > 1 and not profile.collectives:
        raise ConfigError(
            f"--check trains the plans on {world} ranks here, and {named} has no collectives measured "
            f"(probed on one process): the plans' collectives were priced by a guess; {fix}"
        )


def far_off(rows: list[dict]) -> list[str]:
    """A note for each checked plan whose prediction is more than ``FAR_OFF`` times from its
    measurement (or less than 1 / ``FAR_OFF``): not a result to read as the planner's error."""
    notes = []
    for i, row in enumerate(rows, 1):
        ratio = row["predicted_tokens_per_s"] / row["measured_tokens_per_s"]
        if 1 / FAR_OFF <= ratio <= FAR_OFF:
            continue
        factor = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"
        notes.append(
            f"plan note: #{i} {row['plan']}: predicted {row['predicted_tokens_per_s']:,.0f} tokens/s, measured "
            f"{row['measured_tokens_per_s']:,.0f} ({factor}): the figures priced were not this machine's as "
            "it ran (another device's, a profile without collectives, or a machine busy with other work); "
            "probe again and check on a quiet machine"
        )
    return notes


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (tied values share their mean rank); nan under 2 points."""
    if len(xs) < 2:
        return float("nan")
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def measure(plans: list[Plan], job: JobConfig, world: int, steps: int, rounds: int = 1) -> list[dict]:
    """Each plan trained for ``CHECK_WARMUP + steps`` steps, ``rounds`` times (every plan once
    per round), at its fastest round: predicted and measured tokens/s and peak memory (on CPU
    the process's peak resident memory, which the prediction does not count alike), and the
    loss it ended at (speed beside learning)."""
    specs = [
        f"plan{i}:" + ",".join(f"{k}={v}" for k, v in plan.settings.config().items())
        for i, plan in enumerate(plans, 1)
    ]
    runs: list[list] = [[] for _ in plans]
    for _ in range(rounds):
        for i, spec in enumerate(specs):
            variant = variant_job(job, spec, CHECK_WARMUP + steps, world)
            runs[i].append(
                summarize(
                    variant.name, spec, run_variant(variant.name, variant.job, world, CHECK_WARMUP), world
                )
            )
    rows = []
    for i, (plan, results) in enumerate(zip(plans, runs), 1):
        result = max(results, key=lambda r: r.tokens_per_second_per_device)
        measured = result.tokens_per_second_per_device
        rows.append(
            {
                "plan": plan.describe(),
                "overrides": plan.overrides,
                "predicted_tokens_per_s": plan.tokens_per_s,
                "measured_tokens_per_s": measured,
                "rounds_tokens_per_s": [r.tokens_per_second_per_device for r in results],
                "error": plan.tokens_per_s / measured - 1,
                "predicted_split": plan.time.split() if plan.time else None,
                "predicted_peak_gib": plan.peak_gib,
                "measured_peak_gib": result.peak_memory_gib,
                "final_loss": result.final_loss,
            }
        )
        print(
            f"  {i}: {plan.describe()}: predicted {plan.tokens_per_s:,.0f}, measured {measured:,.0f} "
            f"tokens/s{f' (best of {rounds})' if rounds > 1 else ''}; peak predicted {plan.peak_gib:.1f} GiB, "
            f"measured {result.peak_memory_gib:.1f}; loss at the end {result.final_loss:.3f}",
            flush=True,
        )
    return rows


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        "spearman": spearman(
            [r["predicted_tokens_per_s"] for r in rows], [r["measured_tokens_per_s"] for r in rows]
        ),
    }


def table(rows: list[dict]) -> str:
    lines = ["| # | plan | predicted tokens/s | measured tokens/s | error |", "|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['plan']} | {r['predicted_tokens_per_s']:,.0f} | "
            f"{r['measured_tokens_per_s']:,.0f} | {100 * r['error']:+.0f}% |"
        )
    return "\n".join(lines)


def distinct_shapes(plans: list[Plan], count: int) -> list[Plan]:
    """The best ``count`` plans, one of each shape (degrees, schedule, checkpointing mode)."""
    seen: set[tuple] = set()
    chosen = []
    for plan in plans:
        d, s = plan.dims, plan.settings
        shape = (d.dp_replicate, d.dp_shard, d.tp, d.cp, d.pp, d.ep, s.schedule if d.pp > 1 else "", s.ac)
        if shape not in seen and len(chosen) < count:
            seen.add(shape)
            chosen.append(plan)
    return chosen


def check_plans(plans: list[Plan], job: JobConfig, world: int, options: dict, device: DeviceSpec) -> int:
    """Run, print and (``--json``) record the check of ``options['--check']`` plans."""
    top = distinct_shapes(plans, int(options["--check"]))
    steps, rounds = int(options.get("--steps", CHECK_STEPS)), int(options.get("--rounds", 1))
    print(
        f"\nchecking the {len(top)} best plans: {CHECK_WARMUP} warm-up + {steps} timed steps each"
        + (f", {rounds} rounds, each plan at its fastest" if rounds > 1 else "")
    )
    rows = measure(top, job, world, steps, rounds)
    stats = summary(rows)
    print(table(rows))
    notes = far_off(rows)
    for note in notes:
        print(note, file=sys.stderr)
    print(
        f"median error {100 * stats['median_abs_error']:.0f}%, worst {100 * stats['worst_abs_error']:.0f}%, "
        f"Spearman rank correlation {stats['spearman']:.2f} over {len(rows)} plans"
    )
    if "--json" in options:
        path = Path(str(options["--json"]))
        record = json.loads(path.read_text()) if path.is_file() else {}
        record["check"] = {
            "device": device.name,
            "profile": bool(device.profile),
            "torch": torch.__version__,
            "commit": source_commit(),
            "command": " ".join(["python -m autopar.plan", *sys.argv[1:]]),
            "world_size": world,
            "steps": steps,
            "warmup": CHECK_WARMUP,
            "rounds": rounds,
            "far_off": len(notes),
            "plans": rows,
            **stats,
        }
        path.write_text(json.dumps(record, indent=2))
    return 0
