"""The planner search's CPU seconds on a few cluster-sized questions, as a table.

    python scripts/bench_search.py [--repeats 3] [--json FILE] [--cluster]

Each question is answered as ``plan --top 3`` answers it (the search by bounds, ``keep=3``)
after one warm-up answer (the model's op counts and other per-question terms are computed
once, then cached), and timed by ``time.process_time``: the minimum of ``--repeats``, so a
loaded machine's other work counts as little as it can. The JSON records the commit (``+dirty`` for uncommitted code). Nothing
trains, so no loss applies; the best plan is printed so that two commits can be seen to agree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autopar.cli.bench import source_commit
from autopar.planner.devices import PRESETS
from autopar.planner.search import search_counted
from autopar.training.resolve import model_args, parse_job

QUESTIONS = {
    # name: (job flags, world size)
    "Qwen3-8B on 1,024": (["--job.config", "qwen3_8b"], 1024),
    "Qwen3-30B-A3B on 64": (["--job.config", "qwen3_30b_a3b"], 64),
    "Qwen3.5-27B on 128": (["--job.config", "qwen3.5_27b"], 128),
    "Qwen3.5-35B-A3B on 256": (["--job.config", "qwen3.5_35b_a3b"], 256),
}
CLUSTER = {
    "Qwen3-235B-A22B on 16,384": (["--model.flavor", "235B-A22B", "--training.seq_len", "4096"], 16384),
    "Qwen3.5-397B-A17B on 16,384": (
        ["--model.name", "qwen3.5", "--model.flavor", "397B-A17B", "--training.seq_len", "4096"],
        16384,
    ),
}
"""The issue's MoE questions at the Llama 3 paper's scale (``--cluster``: about a minute each)."""


def measure(argv: list[str], world: int, repeats: int) -> dict:
    job = parse_job(argv)
    args = model_args(job)
    searched = search_counted(job, args, world, 8, PRESETS["h100"], keep=3)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.process_time()
        search_counted(job, args, world, 8, PRESETS["h100"], keep=3)
        seconds.append(time.process_time() - start)
    best = searched.plans[0]
    return {
        "cpu_seconds": min(seconds),
        "candidates": searched.candidates,
        "valid": searched.valid,
        "scored": searched.scored,
        "best": best.describe(),
        "best_tokens_per_s": best.tokens_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cluster", action="store_true", help="the 16,384-rank MoE questions instead")
    known = parser.parse_args()
    questions = CLUSTER if known.cluster else QUESTIONS
    rows = {name: measure(argv, world, known.repeats) for name, (argv, world) in questions.items()}
    print("| question | search (CPU s) | candidates / valid / scored | best plan | tokens/s/GPU |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['cpu_seconds']:.2f} | {r['candidates']:,} / {r['valid']:,} / {r['scored']:,} "
            f"| {r['best']} | {r['best_tokens_per_s']:,.0f} |"
        )
    if known.json:
        known.json.write_text(json.dumps({"commit": source_commit(), "questions": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
