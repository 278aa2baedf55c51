"""One GPU sitting: the measurements only a GPU can give, in priority order, inside a time budget.

    python -m autopar.cli.sitting --out DIR [--plan gpu] [--budget-s 540] [--only NAME ...]

A lent GPU comes for minutes, a command for at most ten, so the steps run most valuable
first and a step starts only if its estimate fits what is left of ``--budget-s``; each is
killed at the budget's end. Everything lands in ``DIR/sitting.json`` (commit, device, torch,
and per step its command, exit status, seconds and the JSON the step wrote) and
``DIR/sitting.log`` (every step's output): two files, as the GPU tool brings back few.
``python -m autopar.cli.bench_tables DIR/sitting.json`` turns the JSON into BENCHMARKS.md's
tables. ``--plan cpu`` runs the same kinds of step on the debug models in seconds, so the
sitting itself is tested on a CPU before any GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from autopar.cli.bench import source_commit


@dataclass(frozen=True)
class Step:
    name: str
    command: str
    """What follows ``python -m``; ``{json}`` becomes this step's JSON path, ``{out}`` the
    sitting's folder (for a file a later step reads)."""
    estimate_s: int
    """Seconds it is expected to take on the plan's device: it starts only if this fits."""

    @property
    def argv(self) -> list[str]:
        return self.command.split()


QWEN3_1_7B = (
    "--job.config train_configs/qwen3_1.7b.toml --training.seq_len 4096 --training.local_batch_size 2"
)
QWEN3_1_7B_DPO = (
    "--job.config train_configs/qwen3_8b_dpo_lora.toml --model.flavor 1.7B "
    "--training.seq_len 4096 --training.local_batch_size 2"
)
DPO_VARIANTS = (
    "sft_lora:training.dataset_format=text,training.dataset=autopar_corpus,"
    "training.document_masking=true,dpo.reference=copy "
    "dpo_lora_adapters_off:dpo.reference=adapters_off "
    "dpo_lora_chunked:dpo.reference=adapters_off,training.loss_chunk_tokens=1024 "
    "dpo_full_copy:lora.enable=false,dpo.reference=copy"
)
"""DPO against SFT on the same model, plan and row length: the preset's LoRA DPO (reference =
the base with adapters off), the same reading its log-probabilities 1,024 tokens at a time,
full DPO with a reference copy, and LoRA SFT on text."""
QWEN3_5_2B = (
    "--model.name qwen3.5 --model.flavor 2B --model.num_hidden_layers 8 "
    "--training.seq_len 4096 --training.local_batch_size 2"
)
PLAN_CHECK = "--world-size 1 --gpus-per-node 1 --steps 4"
"""One GPU's plans checked against measurement (#57): the planner's predictions (the H100 preset;
the probed profile re-predicts them from the JSON afterwards) beside measured tokens/s."""
PLANS: dict[str, tuple[Step, ...]] = {
    "gpu": (
        Step("triton_delta_rule", "pytest -q -s -m gpu tests/test_triton_delta_rule.py", 120),
        Step(
            "delta_rule_2b",
            "autopar.cli.bench_delta_rule --flavor 2B --batch 2 --seq 4096 --json {json}",
            120,
        ),
        Step(
            "qwen3.5_2b_kernels",
            f"autopar.bench --json {{json}} {QWEN3_5_2B} --variants triton delta_rule_autopar --warmup 3 --steps 8",
            200,
        ),
        Step("gpu_tests", "pytest -q -m gpu tests/test_gpu.py tests/test_fla_delta_rule.py", 290),
        Step("delta_rule_kernels", "autopar.cli.bench_delta_rule --seq 4096 16384 --json {json}", 110),
        Step(
            "qwen3_1.7b_regression",
            f"autopar.bench --json {{json}} {QWEN3_1_7B} --variants compiled fp8 eager --warmup 3 --steps 8",
            240,
        ),
        Step(
            "qwen3_1.7b_dpo",
            f"autopar.bench --json {{json}} {QWEN3_1_7B_DPO} --variants {DPO_VARIANTS} --warmup 2 --steps 5",
            250,
        ),
    ),
    "planner": (
        Step("gpu_ring_gqa", "pytest -q -m gpu tests/test_gpu.py -k ring", 60),
        Step("probe", f"autopar.probe --output {{out}}/device_profile.json {QWEN3_1_7B}", 90),
        Step(
            "check_eager",
            f"autopar.plan --json {{json}} {QWEN3_1_7B} {PLAN_CHECK} --compile.enable false --check 2",
            60,
        ),
        Step("check_compiled", f"autopar.plan --json {{json}} {QWEN3_1_7B} {PLAN_CHECK} --check 4", 240),
        Step(
            "probe_qwen3.5",
            f"autopar.probe --output {{out}}/device_profile_qwen3.5.json {QWEN3_5_2B} --compile.enable true",
            120,
        ),
        Step(
            "check_qwen3.5",
            f"autopar.plan --json {{json}} {QWEN3_5_2B} --compile.enable true {PLAN_CHECK} --check 2",
            160,
        ),
        Step(
            "check_fp8",
            f"autopar.plan --json {{json}} {QWEN3_1_7B} {PLAN_CHECK} --float8.enable true "
            "--float8.backend torchao --check 2",
            80,
        ),
        Step(
            "check_compiled_batch4",
            f"autopar.plan --json {{json}} {QWEN3_1_7B} {PLAN_CHECK} --training.local_batch_size 4 --check 3",
            70,
        ),
        Step(
            "auto_train",
            f"autopar.train {QWEN3_1_7B} --parallelism.auto true --training.steps 8 --checkpoint.enable false "
            "--metrics.log_freq 1 --job.dump_folder /tmp/autopar_auto_train",
            150,
        ),
    ),
    "cpu": (
        Step("delta_rule_kernels", "autopar.cli.bench_delta_rule --seq 128 --repeat 1 --json {json}", 60),
        Step(
            "debug_bench",
            "autopar.bench --json {json} --job.config debug_model_qwen3.5 --variants eager --warmup 1 --steps 2",
            60,
        ),
    ),
}
"""Steps in the order they run: what only a GPU shows first (the triton delta-rule kernel's
bf16 numerics and its compiled programs against autopar's, its per-layer time beside
autopar's and FLA's forward at Qwen3.5-2B's heads, Qwen3.5-2B at 8 layers compiled with it and
with autopar's; then the CUDA tests, the 9B-head kernel table), then the regression check against the pre-recipe
figures, then what landed since (DPO against SFT). ``planner`` is the planner's sitting: torch's
ring attention with grouped k/v heads on the CUDA kernels, the probe on the job, and the
planner's one-GPU predictions (eager, compiled by checkpointing mode, FP8) against measurement.
``cpu`` is the same shape of sitting on the debug models, to test this script."""


@dataclass
class StepRecord:
    name: str
    command: str
    status: str
    """ok, failed (exit code in ``returncode``), timed out, or skipped (its estimate did not fit)."""
    seconds: float = 0.0
    returncode: int | None = None
    result: dict | None = None
    """The JSON the step wrote (a benchmark's table rows), if any."""


@dataclass
class Sitting:
    commit: str
    device: str
    torch: str
    budget_s: int
    steps: list[StepRecord] = field(default_factory=list)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_step(step: Step, out: Path, seconds_left: float, log) -> StepRecord:
    """Run ``step`` as ``python -m ...`` with output appended to ``log``, for at most ``seconds_left``."""
    json_path = out / f"{step.name}.json"
    argv = [
        sys.executable,
        "-m",
        *(a.replace("{json}", str(json_path)).replace("{out}", str(out)) for a in step.argv),
    ]
    command = "python -m " + step.command.replace(" --json {json}", "").replace("{out}", str(out))
    if step.estimate_s > seconds_left:
        return StepRecord(step.name, command, "skipped")
    log.write(f"\n===== {step.name}: {command}\n")
    log.flush()
    start = time.monotonic()
    try:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=seconds_left, check=False)
        status, code = ("ok" if done.returncode == 0 else "failed"), done.returncode
    except subprocess.TimeoutExpired:
        status, code = "timed out", None
    record = StepRecord(step.name, command, status, time.monotonic() - start, code)
    if json_path.exists():
        record.result = json.loads(json_path.read_text())
        json_path.unlink()  # kept inside sitting.json: the GPU tool brings back few files
    return record


def sit(plan: str, out: Path, budget_s: int, only: list[str] | None = None) -> Sitting:
    """Run ``plan``'s steps (or those named in ``only``) within ``budget_s`` seconds."""
    out.mkdir(parents=True, exist_ok=True)
    sitting = Sitting(source_commit(), device_name(), torch.__version__, budget_s)
    deadline = time.monotonic() + budget_s
    with open(out / "sitting.log", "a") as log:
        for step in PLANS[plan]:
            if only and step.name not in only:
                continue
            sitting.steps.append(run_step(step, out, deadline - time.monotonic(), log))
            (out / "sitting.json").write_text(json.dumps(asdict(sitting), indent=2))
    return sitting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.cli.sitting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="folder for sitting.json and sitting.log")
    parser.add_argument(
        "--plan", choices=sorted(PLANS), default="gpu" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--budget-s", type=int, default=540, help="seconds for the whole sitting")
    parser.add_argument("--only", nargs="+", default=None, help="run only these steps")
    parser.add_argument("--list", action="store_true", help="print the plan's steps and exit")
    options = parser.parse_args(argv)
    steps = PLANS[options.plan]
    unknown = sorted(set(options.only or ()) - {s.name for s in steps})
    if unknown:
        print(
            f"--only {unknown}: not steps of plan {options.plan!r} ({[s.name for s in steps]})",
            file=sys.stderr,
        )
        return 2
    if options.list:
        for step in steps:
            print(f"{step.name:24} ~{step.estimate_s:>4} s  python -m {step.command}")
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sitting = sit(options.plan, Path(options.out), options.budget_s, options.only)
    for record in sitting.steps:
        print(f"{record.name:24} {record.status:10} {record.seconds:7.1f} s")
    return 0 if all(r.status in ("ok", "skipped") for r in sitting.steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
