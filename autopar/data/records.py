"""Conversation records (a chat JSONL line, a table row) read into what a chat template renders.

A record is ``{"messages": [{"role", "content", ...}], "tools": [...]}`` or ShareGPT's
``{"conversations": [{"from", "value"}]}`` (LLaMA-Factory's too: a ``function_call`` turn is
the assistant's tool call, a ``"system"`` field the first turn). What the templates would
render wrongly without a word is refused here, one line naming the file, the row and the field
(``messages[2].tool_calls``):
a message without content (an assistant's with ``tool_calls`` may have none), ``tool_calls``
that are not a list of named calls, a function spec without a name, reasoning that is not text,
a conversation opening with a tool response (Qwen's templates then drop the turn's header), and
text that is not valid Unicode. Content given as a list of parts (Qwen3.5's and OpenAI's
``[{"type": "text", "text": ...}]``) is read as its text parts joined, which is how Qwen3.5's
template renders them; image and video parts are refused, since autopar trains text only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from autopar.data.errors import DataError, check_unicode
from autopar.data.jsonl import jsonl_records

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""A message's reasoning under the names transformers accepts, first found wins."""
MEDIA_PARTS = ("image", "image_url", "video", "video_url", "audio", "input_audio")
"""Content parts a vision (or audio) model reads, which a text model cannot learn from."""


class Conversation(NamedTuple):
    """One line of chat JSONL: its messages and the function specs it offers (None: no tools)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def _content_parts(parts: list[Any], where: str) -> str:
    """The text of a list of content parts, joined as Qwen3.5's template joins them."""
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and (kind in MEDIA_PARTS or any(m in part for m in MEDIA_PARTS)):
            raise DataError(
                f"{where}[{k}] is {kind or 'image or video'!r} content: autopar trains text models on "
                "text only; drop the conversations that hold images (or their media parts)"
            )
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise DataError(
                f'{where}[{k}] is not a text part ({{"type": "text", "text": "..."}}) but {part!r:.60}'
            )
        texts.append(part["text"])
    return "".join(texts)


def _content(raw: dict[str, Any], key: str, role: str, where: str) -> str:
    """A message's text: a string, or text parts joined; missing only beside tool calls."""
    content = raw.get(key)
    if isinstance(content, list):
        return _content_parts(content, f"{where}.{key}")
    if content is None:
        if role == "assistant" and raw.get("tool_calls"):
            return ""
        raise DataError(
            f"{where} ({role}) has no {key!r}; give every message its text ('' when empty; an "
            "assistant message with tool_calls may leave it out)"
        )
    if not isinstance(content, str):
        raise DataError(
            f"{where}: {key!r} of a {role} message must be a string (or a list of text parts), "
            f"not {type(content).__name__}"
        )
    return content


def _function_name(spec: Any) -> Any:
    """The name of a function spec or call, given bare or under ``function``."""
    if not isinstance(spec, dict):
        return None
    inner = spec.get("function", spec)
    return inner.get("name") if isinstance(inner, dict) else None


def _tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise DataError(
            f"{where}.tool_calls is {type(calls).__name__}, not a list of calls; write "
            '[{"function": {"name": ..., "arguments": {...}}}] (a single call in [ ])'
        )
    for k, call in enumerate(calls):
        name = _function_name(call)
        if not isinstance(name, str) or not name:
            raise DataError(
                f'{where}.tool_calls[{k}] has no function name; write {{"function": {{"name": ..., '
                '"arguments": {...}}}'
            )


def _function_call(value: Any, where: str) -> dict[str, Any]:
    """LLaMA-Factory's ShareGPT ``function_call`` turn: its value is the call, or a list of
    calls, as JSON (``{"name", "arguments"}``); it is the assistant's ``tool_calls``, which is
    how Qwen's templates render a call."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError as err:
        raise DataError(
            f"{where}.value is not JSON ({getattr(err, 'msg', err)}); a function_call holds the call "
            '({"name": ..., "arguments": {...}}) as JSON'
        ) from None
    check_unicode(calls, where, "value")  # JSON's escapes may write a lone surrogate
    tool_calls = [
        {"type": "function", "function": call} for call in (calls if isinstance(calls, list) else [calls])
    ]
    _tool_calls(tool_calls, where)
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def _system(record: dict[str, Any], messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The messages with a record's own ``"system"`` prompt (LLaMA-Factory's ShareGPT and
    Alpaca records keep it beside the turns) as their first turn."""
    system = record.get("system")
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise DataError(
            f'{where}: "system" is {type(system).__name__}, not text; write the system prompt as a string'
        )
    if messages[0]["role"] == "system":
        raise DataError(f'{where}: has a "system" field and a system turn; keep one of them')
    return [{"role": "system", "content": system}, *messages]


def _message(raw: Any, where: str, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a message must be an object, not {type(raw).__name__}")
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if role_key not in raw:
        raise DataError(f"{where}: a message has no {role_key!r}")
    role = raw[role_key]
    if sharegpt and role == "function_call":
        return _function_call(raw.get("value"), where)
    if sharegpt:
        if role not in SHAREGPT_ROLES:
            raise DataError(f"{where}: unknown role {role!r}; ShareGPT roles are {sorted(SHAREGPT_ROLES)}")
        role = SHAREGPT_ROLES[role]
    elif role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r}; roles are {list(ROLES)}")
    content = _content(raw, content_key, role, where)
    for key in REASONING_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise DataError(
                f"{where}.{key} is {type(raw[key]).__name__}, not text; write the reasoning as a string"
            )
    if raw.get("tool_calls") is not None:
        _tool_calls(raw["tool_calls"], where)
    message = {k: v for k, v in raw.items() if k not in (role_key, content_key)}
    return {"role": role, "content": content, **message}


def _tools(record: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A record's ``tools``: a list of JSON-schema function specs, or None; the list may be
    written as a JSON string (as ShareGPT files and most Hub sets hold it)."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as err:
            raise DataError(
                f'{where}: "tools" is a string but not JSON ({getattr(err, "msg", err)})'
            ) from None
        check_unicode(tools, where, "tools")  # JSON's escapes may write a lone surrogate
    if tools is None:
        return None
    if isinstance(tools, list):
        bad = [i for i, t in enumerate(tools, 1) if not isinstance(t, dict)]
        if not bad:
            unnamed = [i for i, t in enumerate(tools) if not isinstance(_function_name(t), str)]
            if unnamed:
                raise DataError(
                    f'{where}: "tools"[{unnamed[0]}] has no function name; a spec is {{"type": '
                    '"function", "function": {"name": ..., "parameters": {...}}}'
                )
            return tools
        found = f"item {bad[0]} is {type(tools[bad[0] - 1]).__name__}"
    else:
        found = f"it is {type(tools).__name__}"
    raise DataError(
        f'{where}: "tools" must be a list of function specs (JSON objects, as apply_chat_template '
        f"takes them), but {found}"
    )


def parse_record(record: Any, where: str) -> Conversation:
    """One conversation record (a JSONL line, a table row): ``{"messages": [...], "tools":
    [...]}`` or ShareGPT's ``{"conversations": [...]}``. A bad record is a DataError naming
    ``where`` and the field."""
    if not isinstance(record, dict) or not ({"messages", "conversations"} & record.keys()):
        raise DataError(f'{where}: a line must be an object with "messages" (or ShareGPT "conversations")')
    key = "messages" if "messages" in record else "conversations"
    messages = record[key]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list")
    first = messages[0]
    sharegpt = isinstance(first, dict) and "from" in first and "role" not in first  # in either column
    check_unicode(record, where)
    parsed = [_message(m, f"{where}: {key}[{i}]", sharegpt) for i, m in enumerate(messages)]
    parsed = _system(record, parsed, where)
    if parsed[0]["role"] == "tool":
        raise DataError(
            f"{where}: {key}[0] is a tool response, which answers an assistant's tool call; "
            "start the conversation with the system or user message that led to the call"
        )
    return Conversation(parsed, _tools(record, where))


def read_records(path: str | Path) -> Iterator[Conversation]:
    """The conversations of a chat JSONL file: one ``{"messages": [{"role", "content"}, ...],
    "tools": [...]}`` (``tools`` optional; or ShareGPT's ``{"conversations": [{"from", "value"},
    ...]}``) per line; a bad line is a DataError naming the file and line."""
    for where, record in jsonl_records(path):
        yield parse_record(record, where)


def read_conversations(path: str | Path) -> Iterator[list[dict[str, Any]]]:
    """The messages of each conversation of a chat JSONL file (``read_records`` without tools)."""
    for conversation in read_records(path):
        yield conversation.messages
