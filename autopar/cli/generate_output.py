"""Where ``autopar.generate`` writes its records, checked before any work.

Generation follows training's rule for files (``training/checkpointing/previous_run.py``):
it never replaces a file it did not write in this run. An output already there is refused
before the model is loaded, unless ``generate.overwrite`` is set and the file holds an earlier
generation's records (one JSON object with prompt_ids, new_ids and text per line); any other
file, a training run's ``metrics.jsonl`` say, is never replaced. The records are written beside
the output and moved into place whole, without replacing a file another process wrote there
meanwhile.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from autopar.config import ConfigError, JobConfig
from autopar.config.checks import check_output_file

RECORD_KEYS = frozenset({"prompt_ids", "new_ids", "text"})
"""What every record of a generation holds (``acceptance`` too with speculation)."""


def output_path(job: JobConfig) -> Path:
    """``generate.output``, else ``<job.dump_folder>/generations.jsonl``."""
    return Path(job.generate.output or Path(job.job.dump_folder) / "generations.jsonl")


def check_output(job: JobConfig) -> None:
    """The output can be written and replaces nothing this run may not replace: one line
    naming ``generate.output`` and the fix, before any work."""
    path = output_path(job)
    check_output_file(path, "--generate.output", "generations.jsonl")
    if not path.exists():
        return
    if not job.generate.overwrite:
        raise ConfigError(
            f"generate.output={path} exists, and generation never replaces a file it did not write in "
            "this run; name another --generate.output, or pass --generate.overwrite true to replace an "
            "earlier generation's records"
        )
    problem = not_generations(path)
    if problem is not None:
        raise ConfigError(
            f"generate.output={path} is not the records of an earlier generation ({problem}), and "
            "generate.overwrite replaces only those; name another --generate.output"
        )


def not_generations(path: Path) -> str | None:
    """Why ``path`` is not a file of generation records, or None when it is one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        return f"not readable as text: {err}"
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            return f"line {number} is not JSON"
        if not isinstance(record, dict) or not record.keys() >= RECORD_KEYS:
            return f"line {number} is not a record of {', '.join(sorted(RECORD_KEYS))}"
    return None


def write_records(path: Path, records: list[dict], overwrite: bool) -> None:
    """``records`` as JSONL at ``path``, written beside it and moved into place whole. Without
    ``overwrite`` a file that appeared at ``path`` during the run is left alone (ConfigError
    naming where the records are instead)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(f".{path.name}.{os.getpid()}.partial")
    written.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if overwrite:
        written.replace(path)
        return
    try:
        os.link(written, path)  # fails, rather than replaces, where a file is there
    except FileExistsError:
        kept = path.with_name(f"{path.name}.{os.getpid()}")
        written.replace(kept)
        raise ConfigError(
            f"generate.output={path} was written by another process during this run; it is left as it "
            f"is and this run's records are in {kept}"
        ) from None
    except OSError:  # a file system without hard links: the check before the work stands for it
        written.replace(path)
        return
    written.unlink()
