"""Conversations to token ids and a learned-token mask, with the model's own chat template.

The template is the one transformers' ``apply_chat_template`` uses (``chat_template.jinja``
beside the tokenizer, else the ``chat_template`` of its ``tokenizer_config.json``), a template
file given by name, or Qwen2.5's official template when none exists; it is found and rendered
as transformers does (``chat_template.py``), with a record's ``tools``. The rendered text is
tokenized whole (special tokens are single tokens), so the ids equal
``apply_chat_template(messages, tools=tools, tokenize=True)``; special tokens written inside a
message's own text stay text (``specials.py``), so they never open or close a turn. Records are
read and checked in ``records.py``.

Which tokens are learned is read off the rendered ChatML text: an assistant turn is
``<|im_start|>assistant\\n`` ... ``<|im_end|>``, and everything after the header up to and
including ``<|im_end|>`` is learned (the content, Qwen3's and Qwen3.5's ``<think>`` block, tool
calls); the headers, the system, user and tool turns (Qwen3.5's tool responses are a user turn)
and the newline after ``<|im_end|>`` are not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from autopar.data.chat_template import (
    DEFAULT_TEMPLATE,
    TEMPLATES,
    render,
    template_source,
    template_text,
    tokenizer_config,
)
from autopar.data.errors import DataError
from autopar.data.records import Conversation, parse_record, read_conversations, read_records
from autopar.data.specials import Specials
from autopar.data.splits import folder_files, one_split
from autopar.data.tokenizer import tokenizer_file

__all__ = [
    "DEFAULT_TEMPLATE",
    "TEMPLATES",
    "ChatFormat",
    "Conversation",
    "ConversationEncoder",
    "encode",
    "encode_files",
    "learned_spans",
    "load_chat",
    "parse_record",
    "read_conversations",
    "read_records",
    "render",
    "template_text",
    "tokenizer_config",
]
CHATML_TOKENIZER = Path(__file__).parent / "tokenizers" / "chatml"
"""A small byte-level BPE with Qwen's ChatML specials (512 ids: the debug flavor's
vocabulary), for tests and examples."""
CHAT_EXAMPLE = Path(__file__).parent / "chat_example" / "conversations.jsonl"
"""24 short conversations written for autopar: the SFT walk-through's data."""
SPECIALS = ("<|im_start|>", "<|im_end|>")
"""What a ChatML template writes as single tokens; a tokenizer without them is refused."""
_HEADER = "<|im_start|>assistant\n"
_ASSISTANT = re.compile(re.escape(_HEADER) + r".*?" + re.escape("<|im_end|>"), re.DOTALL)

LossOn = Literal["assistant", "all", "last_assistant"]


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


@lru_cache(maxsize=4)
def _specials(path: str) -> Specials:
    """The tokenizer at ``path`` with a copy that reads special tokens as text."""
    return Specials.of(_tokenizer(path), tokenizer_file(path))


def encode(
    messages: list[dict[str, Any]],
    tokenizer_path: str | Path,
    template: str | Path | None = None,
    loss_on: LossOn = "assistant",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """(token ids, learned) of one conversation offering ``tools`` (JSON-schema function
    specs, as ``apply_chat_template(messages, tools=tools)`` takes them): ``learned[i]`` says
    token ``i`` is a target (``loss_on``: every assistant turn, the last one, or all tokens)."""
    text = template_text(tokenizer_path, template, tools)
    ids, learned = _encode(messages, str(tokenizer_path), text, loss_on, tools)
    return ids, learned.tolist()


def _encode(
    messages: list[dict[str, Any]],
    tokenizer_path: str,
    template: str,
    loss_on: LossOn,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], np.ndarray]:
    """``encode`` with the template text already read (once per dataset, not per line)."""
    specials = _specials(tokenizer_path)
    text = render(specials.masked(messages), template, specials.masked(tools))
    ids, offsets = specials.encode(text)
    spans = learned_spans(text, loss_on)
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    # a token is learned when it ends inside a span (a token straddling the header's newline
    # and the content belongs to the content); spans are sorted and disjoint, so the only
    # candidate is the last span starting before the token's end
    candidate = np.searchsorted(starts, offsets[:, 1], side="left") - 1
    inside = (candidate >= 0) & (offsets[:, 1] <= ends[candidate.clip(0)] if ends.size else False)
    return ids, inside & (offsets[:, 1] > offsets[:, 0])


@dataclass(frozen=True)
class ChatFormat:
    """How a job turns conversations into tokens: its tokenizer, template and loss_on."""

    tokenizer_path: str
    template: str | None = None
    loss_on: LossOn = "assistant"

    def check(self) -> None:
        """Raise DataError when the template is missing or cannot render a plain conversation,
        or the tokenizer lacks the template's special tokens."""
        text, where = template_source(self.tokenizer_path, self.template)
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


class ConversationEncoder:
    """Conversations to (token ids, learned) with one ChatFormat; the template text is read
    once per kind of conversation (with tools or not: a folder may have a "tool_use" template)."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self._templates: dict[bool, str] = {}

    def __call__(self, conversation: Conversation, where: str) -> tuple[np.ndarray, np.ndarray]:
        messages, tools = conversation
        if (tools is not None) not in self._templates:
            self._templates[tools is not None] = template_text(
                self.chat.tokenizer_path, self.chat.template, tools
            )
        template = self._templates[tools is not None]
        try:
            ids, mask = _encode(messages, self.chat.tokenizer_path, template, self.chat.loss_on, tools)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        return np.asarray(ids, dtype=np.int64), mask


def encode_files(files: list[Path], chat: ChatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, learned, end offset of each conversation) of every conversation in ``files``
    (.jsonl), one after another."""
    encoder = ConversationEncoder(chat)
    ids: list[np.ndarray] = []
    learned: list[np.ndarray] = []
    for file in files:
        if file.suffix != ".jsonl":
            raise DataError(f"{file}: chat data is .jsonl conversations, not {file.suffix or 'this file'}")
        for number, conversation in enumerate(read_records(file), 1):
            conversation_ids, mask = encoder(conversation, f"{file}: conversation {number}")
            ids.append(conversation_ids)
            learned.append(mask)
    mask = np.concatenate(learned) if learned else np.zeros(0, dtype=bool)
    if not mask.any():
        raise DataError(
            f"{files[0]}: no token to learn (no assistant turn with training.loss_on={chat.loss_on!r})"
        )
    ends = np.cumsum([a.size for a in ids], dtype=np.int64)
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), mask, ends


def load_chat(
    path: Path, chat: ChatFormat, section: str = "training"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, learned, conversation ends) of every conversation in a .jsonl file or a
    folder of them (of the split ``section`` reads)."""
    files = [path] if path.is_file() else [p for p in folder_files(path) if p.suffix == ".jsonl"]
    files = one_split(path, files, section) if files else files
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
