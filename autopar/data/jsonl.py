"""Reading JSONL files: the one loop every record reader (chat, text, preference, prompt) runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autopar.data.errors import DataError, not_utf8


def jsonl_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSONL file parsed, with ``where`` ("path:line") for naming it
    in errors; a line that is not JSON, or a file that is not UTF-8, is a DataError saying so."""
    try:
        with Path(path).open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Notepad's) is no text
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except (
                    ValueError,
                    RecursionError,
                ) as err:  # bad JSON, a number past Python's digit limit, nesting past its stack
                    raise DataError(f"{where}: not JSON ({getattr(err, 'msg', err)})") from None
                yield where, record
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
