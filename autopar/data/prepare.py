"""Tokenize text / jsonl once into a memory-mapped token file for training.

    python -m autopar.data.prepare --input corpus/ more.jsonl --output data/mix \
        [--tokenizer path/to/tokenizer.json]

writes ``data/mix.bin`` and ``data/mix.json``. Point ``training.dataset_path`` at
``data/mix.bin``, or blend several with ``training.dataset_blend = ["0.7:a.bin", "0.3:b.bin"]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from autopar.data.errors import DataError
from autopar.data.tokenizer import build_tokenizer
from autopar.data.tokens import source_files, tokenize_files, write_prepared

logger = logging.getLogger(__name__)


def prepare(inputs: list[str], output: str, tokenizer_path: str | None) -> tuple[Path, int]:
    """Tokenize every input (files or folders) into ``output``.bin/.json: (.bin path, tokens)."""
    tokenizer = build_tokenizer(tokenizer_path)
    files = [f for item in inputs for f in source_files(Path(item))]
    prefix = Path(output)
    if prefix.suffix in (".bin", ".json"):
        prefix = prefix.with_suffix("")
    if prefix.with_suffix(".bin").exists():
        raise DataError(f"{prefix.with_suffix('.bin')}: already exists; choose another --output")
    tokens = tokenize_files(files, tokenizer)
    return write_prepared(tokens, prefix, tokenizer, [str(f) for f in files]), tokens.size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="text/jsonl files or folders")
    parser.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin and PREFIX.json)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json; default: byte tokenizer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path, num_tokens = prepare(args.input, args.output, args.tokenizer)
    except DataError as err:
        parser.exit(2, f"error: {err}\n")
    logger.info("wrote %s: %d tokens", path, num_tokens)


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
