"""On-policy RL against TRL 1.16's ``GRPOTrainer`` on this machine, the same everything:

    python -m autopar.cli.bench_rl --steps 20 --trl-python /path/to/venv-with-trl/bin/python

Both train the ``rl_debug`` job: the tiny Qwen3 from the same initial weights (ours, written
as an HF folder for TRL), the shipped toy prompts and ``autopar.rewards:letter_share``, 32
completions a step (4 prompts x 8), up to 24 new tokens each at temperature 1, TRL's dapo
loss, AdamW at the same learning rate and warm-up, one thread each. Each runs in its own
process; the table gives seconds per optimizer step (median after the first, rollout
included) and its split, and the mean reward of the first and last five steps (a faster
variant that learns worse is not faster). TRL's rows come from its own log history.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.cli.bench import source_commit
from autopar.data.chat import CHATML_TOKENIZER
from autopar.data.tokens import BUILTIN_DATASETS

TRL_SCRIPT = """
import json, sys, time, torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, {root!r})
from autopar.rewards import letter_share
torch.set_num_threads(1)
model = Qwen3ForCausalLM.from_pretrained({model!r}, torch_dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained({tokenizer!r})
records = [json.loads(line) for line in open({prompts!r})]
times = []
class Clock(TrainerCallback):
    def on_step_begin(self, *a, **k): self.start = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.start)
args = GRPOConfig(output_dir={out!r}, use_cpu=True, bf16=False, max_steps={steps}, learning_rate={lr},
    lr_scheduler_type="constant_with_warmup", warmup_steps={warmup}, weight_decay=0.0, max_grad_norm=1.0,
    per_device_train_batch_size=16, gradient_accumulation_steps=2, num_generations=8,
    max_completion_length=24, temperature=1.0, logging_steps=1, report_to=[], save_strategy="no",
    seed=0, shuffle_dataset=False)
trainer = GRPOTrainer(model=model, reward_funcs=[letter_share], args=args,
    train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[Clock()])
trainer.train()
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
print(json.dumps({{"step_seconds": times, "rewards": rewards}}))
"""


def autopar_row(steps: int, folder: Path) -> dict:
    """Our ``rl_debug`` for ``steps`` steps; its per-step times and rewards from metrics.jsonl."""
    command = [
        sys.executable,
        "-m",
        "autopar.train",
        "--job.config",
        "rl_debug",
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(folder / "autopar"),
    ]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    records = [json.loads(line) for line in (folder / "autopar" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "reward" in r]
    return {
        "step_seconds": [r["step_time_s"] for r in steps_],
        "rollout_seconds": [r["time/rollout"] + r["time/scoring"] for r in steps_],
        "rewards": [r["reward"] for r in steps_],
    }


def trl_row(python: str, steps: int, folder: Path) -> dict:
    """TRL's GRPOTrainer on the same job, run by ``python`` (an interpreter with trl 1.16)."""
    import torch

    from autopar.models import build_model, to_hf
    from autopar.parallel.materialize import seeded_values
    from autopar.training.resolve import model_args, parse_job

    job = parse_job(["--job.config", "rl_debug"])
    args = model_args(job)
    model = build_model(args)
    value = seeded_values(args, job.debug.seed, torch.device("cpu"))  # the weights autopar starts from
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(value(name, p.shape))
    to_hf(model, folder / "model")
    script = TRL_SCRIPT.format(
        root=str(Path(__file__).resolve().parents[2]),
        model=str(folder / "model"),
        tokenizer=str(CHATML_TOKENIZER),
        prompts=str(BUILTIN_DATASETS["rl_example"]),
        out=str(folder / "trl"),
        steps=steps,
        lr=job.optimizer.lr,
        warmup=job.lr_scheduler.warmup_steps,
    )
    done = subprocess.run(
        [python, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: dict[str, dict]) -> str:
    header = f"{'':8} {'s/step':>8} {'rollout s':>10} {'reward first 5':>15} {'last 5':>8}"
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        seconds = statistics.median(row["step_seconds"][1:])
        rollout = statistics.median(row["rollout_seconds"][1:]) if "rollout_seconds" in row else float("nan")
        first, last = (statistics.mean(row["rewards"][:5]), statistics.mean(row["rewards"][-5:]))
        lines.append(f"{name:8} {seconds:>8.3f} {rollout:>10.3f} {first:>15.4f} {last:>8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.cli.bench_rl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trl-python", required=True, help="an interpreter with trl==1.16.0 installed")
    parser.add_argument("--json", help="write both rows here")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {
            "autopar": autopar_row(options.steps, Path(tmp)),
            "trl": trl_row(options.trl_python, options.steps, Path(tmp)),
        }
    print(table(rows))
    if options.json:
        record = {"commit": source_commit(), "steps": options.steps, "threads": 1, "rows": rows}
        Path(options.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
