"""Per-step batches for one data-parallel rank, and the dataset a job names.

Step t covers global samples [t*G, (t+1)*G) for global batch G. Micro-step m of data-parallel
rank r reads samples ``start + m*D*L + r*L + [0, L)`` for D ranks of local batch L. The only
state is the number of samples consumed, so a checkpoint resumes exactly, also under another
data-parallel degree.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import Training
from autopar.data.chat import ChatFormat, load_chat, pad_to_windows
from autopar.data.dataset import Blend, PackedWindows, SampleSource
from autopar.data.errors import DataError
from autopar.data.streamed import open_table
from autopar.data.tables import Columns, TableRows, is_table
from autopar.data.tokenizer import Tokenizer, build_tokenizer, tokenizer_file
from autopar.data.tokens import (
    BUILTIN_DATASETS,
    document_ends,
    is_prepared,
    load_tokens,
    prepared_chat,
    read_learned,
)

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (L, S) int64
    labels: torch.Tensor  # (L, S) int64, IGNORE_INDEX where no target
    documents: torch.Tensor | None = None  # (L, S) int64 document ids with document masking
    pairs: torch.Tensor | None = None  # (P,) int64: preference data, the pairs' indices in the data


def parse_blend(items: list[str]) -> list[tuple[float, Path]]:
    """'weight:path' items -> [(weight, path)]; raises DataError on a malformed item."""
    out = []
    for item in items:
        weight, sep, path = item.partition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not (math.isfinite(w) and w > 0) or not path:
            raise DataError(
                f"training.dataset_blend item {item!r} is not 'weight:path' with a finite positive weight"
            )
        out.append((w, Path(path)))
    return out


def dataset_path(dataset: str, path: str | None, section: str = "training") -> Path:
    """The path a job's ``<section>.dataset`` / ``<section>.dataset_path`` name."""
    if path is not None:
        return Path(path)
    if dataset not in BUILTIN_DATASETS:
        hub = (
            " (torchtitan streams it from the Hugging Face Hub; autopar reads local files: "
            f"download it, tokenize it once with autopar-prepare, and point {section}.dataset_path there)"
            if dataset.startswith("c4") or "/" in dataset
            else ""
        )
        raise DataError(
            f"{section}.dataset={dataset!r} is not built in ({sorted(BUILTIN_DATASETS)}){hub}; "
            f"set {section}.dataset_path to your files"
        )
    return BUILTIN_DATASETS[dataset]


def build_samples(
    dataset: str,
    path: str | None,
    blend: list[str],
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int,
    section: str = "training",
    chat: ChatFormat | None = None,
    document_masking: bool = False,
    text_field: str = "text",
) -> SampleSource:
    """The sample source of a job's [training] (or ``section``'s) data fields; with ``chat``,
    raw .jsonl files and tables hold conversations (prepared files say themselves what they
    hold); with ``document_masking``, samples carry their document boundaries; ``text_field``:
    the JSONL key or table column of text documents."""
    if blend:
        parts = [
            windows(p, tokenizer, seq_len, seed + i, section, chat, document_masking)
            for i, (_, p) in enumerate(parse_blend(blend))
        ]
        return Blend(parts, [w for w, _ in parse_blend(blend)], seed)
    source = dataset_path(dataset, path, section)
    return windows(source, tokenizer, seq_len, seed, section, chat, document_masking, text_field)


def windows(
    source: Path,
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int,
    section: str,
    chat: ChatFormat | None,
    document_masking: bool = False,
    text_field: str = "text",
) -> PackedWindows:
    """The sequences of one dataset: text, raw chat (rendered now, last sequence padded),
    a table (Parquet, Arrow: tokenized as windows read it) or prepared (tokens, and the
    learned mask of a prepared chat file). Documents are conversations or table rows, or the
    text between end-of-text tokens (a prepared file's index)."""
    if is_table(source):
        stream = open_table(source, tokenizer, chat, text_field, section)
        if chat is not None:
            stream.pad(seq_len, chat.pad_id())
        tokens, learned, ends = stream, stream.learned, stream.ends
    elif chat is not None and not is_prepared(source):
        tokens, learned, ends = load_chat(source, chat, section)
        tokens, learned = pad_to_windows(tokens, learned, seq_len, chat.pad_id())
    else:
        tokens, learned = load_tokens(source, tokenizer, text_field, section), read_learned(source)
        ends = document_ends(source, tokens, tokenizer.eos_id) if document_masking else None
        rendered = prepared_chat(source)
        if chat is not None and rendered is not None and rendered["loss_on"] != chat.loss_on:
            raise DataError(
                f"{source}: prepared with loss_on={rendered['loss_on']!r}, but training.loss_on="
                f"{chat.loss_on!r}; set it to {rendered['loss_on']!r} or prepare the data again"
            )
    return PackedWindows(
        tokens,
        seq_len,
        seed,
        str(source),
        tokenizer.vocab_size,
        f"{section}.seq_len",
        learned,
        ends if document_masking else None,
    )


@dataclass(eq=False)
class RankSteps(ABC):
    """Which samples one data-parallel rank takes in each micro-batch of an optimizer step,
    and how many the run has consumed (its resumable state). A subclass builds the micro-batch
    of the ``local_batch`` samples visited at ``first`` onwards."""

    global_batch: int
    local_batch: int
    dp_rank: int
    dp_size: int
    device: torch.device
    consumed_samples: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        assert self.global_batch % (self.local_batch * self.dp_size) == 0, "validated by the job config"

    @property
    def micro_steps(self) -> int:
        return self.global_batch // (self.local_batch * self.dp_size)

    @abstractmethod
    def micro_batch(self, first: int) -> Batch: ...

    def next_step(self) -> list[Batch]:
        batches = []
        for m in range(self.micro_steps):
            first = self.consumed_samples + (m * self.dp_size + self.dp_rank) * self.local_batch
            batches.append(self.micro_batch(first))
        self.consumed_samples += self.global_batch
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


@dataclass(eq=False, kw_only=True)
class StepLoader(RankSteps):
    """Yields the micro-batches of one optimizer step for one data-parallel rank."""

    samples: SampleSource

    def micro_batch(self, first: int) -> Batch:
        """Samples ``first`` onwards as one array on the device (one copy): the token windows,
        or inputs, masked labels and document ids side by side."""
        indices = range(first, first + self.local_batch)
        rows = np.stack([self.samples.sample(k) for k in indices])  # (L, S + 1)
        masks = [self.samples.targets(k) for k in indices]
        docs = [self.samples.documents(k) for k in indices]
        masked = any(mask is not None for mask in masks)  # chat rows (a blend may mix them with text)
        documents = docs[0] is not None  # every part of a blend has boundaries, or none has
        if masked or documents:
            learned = np.stack([np.ones(rows.shape[1] - 1, bool) if mask is None else mask for mask in masks])
            ids = np.stack(docs) if documents else None  # (L, S + 1)
            if ids is not None:
                learned &= ids[:, 1:] == ids[:, :-1]  # no target is predicted across a boundary
            columns = [rows[:, :-1], np.where(learned, rows[:, 1:], IGNORE_INDEX)]
            rows = np.concatenate(columns if ids is None else [*columns, ids[:, :-1]], axis=1)
        window = torch.from_numpy(rows)
        if self.device.type == "cuda":
            window = window.pin_memory().to(self.device, non_blocking=True)
        if not (masked or documents):
            return Batch(inputs=window[:, :-1], labels=window[:, 1:])
        parts = window.chunk(3 if documents else 2, dim=1)
        return Batch(inputs=parts[0], labels=parts[1], documents=parts[2] if documents else None)


def check_data(
    dataset: str,
    path: str | None,
    blend: list[str],
    section: str = "training",
    columns: Columns | None = None,
) -> None:
    """Raise DataError if the job's data fields name nothing readable (cheap: no tokenizing;
    a table's ``columns`` are checked in every file's metadata)."""
    if blend:
        for _, p in parse_blend(blend):
            if not p.with_suffix(".bin").is_file():
                raise DataError(
                    f"training.dataset_blend: {p} is not a prepared dataset (.bin + .json); "
                    "make one with python -m autopar.data.prepare"
                )
        return
    source = dataset_path(dataset, path, section)
    if not source.exists():
        hub = (
            "; a Hub dataset name? autopar reads local files: download it (hf download --repo-type "
            "dataset NAME --local-dir DIR) and point there"
            if path is not None and path.count("/") == 1 and not path.startswith((".", "/"))
            else ""
        )
        raise DataError(f"{section}.dataset_path={str(source)!r}: no such file or folder{hub}")
    if columns is not None and is_table(source):
        TableRows(source, columns, section, announce=False)


def check_training_data(
    cfg: Training, tokenizer_path: str | None, vocab_size: int, max_position_embeddings: int
) -> None:
    """The job's data, tokenizer and sequence length against a model's vocabulary and length."""
    if tokenizer_path is not None and not tokenizer_file(tokenizer_path).is_file():
        raise ConfigError(f"model.tokenizer_path={tokenizer_path!r}: no tokenizer.json there")
    try:
        tokenizer = build_tokenizer(tokenizer_path)
    except DataError as err:
        raise ConfigError(f"model.tokenizer_path: {err}") from None
    try:
        columns = (
            None if cfg.dataset_format in ("preference", "prompts") else table_columns(cfg)
        )  # read when loaded
        check_data(cfg.dataset, cfg.dataset_path, cfg.dataset_blend, columns=columns)
    except DataError as err:
        raise ConfigError(str(err)) from None
    if cfg.dataset_format in ("chat", "preference"):
        check_chat(cfg, tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); raise model.vocab_size or use a smaller tokenizer"
        )
    if cfg.seq_len > max_position_embeddings:
        raise ConfigError(
            f"training.seq_len={cfg.seq_len} exceeds model.max_position_embeddings="
            f"{max_position_embeddings}; lower seq_len or raise max_position_embeddings"
        )


def table_columns(cfg: Training) -> Columns:
    """The columns a job reads from a table dataset."""
    return Columns(text=None) if cfg.dataset_format == "chat" else Columns(text=cfg.dataset_text_field)


def check_chat(cfg: Training, tokenizer_path: str | None) -> None:
    """Chat data needs a tokenizer with the template's special tokens and a template that
    exists."""
    if tokenizer_path is None:
        raise ConfigError(
            f"training.dataset_format={cfg.dataset_format!r} needs the model's tokenizer (with <|im_start|> "
            "and <|im_end|>): set model.hf_assets_path or model.tokenizer_path"
        )
    try:
        ChatFormat(tokenizer_path, cfg.chat_template, cfg.loss_on).check()
    except DataError as err:
        raise ConfigError(f"training.dataset_format={cfg.dataset_format!r}: {err}") from None


def check_batch(cfg: Training, dp: int) -> None:
    """The global batch must split evenly into micro-steps of ``local_batch_size`` x ``dp``."""
    per_micro_step = cfg.local_batch_size * dp
    if cfg.global_batch_size != -1 and cfg.global_batch_size % per_micro_step:
        raise ConfigError(
            f"training.global_batch_size={cfg.global_batch_size} is not a multiple of "
            f"local_batch_size x data-parallel degree = {cfg.local_batch_size} x {dp} = "
            f"{per_micro_step}; use a multiple of {per_micro_step}"
        )
