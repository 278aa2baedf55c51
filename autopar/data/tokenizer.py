"""Tokenizers: HF ``tokenizer.json`` through the ``tokenizers`` library, or built-in bytes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from autopar.data.errors import DataError
from autopar.data.specials import Specials


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    name: str
    """Identifies the vocabulary, so prepared data made with another one is refused."""

    @property
    def specials(self) -> Specials | None:
        """Its special tokens, for conversations whose text must stay text (None: it has none)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 ends a document. Needs no files."""

    vocab_size: int = 257
    eos_id: int = 256
    name: str = "byte"

    @property
    def specials(self) -> None:
        return None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (as shipped with every Qwen checkpoint)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        file = tokenizer_file(path)
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises a bare Exception for unreadable files
            raise DataError(f"{file}: not a readable HF tokenizer.json ({err})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = next(
            (
                self._tok.token_to_id(t)
                for t in ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
                if self._tok.token_to_id(t) is not None
            ),
            None,
        )
        if eos is None:
            raise DataError(f"{file}: no end-of-text token (<|endoftext|>, </s>, <eos>) in vocab")
        self.eos_id = eos
        self.name = "hf:" + hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        self._file = file
        self._specials: Specials | None = None

    @property
    def specials(self) -> Specials:
        """Built once, when a conversation is first encoded (a second copy of the tokenizer)."""
        if self._specials is None:
            self._specials = Specials.of(self._tok, self._file)
        return self._specials

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` (a file or a folder) names."""
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


def build_tokenizer(path: str | None) -> Tokenizer:
    """The HF tokenizer at ``path``, or the byte tokenizer when ``path`` is None."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
