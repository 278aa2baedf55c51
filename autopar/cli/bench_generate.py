"""The sampler's table: prefill and decode tokens/s of ``autopar.models.generation`` (eager and
with the compiled decode step) beside transformers' ``generate`` on the same model.

    python -m autopar.cli.bench_generate [--models qwen3:debug qwen3.5:debug] [--batch 1 4]
        [--prompt 128] [--new 64] [--repeat 3] [--threads 1] [--json out.json]
        [--speculative 1 2] [--train-steps 150]

Each model is built from its flavor with random weights (``init_weights``), saved as an HF
folder and loaded by transformers, so both run the same weights in fp32 on CPU. Prompts are
random tokens, all ``--prompt`` long (no padding for transformers). Greedy, no stop token.
Prefill tokens/s: prompt tokens over the time of a one-token generation; decode tokens/s:
the further ``new - 1`` tokens of every row over the time they add. Medians of ``--repeat``;
the compiled step is compiled (and its seconds recorded) before it is timed. The correctness
column beside the speeds: the share of our greedy tokens that equal the argmax of
transformers' forward over the generated sequence (the greedy tokens by definition).
``--speculative k ...`` adds MTP speculative decoding against plain greedy (``bench_speculative``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from autopar.cli.bench import source_commit
from autopar.cli.bench_speculative import speculative_rows, speculative_table
from autopar.models import build_model, get_flavor, save_hf
from autopar.models.generation import generate
from autopar.models.qwen import Qwen
from autopar.parallel.torch_internals import key_compile_cache_on_vector_isa

SHARPEN = 10.0
"""The head's weights are multiplied by this in both models: a random model's logits are
near-uniform (top probability 0.004 of 512), so fp32 rounding would decide its argmax ties
(tests/test_generate.py does the same)."""


@dataclass
class GenerateRow:
    model: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    eager_prefill_tps: float
    eager_decode_tps: float
    compiled_prefill_tps: float
    compiled_decode_tps: float
    hf_prefill_tps: float
    hf_decode_tps: float
    compiled_decode_x_hf: float
    eager_decode_x_hf: float
    compile_seconds: float
    greedy_agreement: float
    compiled_tokens_equal_eager: bool


def models(spec: str, seed: int) -> tuple[Qwen, torch.nn.Module]:
    """(ours, transformers') with the same random weights, from ``family:flavor``."""
    import transformers

    family, flavor = spec.split(":")
    ours = build_model(get_flavor(family, flavor))
    ours.init_weights(seed=seed)
    with torch.no_grad():
        ours.lm_head.weight.mul_(SHARPEN)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(ours.state_dict(), ours.args, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ours.eval(), hf.eval()


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speeds(
    run: Callable[[int], object], batch: int, prompt: int, new: int, repeat: int
) -> tuple[float, float]:
    """(prefill, decode) tokens/s of ``run(max_new_tokens)`` over ``batch`` prompts."""
    first = median_seconds(lambda: run(1), repeat)
    whole = median_seconds(lambda: run(new), repeat)
    return batch * prompt / first, batch * (new - 1) / max(whole - first, 1e-9)


def hf_runner(hf: torch.nn.Module, prompts: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """transformers' greedy ``generate`` of exactly ``n`` new tokens (cached, no eos)."""
    import transformers

    def run(n: int) -> torch.Tensor:
        config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        mask = torch.ones_like(prompts)
        return hf.generate(prompts, attention_mask=mask, generation_config=config)[:, prompts.shape[1] :]

    return run


@torch.no_grad()
def agreement(hf: torch.nn.Module, prompts: torch.Tensor, new: list[list[int]]) -> float:
    """The share of ``new`` tokens equal to the argmax of transformers' forward at their place."""
    sequences = torch.cat((prompts, torch.tensor(new)), dim=1)  # (B, P + N)
    logits = hf(sequences[:, :-1]).logits[:, prompts.shape[1] - 1 :]  # (B, N, V)
    return (logits.argmax(dim=-1) == sequences[:, prompts.shape[1] :]).float().mean().item()


def row(spec: str, batch: int, prompt: int, new: int, repeat: int, seed: int) -> GenerateRow:
    ours, hf = models(spec, seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, ours.args.vocab_size, (batch, prompt), generator=gen)
    listed = prompts.tolist()
    eager = speeds(lambda n: generate(ours, listed, n), batch, prompt, new, repeat)
    key_compile_cache_on_vector_isa()
    start = time.perf_counter()
    compiled_tokens = generate(ours, listed, new, compiled=True)  # compiles the step
    compile_seconds = time.perf_counter() - start
    compiled = speeds(lambda n: generate(ours, listed, n, compiled=True), batch, prompt, new, repeat)
    hf_speeds = speeds(hf_runner(hf, prompts), batch, prompt, new, repeat)
    eager_tokens = generate(ours, listed, new)
    return GenerateRow(
        model=spec,
        batch=batch,
        prompt_tokens=prompt,
        new_tokens=new,
        eager_prefill_tps=eager[0],
        eager_decode_tps=eager[1],
        compiled_prefill_tps=compiled[0],
        compiled_decode_tps=compiled[1],
        hf_prefill_tps=hf_speeds[0],
        hf_decode_tps=hf_speeds[1],
        compiled_decode_x_hf=compiled[1] / hf_speeds[1],
        eager_decode_x_hf=eager[1] / hf_speeds[1],
        compile_seconds=compile_seconds,
        greedy_agreement=agreement(hf, prompts, eager_tokens),
        compiled_tokens_equal_eager=compiled_tokens == eager_tokens,
    )


def table(rows: list[GenerateRow]) -> str:
    header = (
        f"{'model':<14} {'batch':>5} {'prefill tok/s: eager':>20} {'compiled':>9} {'HF':>8} "
        f"{'decode tok/s: eager':>19} {'compiled':>9} {'HF':>7} {'compiled/HF':>11} {'eager/HF':>9} "
        f"{'compile s':>9} {'greedy = HF argmax':>18} {'compiled = eager':>16}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.model:<14} {r.batch:>5} {r.eager_prefill_tps:>20.0f} {r.compiled_prefill_tps:>9.0f} "
            f"{r.hf_prefill_tps:>8.0f} {r.eager_decode_tps:>19.0f} {r.compiled_decode_tps:>9.0f} "
            f"{r.hf_decode_tps:>7.0f} {r.compiled_decode_x_hf:>10.2f}x {r.eager_decode_x_hf:>8.2f}x "
            f"{r.compile_seconds:>9.1f} {r.greedy_agreement:>17.1%} {r.compiled_tokens_equal_eager!s:>16}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.bench_generate", description=__doc__)
    parser.add_argument("--models", nargs="*", default=["qwen3:debug", "qwen3.5:debug"], help="family:flavor")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="prompts decoded together")
    parser.add_argument("--prompt", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both stacks)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--speculative", type=int, nargs="*", default=[], help="k of MTP speculative rows")
    parser.add_argument(
        "--train-steps", type=int, default=150, help="training of the rows' trained head (0: none)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    load = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        rows = [
            row(spec, batch, options.prompt, options.new, options.repeat, options.seed)
            for spec in options.models
            for batch in options.batch
        ]
        speculation = (options.speculative, options.prompt, options.new, options.train_steps)
        speculative = speculative_rows(*speculation, options.seed, options.repeat)
    finally:
        torch.set_num_threads(threads)
    print(f"greedy generation, fp32 on CPU, {options.threads} thread(s), load average {load[0]:.1f} at start")
    if rows:
        print(table(rows))
    if speculative:
        print(speculative_table(speculative))
    if options.json:
        record = {
            "commit": source_commit(),
            "device": "cpu",
            "threads": options.threads,
            "load_average": load,
        }
        record |= {"prompt_tokens": options.prompt, "new_tokens": options.new, "repeat": options.repeat}
        record["rows"] = [asdict(r) for r in rows]
        record["speculative_rows"] = [asdict(r) for r in speculative]
        with open(options.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
