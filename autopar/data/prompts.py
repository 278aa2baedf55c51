"""Prompts files: a JSONL of ``{"prompt": text}`` or ``{"messages": [...], "tools": [...]}``
lines, read into token ids (conversations rendered with the chat template and its generation
prompt, as SFT renders them). ``python -m autopar.generate`` and training's sample prompts
(``validation.sample_prompts``) read them alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.config.errors import ConfigError
from autopar.data.chat_template import render
from autopar.data.errors import DataError, not_utf8
from autopar.data.records import parse_record
from autopar.data.tokenizer import Tokenizer

END_OF_TURN = ("<|im_end|>", "<|endoftext|>")
"""Tokens that end a reply besides the tokenizer's end of text."""


def read_prompts(path: str | None, tokenizer: Tokenizer, template: str, field: str) -> list[list[int]]:
    """Token ids of every line of the prompts file ``path`` (the job's ``field``); a bad file
    or line is one DataError."""
    if path is None:
        raise ConfigError(f'{field} is unset; name a JSONL file of {{"prompt": text}} lines')
    if not Path(path).is_file():
        raise ConfigError(f"{field}={path!r} is not a file; name a JSONL file of prompts")
    prompts = []
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no text
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(prompt_ids(line, template, tokenizer, f"{path} line {number}"))
    if not prompts:
        raise DataError(f"{path}: no prompts; write one JSON object per line")
    return prompts


def prompt_ids(line: str, template: str, tokenizer: Tokenizer, where: str) -> list[int]:
    """A line's token ids: its "prompt" as text, or its "messages" (checked as SFT checks
    them) rendered with the generation prompt and encoded as ``conversation_ids`` does."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg}); write one JSON object per line") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return tokenizer.encode(record["prompt"])
    if isinstance(record, dict) and "messages" in record:
        conversation = parse_record(record, where)
        try:
            return conversation_ids(conversation.messages, template, tokenizer, conversation.tools)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    raise DataError(f'{where}: expected {{"prompt": text}} or {{"messages": [...]}}')


def conversation_ids(
    messages: list[dict[str, Any]],
    template: str,
    tokenizer: Tokenizer,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The conversation rendered with the generation prompt, as token ids. Special-token text
    inside the messages (``<|im_end|>`` typed by a user) stays text, as SFT encodes it
    (``data/specials.py``): only the template's own specials are control tokens."""
    specials = tokenizer.specials
    if specials is None:
        return tokenizer.encode(render(messages, template, tools, generation_prompt=True))
    text = render(specials.masked(messages), template, specials.masked(tools), generation_prompt=True)
    return specials.encode(text)[0]


def check_vocabulary(prompts: list[list[int]], vocab_size: int, where: str | None) -> None:
    """One line when the tokenizer gives ids the model has no embedding for."""
    for i, prompt in enumerate(prompts):
        if max(prompt, default=0) >= vocab_size:
            raise DataError(
                f"{where}: prompt {i} has token id {max(prompt)}, past the model's vocab_size={vocab_size}; "
                "use the tokenizer the model was trained with (model.tokenizer_path or model.hf_assets_path)"
            )


def stop_ids(tokenizer: Tokenizer) -> set[int]:
    """The tokenizer's end of text and the end-of-turn tokens it has."""
    ids = {tokenizer.eos_id}
    for token in END_OF_TURN:
        encoded = tokenizer.encode(token)
        if len(encoded) == 1:
            ids.add(encoded[0])
    return ids
