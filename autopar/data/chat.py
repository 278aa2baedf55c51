"""Conversations to token ids and a learned-token mask, with the model's own chat template.

The template is the ``chat_template`` of the ``tokenizer_config.json`` beside the tokenizer
(what transformers' ``apply_chat_template`` uses), a template file given by name, or Qwen2.5's
official template when neither exists. It is rendered as transformers renders it: jinja2 in a
sandbox, ``trim_blocks`` and ``lstrip_blocks``, ``tojson`` without ASCII escapes, and
``raise_exception``. The rendered text is tokenized whole (special tokens are single tokens),
so the ids equal ``apply_chat_template(messages, tokenize=True)``.

Which tokens are learned is read off the rendered ChatML text: an assistant turn is
``<|im_start|>assistant\\n`` ... ``<|im_end|>``, and everything after the header up to and
including ``<|im_end|>`` is learned (the content, Qwen3's ``<think>`` block, tool calls); the
headers, the system, user and tool turns and the newline after ``<|im_end|>`` are not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from autopar.data.errors import DataError, not_utf8
from autopar.data.tokenizer import tokenizer_file

TEMPLATES = Path(__file__).parent / "templates"
"""Shipped templates: Qwen's official ones (``qwen2.5.jinja``, ``qwen3.jinja``)."""
DEFAULT_TEMPLATE = TEMPLATES / "qwen2.5.jinja"
CHATML_TOKENIZER = Path(__file__).parent / "tokenizers" / "chatml"
"""A small byte-level BPE with Qwen's ChatML specials (512 ids: the debug flavor's
vocabulary), for tests and examples."""
CHAT_EXAMPLE = Path(__file__).parent / "chat_example" / "conversations.jsonl"
"""24 short conversations written for autopar: the SFT walk-through's data."""
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
SPECIALS = ("<|im_start|>", "<|im_end|>")
"""What a ChatML template writes as single tokens; a tokenizer without them is refused."""
_HEADER = "<|im_start|>assistant\n"
_ASSISTANT = re.compile(re.escape(_HEADER) + r".*?" + re.escape("<|im_end|>"), re.DOTALL)

LossOn = Literal["assistant", "all", "last_assistant"]


def template_text(tokenizer_path: str | Path | None, template: str | Path | None = None) -> str:
    """The chat template a conversation is rendered with: ``template`` (a file, or a shipped
    name such as ``qwen3``), else the ``chat_template`` beside the tokenizer, else Qwen2.5's."""
    return _template_source(tokenizer_path, template)[0]


def _template_source(tokenizer_path: str | Path | None, template: str | Path | None) -> tuple[str, str]:
    """``template_text`` and where it was read from (for messages)."""
    if template is not None:
        path = Path(template)
        if not path.is_file() and (TEMPLATES / f"{template}.jinja").is_file():
            path = TEMPLATES / f"{template}.jinja"
        if not path.is_file():
            shipped = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
            raise DataError(
                f"chat template {str(template)!r}: no such file, nor a shipped template ({shipped})"
            )
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as err:
            raise not_utf8(path, err) from None
    if tokenizer_path is not None:
        config = tokenizer_config(tokenizer_path)
        found = config.get("chat_template")
        if isinstance(found, list):  # named templates: the default one
            found = next(
                (t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
        where = f"{tokenizer_file(str(tokenizer_path)).parent / 'tokenizer_config.json'} chat_template"
        if isinstance(found, str):
            return found, where
        if found is not None:
            raise DataError(f"{where}: not a template (a string, or a list with one named 'default')")
    return DEFAULT_TEMPLATE.read_text(), str(DEFAULT_TEMPLATE)


def tokenizer_config(tokenizer_path: str | Path) -> dict[str, Any]:
    """The ``tokenizer_config.json`` beside the tokenizer ({} when there is none); one that is
    not a JSON object is a DataError naming it."""
    path = tokenizer_file(str(tokenizer_path)).parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}: not JSON ({err.msg} at line {err.lineno}); re-download it with the tokenizer"
        ) from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object but {type(config).__name__}; re-download it")
    return config


@lru_cache(maxsize=8)
def _compiled(text: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(text)


def render(messages: list[dict[str, Any]], template: str) -> str:
    """The conversation as the template writes it for training (no generation prompt). Any
    failure of the template, compiling (bad syntax, an unknown filter) or rendering (an
    undefined name, its own raise_exception), is one DataError saying what and where."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=False, tools=None)
    except TemplateSyntaxError as err:
        raise DataError(f"chat template line {err.lineno}: {err.message}; fix the template") from None
    except Exception as err:  # the template's code, run on this conversation
        raise DataError(f"chat template failed on this conversation: {type(err).__name__}: {err}") from None


SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hello! How can I help?"},
]
"""What any chat template must render: checked before a job starts."""


def learned_spans(text: str, loss_on: LossOn = "assistant") -> list[tuple[int, int]]:
    """Character spans of ``text`` whose tokens are targets."""
    if loss_on == "all":
        return [(0, len(text))]
    spans = [(m.start() + len(_HEADER), m.end()) for m in _ASSISTANT.finditer(text)]
    return spans[-1:] if loss_on == "last_assistant" else spans


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file(path)))
    missing = [s for s in SPECIALS if tokenizer.token_to_id(s) is None]
    if missing:
        raise DataError(
            f"{tokenizer_file(path)}: the chat template's special tokens {missing} are not single tokens "
            "of this tokenizer; use the model's own tokenizer (Qwen's has them) or add them as special tokens"
        )
    return tokenizer


def encode(
    messages: list[dict[str, Any]],
    tokenizer_path: str | Path,
    template: str | Path | None = None,
    loss_on: LossOn = "assistant",
) -> tuple[list[int], list[bool]]:
    """(token ids, learned) of one conversation: ``learned[i]`` says token ``i`` is a target
    (``loss_on``: every assistant turn, the last one, or all tokens)."""
    ids, learned = _encode(messages, str(tokenizer_path), template_text(tokenizer_path, template), loss_on)
    return ids, learned.tolist()


def _encode(
    messages: list[dict[str, Any]], tokenizer_path: str, template: str, loss_on: LossOn
) -> tuple[list[int], np.ndarray]:
    """``encode`` with the template text already read (once per dataset, not per line)."""
    text = render(messages, template)
    encoding = _tokenizer(tokenizer_path).encode(text, add_special_tokens=False)
    spans = learned_spans(text, loss_on)
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    # a token is learned when it ends inside a span (a token straddling the header's newline
    # and the content belongs to the content); spans are sorted and disjoint, so the only
    # candidate is the last span starting before the token's end
    candidate = np.searchsorted(starts, offsets[:, 1], side="left") - 1
    inside = (candidate >= 0) & (offsets[:, 1] <= ends[candidate.clip(0)] if ends.size else False)
    return list(encoding.ids), inside & (offsets[:, 1] > offsets[:, 0])


@dataclass(frozen=True)
class ChatFormat:
    """How a job turns conversations into tokens: its tokenizer, template and loss_on."""

    tokenizer_path: str
    template: str | None = None
    loss_on: LossOn = "assistant"

    def check(self) -> None:
        """Raise DataError when the template is missing or cannot render a plain conversation,
        or the tokenizer lacks the template's special tokens."""
        text, where = _template_source(self.tokenizer_path, self.template)
        try:
            render(SAMPLE_CONVERSATION, text)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        _tokenizer(self.tokenizer_path)
        self.pad_id()

    def pad_id(self) -> int:
        """The id that fills the last partial sequence (never learned): the tokenizer's
        pad_token, else <|endoftext|>."""
        name = tokenizer_config(self.tokenizer_path).get("pad_token")
        if isinstance(name, dict):  # an AddedToken written out
            name = name.get("content")
        tokenizer = _tokenizer(self.tokenizer_path)
        found = tokenizer.token_to_id(name) if isinstance(name, str) else None
        return found if found is not None else tokenizer.token_to_id("<|endoftext|>") or 0


def encode_files(files: list[Path], chat: ChatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, learned, end offset of each conversation) of every conversation in ``files``
    (.jsonl), one after another."""
    template = template_text(chat.tokenizer_path, chat.template)
    ids: list[int] = []
    learned: list[np.ndarray] = []
    ends: list[int] = []
    for file in files:
        if file.suffix != ".jsonl":
            raise DataError(f"{file}: chat data is .jsonl conversations, not {file.suffix or 'this file'}")
        for number, messages in enumerate(read_conversations(file), 1):
            try:
                conversation, mask = _encode(messages, chat.tokenizer_path, template, chat.loss_on)
            except DataError as err:
                raise DataError(f"{file}: conversation {number}: {err}") from None
            ids += conversation
            learned.append(mask)
            ends.append(len(ids))
    mask = np.concatenate(learned) if learned else np.zeros(0, dtype=bool)
    if not mask.any():
        raise DataError(
            f"{files[0]}: no token to learn (no assistant turn with training.loss_on={chat.loss_on!r})"
        )
    return np.asarray(ids, dtype=np.int64), mask, np.asarray(ends, dtype=np.int64)


def load_chat(path: Path, chat: ChatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, learned, conversation ends) of every conversation in a .jsonl file or a
    folder of them."""
    files = [path] if path.is_file() else sorted(path.rglob("*.jsonl"))
    if not files:
        raise DataError(f"{path}: holds no .jsonl chat files")
    return encode_files(files, chat)


def pad_to_windows(
    tokens: np.ndarray, learned: np.ndarray, seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pad the stream so the last partial sequence is kept whole; pads are never learned
    (the mask, not the id, says so: a pad id equal to a real token masks nothing else)."""
    short = (-(tokens.size - 1)) % seq_len
    return (
        np.concatenate([tokens, np.full(short, pad_id, dtype=tokens.dtype)]),
        np.concatenate([learned, np.zeros(short, dtype=bool)]),
    )


def _message(raw: Any, where: str, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a message must be an object, not {type(raw).__name__}")
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if role_key not in raw:
        raise DataError(f"{where}: a message has no {role_key!r}")
    role = raw[role_key]
    if sharegpt:
        if role not in SHAREGPT_ROLES:
            raise DataError(f"{where}: unknown role {role!r}; ShareGPT roles are {sorted(SHAREGPT_ROLES)}")
        role = SHAREGPT_ROLES[role]
    elif role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r}; roles are {list(ROLES)}")
    content = raw.get(content_key, "")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise DataError(f"{where}: {content_key!r} of a {role} message must be a string")
    message = {k: v for k, v in raw.items() if k not in (role_key, content_key)}
    return {"role": role, "content": content, **message}


def read_conversations(path: str | Path) -> Iterator[list[dict[str, Any]]]:
    """The conversations of a chat JSONL file: one ``{"messages": [{"role", "content"}, ...]}``
    (or ShareGPT's ``{"conversations": [{"from", "value"}, ...]}``) per line; a bad line is a
    DataError naming the file and line."""
    try:
        yield from _conversations(path)
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None


def _conversations(path: str | Path) -> Iterator[list[dict[str, Any]]]:
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not ({"messages", "conversations"} & record.keys()):
                raise DataError(
                    f'{where}: a line must be an object with "messages" (or ShareGPT "conversations")'
                )
            sharegpt = "messages" not in record
            messages = record["conversations" if sharegpt else "messages"]
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{where}: messages must be a non-empty list")
            yield [_message(m, where, sharegpt) for m in messages]
