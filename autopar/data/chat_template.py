"""Which chat template a conversation is rendered with, and rendering it as transformers does.

The template is found as transformers' ``from_pretrained`` finds it (5.x
``tokenization_utils_base``): the files beside the tokenizer, ``chat_template.jinja`` (the
default) and ``additional_chat_templates/NAME.jinja``, replace the ``chat_template`` of
``tokenizer_config.json`` whenever any exists; of several named templates ``apply_chat_template``
takes ``tool_use`` when it is given tools and one has that name, else ``default``. A template
given by file or shipped name wins over all of them, and Qwen2.5's official template is the
fallback. Rendering is transformers' too: jinja2 in a sandbox, ``trim_blocks`` and
``lstrip_blocks``, ``tojson`` without ASCII escapes, ``raise_exception``, the conversation's
``tools`` as ``tools``, and a message's ``thinking`` or ``reasoning`` readable as
``reasoning_content``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from autopar.data.errors import DataError, not_utf8
from autopar.data.records import REASONING_FIELDS
from autopar.data.tokenizer import tokenizer_file

TEMPLATES = Path(__file__).parent / "templates"
"""Shipped templates: Qwen's official ones (``qwen2.5.jinja``, ``qwen3.jinja``, ``qwen3.5.jinja``)."""
DEFAULT_TEMPLATE = TEMPLATES / "qwen2.5.jinja"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
"""transformers' names (``utils/hub.py``) for the template files beside a tokenizer."""


def template_text(
    tokenizer_path: str | Path | None, template: str | Path | None = None, tools: list[Any] | None = None
) -> str:
    """The chat template a conversation (with ``tools``, or None) is rendered with: ``template``
    (a file, or a shipped name such as ``qwen3.5``), else the one beside the tokenizer, else
    Qwen2.5's."""
    return template_source(tokenizer_path, template, tools)[0]


def template_source(
    tokenizer_path: str | Path | None, template: str | Path | None, tools: list[Any] | None = None
) -> tuple[str, str]:
    """``template_text`` and where it was read from (for messages)."""
    if template is not None:
        return _named(template)
    if tokenizer_path is not None:
        found = templates_beside(tokenizer_path)
        if found:
            return _pick(found, tools, tokenizer_file(str(tokenizer_path)).parent)
    return DEFAULT_TEMPLATE.read_text(encoding="utf-8"), str(DEFAULT_TEMPLATE)


def _named(template: str | Path) -> tuple[str, str]:
    path = Path(template)
    if not path.is_file() and (TEMPLATES / f"{template}.jinja").is_file():
        path = TEMPLATES / f"{template}.jinja"
    if not path.is_file():
        shipped = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
        raise DataError(f"chat template {str(template)!r}: no such file, nor a shipped template ({shipped})")
    return _read(path), str(path)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None


def templates_beside(tokenizer_path: str | Path) -> dict[str, tuple[str, str]]:
    """The templates beside a tokenizer by name: ``{name: (text, where)}`` ({} when none).
    Template files replace the ``tokenizer_config.json`` field, as in transformers."""
    folder = tokenizer_file(str(tokenizer_path)).parent
    files = {p.stem: p for p in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = folder / CHAT_TEMPLATE_FILE
    if files:
        return {name: (_read(path), str(path)) for name, path in files.items()}
    field = tokenizer_config(tokenizer_path).get("chat_template")
    where = f"{folder / 'tokenizer_config.json'} chat_template"
    if field is None:
        return {}
    if isinstance(field, str):
        return {"default": (field, where)}
    named = isinstance(field, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in field
    )
    if not named:
        raise DataError(f"{where}: not a template (a string, or a list of {{'name', 'template'}} objects)")
    return {t["name"]: (t["template"], f"{where} {t['name']!r}") for t in field}


def _pick(found: dict[str, tuple[str, str]], tools: list[Any] | None, folder: Path) -> tuple[str, str]:
    """The one ``apply_chat_template`` renders with: ``tool_use`` for a conversation with
    tools when there is one, else ``default``."""
    if tools is not None and "tool_use" in found:
        return found["tool_use"]
    if "default" in found:
        return found["default"]
    raise DataError(
        f"{folder}: chat templates {sorted(found)} and none is the default ({CHAT_TEMPLATE_FILE}); "
        "name one with training.chat_template (its file; prepare: --template)"
    )


def tokenizer_config(tokenizer_path: str | Path) -> dict[str, Any]:
    """The ``tokenizer_config.json`` beside the tokenizer ({} when there is none); one that is
    not a JSON object is a DataError naming it."""
    path = tokenizer_file(str(tokenizer_path)).parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read(path))
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

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(text)


def with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: the first reasoning found
    (``REASONING_FIELDS``) is also ``reasoning_content`` (and ``thinking`` when absent)."""
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render(
    messages: list[dict[str, Any]],
    template: str,
    tools: list[dict[str, Any]] | None = None,
    generation_prompt: bool = False,
) -> str:
    """The conversation as the template writes it for training (no generation prompt; with
    ``generation_prompt`` the header of the assistant turn to generate follows), with
    its function specs as ``tools``. Any failure of the template, compiling (bad syntax, an
    unknown filter) or rendering (an undefined name, its own raise_exception), is one
    DataError saying what and where."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return _compiled(template).render(
            messages=with_reasoning_aliases(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
        )
    except TemplateSyntaxError as err:
        raise DataError(f"chat template line {err.lineno}: {err.message}; fix the template") from None
    except Exception as err:  # the template's code, run on this conversation
        raise DataError(f"chat template failed on this conversation: {type(err).__name__}: {err}") from None
