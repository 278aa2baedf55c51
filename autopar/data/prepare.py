"""Tokenize text / jsonl once into a memory-mapped token file for training.

    python -m autopar.data.prepare --input corpus/ more.jsonl --output data/mix \
        [--tokenizer path/to/tokenizer.json]

writes ``data/mix.bin`` and ``data/mix.json``. Point ``training.dataset_path`` at
``data/mix.bin``, or blend several with ``training.dataset_blend = ["0.7:a.bin", "0.3:b.bin"]``.

    python -m autopar.data.prepare --format chat --input chats/ --output data/sft \
        --tokenizer path/to/Qwen3-0.6B [--template qwen3] [--loss-on assistant]

renders conversations with the chat template (as ``training.dataset_format = "chat"`` does) and
also writes ``data/sft.mask``, the learned-token mask; ``.idx`` then holds conversation ends.
Prepared text and chat files blend freely. Every input is read and encoded before anything is
written, so a bad line leaves no output behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from autopar.data.chat import ChatFormat, encode_files
from autopar.data.errors import DataError
from autopar.data.tokenizer import build_tokenizer
from autopar.data.tokens import source_files, token_dtype, tokenize_files, write_prepared

logger = logging.getLogger(__name__)


OUTPUT_SUFFIXES = (".bin", ".idx", ".json", ".mask")
"""Every file ``write_prepared`` may write beside the prefix (a text dataset has no .mask,
but a .mask left there would make it read as chat data)."""


def output_files(prefix: Path) -> list[Path]:
    """The files a prepare into ``prefix`` writes."""
    return [prefix.with_suffix(suffix) for suffix in OUTPUT_SUFFIXES]


def prepare(
    inputs: list[str],
    output: str,
    tokenizer_path: str | None,
    chat: ChatFormat | None = None,
) -> tuple[Path, int]:
    """Tokenize every input (files or folders) into ``output``.bin/.idx/.json (and .mask with
    ``chat``): (.bin path, tokens)."""
    tokenizer = build_tokenizer(tokenizer_path)
    files = [f for item in inputs for f in source_files(Path(item))]
    prefix = Path(output)
    if output.endswith(("/", os.sep)) or prefix.is_dir():
        raise DataError(
            f"--output {output}: is a folder; give a file prefix, e.g. --output {prefix / 'data'} "
            f"(writes {prefix / 'data.bin'} and its .json)"
        )
    if prefix.suffix in (".bin", ".json"):
        prefix = prefix.with_suffix("")
    existing = [str(path) for path in output_files(prefix) if path.exists()]
    if existing:
        more = f" (so do {', '.join(existing[1:])})" if len(existing) > 1 else ""
        raise DataError(
            f"{existing[0]}: already exists{more}, and --output {output} would overwrite it; choose "
            "another --output (or move the file away)"
        )
    sources = [str(f) for f in files]
    if chat is None:
        tokens = tokenize_files(files, tokenizer)
        return write_prepared(tokens, prefix, tokenizer, sources), tokens.size
    chat.check()
    ids, learned, ends = encode_files(files, chat)
    ids = ids.astype(token_dtype(tokenizer.vocab_size))
    rendered = {"loss_on": chat.loss_on, "template": chat.template or "beside the tokenizer"}
    return write_prepared(ids, prefix, tokenizer, sources, ends, learned, rendered), ids.size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="text/jsonl files or folders")
    parser.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin and PREFIX.json)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json; default: byte tokenizer")
    parser.add_argument("--format", choices=["text", "chat"], default="text", help="what the inputs hold")
    parser.add_argument(
        "--template", default=None, help="chat: template file or shipped name (qwen2.5, qwen3)"
    )
    parser.add_argument("--loss-on", choices=["assistant", "all", "last_assistant"], default="assistant")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.format == "chat" and args.tokenizer is None:
        parser.exit(
            2, "error: --format chat needs --tokenizer (the model's, with <|im_start|> and <|im_end|>)\n"
        )
    chat = ChatFormat(args.tokenizer, args.template, args.loss_on) if args.format == "chat" else None
    try:
        path, num_tokens = prepare(args.input, args.output, args.tokenizer, chat)
    except DataError as err:
        parser.exit(2, f"error: {err}\n")
    logger.info("wrote %s: %d tokens", path, num_tokens)


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
