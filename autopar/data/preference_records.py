"""TRL's preference records, read from JSONL, Parquet and ``datasets`` folders and checked.

A record is ``{"prompt", "chosen", "rejected"}`` (TRL's ``DPOTrainer`` format): all three
strings (plain), or lists of messages (conversational: the prompt's turns, then the chosen and
the rejected assistant turns), with optional ``tools`` (function specs, or their JSON string)
and ``chat_template_kwargs`` (template variables such as ``enable_thinking``). Without a
``prompt`` the prompt is implicit, the shared beginning of ``chosen`` and ``rejected``, split off
as TRL's ``extract_prompt`` does. Every problem is one DataError naming the file, the row and
the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from autopar.data.errors import DataError
from autopar.data.jsonl import jsonl_records
from autopar.data.records import parse_record
from autopar.data.tables import Columns, TableRows, is_table, without_nulls

FIELDS = ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs")
"""The columns a preference record may hold; ``chosen`` and ``rejected`` are required."""
Messages = list[dict[str, Any]]
Text = str | Messages
_S = TypeVar("_S", str, Messages)


@dataclass(frozen=True)
class PreferenceRecord:
    """One checked record: plain (three strings) or conversational (three message lists)."""

    prompt: Text
    chosen: Text
    rejected: Text
    tools: Messages | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


class PreferenceColumns(Columns):
    """The columns of a preference table: ``chosen`` and ``rejected``, and whichever of
    ``prompt``, ``tools`` and ``chat_template_kwargs`` it has."""

    def __init__(self) -> None:
        super().__init__(text=None)

    def of(self, file: Path, schema: Any) -> list[str]:
        names = list(schema.names)
        missing = [name for name in ("chosen", "rejected") if name not in names]
        if missing:
            raise DataError(
                f"{file}: no column {missing[0]!r} (its columns: {', '.join(names)}); preference data holds "
                '"chosen" and "rejected" (and "prompt") in every row'
            )
        return [name for name in FIELDS if name in names]


def read_preferences(source: Path) -> Iterator[tuple[str, PreferenceRecord]]:
    """(where, record) of every record of a .jsonl file, a folder of them, or a table dataset
    (Parquet / Arrow files, a ``save_to_disk`` folder); ``where`` is ``file:line`` or
    ``file: row n``."""
    if is_table(source):
        rows = TableRows(source, PreferenceColumns())
        for index, row in rows:
            where = rows.where(index)
            yield where, parse_preference(without_nulls(row), where)
        return
    files = [source] if source.is_file() else sorted(source.rglob("*.jsonl"))
    if not files:
        raise DataError(f"{source}: holds no .jsonl, .parquet or .arrow preference files")
    for file in files:
        if file.suffix != ".jsonl":
            raise DataError(
                f"{file}: preference data is .jsonl, .parquet or .arrow, not {file.suffix or 'this'}"
            )
        yield from _jsonl(file)


def _jsonl(file: Path) -> Iterator[tuple[str, PreferenceRecord]]:
    for where, record in jsonl_records(file):
        yield where, parse_preference(record, where)


def parse_preference(record: Any, where: str) -> PreferenceRecord:
    """One record checked: a DataError naming ``where`` and the field for a missing
    completion, a wrong type, an empty completion or prompt, malformed ``tools``."""
    if not isinstance(record, dict):
        raise DataError(f'{where}: a preference record is an object with "prompt", "chosen" and "rejected"')
    for name in ("chosen", "rejected"):
        if record.get(name) is None:
            raise DataError(
                f'{where}: no "{name}"; a preference record holds "chosen" and "rejected" completions'
            )
    chosen, rejected = (_text(record[name], f'{where}, "{name}"') for name in ("chosen", "rejected"))
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion:
            raise DataError(f'{where}, "{name}": an empty completion; drop the record or write the answer')
    if type(chosen) is not type(rejected):
        raise DataError(f'{where}: "chosen" and "rejected" must both be text or both lists of messages')
    prompt = record.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected, where)
    else:
        prompt = _text(prompt, f'{where}, "prompt"')
        if prompt == []:
            raise DataError(
                f'{where}, "prompt": an empty list of messages; give the turns before the answers'
            )
        if type(prompt) is not type(chosen):
            kind = "text" if isinstance(chosen, str) else "lists of messages"
            raise DataError(f'{where}: "prompt" must be {kind} as "chosen" and "rejected" are')
    if not isinstance(chosen, list):
        return PreferenceRecord(prompt, chosen, rejected)
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        _check_completion(completion, f'{where}, "{name}"')
    return PreferenceRecord(
        prompt,
        chosen,
        rejected,
        _tools(record, where),
        _template_kwargs(record.get("chat_template_kwargs"), where),
    )


COMPLETION_ROLES = ("assistant", "tool")
"""What a conversational completion holds: the assistant's turns (and the tool responses
between its calls); the user's and the system's belong to the prompt."""


def _check_completion(messages: Messages, where: str) -> None:
    """A completion of the assistant's turns only: a user or system turn there would be
    trained on as the answer (and rendered as the next prompt's turn)."""
    for i, message in enumerate(messages):
        if message["role"] not in COMPLETION_ROLES:
            raise DataError(
                f"{where}: messages[{i}] is a {message['role']} message; a completion holds the assistant's "
                "turns (the user's and the system's belong in \"prompt\")"
            )


def _text(value: Any, where: str) -> Text:
    """A plain string, or a list of messages checked as chat messages are."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            return value
        return parse_record({"messages": value}, where).messages
    raise DataError(f"{where}: must be a string or a list of messages, not {type(value).__name__}")


def _tools(record: dict[str, Any], where: str) -> Messages | None:
    """``tools`` as apply_chat_template takes them (a JSON string is parsed, as TRL does)."""
    probe = {"messages": [{"role": "user", "content": ""}], "tools": record.get("tools")}
    return parse_record(probe, where).tools


def _template_kwargs(value: Any, where: str) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    raise DataError(
        f'{where}: "chat_template_kwargs" must be an object of template variables (e.g. '
        f'{{"enable_thinking": false}}), not {type(value).__name__}'
    )


def extract_prompt(chosen: _S, rejected: _S, where: str) -> tuple[_S, _S, _S]:
    """(prompt, chosen, rejected) of a record whose prompt is implicit, split as TRL's
    ``extract_prompt``: at the first message (or character) where the two differ; a space
    just before a differing character goes to the completions; two identical ones (or one
    the start of the other) keep their last element as the completion."""
    shortest = min(len(chosen), len(rejected))
    first = next((i for i in range(shortest) if chosen[i] != rejected[i]), None)
    split = shortest - 1  # no difference: TRL's loop runs out and leaves its last index
    if first is not None:
        split = first - 1 if first > 0 and chosen[first - 1] == " " else first
    if split <= 0:
        raise DataError(
            f'{where}: no "prompt" and "chosen" and "rejected" share no beginning to take as one; add a "prompt"'
        )
    return chosen[:split], chosen[split:], rejected[split:]
