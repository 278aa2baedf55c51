"""What a run may do to what an earlier run in its ``job.dump_folder`` left there.

Checked before any work (``check_previous_run``, by the train command), each refusal a
``ConfigError`` naming the setting and the flag that allows it:

- A run with no checkpoint of its own to resume starts afresh, replacing the metrics.jsonl and
  config.toml there. That is the same job run again (after a crash before its first
  checkpoint, say) when config.toml holds this job; another job is refused, naming the
  settings that differ, unless ``job.overwrite_dump_folder``.
- ``checkpoint.load_step`` older than a later checkpoint rewinds the run: those checkpoints
  and the metrics rows after load_step are discarded. Refused, naming them, unless
  ``checkpoint.allow_rewind``.
- A resume continues the run its checkpoint saved, whose settings the checkpoint records
  (``settings_record``). Each setting that changed is either applied (the trainer follows this
  job from the resumed step on and says so in one line, ``changed_settings``) or refused
  (``REFUSED_ON_RESUME``: what the trained weights compute), never recorded in config.toml
  while the run goes on with the saved value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from autopar.config.errors import ConfigError
from autopar.config.parse import to_toml
from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.training.checkpointing.dcp_state import complete_steps, newest_readable
from autopar.training.metrics.logger import whole_records
from autopar.training.resolve import parse_job

RUN_CONTROL = (
    "job.config_file",
    "job.description",
    "job.dump_folder",
    "job.overwrite_dump_folder",
    "checkpoint.load_step",
    "checkpoint.allow_rewind",
    "comm.",
)
"""Settings (or prefixes) that say how a command runs, not what it trains: two runs never
differ by them."""

NOT_USED_ON_RESUME = ("checkpoint.initial_load_path", "checkpoint.initial_load_in_hf")
"""Where a fresh run's weights come from: a resume takes them from its checkpoint (a LoRA
run's frozen base is checked on its own, by the trainer)."""

REFUSED_ON_RESUME = ("model.", "lora.enable", "lora.rank", "lora.alpha", "lora.target_modules")
"""What the trained weights compute: the model's shape and numerics, and the LoRA adapters'
layout and scale. Changing one on resume would train on from weights that no longer compute
what they learned; such a job starts a new run instead."""

APPLIED_MODEL_ARGS = (
    "model.router_aux_loss_coef",
    "model.max_position_embeddings",
    "model.initializer_range",
)
"""Model args a resume may change: a loss coefficient, the longest position, the init scale."""


def _plain(value: Any) -> Any:
    """``value`` as JSON keeps it (tuples become lists), so a saved and a new value compare."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _is(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in names)


def job_settings(job: JobConfig) -> dict[str, Any]:
    """Every field of ``job`` but the run-control ones, by its dotted name (``[model]``
    overrides as ``model.<arg>``)."""
    flat: dict[str, Any] = {}
    for section, values in dataclasses.asdict(job).items():
        for key, value in values.items():
            if key == "overrides":
                flat.update({f"{section}.{k}": _plain(v) for k, v in value.items()})
            else:
                flat[f"{section}.{key}"] = _plain(value)
    return {k: v for k, v in flat.items() if not _is(k, RUN_CONTROL)}


def settings_record(job: JobConfig, args: ModelArgs) -> str:
    """What a checkpoint records of the settings it was trained with (JSON): the job's, with
    the resolved model args as ``model.<arg>`` in place of the [model] section."""
    settings = {
        k: v
        for k, v in job_settings(job).items()
        if not k.startswith("model.") and not _is(k, NOT_USED_ON_RESUME)
    }
    settings.update({f"model.{f.name}": _plain(getattr(args, f.name)) for f in dataclasses.fields(args)})
    return json.dumps(settings, sort_keys=True)


def _shown(value: Any) -> str:
    """A value as the command line spells it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(_shown, value))
    return str(value)


def differences(before: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings whose values differ: name -> (before, now)."""
    return {
        k: (before.get(k), now.get(k))
        for k in sorted(before.keys() | now.keys())
        if before.get(k) != now.get(k)
    }


def listed(changes: dict[str, tuple[Any, Any]], most: int = 6) -> str:
    """``name before -> now, ...``, the first ``most`` of them."""
    shown = [f"{k} {_shown(a)} -> {_shown(b)}" for k, (a, b) in list(changes.items())[:most]]
    more = f" (and {len(changes) - most} more)" if len(changes) > most else ""
    return ", ".join(shown) + more


def changed_settings(saved: dict[str, Any], job: JobConfig, args: ModelArgs) -> dict[str, tuple[Any, Any]]:
    """The settings that differ from those the checkpoint's train state ``saved`` records
    (none for a checkpoint that records none)."""
    if "settings" not in saved:
        return {}
    before = json.loads(saved["settings"])
    for field in dataclasses.fields(ModelArgs):  # one added since: the checkpoint ran its default
        if field.default is not dataclasses.MISSING:
            before.setdefault(f"model.{field.name}", _plain(field.default))
    return differences(before, json.loads(settings_record(job, args)))


def check_previous_run(job: JobConfig, args: ModelArgs) -> None:
    """Refuse a run that would replace, discard or contradict what an earlier run in its
    dump folder left, naming the flag that allows it (see the module's docstring)."""
    checkpoint = job.checkpoint
    folder = Path(job.job.dump_folder) / checkpoint.folder
    steps = complete_steps(folder) if checkpoint.enable else []
    if checkpoint.load_step >= 0:
        _check_rewind(job, steps)
    if checkpoint.load_step < 0 and not steps:
        _check_fresh_start(job)
        return
    _logged_steps(Path(job.job.dump_folder))  # a resume rewrites metrics.jsonl: lines not ours are refused
    resumed = newest_readable(folder, [checkpoint.load_step] if checkpoint.load_step >= 0 else steps)
    if resumed is not None:  # else every one is damaged: the resume says so
        _check_resume(job, args, folder / f"step-{resumed[0]}", resumed[1])


def _logged_steps(folder: Path) -> list[int]:
    """The steps metrics.jsonl in ``folder`` has rows of (a last line cut off mid-write
    skipped); ConfigError when a line is not a record of ours."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in whole_records(path)[0]]


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if min(steps) == max(steps) else f"steps {min(steps)}-{max(steps)}"


def _check_rewind(job: JobConfig, steps: list[int]) -> None:
    load_step = job.checkpoint.load_step
    later = [s for s in steps if s > load_step]
    if not later or job.checkpoint.allow_rewind:
        return
    folder = Path(job.job.dump_folder)
    rows = [s for s in _logged_steps(folder) if s > load_step]
    rows_said = f" and the metrics.jsonl rows of {_span(rows)}" if rows else ""
    names = ", ".join(f"step-{s}" for s in later)
    raise ConfigError(
        f"checkpoint.load_step={load_step} rewinds this run: its later checkpoint{'s' if len(later) > 1 else ''} "
        f"{names}{rows_said} "
        f"would be discarded; pass --checkpoint.allow_rewind true to discard them and train on from "
        f"step {load_step}, or start a new run from it in another --job.dump_folder "
        f"(--checkpoint.initial_load_path {folder / job.checkpoint.folder / f'step-{load_step}'})"
    )


def changes_since(config: Path, job: JobConfig) -> dict[str, tuple[Any, Any]] | None:
    """How ``job`` differs from the job in the TOML file ``config`` (None when there is none);
    ConfigError when it is not a job."""
    if not config.is_file():
        return None
    return differences(job_settings(parse_job(["--job.config", str(config)])), job_settings(job))


def write_config(job: JobConfig, resumed: int | None) -> None:
    """``<dump_folder>/config.toml``: the resolved job, runnable as is, written whole (renamed
    into place). A resume keeps the one it replaces when that was another job, as
    ``config.until-step-N.toml`` (the job that trained up to the resumed step N, kept once); a
    resume of a run already trained to training.steps writes none (nothing runs with this job)."""
    folder = Path(job.job.dump_folder)
    path = folder / "config.toml"
    if resumed is not None and resumed >= job.training.steps:
        return
    if resumed is not None:
        try:
            changed = changes_since(path, job)
        except (ValueError, OSError):
            changed = {"config.toml": (None, None)}  # not a job: kept all the same
        kept = folder / f"config.until-step-{resumed}.toml"
        if (
            changed and not kept.exists()
        ):  # one kept already: that job trained to step N, this one's steps ran again
            path.replace(kept)
    written = folder / ".config.toml.partial"
    written.write_text(to_toml(job))
    written.replace(path)


def _check_fresh_start(job: JobConfig) -> None:
    folder = Path(job.job.dump_folder)
    if job.job.overwrite_dump_folder:
        return
    config, rows = folder / "config.toml", _logged_steps(folder)
    if not rows and not config.exists():
        return
    held = [f"metrics.jsonl ({_span(rows)})"] if rows else []
    if config.exists():
        held.append("config.toml")
    try:
        changes = changes_since(config, job)
    except (ValueError, OSError) as err:  # ConfigError, or a file that is not text
        changes, why = None, f"its config.toml is not a job autopar can read ({err})"
    else:
        why = "it has no config.toml to tell which job it was"
    if changes is not None:
        if not changes:
            return  # the same job again: it replaces what it wrote
        why = f"it was another job: {listed(changes)}"
    raise ConfigError(
        f"job.dump_folder={str(folder)!r} holds an earlier run's {' and '.join(held)}, which this run "
        f"(with no checkpoint of it to resume) would replace; {why}. Give this run its own "
        "--job.dump_folder, or pass --job.overwrite_dump_folder true to replace that run"
    )


def _check_resume(job: JobConfig, args: ModelArgs, path: Path, saved: dict[str, Any]) -> None:
    """Refuse to resume ``path`` (whose train state is ``saved``) with settings that change
    what its weights compute."""
    changes = changed_settings(saved, job, args)
    refused = {
        k: v for k, v in changes.items() if _is(k, REFUSED_ON_RESUME) and not _is(k, APPLIED_MODEL_ARGS)
    }
    if not refused:
        return
    names = ", ".join(f"{k}={_shown(new)}" for k, (_, new) in refused.items())
    trained = ", ".join(f"{k}={_shown(old)}" for k, (old, _) in refused.items())
    flags = " ".join(f"--{k} {_shown(old)}" for k, (old, _) in refused.items())
    raise ConfigError(
        f"{names}: {path} was trained with {trained}, and a resume cannot change what its weights "
        f"compute; resume with {flags}, or give a run with other settings its own --job.dump_folder"
    )
