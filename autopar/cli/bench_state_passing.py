"""Bytes a Gated DeltaNet layer moves per step under context parallelism, counted.

    python -m autopar.cli.bench_state_passing --flavor 27B --seq 131072 --cp 2 4 8 16

One layer of the named Qwen3.5 flavor runs forward and backward as CP rank 0 of a fake
process group, under fake tensors (no memory, no arithmetic), while every collective it
issues is counted: an all-gather or a reduce-scatter of N bytes over p ranks brings each
rank (p - 1) / p N. Beside it, the same count for the all-to-all scheme (Megatron's, which
we do not implement) from its definition: the layer's inputs to the per-head core (q, k, v
before the convolution, the decay and write-strength inputs) turned from sequence-sharded to
head-sharded, and the core's output turned back, forward and backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.distributed as dist

from autopar.models.args import ModelArgs
from autopar.models.flavors import get_flavor
from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet
from autopar.parallel.state_passing import StatePassing
from autopar.parallel.torch_internals import FakeTensorMode, TorchDispatchMode, fake_store


class CountCollectives(TorchDispatchMode):
    """Bytes each rank receives through the functional all-gathers and reduce-scatters."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "all_gather_into_tensor":  # (input, group_size, group_name)
            group_size = args[1]
            self.received += args[0].numel() * args[0].element_size() * (group_size - 1)
        elif name == "reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
            group_size = args[2]
            self.received += args[0].numel() * args[0].element_size() * (group_size - 1) // group_size
        return func(*args, **(kwargs or {}))


def state_passing_bytes(args: ModelArgs, seq: int, cp: int, head_tail: bool, dtype: torch.dtype) -> int:
    """Bytes CP rank 0 receives for one sequence through one layer's forward and backward."""
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=cp)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))["cp"]
        with torch.device("meta"):
            layer = GatedDeltaNet(args).to(dtype)
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer.to_empty(device="cpu")
            layer.core.sequence = StatePassing(mesh, head_tail)
            x = torch.empty(1, seq // cp, args.hidden_size, dtype=dtype, requires_grad=True)
            with CountCollectives() as counter:
                layer(x).sum().backward()
        return counter.received
    finally:
        dist.destroy_process_group()


def all_to_all_bytes(args: ModelArgs, seq: int, cp: int, dtype: torch.dtype) -> int:
    """Bytes one rank receives for one sequence through one layer, forward and backward, in
    the all-to-all scheme: (cp - 1) / cp of its shard of each tensor crossing layouts."""
    key = args.linear_num_key_heads * args.linear_key_head_dim
    value = args.linear_num_value_heads * args.linear_value_head_dim
    heads = args.linear_num_value_heads
    channels = 2 * key + value + 2 * heads + value  # in: q, k, v, a, b; out: the core's output
    shard = seq // cp * channels * torch.tensor([], dtype=dtype).element_size()
    return 2 * shard * (cp - 1) // cp


def _table(flavor: str, seq: int, degrees: list[int], head_tail: bool, dtype: torch.dtype) -> str:
    args = dataclasses.replace(get_flavor("qwen3.5", flavor), max_position_embeddings=seq)
    header = f"{'cp':>4} {'state passing':>15} {'all-to-all':>15} {'ratio':>9}"
    lines = [
        f"Qwen3.5-{flavor} Gated DeltaNet layer, seq {seq:,}, {dtype}, one sequence, forward + backward, "
        f"bytes received per rank ({'head-tail' if head_tail else 'in-order'} ranges)",
        header,
        "-" * len(header),
    ]
    for cp in degrees:
        ours, theirs = (
            state_passing_bytes(args, seq, cp, head_tail, dtype),
            all_to_all_bytes(args, seq, cp, dtype),
        )
        lines.append(f"{cp:>4} {ours / 2**20:>12.1f}MiB {theirs / 2**20:>12.1f}MiB {theirs / ours:>8.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.bench_state_passing", description=__doc__)
    parser.add_argument("--flavor", default="27B")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--in-order", action="store_true", help="one range per rank (no head-tail balancing)")
    known = parser.parse_args(argv)
    print(_table(known.flavor, known.seq, known.cp, not known.in_order, torch.bfloat16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
