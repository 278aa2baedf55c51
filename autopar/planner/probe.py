"""Measure this machine for the planner: matmul throughput per dtype and GEMM shape, memory
bandwidth, host-to-device copies and, inside a process group, each collective the plans use
per group size. One code path for CUDA (NCCL) and CPU (gloo); each figure is the median of a
few timed repeats after one warm-up, so a CPU probe takes seconds.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.models.args import ModelArgs
from autopar.models.qwen import split_output
from autopar.parallel.torch_internals import TorchDispatchMode
from autopar.planner.profile import (
    AttentionPoint,
    CollectivePoint,
    DeviceProfile,
    MatmulPoint,
    ModelStepPoint,
    RecurrencePoint,
    attention_flops,
    model_key,
    recurrence_flops,
)

CPU_SQUARES = (128, 512, 1024)
CUDA_SQUARES = (1024, 4096, 8192)
CPU_ATTENTION = ((1, 8, 256, 32), (1, 8, 1024, 32))  # (batch, heads, seq, head_dim)
CUDA_ATTENTION = ((1, 16, 1024, 128), (1, 16, 4096, 128))
CPU_MESSAGES = (1 << 16, 1 << 20, 1 << 23)  # bytes: 64 KiB, 1 MiB, 8 MiB
CUDA_MESSAGES = (1 << 20, 1 << 24, 1 << 28)
REPEATS = 5
LONG_RUN_S = 0.5
"""A GEMM's warm-up this long is its own measurement: a one-time cost is lost in it, and the
repeats would cost seconds each (bfloat16 GEMMs on a CPU without bf16 units: 6.6 s for three
1024-cubed ones, measured on this project's 2-core CI machine)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object], device: torch.device, repeats: int = REPEATS, long_run_s: float = math.inf
) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up; a warm-up of
    ``long_run_s`` or more is taken as the measurement. Only where ranks need not make the same
    calls: a collective's ``fn`` must run as often on every rank."""
    start = time.perf_counter()
    fn()
    _sync(device)
    warm_up = time.perf_counter() - start
    if warm_up >= long_run_s:
        return warm_up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_together(
    fns: list[Callable[[], object]], device: torch.device, repeats: int = REPEATS
) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds in which each runs once in
    turn (each already warmed up)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, own in zip(fns, times):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            own.append(time.perf_counter() - start)
    return [statistics.median(own) for own in times]


def probe_dtypes(device: torch.device) -> list[str]:
    """float32 and bfloat16 everywhere; float8 where the GPU has FP8 tensor cores (sm 8.9+)."""
    dtypes = ["float32", "bfloat16"]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        dtypes.append("float8")
    return dtypes


def _matmul_fn(dtype: str, m: int, n: int, k: int, device: torch.device) -> Callable[[], object]:
    """A linear's training GEMMs over ``m`` rows, ``k`` in and ``n`` out features, in the
    layouts autograd runs them: forward x @ W.t(), input gradient g @ W, weight gradient
    g.t() @ x. Float8 runs the forward's ``torch._scaled_mm`` (row-major A, column-major B, as
    its kernel wants) three times, as torchao's recipes run all three in float8."""
    if dtype == "float8":
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: [
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16) for _ in range(3)
        ]
    x = torch.randn(m, k, device=device, dtype=getattr(torch, dtype))
    w = torch.randn(n, k, device=device, dtype=getattr(torch, dtype))
    g = torch.randn(m, n, device=device, dtype=getattr(torch, dtype))
    return lambda: (x @ w.t(), g @ w, g.t() @ x)


def probe_matmul(
    device: torch.device, dtypes: Iterable[str], shapes: Iterable[tuple[int, int, int]]
) -> list[MatmulPoint]:
    """FLOP/s of each (m, n, k) linear's forward and backward GEMMs in each dtype (float8 only
    where each size is a multiple of 16, as its kernel requires)."""
    points = []
    for dtype in dtypes:
        for m, n, k in shapes:
            if dtype == "float8" and (m % 16 or n % 16 or k % 16):
                continue
            seconds = timed(_matmul_fn(dtype, m, n, k, device), device, long_run_s=LONG_RUN_S)
            points.append(MatmulPoint(dtype, m, n, k, 6.0 * m * n * k / seconds))
    return points


def probe_memory(device: torch.device) -> float:
    """Bytes/s of a large elementwise product into a new tensor (two reads, one write), the
    kind of op the model's norms, activations and residuals are; a plain copy runs faster
    than they do."""
    numel = (1 << 28 if device.type == "cuda" else 1 << 24) // 4
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    return 3 * a.nbytes / timed(lambda: a * b, device)


def probe_host(device: torch.device) -> float | None:
    """Bytes/s of a pinned host-to-GPU copy; None on CPU, where there is no such copy."""
    if device.type != "cuda":
        return None
    src = torch.ones((1 << 28) // 4, pin_memory=True)
    dst = torch.empty(src.shape, device=device)
    return src.nbytes / timed(lambda: dst.copy_(src, non_blocking=True), device)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def initialized_model(args: ModelArgs, device: torch.device) -> torch.nn.Module:
    """The model ``args`` describe on ``device``, holding its initial weights. Built alone, its
    norms' weights are whatever memory held, and a step over such garbage (subnormals,
    infinities) took anywhere from 0.3 to 10 s for the debug Qwen3's 0.3 s one on this CPU."""
    from autopar.models.family import build_model

    with torch.device(device):
        model = build_model(args)
    model.init_weights(seed=0)
    return model


def forward_backward(model: torch.nn.Module, device: torch.device, tokens: int = 8) -> Callable[[], None]:
    """One forward and backward of ``model`` over one sequence of ``tokens`` tokens (a mixture
    of experts' logits, without its routing statistics)."""
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)

    def run() -> None:
        logits, _ = split_output(model(ids))
        logits.float().sum().backward()
        for p in model.parameters():
            p.grad = None

    return run


def probe_model_steps(
    device: torch.device,
    args: ModelArgs,
    batches: tuple[int, ...],
    seq: int,
    dtype: str,
    compiled: bool = False,
) -> list[ModelStepPoint]:
    """Seconds of one forward, cross-entropy and backward of the job's model (``args``) over
    each of ``batches`` sequences of ``seq`` tokens as training runs it: float32 master weights
    cast to ``dtype`` in each block's forward (``parallel.mixed_precision``), each block and the
    loss compiled where ``compiled``. The batches take turns (``timed_together``), so a slow
    spell of a shared machine slows each alike rather than one. A batch that does not fit on
    the device is left out."""
    from autopar.config.sections import Compile
    from autopar.parallel.compile import apply_compile
    from autopar.parallel.mixed_precision import apply_compute_dtype
    from autopar.parallel.torch_internals import static_shapes
    from autopar.training.loss import token_loss_sum

    loss = token_loss_sum
    model = initialized_model(args, device)
    if dtype != "float32":
        apply_compute_dtype(model, getattr(torch, dtype))
    if compiled:
        apply_compile(model, Compile(enable=True))  # keys inductor's cache on the vector ISA
        loss = torch.compile(token_loss_sum)  # as ``TrainContext`` compiles it

    def step(batch: int) -> Callable[[], None]:
        ids = torch.randint(0, args.vocab_size, (batch, seq), device=device)

        def run() -> None:
            logits, _ = split_output(model(ids))
            loss(logits, ids).backward()
            for p in model.parameters():
                p.grad = None

        return run

    fitting = {}
    # a static graph per batch, as a job compiles its one shape (a second shape would otherwise
    # recompile the graph with a dynamic batch: 4% slower on this CPU)
    with static_shapes():
        for batch in batches:
            try:
                fitting[batch] = step(batch)
                fitting[batch]()  # the warm-up (and, compiled, the compilation) at this shape
            except torch.OutOfMemoryError:
                del fitting[batch]
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        seconds = timed_together(list(fitting.values()), device)
    return [ModelStepPoint(model_key(args), dtype, b, seq, s, compiled) for b, s in zip(fitting, seconds)]


def count_ops(fn: Callable[[], None]) -> int:
    """The aten ops ``fn`` dispatches (on meta tensors this costs no compute)."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def reference_args() -> ModelArgs:
    """The model the probe times its per-op overhead on: the debug Qwen3 (tiny, always shipped)."""
    from autopar.training.resolve import model_args, parse_job

    return model_args(parse_job(["--job.config", "debug_model"]))


def probe_op_overhead(device: torch.device, args: ModelArgs | None = None) -> float:
    """Seconds per aten op of an eager forward and backward whose compute is negligible (the
    job's model, else the reference model, on 8 tokens): dispatch, autograd and Python, what a
    small model or a small shard pays beside its FLOPs (a custom op's own ops, which a count
    sees as one, included)."""
    run = forward_backward(initialized_model(args or reference_args(), device), device)
    ops = count_ops(run)
    return timed(run, device) / ops


CHECKPOINT_MODES = {"op": ("selective", "op"), "full": ("full", "op")}
"""Activation checkpointing whose machinery the probe times per op: (mode, selective option)."""


def probe_checkpoint_overheads(
    device: torch.device, args: ModelArgs | None = None
) -> tuple[tuple[str, float], ...]:
    """Seconds per model op of ``probe_op_overhead``'s forward and backward with every block
    checkpointed in each of ``CHECKPOINT_MODES``, eager: on this CPU per-op AC's policy, a
    Python call at every op in the forward and again in the recompute, made a one-sequence
    micro-batch's recompute cost twice what rerunning its ops did (BENCHMARKS.md)."""
    from autopar.config.sections import ActivationCheckpoint
    from autopar.parallel.activation_checkpoint import apply_ac

    args = args or reference_args()
    ops = count_ops(forward_backward(initialized_model(args, device), device))
    seconds = []
    for name, (mode, option) in CHECKPOINT_MODES.items():
        model = initialized_model(args, device)
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option), compiled=False)
        seconds.append((name, timed(forward_backward(model, device), device) / ops))
    return tuple(seconds)


PLAN_OVERHEADS = ("tp", "cp")
"""Plans whose own machinery (DTensor dispatch and its collectives, CP's attention mode and
k/v all-gathers) the probe times per op, on pairs of ranks."""


def probe_plan_overheads(
    device: torch.device, args: ModelArgs | None = None
) -> tuple[tuple[str, float], ...]:
    """Seconds per model op of the job's model's (else the reference model's) forward and
    backward on 8 tokens split by each of ``PLAN_OVERHEADS`` over pairs of ranks (training's
    own TP plan with sequence parallel; the CP context of this device): what a plan pays per
    op beyond eager's, with compute still negligible. Every rank calls; the slowest pair's
    figure; none on an odd world."""
    from autopar.config.sections import Parallelism
    from autopar.data.loader import Batch
    from autopar.parallel.context_parallel import ContextParallel
    from autopar.parallel.tensor_parallel import apply_tp

    world = dist.get_world_size()
    if world % 2:
        return ()
    pairs = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("pairs", "plan"))["plan"]
    args = args or reference_args()
    ops = count_ops(forward_backward(initialized_model(args, device), device))
    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    seconds = []
    for plan in PLAN_OVERHEADS:
        model = initialized_model(args, device)  # the same weights on both ranks
        if plan == "tp":
            apply_tp(model, pairs, args, sequence_parallel=True, loss_parallel=False)
            run = forward_backward(model, device)
        else:
            run = _context_parallel_pass(
                model, ContextParallel(Parallelism(), pairs, device.type), Batch(ids, ids)
            )
        slowest = torch.tensor([timed(run, device)], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds.append((plan, slowest.item() / ops))
    return tuple(seconds)


NARROW = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "vocab_size": 64,
}
"""The reference model narrowed until its weights move between ranks in no time: what FSDP
costs it is then its calls alone."""


def probe_fsdp_call(device: torch.device) -> float | None:
    """Seconds FSDP2 costs per collective call beyond the bytes it moves (its hooks, the
    copies in and out of the flat buffers, the wait for the pair's other rank), on pairs of
    ranks: the narrowed reference model fully sharded per block and at the root, forward and
    backward on 8 tokens, less the plain model's, over its calls (each unit gathered for
    forward and again for backward, its gradients reduce-scattered). The slowest pair's
    figure; none on an odd world."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if world % 2:
        return None
    pairs = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("pairs", "fsdp"))["fsdp"]
    args = dataclasses.replace(reference_args(), **NARROW)
    plain = timed(forward_backward(initialized_model(args, device), device), device)
    model = initialized_model(args, device)
    for block in model.layers.values():
        fully_shard(block, mesh=pairs)
    fully_shard(model, mesh=pairs)
    calls = 3 * (len(model.layers) + 1)
    extra = torch.tensor([(timed(forward_backward(model, device), device) - plain) / calls], device=device)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return extra.item() if extra.item() > 0 else None


def _context_parallel_pass(model: torch.nn.Module, cp, batch) -> Callable[[], None]:
    """``forward_backward`` with the batch split by ``cp`` and attention spanning its ranks."""

    def run() -> None:
        with cp(batch) as (local, positions):
            logits, _ = split_output(model(local.inputs, positions=positions))
            logits.float().sum().backward()
        for p in model.parameters():
            p.grad = None

    return run


def group_sizes(world_size: int) -> list[int]:
    """Powers of two from 2 up to the world, and the world itself."""
    sizes = [g for g in (2**i for i in range(1, 20)) if g <= world_size]
    return sizes + ([world_size] if world_size > 1 and world_size not in sizes else [])


def _collective_fn(op: str, numel: int, group_ranks: list[int], group, device: torch.device):
    """(the collective over ``group`` for a tensor of ``numel`` float32 elements, bus bytes
    it moves per rank as a multiple of the tensor's bytes)."""
    g, rank = len(group_ranks), dist.get_rank()
    whole = torch.ones(numel - numel % g, device=device)
    part = torch.ones(whole.numel() // g, device=device)
    share = (g - 1) / g
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, part, group=group), share
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, whole, group=group), share
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group), 2 * share
    if op == "all_to_all":
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole, group=group), share
    if op in ("seq_all_gather", "seq_reduce_scatter"):
        return _sequence_gather_fn(op, numel // g, group, device), share
    first, last = group_ranks[0], group_ranks[-1]  # send/recv across the group's span

    def send_recv() -> None:
        if rank == first:
            dist.send(whole, dst=last)
        elif rank == last:
            dist.recv(whole, src=first)

    return send_recv, 1.0


def _sequence_gather_fn(op: str, numel: int, group, device: torch.device) -> Callable[[], object]:
    """All-gather CP's gather of a rank's ``numel`` k/v elements along the sequence
    (``parallel.context_parallel.all_gather``), forward, or its backward alone."""
    from autopar.parallel.context_parallel import all_gather

    batch, heads, head_dim = 8, 4, 32
    part = torch.ones(batch, heads, max(1, numel // (batch * heads * head_dim)), head_dim, device=device)
    if op == "seq_all_gather":
        return lambda: all_gather(part, gather_dim=2, group=group)
    part.requires_grad_()
    gathered = all_gather(part, gather_dim=2, group=group)
    grad = torch.ones_like(gathered)
    return lambda: gathered.backward(grad, retain_graph=True)


def probe_collectives(
    device: torch.device, messages: Iterable[int], ops: Iterable[str], repeats: int = REPEATS
) -> list[CollectivePoint]:
    """Bus bandwidth of each op over the first g ranks for every group size g, at each
    message size: the slowest rank's median, agreed on by all ranks. Every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    slowest = dist.ReduceOp.MAX
    points = []
    for g in group_sizes(world):
        ranks = list(range(g))
        group = dist.new_group(ranks)
        for op in ops:
            for nbytes in messages:
                seconds, share = torch.zeros(1, device=device), 1.0
                if rank < g:
                    fn, share = _collective_fn(op, nbytes // 4, ranks, group, device)
                    seconds[0] = timed(fn, device, repeats)
                dist.all_reduce(seconds, op=slowest)
                points.append(CollectivePoint(op, g, nbytes, share * nbytes / seconds.item()))
        dist.barrier()
    return points


def _attention_fn(
    dtype: str, b: int, h: int, seq: int, d: int, device: torch.device, cp: int = 1
) -> Callable[[], None]:
    """One causal SDPA forward and backward over (b, h, seq, d) in ``dtype``; with ``cp`` > 1
    the first all-gather CP rank's call (``AttentionPoint``)."""
    half = getattr(torch, dtype)
    k, v = (torch.randn(b, h, seq, d, device=device, dtype=half, requires_grad=True) for _ in range(2))
    if cp == 1:
        q = torch.randn(b, h, seq, d, device=device, dtype=half, requires_grad=True)
        return lambda: (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        )
    from autopar.parallel.context_parallel import shard_sequence

    positions = shard_sequence(torch.arange(seq, device=device), 0, cp, head_tail=True, dim=0)
    mask = torch.arange(seq, device=device)[None, :] <= positions[:, None]
    q = torch.randn(b, h, len(positions), d, device=device, dtype=half, requires_grad=True)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()


def probe_attention(
    device: torch.device, dtypes: Iterable[str], shapes: Iterable[tuple[int, ...]]
) -> list[AttentionPoint]:
    """FLOP/s of a causal SDPA forward and backward at each (batch, heads, seq, head_dim), or
    (..., cp) as an all-gather CP rank of ``cp`` calls it."""
    points = []
    for dtype in dtypes:
        if dtype == "float8":  # attention runs in bf16 under FP8 training
            continue
        for b, h, seq, d, *rest in shapes:
            cp = rest[0] if rest else 1
            seconds = timed(_attention_fn(dtype, b, h, seq, d, device, cp), device)
            flops = attention_flops(b, h, seq, d) / cp
            points.append(AttentionPoint(dtype, b, h, seq, d, flops / seconds, cp))
    return points


def _recurrence_fn(
    dtype: str, shape: tuple[int, int, int, int, int, int], device: torch.device, kernel: str
) -> Callable[[], None]:
    """One gated delta rule forward and backward (``training.delta_rule_kernel`` ``kernel`` as
    it runs here) over (batch, seq, key heads, value heads, dk, dv) in ``dtype``."""
    from autopar.models.qwen3_5.delta_rule import l2norm
    from autopar.models.qwen3_5.triton_delta_rule import triton_problem
    from autopar.parallel.delta_rule_kernel import KERNELS, resolve_delta_rule_kernel

    rule = KERNELS[resolve_delta_rule_kernel(kernel, device.type, triton_problem() is None)].rule

    b, seq, hk, hv, dk, dv = shape
    half = getattr(torch, dtype)
    q, k = (l2norm(torch.randn(b, seq, hk, dk, device=device)).to(half).requires_grad_() for _ in range(2))
    v = torch.randn(b, seq, hv, dv, device=device, dtype=half, requires_grad=True)
    g = -torch.rand(b, seq, hv, device=device)  # log decay <= 0, fp32
    beta = torch.rand(b, seq, hv, device=device, dtype=half)
    return lambda: rule(q, k, v, g, beta).float().sum().backward()


def probe_recurrence(
    device: torch.device,
    dtypes: Iterable[str],
    shapes: Iterable[tuple[int, int, int, int, int, int]],
    kernel: str = "auto",
) -> list[RecurrencePoint]:
    """FLOP/s of the gated delta rule's forward and backward at each shape (a hybrid job's),
    by the job's ``training.delta_rule_kernel``."""
    points = []
    for dtype in dtypes:
        if dtype == "float8":
            continue
        for shape in shapes:
            seconds = timed(_recurrence_fn(dtype, shape, device, kernel), device)
            b, seq, _, hv, dk, dv = shape
            points.append(RecurrencePoint(dtype, *shape, recurrence_flops(b * seq, hv, dk, dv) / seconds))
    return points


def device_memory_gib(device: torch.device, local_world: int) -> float:
    """The GPU's memory, or this host's RAM shared by its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / 2**30 / max(1, local_world)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def run_probe(
    device: torch.device,
    job_shapes: Iterable[tuple[int, int, int]] = (),
    collectives: Iterable[str] = (),
    local_world: int = 1,
    job_attention: Iterable[tuple[int, ...]] = (),
    job_recurrence: Iterable[tuple[int, int, int, int, int, int]] = (),
    job_step: tuple[ModelArgs, tuple[int, ...], int, bool] | None = None,
    delta_rule_kernel: str = "auto",
) -> DeviceProfile:
    """The profile of ``device``: matmuls at the probe's squares and ``job_shapes``, attention
    at the probe's shapes and ``job_attention``, memory and host bandwidth, per-op overhead
    (on the job's model where ``job_step`` names it, else the reference model),
    the job's whole model step (``job_step``: its arguments, batches, sequence length and
    whether it compiles, in the dtype it computes in here), the delta rule by the job's
    ``delta_rule_kernel``, and ``collectives`` when a process group is initialised (every rank
    calls)."""
    attention = sorted(set(CUDA_ATTENTION if device.type == "cuda" else CPU_ATTENTION) | set(job_attention))
    squares = CUDA_SQUARES if device.type == "cuda" else CPU_SQUARES
    shapes = sorted({(s, s, s) for s in squares} | set(job_shapes))
    messages = CUDA_MESSAGES if device.type == "cuda" else CPU_MESSAGES
    grouped = dist.is_available() and dist.is_initialized()
    cuda = device.type == "cuda"
    return DeviceProfile(
        device=device_name(device),
        device_type=device.type,
        torch=torch.__version__,
        driver=_driver() if cuda else None,
        cuda=torch.version.cuda if cuda else None,
        world_size=dist.get_world_size() if grouped else 1,
        local_world_size=local_world,
        memory_gib=device_memory_gib(device, local_world),
        matmul=tuple(probe_matmul(device, probe_dtypes(device), shapes)),
        memory_bytes_per_s=probe_memory(device),
        host_bytes_per_s=probe_host(device),
        op_overhead_s=probe_op_overhead(device, job_step[0] if job_step else None),
        attention=tuple(probe_attention(device, probe_dtypes(device), attention)),
        recurrence=tuple(probe_recurrence(device, probe_dtypes(device), job_recurrence, delta_rule_kernel)),
        collectives=tuple(probe_collectives(device, messages, collectives)) if grouped else (),
        plan_op_overhead_s=(
            probe_plan_overheads(device, job_step[0] if job_step else None) if grouped and collectives else ()
        ),
        fsdp_call_s=probe_fsdp_call(device) if grouped and collectives else None,
        model_steps=probe_job_step(device, job_step),
        checkpoint_op_overhead_s=probe_checkpoint_overheads(device, job_step[0] if job_step else None),
    )


def probe_job_step(
    device: torch.device, job_step: tuple[ModelArgs, tuple[int, ...], int, bool] | None
) -> tuple[ModelStepPoint, ...]:
    """The job's model step in the dtype training computes in on ``device`` (float32 on CPU,
    bfloat16 on GPUs, as ``training.mixed_precision_param = "auto"`` picks) at each of
    ``job_step``'s batches, eager and, where the job compiles (its last item), compiled; in a
    process group every rank times it at once and the slowest rank's figure is kept (none
    where a rank ran out of memory)."""
    if job_step is None:
        return ()
    args, batches, seq, compiled = job_step
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return tuple(
        point
        for mode in ((False, True) if compiled else (False,))
        for point in _slowest_rank_steps(device, args, batches, seq, dtype, mode)
    )


def _slowest_rank_steps(
    device: torch.device, args: ModelArgs, batches: tuple[int, ...], seq: int, dtype: str, compiled: bool
) -> list[ModelStepPoint]:
    """``probe_model_steps`` on every rank of a process group at once (a CPU's cores share
    its clock), with the slowest rank's seconds at each batch; alone where there is no group."""
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        dist.barrier()
    points = probe_model_steps(device, args, batches, seq, dtype, compiled)
    if not grouped:
        return points
    mine = {p.batch: p for p in points}
    slowest = torch.tensor([mine[b].seconds if b in mine else math.inf for b in batches], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [
        dataclasses.replace(mine[b], seconds=s)
        for b, s in zip(batches, slowest.tolist())
        if b in mine and math.isfinite(s)
    ]


def _driver() -> str | None:
    """The NVIDIA driver version, when the NVML binding answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML here: the profile says None
        return None
