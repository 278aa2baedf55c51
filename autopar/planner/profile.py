"""A device profile: what ``python -m autopar.probe`` measured on one machine, and the figures
the time model reads from it in place of a preset's datasheet constants.

Matmul throughput is kept per dtype at a few linear shapes (a linear's forward, input-gradient
and weight-gradient GEMMs together, in autograd's layouts), read exactly at a measured shape
and at any other by interpolating log(FLOP/s) over log(FLOPs of the GEMM), clamped at the measured ends: small
GEMMs run far below peak, and that is what a plan that shards its matmuls (TP, CP) pays.
Collectives are kept as bus bandwidth (nccl-tests' convention: the bytes each rank moves over
the link per second, so ``moved / bus_bytes_per_s`` is the time for any group size) per group
size and message size, read the same way over log(message bytes).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autopar.config.errors import ConfigError
from autopar.models.args import ModelArgs
from autopar.training.metrics.flops import DELTA_RULE_CHUNK

COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "send_recv",
    "seq_all_gather",
    "seq_reduce_scatter",
)
"""The collectives the probe times. ``seq_all_gather`` is all-gather CP's k/v gather as it
runs: the autograd-aware functional all-gather of a (batch, heads, seq, head_dim) tensor
along its sequence, with the layout copies that dimension costs; ``seq_reduce_scatter`` is
that gather's backward (on this CPU the two took 2.3x gloo's plain pair, BENCHMARKS.md)."""


@dataclass(frozen=True)
class MatmulPoint:
    """One timed linear of ``m`` rows, ``k`` in and ``n`` out features: its three GEMMs."""

    dtype: str  # "float32", "bfloat16" or "float8"
    m: int
    n: int
    k: int
    flops_per_s: float

    @property
    def flops(self) -> float:
        return 6.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class AttentionPoint:
    """One timed causal SDPA forward and backward over (batch, heads, seq, head_dim); with
    ``cp`` > 1, as one of ``cp`` ranks of all-gather CP calls it: its seq / cp queries (the
    head and tail chunks) against every key under the causal mask, a rectangle the kernel
    cannot skip the masked half of."""

    dtype: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    flops_per_s: float  # counted as training FLOPs count attention: 12 x heads x head_dim x seq per token
    cp: int = 1

    @property
    def flops(self) -> float:
        """The call's share of the causal attention's FLOPs (a CP rank's: 1 / ``cp``)."""
        return attention_flops(self.batch, self.heads, self.seq, self.head_dim) / self.cp


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward and backward FLOPs of one attention over ``batch`` sequences of ``seq`` tokens,
    as ``training.metrics.flops_per_token`` counts them (causal not halved)."""
    return 12.0 * heads * head_dim * seq * seq * batch


@dataclass(frozen=True)
class RecurrencePoint:
    """One timed gated delta rule (Gated DeltaNet's recurrence) forward and backward over
    ``batch`` sequences of ``seq`` tokens, ``key_heads`` / ``value_heads`` of ``dk`` / ``dv``."""

    dtype: str
    batch: int
    seq: int
    key_heads: int
    value_heads: int
    dk: int
    dv: int
    flops_per_s: float  # counted as training.metrics.delta_rule_flops counts them

    @property
    def flops(self) -> float:
        return recurrence_flops(self.batch * self.seq, self.value_heads, self.dk, self.dv)


def recurrence_flops(tokens: int, value_heads: int, dk: int, dv: int) -> float:
    """Training FLOPs of one gated delta rule over ``tokens`` tokens, as
    ``training.metrics.delta_rule_flops`` counts them per token."""
    return 3.0 * value_heads * (6 * dk * dv + 2 * DELTA_RULE_CHUNK * (2 * dk + dv)) * tokens


@dataclass(frozen=True)
class ModelStepPoint:
    """One timed forward, cross-entropy and backward of a job's whole model on one rank, every
    rank at once as training runs them: what the time model's terms do not itemise (norms,
    rotary, activations, residuals, the loss, the short convolution and gates of a hybrid
    model) is what this took beyond its GEMMs, attention, recurrence and dispatch."""

    model: str  # model_key of the model's arguments
    dtype: str
    batch: int
    seq: int
    seconds: float
    compiled: bool = False
    """Each block and the loss under ``torch.compile``, as a compiled job trains (profiles
    written before this field timed eager steps only)."""


def model_key(args: ModelArgs) -> str:
    """A short stable name of a model's architecture, for matching a profile's timed step."""
    return hashlib.sha1(repr(args).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CollectivePoint:
    """One timed collective over ``group`` consecutive ranks, ``bytes`` the full tensor's size."""

    op: str
    group: int
    bytes: int
    bus_bytes_per_s: float


@dataclass(frozen=True)
class DeviceProfile:
    """Everything one probe run measured, and where (device, versions, world shape)."""

    device: str
    device_type: str  # "cuda" or "cpu"
    torch: str
    driver: str | None  # CUDA only
    cuda: str | None  # CUDA only
    world_size: int
    local_world_size: int
    memory_gib: float  # per rank: the GPU's, or the host's RAM shared by the local ranks
    matmul: tuple[MatmulPoint, ...]
    memory_bytes_per_s: float  # a large elementwise product (two reads and a write)
    host_bytes_per_s: float | None  # host -> device copy; None on CPU
    collectives: tuple[CollectivePoint, ...] = ()
    op_overhead_s: float | None = None  # eager seconds per aten op beside its compute
    attention: tuple[AttentionPoint, ...] = ()
    recurrence: tuple[RecurrencePoint, ...] = ()
    plan_op_overhead_s: tuple[tuple[str, float], ...] = ()
    """(plan, seconds per model op) under a plan's own machinery ("tp", "cp"), timed on two
    ranks; a plan without one pays ``op_overhead_s``."""
    fsdp_call_s: float | None = None
    """Seconds FSDP2 costs per collective call beyond the bytes it moves (hooks, copies, the
    pair's wait), timed on two ranks with weights too small to take time to move."""
    model_steps: tuple[ModelStepPoint, ...] = ()
    checkpoint_op_overhead_s: tuple[tuple[str, float], ...] = ()
    """(activation checkpointing, "op" or "full": seconds per model op of an eager forward and
    backward with every block checkpointed so, on ``op_overhead_s``'s 8 tokens): beyond
    eager's, what the checkpoint's machinery (saved-tensor hooks, per-op AC's policy at every
    op in the forward and again in the recompute) adds to a checkpointed block."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> DeviceProfile:
        """The profile a ``to_json`` record describes; TypeError or ValueError on a wrong one."""
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in record]
        if missing:
            raise ValueError(f"missing field{'s' * (len(missing) > 1)} {', '.join(missing)}")
        fields = dict(record)
        fields["matmul"] = tuple(MatmulPoint(**p) for p in record["matmul"])
        fields["collectives"] = tuple(CollectivePoint(**p) for p in record.get("collectives", ()))
        fields["attention"] = tuple(AttentionPoint(**p) for p in record.get("attention", ()))
        fields["recurrence"] = tuple(RecurrencePoint(**p) for p in record.get("recurrence", ()))
        fields["plan_op_overhead_s"] = tuple((str(k), v) for k, v in record.get("plan_op_overhead_s", ()))
        fields["model_steps"] = tuple(ModelStepPoint(**p) for p in record.get("model_steps", ()))
        fields["checkpoint_op_overhead_s"] = tuple(
            (str(k), v) for k, v in record.get("checkpoint_op_overhead_s", ())
        )
        profile = cls(**fields)
        profile.check()
        return profile

    def check(self) -> None:
        """ValueError naming the first figure that is not a positive number."""
        figures = {"memory_gib": self.memory_gib, "memory_bytes_per_s": self.memory_bytes_per_s}
        for name in ("host_bytes_per_s", "op_overhead_s", "fsdp_call_s"):
            if getattr(self, name) is not None:
                figures[name] = getattr(self, name)
        figures |= {f"matmul {p.dtype} {p.m}x{p.n}x{p.k}": p.flops_per_s for p in self.matmul}
        figures |= {f"{c.op} group {c.group} {c.bytes} B": c.bus_bytes_per_s for c in self.collectives}
        figures |= {f"attention {a.dtype} seq {a.seq} cp {a.cp}": a.flops_per_s for a in self.attention}
        figures |= {f"recurrence {r.dtype} seq {r.seq}": r.flops_per_s for r in self.recurrence}
        figures |= {f"plan_op_overhead_s {plan}": s for plan, s in self.plan_op_overhead_s}
        figures |= {f"model step {m.model} seq {m.seq}": m.seconds for m in self.model_steps}
        figures |= {f"checkpoint_op_overhead_s {mode}": s for mode, s in self.checkpoint_op_overhead_s}
        for name, value in figures.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} is {value!r}, not a positive number")
        if not any(p.dtype in ("float32", "bfloat16") for p in self.matmul):
            raise ValueError("no float32 or bfloat16 matmul was measured")

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))

    def matmul_flops_per_s(self, dtype: str, m: int, n: int, k: int) -> float:
        """FLOP/s of a linear's training GEMMs (m rows, k in, n out) in ``dtype``
        (``matmul_flops_per_s`` over this profile's points)."""
        return matmul_flops_per_s(self.matmul, dtype, m, n, k)

    def attention_flops_per_s(
        self, dtype: str, flops: float, seq: int | None = None, cp: int = 1
    ) -> float | None:
        """FLOP/s of an attention of ``flops`` (``attention_flops``, a CP rank's share) over
        ``seq`` keys in ``dtype`` (bfloat16's for float8, whose attention runs in bf16), as an
        all-gather CP rank of ``cp`` calls it where the probe timed that (else as one rank
        does), interpolated among the points timed at that sequence length where there are
        any (a kernel's rate at one length says little of another's at the same FLOPs); None
        when none was measured."""
        dtype = "bfloat16" if dtype == "float8" else dtype
        points = [a for a in self.attention if a.dtype == dtype]
        points = [a for a in points if a.cp == cp] or [a for a in points if a.cp == 1]
        points = [a for a in points if a.seq == seq] or points
        return log_interpolate([(a.flops, a.flops_per_s) for a in points], flops) if points else None

    def recurrence_flops_per_s(self, dtype: str, flops: float, seq: int | None = None) -> float | None:
        """FLOP/s of a gated delta rule of ``flops`` (``recurrence_flops``) over sequences of
        ``seq`` tokens in ``dtype`` (bfloat16's for float8), among the points of that length
        where there are any; None when none was measured."""
        dtype = "bfloat16" if dtype == "float8" else dtype
        points = [r for r in self.recurrence if r.dtype == dtype]
        points = [r for r in points if r.seq == seq] or points
        return log_interpolate([(r.flops, r.flops_per_s) for r in points], flops) if points else None

    def model_step(self, args: ModelArgs, dtype: str, compiled: bool = False) -> tuple[ModelStepPoint, ...]:
        """The timed steps of this model in ``dtype``, eager or ``compiled``, at each batch the
        probe ran its job at (none if it did not)."""
        key = model_key(args)
        return tuple(m for m in self.model_steps if (m.model, m.dtype, m.compiled) == (key, dtype, compiled))

    def bus_bytes_per_s(self, op: str, group: int, message_bytes: float | None) -> float | None:
        """Bus bandwidth of ``op`` over ``group`` ranks for a tensor of ``message_bytes`` (None:
        the largest measured); the nearest measured group size at or below ``group`` (the
        smallest when none is); None when the op was not measured."""
        points = [c for c in self.collectives if c.op == op]
        if not points:
            return None
        groups = sorted({c.group for c in points})
        size = max((g for g in groups if g <= group), default=groups[0])
        chosen = [(c.bytes, c.bus_bytes_per_s) for c in points if c.group == size]
        at = message_bytes if message_bytes is not None else max(b for b, _ in chosen)
        return log_interpolate(chosen, at)

    def op_overhead(self, tp: int, cp: int) -> float | None:
        """Seconds per op of a plan with these degrees: under TP or CP their measured figure
        (the larger when both), else eager's."""
        plans = dict(self.plan_op_overhead_s)
        under = [plans[p] for p, degree in (("tp", tp), ("cp", cp)) if degree > 1 and p in plans]
        return max(under) if under else self.op_overhead_s

    @property
    def peak_flops(self) -> float:
        """The fastest bf16 (or float32 when bf16 was not measured) GEMM measured."""
        rates = [p.flops_per_s for p in self.matmul if p.dtype == "bfloat16"]
        return max(rates or [p.flops_per_s for p in self.matmul])

    def collective_peak(self) -> float | None:
        """The largest bus bandwidth measured (for the spec's link figure), None without collectives."""
        return max((c.bus_bytes_per_s for c in self.collectives), default=None)


def log_interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at ``x`` from (x, y) points, linear in log-log space, clamped at the ends."""
    points = sorted(points)
    xs = [math.log(px) for px, _ in points]
    lx = math.log(max(x, 1.0))
    i = bisect.bisect_left(xs, lx)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = (xs[i - 1], points[i - 1][1]), (xs[i], points[i][1])
    t = (lx - x0) / (x1 - x0) if x1 > x0 else 0.0
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def load_profile(path: Path, flag: str = "--device-profile", fix: str | None = None) -> DeviceProfile:
    """The profile in ``path``; ConfigError in one line naming the file and the fix (by
    default: the probe writing it there)."""
    fix = fix or f"write one with python -m autopar.probe --output {path}"
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file; {fix}")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{flag} {path}: not a JSON device profile ({err}); {fix}") from None
    try:
        if not isinstance(record, dict):
            raise TypeError(f"a JSON {type(record).__name__}, not an object")
        return DeviceProfile.from_json(record)
    except (TypeError, ValueError) as err:
        text = str(err).splitlines()[0]
        raise ConfigError(f"{flag} {path}: not a device profile ({text}); {fix}") from None


def gemm_shapes(args: ModelArgs, tokens: int, tp: int = 1) -> list[tuple[int, int, int, int]]:
    """(m, n, k, count) of one micro-batch's forward GEMMs on one rank: ``tokens`` rows through
    each attention block's q/k/v and output projections, the MLP's gate+up and down (each
    routed expert at its own width over its share of rows) and the vocabulary head, with TP
    splitting each weight. The Gated DeltaNets' projections are counted as attention's (same
    width within 2x), so their FLOPs weigh the shapes' rates only roughly."""
    h, layers = args.hidden_size, args.num_hidden_layers
    qkv = (args.num_attention_heads + 2 * args.num_key_value_heads) * args.head_dim
    inter = args.moe_intermediate_size if args.num_experts else args.intermediate_size
    rows = tokens * args.num_experts_per_tok // args.num_experts if args.num_experts else tokens
    mlps = layers * max(1, args.num_experts)
    return [
        (tokens, max(1, qkv // tp), h, layers),
        (tokens, h, max(1, args.num_attention_heads * args.head_dim // tp), layers),
        (max(1, rows), max(1, 2 * inter // tp), h, mlps),
        (max(1, rows), h, max(1, inter // tp), mlps),
        (tokens, max(1, args.vocab_size // tp), h, 1),
    ]


def matmul_flops_per_s(points: Sequence[MatmulPoint], dtype: str, m: int, n: int, k: int) -> float:
    """FLOP/s of a linear's training GEMMs (m rows, k in, n out) in ``dtype``: the measured
    figure of that shape among ``points``, else interpolated over FLOPs (bfloat16's figures
    stand in for an unmeasured float8, float32's for an unmeasured bfloat16 and the reverse)."""
    fallback = {"float8": "bfloat16", "bfloat16": "float32", "float32": "bfloat16"}
    same = [p for p in points if p.dtype == dtype] or [p for p in points if p.dtype == fallback[dtype]]
    exact = [p.flops_per_s for p in same if (p.m, p.n, p.k) == (m, n, k)]
    if exact:
        return exact[0]
    return log_interpolate([(p.flops, p.flops_per_s) for p in same], 6.0 * m * n * k)


def gemm_rate(points: Sequence[MatmulPoint], dtype: str, shapes: list[tuple[int, int, int, int]]) -> float:
    """FLOP/s over ``shapes`` (m, n, k, count) together, at ``points``' rates: their FLOPs over
    the sum of each one's time."""
    flops = sum(2.0 * m * n * k * c for m, n, k, c in shapes)
    seconds = sum(2.0 * m * n * k * c / matmul_flops_per_s(points, dtype, m, n, k) for m, n, k, c in shapes)
    return flops / seconds
