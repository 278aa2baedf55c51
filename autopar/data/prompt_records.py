"""TRL's prompt-only records for on-policy RL, read from JSONL, Parquet and ``datasets``
folders, and tokenized as TRL 1.16's ``GRPOTrainer`` tokenizes them.

A record is ``{"prompt": ...}``: text (plain), or a list of messages (conversational: the
turns before the answer), with optional ``tools`` and ``chat_template_kwargs``. Every other
field reaches the reward functions by its name (TRL's ``**kwargs``), e.g. GSM8K's ``answer``.
Plain prompts are tokenized as text with the tokenizer's own special tokens; conversational
ones are rendered with the chat template and its generation prompt (the record's tools and
template variables too) and tokenized without added special tokens, as
``apply_chat_template(add_generation_prompt=True, tokenize=True)`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.data.chat import _tokenizer
from autopar.data.errors import DataError
from autopar.data.jsonl import jsonl_records
from autopar.data.preference import PairEncoder, _text_tokenizer
from autopar.data.preference_records import _template_kwargs, _text, _tools
from autopar.data.tables import Columns, TableRows, is_table, without_nulls

OWN_FIELDS = ("prompt", "tools", "chat_template_kwargs")


@dataclass(frozen=True)
class PromptRecord:
    """One checked record and its prompt's token ids."""

    prompt: str | list[dict[str, Any]]
    prompt_ids: list[int]
    columns: dict[str, Any]
    """Its other fields, for the reward functions."""

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class PromptSource:
    """A job's prompt records and where they came from (none when a replay stands for them)."""

    records: list[PromptRecord]
    path: str

    def describe(self) -> str:
        return (
            f"{self.path} ({len(self.records)} prompts)"
            if self.records
            else f"rollouts replayed from {self.path}"
        )


class PromptColumns(Columns):
    """A prompts table's columns: ``prompt`` and every other one (the rewards read them)."""

    def __init__(self) -> None:
        super().__init__(text=None)

    def of(self, file: Path, schema: Any) -> list[str]:
        names = list(schema.names)
        if "prompt" not in names:
            raise DataError(
                f"{file}: no column 'prompt' (its columns: {', '.join(names)}); prompt-only data holds a "
                '"prompt" (text or messages) in every row'
            )
        return names


def read_prompt_records(source: Path, encoder: PairEncoder) -> list[PromptRecord]:
    """Every record of a .jsonl file, a folder of them, or a table dataset, tokenized; one
    DataError naming the file, the row and the field for a record that does not read."""
    records = [_encoded(raw, where, encoder) for where, raw in _raw_records(source)]
    if not records:
        raise DataError(f"{source}: holds no prompt records")
    return records


def _raw_records(source: Path) -> Iterator[tuple[str, Any]]:
    if is_table(source):
        rows = TableRows(source, PromptColumns())
        for index, row in rows:
            yield rows.where(index), without_nulls(row)
        return
    files = [source] if source.is_file() else sorted(source.rglob("*.jsonl"))
    if not files:
        raise DataError(f"{source}: holds no .jsonl, .parquet or .arrow prompt files")
    for file in files:
        yield from jsonl_records(file)


def _encoded(raw: Any, where: str, encoder: PairEncoder) -> PromptRecord:
    if not isinstance(raw, dict) or raw.get("prompt") is None:
        raise DataError(
            f'{where}: no "prompt"; a prompt-only record is an object with a "prompt" (text or messages)'
        )
    prompt = _text(raw["prompt"], f'{where}, "prompt"')
    if not prompt:
        raise DataError(f'{where}, "prompt": empty; give the text or the turns to answer')
    columns = {k: v for k, v in raw.items() if k not in OWN_FIELDS}
    if isinstance(prompt, str):
        ids = _text_tokenizer(encoder.tokenizer_path).encode(prompt, add_special_tokens=True).ids
        return PromptRecord(prompt, list(ids), columns)
    tools, kwargs = _tools(raw, where), _template_kwargs(raw.get("chat_template_kwargs"), where)
    text = encoder.render(prompt, tools, kwargs, True, where)
    ids = _tokenizer(encoder.tokenizer_path).encode(text, add_special_tokens=False).ids
    return PromptRecord(prompt, list(ids), columns)
