"""BENCHMARKS.md's tables from benchmark JSON: a sitting's, ``autopar.bench``'s or the
delta-rule table's.

    python -m autopar.cli.bench_tables FILE.json [FILE.json ...]

Each table comes with what makes it a record: the command, the device, torch and the
commit it ran from, and a loss beside every speed figure. A ``+dirty`` commit is printed as
it is: such figures do not belong in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _provenance(record: dict, command: str | None) -> str:
    commit = record.get("commit", "not recorded")
    lines = [f"Device {record.get('device', '?')}, torch {record.get('torch', '?')}, commit `{commit}`."]
    if command:
        lines.insert(0, f"```\n{command}\n```")
    return "\n\n".join(lines)


def bench_table(record: dict) -> str:
    """``autopar.bench``'s rows: speed, memory, and the first and last loss of each variant."""
    rows = record["results"]
    base = rows[0]["tokens_per_second_per_device"]
    lines = [
        f"| variant | ranks | tokens/s per device | MFU | peak mem | step ms | vs {rows[0]['variant']} "
        "| loss at 1 | loss at end |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1f}%"
        first = r.get("first_loss")
        lines.append(
            f"| {r['variant']} | {r.get('nproc', record.get('nproc', 1))} | {r['tokens_per_second_per_device']:,.0f} "
            f"| {mfu} | {r['peak_memory_gib']:.1f} GiB | {1000 * r['step_seconds']:.1f} "
            f"| {r['tokens_per_second_per_device'] / base:.2f}x | {'n/a' if first is None else f'{first:.3f}'} "
            f"| {r['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def delta_rule_table(record: dict) -> str:
    """``bench_delta_rule``'s rows, every field a column (FLA's where it ran)."""
    rows = record["rows"]
    fields = [f for f in rows[0] if any(r.get(f) is not None for r in rows)]
    lines = ["| " + " | ".join(fields) + " |", "|" + " ---: |" * len(fields)]
    for r in rows:
        cells = [_cell(r.get(f)) for f in fields]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2e}" if abs(value) < 1e-2 and value else f"{value:.3f}"
    return str(value)


def tables(record: dict) -> str:
    """Markdown for one JSON file: a sitting's steps in order, or one benchmark's table."""
    if "steps" in record:
        parts = [f"Sitting on {record['device']}, torch {record['torch']}, commit `{record['commit']}`."]
        for step in record["steps"]:
            parts.append(f"### {step['name']} ({step['status']}, {step['seconds']:.0f} s)")
            parts.append(f"```\n{step['command']}\n```")
            if step.get("result"):
                parts.append(_body(step["result"]))
        return "\n\n".join(parts)
    return "\n\n".join([_provenance(record, record.get("command")), _body(record)])


def _body(record: dict) -> str:
    if "results" in record:
        return bench_table(record)
    if "rows" in record:
        return delta_rule_table(record)
    return "(no table in this JSON)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.bench_tables", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    options = parser.parse_args(argv)
    print("\n\n".join(tables(json.loads(path.read_text())) for path in options.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
