"""Throughput, MFU, memory: one console line per log step, the same numbers in metrics.jsonl.

``metrics.jsonl`` keys ``step, loss, grad_norm, lr, tps, mfu, memory_gib`` are a contract that
other tools read (a mixture-of-experts run adds ``aux_loss``, its load-balancing loss; ``loss``
stays the language-model cross-entropy; a step whose batch had no learned token adds
``no_learned_tokens: true``); ``tps`` is tokens per second per device, ``mfu`` a percentage (null where no
peak is known, e.g. on CPU), ``memory_gib`` the peak so far (CUDA allocator, or process RSS on CPU).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.config.errors import ConfigError
from autopar.models.args import ModelArgs
from autopar.models.qwen3_5.delta_rule import CHUNK as DELTA_RULE_CHUNK
from autopar.models.qwen3_5.mtp import head_layer_args
from autopar.training.sinks import Sink

logger = logging.getLogger("autopar")

# Dense bf16 tensor-core peaks in FLOP/s, by a substring of torch.cuda.get_device_name().
# Order matters: more specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
)


def mixer_matmul_params(args: ModelArgs, layer: int) -> int:
    """Parameters one token meets in block ``layer``'s token mixer: attention's q/k/v/o (gated
    attention's q twice as wide, query and gate), or a Gated DeltaNet's six input projections,
    its depthwise convolution (K multiply-adds per channel) and out_proj."""
    hidden = args.hidden_size
    mixer = args.mixer(layer)
    if mixer == "linear_attention":
        keys = args.linear_num_key_heads * args.linear_key_head_dim
        values = args.linear_num_value_heads * args.linear_value_head_dim
        projections = hidden * (2 * keys + 2 * values + 2 * args.linear_num_value_heads)
        return projections + args.linear_conv_kernel_dim * (2 * keys + values) + values * hidden
    q = args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    return hidden * ((2 if mixer == "gated_attention" else 1) * q + 2 * kv) + q * hidden


def block_matmul_params(args: ModelArgs, layer: int = 0) -> int:
    """Parameters one token meets in block ``layer``'s projections: its token mixer's and the
    SwiGLU MLP's, or in a mixture-of-experts layer the router's, its top-k experts' and its
    shared expert's (the active parameters)."""
    hidden = args.hidden_size
    mixer = mixer_matmul_params(args, layer)
    if args.is_moe_layer(layer):
        experts = args.num_experts_per_tok * 3 * hidden * args.moe_intermediate_size
        shared = 3 * hidden * args.shared_expert_intermediate_size + (
            hidden if args.shared_expert_intermediate_size else 0
        )
        return mixer + hidden * args.num_experts + experts + shared
    return mixer + 3 * hidden * args.intermediate_size


@functools.lru_cache(maxsize=64)
def matmul_params(args: ModelArgs) -> int:
    """Active parameters used in matmuls: every block projection (a token's experts only)
    and the output head (not the lookup)."""
    blocks = sum(block_matmul_params(args, i) for i in range(args.num_hidden_layers))
    return blocks + args.hidden_size * args.vocab_size


def head_matmul_params(args: ModelArgs) -> int:
    """Parameters one token meets in Qwen3.5's multi-token-prediction head (0 without one):
    its ``fc`` (2H -> H), its full-attention layers, and a second pass through the output
    head (the head's own vocabulary-wide logits)."""
    layers = args.mtp_num_hidden_layers
    if not layers:
        return 0
    hidden = args.hidden_size
    return (
        2 * hidden * hidden
        + layers * block_matmul_params(head_layer_args(args), 0)
        + hidden * args.vocab_size
    )


def delta_rule_flops(args: ModelArgs) -> float:
    """Training FLOPs per token of one Gated DeltaNet's recurrence, 3x its forward: per value
    head, the state read, the write and the output (2*dk*dv each) and, within a chunk of C
    tokens, the key Gram row, the query-key row and the chunk's read of the corrections
    (2*C*(2*dk + dv))."""
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    return 3 * args.linear_num_value_heads * (6 * dk * dv + 2 * DELTA_RULE_CHUNK * (2 * dk + dv))


@functools.lru_cache(maxsize=256)
def flops_per_token(args: ModelArgs, seq_len: int, frozen: bool = False, reference: bool = False) -> float:
    """Training FLOPs per token, 6N + 12*L*H*Q*T (PaLM; causal attention not halved), L
    counting the attention layers; a hybrid model's Gated DeltaNet layers add their
    recurrence's (``delta_rule_flops``). With the weights ``frozen`` (LoRA) backward computes
    no weight gradients: 4N (rank-r adapters add under 1%, left out). A preference step's
    ``reference`` adds its forward, a third of 6N + attention. A model built with its
    multi-token-prediction head (``[mtp] enable``) adds the head's matmuls to N and its
    full-attention layers to L (``head_matmul_params``)."""
    mixers = [args.mixer(i) for i in range(args.num_hidden_layers)]
    attention_layers = len(mixers) - mixers.count("linear_attention") + args.mtp_num_hidden_layers
    attention = 12 * attention_layers * args.num_attention_heads * args.head_dim * seq_len
    recurrence = mixers.count("linear_attention") * delta_rule_flops(args) if args.hybrid else 0.0
    matmuls = matmul_params(args) + head_matmul_params(args)
    forward = 2 * matmuls + (attention + recurrence) / 3
    return (4 if frozen else 6) * matmuls + attention + recurrence + (forward if reference else 0.0)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu_percent(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in percent of ``peak`` FLOP/s (None where the peak is unknown);
    ``tokens_per_second`` per device."""
    return None if peak is None else 100.0 * tokens_per_second * flops_per_token / peak


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tps: float
    mfu: float | None
    memory_gib: float
    step_time_s: float
    tokens_seen: int
    eta_s: float
    skipped: bool = False
    aux_loss: float | None = None
    """A mixture-of-experts model's load-balancing loss (absent for dense models)."""
    no_learned_tokens: bool = False
    """The step's batch had no learned token (chat rows of prompts only): its loss is 0."""
    extra: dict[str, float] = field(default_factory=dict)
    """More of the step's numbers under their own keys: a preference step's TRL metrics."""

    def record(self) -> dict[str, Any]:
        """The JSON record: non-finite numbers become null (JSON has no NaN), ``skipped`` says
        the step made no update."""
        fields = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in {**fields, **self.extra}.items()
            if not (k == "aux_loss" and v is None) and not (k == "no_learned_tokens" and not v)
        }

    def line(self) -> str:
        mfu = "n/a" if self.mfu is None else f"{self.mfu:.1f}%"
        aux = "" if self.aux_loss is None else f"  aux_loss {self.aux_loss:.4f}"
        extra = "".join(  # a preference step: how often and by how much chosen wins; the MTP head's
            f"  {k.removeprefix('rewards/')} {self.extra[k]:.4g}"
            for k in ("rewards/accuracies", "rewards/margins", "mtp_loss", "mtp_acceptance")
            if k in self.extra
        )
        nothing = "  (no learned token in this step)" if self.no_learned_tokens else ""
        return (
            f"step {self.step}  loss {self.loss:.4f}{aux}{extra}  grad_norm {self.grad_norm:.4f}  "
            f"lr {self.lr:.3g}  tps {self.tps:,.0f}  mfu {mfu}  mem {self.memory_gib:.2f}GiB  "
            f"{self.step_time_s:.3g}s/step  tokens {_si(self.tokens_seen)}  eta {_duration(self.eta_s)}{nothing}"
        )


def _si(count: int) -> str:
    """1234567 -> '1.23M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def _duration(seconds: float) -> str:
    """3725 -> '1h02m05s'."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class MetricsLogger:
    """Turns (steps, seconds) windows into tps/MFU/ETA and writes them on the main rank."""

    def __init__(
        self,
        dump_folder: str | Path,
        flops_per_token: float,
        tokens_per_step: int,
        total_steps: int,
        device: torch.device,
        world_size: int,
        is_main: bool,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.total_steps = total_steps
        self.peak = peak_flops(device)
        self.device = device
        self.world_size = world_size
        self.is_main = is_main
        self.sinks = list(sinks)
        """Where the records also go (TensorBoard, W&B); the main rank's only."""
        self.tokens_seen = 0
        """Tokens trained so far where steps differ in size (``record``'s ``tokens``)."""
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        steps: int,
        seconds: float,
        skipped: bool = False,
        aux_loss: float | None = None,
        no_learned_tokens: bool = False,
        tokens: int | None = None,
        extra: dict[str, float] | None = None,
    ) -> StepMetrics:
        """Log one step; ``steps`` ran in ``seconds`` since the last log; ``skipped``: the step
        made no update (its loss or gradient norm was not finite); ``aux_loss``: a mixture of
        experts' load-balancing loss; ``no_learned_tokens``: the step's batch had none;
        ``tokens``: the tokens those steps trained, where steps differ in size (packed
        preference pairs; else ``tokens_per_step`` each); ``extra``: more numbers for the record."""
        step_time = seconds / max(steps, 1)
        window = steps * self.tokens_per_step if tokens is None else tokens
        self.tokens_seen = step * self.tokens_per_step if tokens is None else self.tokens_seen + tokens
        tps = window / max(seconds, 1e-9) / self.world_size
        mfu = mfu_percent(tps, self.flops_per_token, self.peak)
        metrics = StepMetrics(
            step,
            loss,
            grad_norm,
            lr,
            tps,
            mfu,
            peak_memory_gib(self.device),
            step_time,
            self.tokens_seen,
            (self.total_steps - step) * step_time,
            skipped,
            aux_loss,
            no_learned_tokens,
            extra or {},
        )
        if self.is_main:
            logger.info(metrics.line())
            record = metrics.record()
            self._write(record)
        return metrics

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def record_validation(
        self, step: int, loss: float, tokens: int, extra: dict[str, float] | None = None
    ) -> None:
        """Log a held-out loss: its own metrics.jsonl record {"step", "val_loss", "val_tokens"},
        with ``extra`` as ``val_<name>`` (a preference job's: ``val_rewards/accuracies``...)."""
        if not self.is_main:
            return
        shown = "".join(
            f", {k} {v:.4g}" for k, v in (extra or {}).items() if k.startswith(("rewards/acc", "mtp_"))
        )
        logger.info("validation at step %d: val_loss %.4f over %s targets%s", step, loss, _si(tokens), shown)
        values = {"val_loss": loss, **{f"val_{k}": v for k, v in (extra or {}).items()}}
        finite = {k: v if math.isfinite(v) else None for k, v in values.items()}
        self._write({"step": step, **finite, "val_tokens": tokens})

    def forget_after(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a resumed run replays them), and a last
        line a stopped run left cut off mid-write (a full disk, a kill while appending), saying
        so; a line that is not a record of ours is refused (``whole_records``)."""
        if not self.is_main or not self.path.is_file():
            return
        records, cut = whole_records(self.path) if step > 0 else ([], None)  # a fresh start: none kept
        if cut is not None:
            logger.warning(
                "%s: dropped its last line, a record a stopped run cut off mid-write: %r", self.path, cut
            )
        kept = [r for r in records if r["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


RECORD_START = '{"step": '
"""How every record this module writes begins (``step`` is the first key of each)."""


def whole_records(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a metrics.jsonl file, and its last line when that is a record cut off
    mid-write (a kill or a full disk while appending: no newline after it, and the start of
    one of ours). Any other line is not ours: refused, naming it, since a resume rewrites the
    file and would delete it."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and type(record.get("step")) is int:
            records.append(record)
        elif number == len(lines) and not text.endswith("\n") and _starts_a_record(line):
            return records, line
        else:
            raise ConfigError(
                f"{path} line {number} is not a record autopar wrote ({line[:60]!r}); runs in this "
                "job.dump_folder rewrite that file: move it (or that line) elsewhere, then rerun"
            )
    return records, None


def _starts_a_record(line: str) -> bool:
    return line.startswith(RECORD_START) or RECORD_START.startswith(line)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
