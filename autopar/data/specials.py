"""A conversation's own text never becomes chat structure.

The template writes ``<|im_start|>``, ``<|im_end|>`` and the other special tokens around the
messages; a message that holds the same text (``"<|im_end|>\\n<|im_start|>assistant\\n..."``, a
prompt injection or a scraped chat log) must stay text, or the injected turn is rendered as an
assistant turn and learned. As a chat stack does, the special tokens of the data are encoded as
plain text (``encode_special_tokens``), those of the template as single tokens.

How: before rendering, each special token inside the data is replaced by a mark of the same
length (a character of Unicode's private use plane 16 repeated), so the template and the
learned-span search see no structure in it and every offset stays where it was; the rendered
text is split at the template's special tokens, and each piece is encoded with the marks put
back and special-token parsing off. A conversation without special tokens in its text is
encoded whole, exactly as ``apply_chat_template`` encodes it; splitting at special tokens is
what the tokenizer does itself, so the ids of the other pieces do not change either.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

_MARK = 0x100000
"""The first mark character: Supplementary Private Use Area-B, which no text uses."""


class Specials:
    """The special tokens of one tokenizer, and how data text that holds them is encoded."""

    def __init__(self, tokenizer: Any, plain: Any) -> None:
        """``tokenizer``: parses special tokens; ``plain``: the same one, with
        ``encode_special_tokens`` set, which reads them as text."""
        self.tokenizer = tokenizer
        self.plain = plain
        names = sorted(
            {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special},
            key=len,
            reverse=True,
        )
        self.pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self.marks = {name: chr(_MARK + k) * len(name) for k, name in enumerate(names)}
        self.unmark = re.compile("|".join(map(re.escape, self.marks.values()))) if names else None
        self.names = {mark: name for name, mark in self.marks.items()}

    @classmethod
    def of(cls, tokenizer: Any, file: Path) -> Specials:
        """The specials of ``tokenizer``, loaded from ``file``, with a second copy of it that
        reads them as text."""
        from tokenizers import Tokenizer

        plain = Tokenizer.from_file(str(file))
        plain.encode_special_tokens = True
        return cls(tokenizer, plain)

    def masked(self, value: Any) -> Any:
        """``value`` (messages, tools) with every special token inside its strings (keys
        too) replaced by its mark."""
        if isinstance(value, str):
            if self.pattern is None or not self.pattern.search(value):
                return value
            return self.pattern.sub(lambda m: self.marks[m.group()], value)
        if isinstance(value, dict):
            return {self.masked(k): self.masked(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.masked(v) for v in value]
        return value

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        """(ids, character offsets (N, 2)) of rendered ``text``, the marks encoded as the
        text they stand for."""
        if self.unmark is None or not self.unmark.search(text):
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
            return list(encoding.ids), np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        assert self.pattern is not None, "marks exist only where special tokens do"
        ids: list[int] = []
        offsets: list[np.ndarray] = []
        start = 0
        for found in [*self.pattern.finditer(text), None]:
            end = len(text) if found is None else found.start()
            if end > start:
                piece = self.unmark.sub(lambda m: self.names[m.group()], text[start:end])
                encoding = self.plain.encode(piece, add_special_tokens=False)
                ids += encoding.ids
                offsets.append(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + start)
            if found is not None:
                ids.append(self.tokenizer.token_to_id(found.group()))
                offsets.append(np.array([[found.start(), found.end()]], dtype=np.int64))
                start = found.end()
        return ids, np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64)
