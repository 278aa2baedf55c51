"""The delta-rule kernel table: autopar's chunked gated delta rule beside transformers' torch
reference, at a Qwen3.5 flavor's head counts (default 9B's: 16 key heads, 32 value heads,
dk = dv = 128).

    python -m autopar.cli.bench_delta_rule [--seq 2048 8192] [--flavor 9B] [--batch 1]
        [--repeat 3] [--json out.json]

Per sequence length: forward + backward seconds of each (median of ``--repeat``), their
ratio, the bytes each keeps for backward as a multiple of its inputs, one Gated DeltaNet
layer compiled against eager (with the job default's kernel: ``triton`` on CUDA), and the
largest output difference from the reference (the correctness figure beside the speed
ones). Inputs are fp32 on CPU, bf16 on CUDA. On CUDA, the ``triton`` kernel's columns: its
forward + backward and forward seconds, what it keeps, and its error ratio (the largest
||bf16 - fp32|| / ||fp32|| over the output and every input's gradient, against autopar's
kernel in fp32 on the same values); with fla-core installed, FLA's kernels
(``training.delta_rule_kernel = "fla"``) get their forward seconds, and where FLA runs its
backward here, its time, what it keeps, the layer compiled with them and their difference
from ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from autopar.cli.bench import source_commit
from autopar.models import get_flavor
from autopar.models.qwen3_5.delta_rule import DeltaRuleKernel, gated_delta_rule
from autopar.models.qwen3_5.fla_delta_rule import FLA, fla_gated_delta_rule, fla_version_problem
from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet
from autopar.models.qwen3_5.triton_delta_rule import triton_gated_delta_rule, triton_problem
from autopar.parallel.delta_rule_kernel import apply_delta_rule_kernel
from autopar.parallel.torch_internals import key_compile_cache_on_vector_isa


def heads(flavor: str) -> dict[str, int]:
    """A Qwen3.5 flavor's Gated DeltaNet head counts and widths."""
    args = get_flavor("qwen3.5", flavor)
    return {
        "key_heads": args.linear_num_key_heads,
        "value_heads": args.linear_num_value_heads,
        "key_dim": args.linear_key_head_dim,
        "value_dim": args.linear_value_head_dim,
    }


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
    fla_forward_seconds: float | None = None
    triton_seconds: float | None = None
    triton_forward_seconds: float | None = None
    triton_saved_x_inputs: float | None = None
    triton_error_ratio: float | None = None
    ours_forward_seconds: float | None = None


def inputs(
    seq: int, device: torch.device, dtype: torch.dtype, shape: dict[str, int], batch: int = 1
) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    kh, vh, dk, dv = shape.values()

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype).requires_grad_()

    q, k, v = draw(batch, seq, kh, dk), draw(batch, seq, kh, dk), draw(batch, seq, vh, dv)
    g = (-torch.rand(batch, seq, vh, generator=gen, device=device) * 2).requires_grad_()
    beta = torch.rand(batch, seq, vh, generator=gen, device=device).to(dtype).requires_grad_()
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


def saved_bytes(fn: Callable[..., object], *args: object, **kwargs: object) -> int:
    """Bytes autograd keeps for backward of ``fn(*args, **kwargs)``."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return total


def saved_multiple(fn: Callable[..., torch.Tensor], tensors: list[torch.Tensor]) -> float:
    """Bytes autograd keeps for backward, over the inputs' bytes."""
    return saved_bytes(fn, *tensors) / sum(t.numel() * t.element_size() for t in tensors)


def forward_seconds(fn: Callable[[], torch.Tensor], repeat: int, device: torch.device) -> float:
    """Median seconds of a forward alone (no autograd)."""
    with torch.no_grad():
        return timed_forward(fn, repeat, device)


def timed_forward(fn: Callable[[], torch.Tensor], repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def error_ratio(tensors: list[torch.Tensor]) -> float:
    """The triton kernel in the inputs' dtype against autopar's in fp32 on the same values:
    the largest ||ours - fp32|| / ||fp32|| over the output and each input's gradient."""

    def output_and_grads(rule, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        out = rule(*leaves)
        weight = torch.randn(
            out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device
        )
        return [out, *torch.autograd.grad((out.float() * weight).sum(), leaves)]

    ours = output_and_grads(triton_gated_delta_rule, tensors)
    exact = output_and_grads(gated_delta_rule, [t.float() for t in tensors])
    return max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(ours, exact))


def layer_seconds(
    seq: int,
    device: torch.device,
    dtype: torch.dtype,
    repeat: int,
    flavor: str,
    kernel: DeltaRuleKernel | None = None,
) -> tuple[float, float]:
    """(eager, compiled) forward + backward seconds of one Gated DeltaNet layer of ``flavor``
    (by ``kernel``, else the job default's for this device)."""
    args = get_flavor("qwen3.5", flavor)
    torch.manual_seed(0)
    layer = GatedDeltaNet(args).to(device=device, dtype=dtype)
    apply_delta_rule_kernel(layer, "auto", device.type)
    if kernel is not None:
        layer.core.sequence.kernel = kernel
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, seq, args.hidden_size, device=device, dtype=dtype)
    key_compile_cache_on_vector_isa()
    compiled = torch.compile(layer, fullgraph=True)
    return timed(lambda: layer(x), repeat, device), timed(lambda: compiled(x), repeat, device)


@dataclass(frozen=True)
class Setting:
    flavor: str
    batch: int
    repeat: int
    device: torch.device
    dtype: torch.dtype


def triton_columns(tensors: list[torch.Tensor], at: Setting) -> dict[str, float]:
    """The triton kernel's columns (CUDA only: on a CPU its programs run interpreted)."""
    if at.device.type != "cuda" or triton_problem() is not None:
        return {}
    return {
        "triton_seconds": timed(lambda: triton_gated_delta_rule(*tensors), at.repeat, at.device),
        "triton_forward_seconds": forward_seconds(
            lambda: triton_gated_delta_rule(*tensors), at.repeat, at.device
        ),
        "triton_saved_x_inputs": saved_multiple(triton_gated_delta_rule, tensors),
        "triton_error_ratio": error_ratio(tensors),
        "ours_forward_seconds": forward_seconds(lambda: gated_delta_rule(*tensors), at.repeat, at.device),
    }


def fla_columns(seq: int, tensors: list[torch.Tensor], at: Setting) -> dict[str, float]:
    """FLA's forward where fla-core imports on CUDA; its backward and layer where it runs here."""
    if at.device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return {}
    columns = {
        "fla_forward_seconds": forward_seconds(lambda: fla_gated_delta_rule(*tensors), at.repeat, at.device)
    }
    if fla_version_problem() is None:  # Hopper with Triton < 3.7.1: FLA refuses its backward
        with torch.no_grad():
            ours_out = gated_delta_rule(*tensors).float()
            fla_out = fla_gated_delta_rule(*tensors).float()
        columns |= {
            "fla_seconds": timed(lambda: fla_gated_delta_rule(*tensors), at.repeat, at.device),
            "fla_saved_x_inputs": saved_multiple(fla_gated_delta_rule, tensors),
            "layer_fla_compiled_seconds": layer_seconds(seq, at.device, at.dtype, at.repeat, at.flavor, FLA)[
                1
            ],
            "fla_max_difference_from_ours": (fla_out - ours_out).abs().max().item(),
        }
    return columns


def row(seq: int, at: Setting) -> KernelRow:
    tensors = inputs(seq, at.device, at.dtype, heads(at.flavor), at.batch)
    ours = timed(lambda: gated_delta_rule(*tensors), at.repeat, at.device)
    theirs = timed(lambda: reference(*tensors), at.repeat, at.device)
    with torch.no_grad():
        difference = (gated_delta_rule(*tensors).float() - reference(*tensors).float()).abs().max().item()
    eager, compiled = layer_seconds(seq, at.device, at.dtype, at.repeat, at.flavor)
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
        **triton_columns(tensors, at),
        **fla_columns(seq, tensors, at),
    )


def table(rows: list[KernelRow]) -> str:
    header = (
        f"{'seq':>6} {'ours s':>8} {'HF ref s':>9} {'speedup':>8} {'saved/in ours':>14} "
        f"{'saved/in HF':>12} {'layer eager s':>14} {'compiled s':>11} {'max |diff|':>11}"
    )
    extra = [
        ("ours fwd s", "ours_forward_seconds", ".3f"),
        ("triton s", "triton_seconds", ".3f"),
        ("triton fwd s", "triton_forward_seconds", ".3f"),
        ("saved/in triton", "triton_saved_x_inputs", ".1f"),
        ("triton err", "triton_error_ratio", ".2e"),
        ("FLA fwd s", "fla_forward_seconds", ".3f"),
        ("FLA s", "fla_seconds", ".3f"),
        ("saved/in FLA", "fla_saved_x_inputs", ".1f"),
        ("FLA compiled s", "layer_fla_compiled_seconds", ".3f"),
        ("FLA-ours", "fla_max_difference_from_ours", ".2e"),
    ]
    extra = [column for column in extra if any(getattr(r, column[1]) is not None for r in rows)]
    header += "".join(f" {title:>{len(title) + 1}}" for title, _, _ in extra)
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r.seq:>6} {r.ours_seconds:>8.3f} {r.reference_seconds:>9.3f} {r.speedup:>7.2f}x "
            f"{r.ours_saved_x_inputs:>13.1f}x {r.reference_saved_x_inputs:>11.1f}x "
            f"{r.layer_eager_seconds:>14.3f} {r.layer_compiled_seconds:>11.3f} {r.max_output_difference:>11.2e}"
        )
        for title, name, spec in extra:
            value = getattr(r, name)
            line += f" {'n/a' if value is None else format(value, spec):>{len(title) + 1}}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.bench_delta_rule", description=__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths")
    parser.add_argument("--flavor", default="9B", help="the Qwen3.5 flavor whose heads to run")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    options = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    at = Setting(options.flavor, options.batch, options.repeat, device, dtype)
    rows = [row(seq, at) for seq in options.seq]
    shape = heads(options.flavor)
    print(f"gated delta rule, {shape}, batch {options.batch}, {dtype} on {device.type}, forward + backward")
    print(table(rows))
    if options.json:
        record = {"commit": source_commit(), "device": device.type, "dtype": str(dtype), "heads": shape}
        record |= {"flavor": options.flavor, "batch": options.batch, "rows": [asdict(r) for r in rows]}
        with open(options.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
