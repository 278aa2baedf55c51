"""Reading a job: defaults, then the TOML file, then CLI flags (CLI > TOML > defaults).

CLI flags are ``--section.field value`` or ``--section.field=value``; booleans are
``true``/``false`` (a bare flag means true), lists are comma-separated, nested lists use
``;`` between inner lists, and ``none`` unsets an optional field. Keys under ``[model]``
that are model args (``num_hidden_layers``...) become ``model.overrides``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import itertools
import math
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig, Model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_FLAGS = ("--job.config", "--job.config_file", "--job.config-file")
PRINT_FLAGS = ("--print-config", "--print_config")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def sections() -> dict[str, type]:
    """Section name -> its dataclass."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(c) for c in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def coerce(value: Any, annotation: Any, key: str, from_cli: bool) -> Any:
    """``value`` converted to ``annotation``, or a ConfigError naming ``key``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if from_cli and isinstance(value, str) and value.lower() in _NONE:
            return None
        return coerce(value, inner[0], key, from_cli)
    if origin is Literal:
        for choice in args:
            try:
                if coerce(value, type(choice), key, from_cli) == choice:
                    return choice
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} is not one of {list(args)}")
    if origin is list:
        if from_cli and isinstance(value, str):
            separator = ";" if typing.get_origin(args[0]) is list else ","
            value = [] if value == "" else value.split(separator)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} is not a list of {_type_name(args[0])}")
        return [coerce(v, args[0], f"{key}[{i}]", from_cli) for i, v in enumerate(value)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # an immutable list (model args)
        if from_cli and isinstance(value, str):
            value = value.strip("[]")
        return tuple(coerce(value, list[args[0]], key, from_cli))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key}={value!r} is not a bool; use true or false")
    if annotation in (int, float):
        number = _number(value, annotation, from_cli)
        if number is None:
            raise ConfigError(f"{key}={value!r} is not {'an int' if annotation is int else 'a number'}")
        if not math.isfinite(number):  # a NaN passes every range check, an inf every lower bound
            raise ConfigError(f"{key}={number} must be a finite number")
        return number
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} is not a string; quote it in TOML")
    if annotation is Any or typing.get_origin(annotation) is dict:
        return value
    raise TypeError(f"unsupported config type {annotation!r} for {key}")  # internal invariant


def _number(value: Any, annotation: type, from_cli: bool) -> int | float | None:
    """``value`` as an int or float (``annotation``), or None when it is not one."""
    if isinstance(value, str) and from_cli:
        try:
            return annotation(value)
        except ValueError:
            return None
    if (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and (annotation is float or float(value).is_integer())
    ):
        return annotation(value)
    return None


def _unknown(kind: str, name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"unknown {kind} {name!r}{hint}")


ModelFields = Mapping[str, Any]
"""Model argument name -> type: the keys ``[model]`` accepts besides its own fields. The
config floor does not know the model; callers pass its fields (``autopar.training.resolve`` does)."""


SECTION_ALIASES = {"quantize.linear.float8": "float8"}
"""torchtitan's sections that are ours under another name (TOML tables and CLI prefixes)."""
FIELD_ALIASES = {"float8.recipe_name": "float8.recipe"}
"""torchtitan's fields that are ours under another name."""
CONVERTERS = {"float8": "float8.enable", "quantize.linear.float8": "float8.enable"}
"""torchtitan's ``model.converters`` items and the switch each one turns on."""


def canonical(dotted: str) -> str:
    """Our name for a dotted key given under torchtitan's name (unchanged otherwise)."""
    for alias, ours in SECTION_ALIASES.items():
        if dotted.startswith(alias + "."):
            dotted = ours + dotted[len(alias) :]
    return FIELD_ALIASES.get(dotted, dotted)


def _converters(job: JobConfig, value: Any, from_cli: bool, model_fields: ModelFields) -> None:
    """torchtitan's ``model.converters = ["float8"]``: each item turns its feature on."""
    for i, item in enumerate(coerce(value, list[str], "model.converters", from_cli)):
        if item not in CONVERTERS:
            raise ConfigError(
                f"model.converters[{i}]={item!r} is not supported; known: {sorted(CONVERTERS)} "
                "(each the same as float8.enable=true)"
            )
        set_field(job, CONVERTERS[item], True, False, model_fields)


def set_field(job: JobConfig, dotted: str, value: Any, from_cli: bool, model_fields: ModelFields) -> None:
    """Assign ``section.field`` (or a model arg under ``model.``), type-checked; torchtitan's
    names (``SECTION_ALIASES``, ``FIELD_ALIASES``, ``model.converters``) are accepted too."""
    dotted = canonical(dotted)
    if dotted == "model.converters":
        _converters(job, value, from_cli, model_fields)
        return
    section_name, _, name = dotted.partition(".")
    all_sections = sections()
    if section_name not in all_sections or not name:
        raise _unknown("config section", section_name, list(all_sections))
    section = getattr(job, section_name)
    types_ = field_types(type(section))
    if isinstance(section, Model) and name not in types_:
        if name not in model_fields:
            known = [n for n in types_ if n != "overrides"] + list(model_fields)
            raise _unknown("model field", dotted, [f"model.{n}" for n in known])
        section.overrides[name] = coerce(value, model_fields[name], dotted, from_cli)
        return
    if name not in types_ or (isinstance(section, Model) and name == "overrides"):
        raise _unknown("config field", dotted, [f"{section_name}.{n}" for n in types_])
    setattr(section, name, coerce(value, types_[name], dotted, from_cli))


def toml_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A parsed TOML file as {dotted key: value}; tables nest only under an alias section
    (``[quantize.linear.float8]``), elsewhere a table value is an ordinary (dict) value."""
    flat: dict[str, Any] = {}

    def visit(prefix: str, table: dict[str, Any]) -> None:
        for name, value in table.items():
            dotted = f"{prefix}.{name}"
            if isinstance(value, dict) and any(a.startswith(dotted) for a in SECTION_ALIASES):
                visit(dotted, value)
            else:
                flat[dotted] = value

    for section_name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: top-level key {section_name!r} must be a [section] table")
        visit(section_name, table)
    return flat


def apply_toml(job: JobConfig, data: dict[str, Any], source: str, model_fields: ModelFields) -> None:
    for dotted, value in toml_keys(data, source).items():
        try:
            set_field(job, dotted, value, False, model_fields)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None


def _split_cli(argv: list[str]) -> tuple[list[tuple[str, str | None]], bool]:
    """argv -> [(dotted key, raw value or None for a bare flag)], print_config flag."""
    pairs: list[tuple[str, str | None]] = []
    print_config = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in PRINT_FLAGS:
            print_config = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(_unexpected(arg, pairs[-1] if pairs else None))
        key, eq, raw = arg[2:].partition("=")
        value: str | None = raw if eq else None
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs, print_config


def _unexpected(arg: str, previous: tuple[str, str | None] | None) -> str:
    """The line for a bare word on the command line; after a list field's value it is most
    likely the list's next item, given apart (``--dpo.loss_type sigmoid sft``)."""
    if previous is not None and previous[1] is not None:
        key, value = previous
        section, _, name = canonical(key).partition(".")
        annotation = field_types(sections()[section]).get(name) if section in sections() else None
        inner = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        if typing.get_origin(annotation) is list or typing.get_origin(inner[0]) is list:
            return (
                f"unexpected argument {arg!r} after --{key} {value}: {section}.{name} is a list, its items "
                f"comma-separated: --{key} {value},{arg}"
            )
    return f"unexpected argument {arg!r}; flags look like --training.steps 20"


PRESETS = Path(__file__).resolve().parents[1] / "train_configs"
"""The TOML jobs shipped in the package, named by file name with or without ``.toml``."""


def config_path(name: str) -> Path:
    """The TOML file ``--job.config name`` means: a path, else a preset's name."""
    path = Path(name)
    if path.is_file():
        return path
    preset = PRESETS / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    if path.parent == Path(".") and preset.is_file():
        return preset
    presets = sorted(p.stem for p in PRESETS.glob("*.toml"))
    raise ConfigError(f"job.config_file={name!r}: no such file, nor a preset ({', '.join(presets)})")


def parse_job(argv: list[str], model_fields: ModelFields) -> JobConfig:
    """The resolved JobConfig of a command line (CLI > TOML > defaults), not yet validated."""
    pairs, print_config = _split_cli(argv)
    job = JobConfig()
    config_files = [v for k, v in pairs if k in ("job.config", "job.config_file")]
    if len(config_files) > 1:
        raise ConfigError(
            f"--job.config is given {len(config_files)} times ({', '.join(map(str, config_files))}); "
            "give one file and override its fields with flags"
        )
    config_file = config_files[0] if config_files else None
    if config_file is not None:
        path = config_path(config_file)
        config_file = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{config_file}: not valid TOML ({err})") from None
        apply_toml(job, data, config_file, model_fields)
        job.job.config_file = config_file
    for key, value in pairs:
        if key in ("job.config", "job.config_file"):
            continue
        if value is not None:
            set_field(job, key, value, True, model_fields)
            continue
        try:
            set_field(job, key, "true", True, model_fields)  # a bare flag means true
        except ConfigError as err:
            if str(err).startswith("unknown"):
                raise
            raise ConfigError(f"--{key} needs a value, e.g. --{key} VALUE") from None
    job.job.print_config |= print_config
    return job


def explicit_keys(argv: list[str]) -> tuple[set[str], set[str]]:
    """Dotted keys (``section.field``) the command line sets, and those its TOML file sets."""
    pairs, _ = _split_cli(argv)

    def ours(keys: Iterable[str]) -> set[str]:
        return {"float8.enable" if k == "model.converters" else canonical(k) for k in keys}

    cli = ours(k for k, _ in pairs if k not in ("job.config", "job.config_file"))
    config_file = next((v for k, v in pairs if k in ("job.config", "job.config_file")), None)
    if config_file is None:
        return cli, set()
    path = config_path(config_file)
    return cli, ours(toml_keys(tomllib.loads(path.read_text()), str(path)))


def derive_job(base: JobConfig, overrides: Iterable[str], model_fields: ModelFields) -> JobConfig:
    """A copy of ``base`` with ``key=value`` overrides applied as CLI flags would be."""
    job = copy.deepcopy(base)
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r} is not key=value (e.g. training.steps=20)")
        set_field(job, key.strip(), value.strip(), True, model_fields)
    return job


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of ``cls`` (its --help text)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def toml_value(value: Any) -> str:
    """A TOML literal of a string, number, boolean or list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


COMMANDS = {("job", "print_config"), ("job", "overwrite_dump_folder"), ("checkpoint", "allow_rewind")}
"""Fields that ask for one run's action, not settings of the job: a written job leaves them out,
so running it again asks anew."""


def to_toml(job: JobConfig) -> str:
    """The resolved job as TOML that parse_job reads back to the same config, ready to run
    (``COMMANDS`` are left out)."""
    lines = []
    for name in sections():
        section = getattr(job, name)
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(section).items():
            if (name, key) in COMMANDS:
                continue  # a command, not a setting: the printed job trains as it is
            if key == "overrides":
                lines.extend(f"{k} = {toml_value(v)}" for k, v in value.items())
            elif value is None:
                lines.append(f"# {key} is unset")
            else:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    """Every flag with its type, default and documentation."""
    lines = [
        "usage: train.py --job.config FILE [--section.field VALUE ...] [--print-config]",
        "       train.py --job.config FILE [...] --dry-run --world-size N",
        "Precedence: CLI > TOML > defaults. Lists are comma-separated; booleans true/false.",
        "  --print-config        print the resolved job as TOML and exit",
        "  --dry-run --world-size N",
        "                        build the job for N GPUs on this machine (fake tensors, no GPU), run one",
        "                        step of each rank role and report its peak memory; writes dry_run.json",
        "  parallelism.auto=true picks the plan; python -m autopar.plan ranks plans without a job",
        "",
    ]
    defaults = JobConfig()
    for name, cls in sections().items():
        lines.append(f"[{name}]")
        docs = field_docs(cls)
        for key, annotation in field_types(cls).items():
            if key == "overrides":
                lines.append(f"  --model.<arg> VALUE  {docs[key]}")
                continue
            default = getattr(getattr(defaults, name), key)
            lines.append(f"  --{name}.{key} {_type_name(annotation)} (default {default!r})")
            lines.append(f"      {docs.get(key, '')}")
        lines.append("")
    return "\n".join(lines)
