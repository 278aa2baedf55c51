"""Throughput, MFU, memory: one console line per log step, the same numbers in metrics.jsonl.

``metrics.jsonl`` keys ``step, loss, grad_norm, lr, tps, mfu, memory_gib`` are a contract that
other tools read (a mixture-of-experts run adds ``aux_loss``, its load-balancing loss; ``loss``
stays the language-model cross-entropy; a step whose batch had no learned token adds
``no_learned_tokens: true``); ``tps`` is tokens per second per device, ``mfu`` a percentage (null where no
peak is known, e.g. on CPU), ``memory_gib`` the peak so far (CUDA allocator, or process RSS on CPU).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.config.errors import ConfigError
from autopar.training.metrics.flops import mfu_percent, peak_flops, peak_memory_gib
from autopar.training.metrics.sinks import Sink

logger = logging.getLogger("autopar")


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
