"""Preference pairs as token ids, tokenized exactly as TRL 1.16's ``DPOTrainer`` tokenizes them.

TRL's rule (``DPOTrainer._prepare_dataset``), followed step by step:
- plain records: the tokenizer's ``eos_token`` (``tokenizer_config.json``) is appended to each
  completion whose text does not end with it; prompt, prompt + chosen and prompt + rejected are
  tokenized as text, with the tokenizer's own special tokens (its post-processor: a bos where
  the tokenizer adds one, nothing for Qwen's);
- conversational records: the chat template (found as SFT finds it) renders the prompt with the
  generation prompt, and prompt + chosen and prompt + rejected whole, with the record's
  ``tools`` and ``chat_template_kwargs``; the rendered text is tokenized without added special
  tokens, as ``apply_chat_template(tokenize=True)`` does;
- the prompt is the tokens the prompt shares with BOTH prompt + completion token lists (where
  they diverge, not where the prompt ends: a template may render the prompt alone differently,
  and text tokens may merge across the boundary); each completion is the rest of its list.

Truncation is TRL's ``keep_start``: prompt + completion is cut to ``max_length`` tokens, the
chosen and the rejected sequence each on its own. TRL silently drops a pair whose prompt alone
fills ``max_length``; autopar refuses it with one line naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from autopar.data.chat import ChatFormat, _tokenizer
from autopar.data.chat_template import _compiled, template_text, tokenizer_config, with_reasoning_aliases
from autopar.data.errors import DataError
from autopar.data.preference_records import PreferenceRecord, read_preferences
from autopar.data.tokenizer import tokenizer_file

PREFERENCE_EXAMPLE = Path(__file__).parent / "preference_example" / "pairs.jsonl"
"""300 short plain pairs (count, count down, repeat, spell) where chosen follows the rule and
rejected breaks it: the DPO walk-through's data, in the debug tokenizer's reach."""
Truncation = Literal["keep_start", "refuse"]
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""transformers hands a template the tokenizer's special tokens as variables of these names."""


@dataclass(frozen=True)
class Pair:
    """One preference pair as int64 token ids: the prompt, and the chosen and rejected
    completions that follow it (TRL's ``prompt_ids``, ``chosen_ids``, ``rejected_ids``)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    @property
    def identical(self) -> bool:
        """Chosen and rejected are the same tokens: allowed, the pair's loss is constant."""
        return np.array_equal(self.chosen, self.rejected)


@dataclass(frozen=True)
class PreferenceSet:
    """The pairs of a preference dataset, and what was done to them (said once in the log)."""

    pairs: list[Pair]
    truncated: int
    """Pairs whose chosen or rejected sequence was cut to ``max_length``."""
    identical: int
    """Pairs whose chosen and rejected completions are the same tokens (as trained: after
    truncation)."""
    made_identical: int = 0
    """Of those, the pairs truncation made so (cut before their completions differ)."""


class PairEncoder:
    """Preference records to Pairs with one tokenizer (and chat template for conversations)."""

    def __init__(self, tokenizer_path: str, chat: ChatFormat | None = None) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.chat = chat if chat is not None else ChatFormat(self.tokenizer_path)
        config = tokenizer_config(self.tokenizer_path)
        self.specials = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
        }
        """The tokenizer's special tokens by name, as transformers hands them to a template."""
        self._templates: dict[bool, str] = {}

    def __call__(self, record: PreferenceRecord, where: str) -> Pair:
        if record.conversational:
            prompt, chosen, rejected = self._chat_ids(record, where)
        else:
            prompt, chosen, rejected = self._text_ids(record)
        start = min(shared_prefix(prompt, chosen), shared_prefix(prompt, rejected))
        return Pair(
            np.asarray(prompt[:start], dtype=np.int64),
            np.asarray(chosen[start:], dtype=np.int64),
            np.asarray(rejected[start:], dtype=np.int64),
        )

    def eos_token(self) -> str:
        """The text TRL appends to plain completions: the tokenizer's ``eos_token``."""
        eos = self.specials.get("eos_token")
        if eos is None:
            raise DataError(
                f"{self.tokenizer_path}: tokenizer_config.json names no eos_token, which plain preference "
                "completions end with; use the model's own tokenizer folder"
            )
        return eos

    def _text_ids(self, record: PreferenceRecord) -> tuple[list[int], list[int], list[int]]:
        eos = self.eos_token()
        tokenizer = _text_tokenizer(self.tokenizer_path)
        texts = [record.prompt] + [
            c if c.endswith(eos) else c + eos for c in (record.chosen, record.rejected)
        ]
        prompt, chosen, rejected = texts
        encoded = [prompt, prompt + chosen, prompt + rejected]
        return tuple(tokenizer.encode(text, add_special_tokens=True).ids for text in encoded)  # type: ignore[return-value]

    def _chat_ids(self, record: PreferenceRecord, where: str) -> tuple[list[int], list[int], list[int]]:
        tokenizer = _tokenizer(self.tokenizer_path)
        extra = (record.tools, record.chat_template_kwargs)
        texts = [
            self.render(record.prompt, *extra, True, where),
            self.render(record.prompt + record.chosen, *extra, False, where),
            self.render(record.prompt + record.rejected, *extra, False, where),
        ]
        return tuple(tokenizer.encode(text, add_special_tokens=False).ids for text in texts)  # type: ignore[return-value]

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        generation_prompt: bool,
        where: str,
    ) -> str:
        """The conversation as ``apply_chat_template`` writes it: the tokenizer's special tokens
        and a record's ``chat_template_kwargs`` as template variables (the latter win)."""
        with_tools = tools is not None
        if with_tools not in self._templates:
            self._templates[with_tools] = template_text(self.tokenizer_path, self.chat.template, tools)
        variables = {**self.specials, **(template_kwargs or {})}
        try:
            return _compiled(self._templates[with_tools]).render(
                **{
                    **variables,
                    "messages": with_reasoning_aliases(messages),
                    "tools": tools,
                    "documents": None,
                    "add_generation_prompt": generation_prompt,
                }
            )
        except Exception as err:  # the template's code, run on this record
            raise DataError(
                f"{where}: chat template failed on this record: {type(err).__name__}: {err}"
            ) from None


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken written out."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=4)
def _text_tokenizer(path: str) -> Any:
    """The tokenizer plain records are encoded with (no chat specials needed)."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the library raises a bare Exception for unreadable files
        raise DataError(f"{file}: not a readable HF tokenizer.json ({err})") from None


def shared_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens two lists share (TRL's ``common_prefix_length``)."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def truncate(pair: Pair, max_length: int, mode: Truncation, where: str) -> tuple[Pair, bool]:
    """(the pair with prompt + chosen and prompt + rejected each cut to ``max_length`` tokens,
    whether anything was cut), as TRL's ``keep_start``; ``refuse``: a pair longer than
    ``max_length`` is a DataError. A prompt that fills ``max_length`` is always refused (it
    leaves no completion token to learn from; TRL drops such pairs without a word)."""
    room = max_length - pair.prompt.size
    if room <= 0:
        raise DataError(
            f"{where}: the prompt alone is {pair.prompt.size} tokens and fills max_length={max_length}, "
            "leaving no completion token; raise --dpo.max_length (-1: half of --training.seq_len), "
            "shorten the prompt or drop the record"
        )
    if pair.chosen.size <= room and pair.rejected.size <= room:
        return pair, False
    if mode == "refuse":
        longest = pair.prompt.size + max(pair.chosen.size, pair.rejected.size)
        raise DataError(
            f"{where}: the pair is {longest} tokens, longer than max_length={max_length}, and "
            'dpo.truncation="refuse"; shorten the record or set dpo.truncation="keep_start"'
        )
    return replace(pair, chosen=pair.chosen[:room], rejected=pair.rejected[:room]), True


def load_pairs(
    source: Path,
    chat: ChatFormat | None,
    tokenizer_path: str,
    max_length: int | None = None,
    truncation: Truncation = "keep_start",
) -> PreferenceSet:
    """Every preference record of ``source`` (a .jsonl file or folder, a Parquet / Arrow file or
    folder, a ``save_to_disk`` folder) as Pairs, in file order, truncated to ``max_length``
    when given. ``chat`` gives the template of conversational records (None: the one beside
    the tokenizer, as SFT finds it)."""
    encode = PairEncoder(tokenizer_path, chat)
    pairs: list[Pair] = []
    truncated = identical = made_identical = 0
    for where, record in read_preferences(Path(source)):
        pair = encode(record, where)
        differed = not pair.identical
        if max_length is not None:
            pair, cut = truncate(pair, max_length, truncation, where)
            truncated += cut
        identical += pair.identical
        made_identical += differed and pair.identical
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{source}: holds no preference records")
    if identical == len(pairs):
        raise DataError(nothing_to_learn(source, len(pairs), made_identical, max_length))
    return PreferenceSet(pairs, truncated, identical, made_identical)


def nothing_to_learn(source: Path, pairs: int, made_identical: int, max_length: int | None) -> str:
    """The line for data whose every pair has chosen = rejected: DPO's loss is then log 2 at
    every step with no gradient (TRL trains on such data without a word)."""
    why = "as the records hold them"
    fix = "give pairs whose chosen and rejected answers differ"
    if made_identical:
        why = f"after truncation to max_length={max_length} ({made_identical} cut before they differ)"
        fix = "raise --dpo.max_length (-1: half of --training.seq_len) so the completions keep where they differ"
    return (
        f"{source}: every pair's chosen and rejected completions are the same tokens {why}, so DPO would "
        f"learn nothing from its {pairs} pairs; {fix}"
    )
