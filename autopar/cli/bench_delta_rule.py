"""The delta-rule kernel table: autopar's chunked gated delta rule beside transformers' torch
reference, at Qwen3.5-9B's head counts (16 key heads, 32 value heads, dk = dv = 128).

    python -m autopar.cli.bench_delta_rule [--seq 2048 8192] [--repeat 3] [--json out.json]

Per sequence length: forward + backward seconds of each (median of ``--repeat``), their
ratio, the bytes each keeps for backward as a multiple of its inputs, one Gated DeltaNet
layer compiled against eager, and the largest output difference from the reference (the
correctness figure beside the speed ones). Inputs are fp32 on CPU, bf16 on CUDA. On CUDA
with fla-core installed, FLA's kernels (``training.delta_rule_kernel = "fla"``) get the same
columns: their time, what they keep, the layer compiled with them, their difference from ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from autopar.cli.bench import source_commit
from autopar.models import get_flavor
from autopar.models.qwen3_5.delta_rule import gated_delta_rule
from autopar.models.qwen3_5.fla_delta_rule import FLA, fla_gated_delta_rule, fla_version_problem
from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet

HEADS = {"key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128}
"""Qwen3.5-9B's (and 4B's) Gated DeltaNet head counts."""


@dataclass
class KernelRow:
    seq: int
    ours_seconds: float
    reference_seconds: float
    speedup: float
    ours_saved_x_inputs: float
    reference_saved_x_inputs: float
    layer_eager_seconds: float
    layer_compiled_seconds: float
    max_output_difference: float
    fla_seconds: float | None = None
    fla_saved_x_inputs: float | None = None
    layer_fla_compiled_seconds: float | None = None
    fla_max_difference_from_ours: float | None = None


def inputs(seq: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    kh, vh, dk, dv = HEADS.values()

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_()

    q, k, v = draw(1, seq, kh, dk), draw(1, seq, kh, dk), draw(1, seq, vh, dv)
    g = (-torch.rand(1, seq, vh, generator=gen, device=device) * 2).requires_grad_()
    beta = torch.rand(1, seq, vh, generator=gen, device=device).to(dtype).requires_grad_()
    return [q, k, v, g, beta]


def reference(q, k, v, g, beta) -> torch.Tensor:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def timed(fn: Callable[[], torch.Tensor], repeat: int, device: torch.device) -> float:
    """Median seconds of forward + backward."""
    times = []
    for _ in range(repeat + 1):  # the first call warms up
        start = time.perf_counter()
        fn().float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def saved_multiple(fn: Callable[..., torch.Tensor], tensors: list[torch.Tensor]) -> float:
    """Bytes autograd keeps for backward, over the inputs' bytes."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*tensors)
    return total / sum(t.numel() * t.element_size() for t in tensors)


def layer_seconds(
    seq: int, device: torch.device, dtype: torch.dtype, repeat: int, fla: bool = False
) -> tuple[float, float]:
    """(eager, compiled) forward + backward seconds of one Qwen3.5-9B Gated DeltaNet layer
    (with FLA's delta rule if ``fla``)."""
    args = get_flavor("qwen3.5", "9B")
    torch.manual_seed(0)
    layer = GatedDeltaNet(args).to(device=device, dtype=dtype)
    if fla:
        layer.core.sequence.kernel = FLA
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, seq, args.hidden_size, device=device, dtype=dtype)
    compiled = torch.compile(layer, fullgraph=True)
    return timed(lambda: layer(x), repeat, device), timed(lambda: compiled(x), repeat, device)


def row(seq: int, repeat: int, device: torch.device, dtype: torch.dtype) -> KernelRow:
    tensors = inputs(seq, device, dtype)
    ours = timed(lambda: gated_delta_rule(*tensors), repeat, device)
    theirs = timed(lambda: reference(*tensors), repeat, device)
    with torch.no_grad():
        difference = (gated_delta_rule(*tensors).float() - reference(*tensors).float()).abs().max().item()
    eager, compiled = layer_seconds(seq, device, dtype, repeat)
    fla = {}
    if device.type == "cuda" and fla_version_problem() is None:
        with torch.no_grad():
            ours_out = gated_delta_rule(*tensors).float()
            fla_out = fla_gated_delta_rule(*tensors).float()
        fla = {
            "fla_seconds": timed(lambda: fla_gated_delta_rule(*tensors), repeat, device),
            "fla_saved_x_inputs": saved_multiple(fla_gated_delta_rule, tensors),
            "layer_fla_compiled_seconds": layer_seconds(seq, device, dtype, repeat, fla=True)[1],
            "fla_max_difference_from_ours": (fla_out - ours_out).abs().max().item(),
        }
    return KernelRow(
        seq=seq,
        ours_seconds=ours,
        reference_seconds=theirs,
        speedup=theirs / ours,
        ours_saved_x_inputs=saved_multiple(gated_delta_rule, tensors),
        reference_saved_x_inputs=saved_multiple(reference, tensors),
        layer_eager_seconds=eager,
        layer_compiled_seconds=compiled,
        max_output_difference=difference,
        **fla,
    )


def table(rows: list[KernelRow]) -> str:
    header = (
        f"{'seq':>6} {'ours s':>8} {'HF ref s':>9} {'speedup':>8} {'saved/in ours':>14} "
        f"{'saved/in HF':>12} {'layer eager s':>14} {'compiled s':>11} {'max |diff|':>11}"
    )
    with_fla = any(r.fla_seconds is not None for r in rows)
    if with_fla:
        header += f" {'FLA s':>8} {'saved/in FLA':>13} {'FLA compiled s':>15} {'FLA-ours':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r.seq:>6} {r.ours_seconds:>8.3f} {r.reference_seconds:>9.3f} {r.speedup:>7.2f}x "
            f"{r.ours_saved_x_inputs:>13.1f}x {r.reference_saved_x_inputs:>11.1f}x "
            f"{r.layer_eager_seconds:>14.3f} {r.layer_compiled_seconds:>11.3f} {r.max_output_difference:>11.2e}"
        )
        if with_fla and r.fla_seconds is not None:
            line += (
                f" {r.fla_seconds:>8.3f} {r.fla_saved_x_inputs:>12.1f}x {r.layer_fla_compiled_seconds:>15.3f} "
                f"{r.fla_max_difference_from_ours:>9.2e}"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.bench_delta_rule", description=__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    options = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [row(seq, options.repeat, device, dtype) for seq in options.seq]
    print(f"gated delta rule, {HEADS}, batch 1, {dtype} on {device.type}, forward + backward")
    print(table(rows))
    if options.json:
        record = {"commit": source_commit(), "device": device.type, "dtype": str(dtype), "heads": HEADS}
        record["rows"] = [asdict(r) for r in rows]
        with open(options.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
