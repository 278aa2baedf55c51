"""Tokenize text / jsonl once into a memory-mapped token file for training.

    python -m autopar.data.prepare --input corpus/ more.jsonl --output data/mix \
        [--tokenizer path/to/tokenizer.json]

writes ``data/mix.bin`` and ``data/mix.json``. Point ``training.dataset_path`` at
``data/mix.bin``, or blend several with ``training.dataset_blend = ["0.7:a.bin", "0.3:b.bin"]``.

    python -m autopar.data.prepare --format chat --input chats/ --output data/sft \
        --tokenizer path/to/Qwen3-0.6B [--template qwen3] [--loss-on assistant]

renders conversations with the chat template (as ``training.dataset_format = "chat"`` does) and
also writes ``data/sft.mask``, the learned-token mask; ``.idx`` then holds conversation ends.
Prepared text and chat files blend freely. Inputs may be Parquet files, folders of them and
``datasets.save_to_disk`` folders too (``--text-field`` names the text column), read a row
group or Arrow batch at a time. Documents are written as they are encoded, so memory holds
one chunk of the input, not the dataset; a bad line leaves no output behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from autopar.data.chat import ChatFormat, ConversationEncoder, read_records
from autopar.data.errors import DataError
from autopar.data.streamed import Encoded, row_encoder
from autopar.data.tables import TableRows, is_table
from autopar.data.tokenizer import Tokenizer, build_tokenizer
from autopar.data.tokens import documents, source_files, write_prepared

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
    text_field: str = "text",
) -> tuple[Path, int]:
    """Tokenize every input (files, folders, tables) into ``output``.bin/.idx/.json (and
    .mask with ``chat``): (.bin path, tokens)."""
    tokenizer = build_tokenizer(tokenizer_path)
    columns, encode_row = row_encoder(tokenizer, chat, text_field, "--text-field")
    parts = [
        TableRows(Path(item), columns, "prepare")
        if is_table(Path(item))
        else source_files(Path(item), "prepare")
        for item in inputs
    ]
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
    sources = [str(f) for part in parts for f in (part.files if isinstance(part, TableRows) else part)]
    if chat is not None:
        chat.check()
    rendered = (
        None
        if chat is None
        else {"loss_on": chat.loss_on, "template": chat.template or "beside the tokenizer"}
    )

    def documents() -> Iterator[Encoded]:
        for part in parts:
            if isinstance(part, TableRows):
                yield from (encode_row(row, part.where(index)) for index, row in part)
            else:
                yield from file_documents(part, tokenizer, chat, text_field)

    return write_prepared(documents(), prefix, tokenizer, sources, rendered)


def file_documents(
    files: list[Path], tokenizer: Tokenizer, chat: ChatFormat | None, text_field: str
) -> Iterator[Encoded]:
    """The documents of text / jsonl files: text then end-of-text, or conversations."""
    if chat is None:
        for file in files:
            for doc in documents(file, text_field):
                yield np.asarray([*tokenizer.encode(doc), tokenizer.eos_id], dtype=np.int64), None
        return
    encoder = ConversationEncoder(chat)
    for file in files:
        if file.suffix != ".jsonl":
            raise DataError(f"{file}: chat data is .jsonl conversations, not {file.suffix or 'this file'}")
        for number, conversation in enumerate(read_records(file), 1):
            yield encoder(conversation, f"{file}: conversation {number}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m autopar.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", nargs="+", required=True, help="text/jsonl/Parquet files or folders, save_to_disk folders"
    )
    parser.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin and PREFIX.json)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json; default: byte tokenizer")
    parser.add_argument("--format", choices=["text", "chat"], default="text", help="what the inputs hold")
    parser.add_argument(
        "--template", default=None, help="chat: template file or shipped name (qwen2.5, qwen3)"
    )
    parser.add_argument("--loss-on", choices=["assistant", "all", "last_assistant"], default="assistant")
    parser.add_argument(
        "--text-field", default="text", help="text: the jsonl key or table column of each document"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.format == "chat" and args.tokenizer is None:
        parser.exit(
            2, "error: --format chat needs --tokenizer (the model's, with <|im_start|> and <|im_end|>)\n"
        )
    chat = ChatFormat(args.tokenizer, args.template, args.loss_on) if args.format == "chat" else None
    try:
        path, num_tokens = prepare(args.input, args.output, args.tokenizer, chat, args.text_field)
    except DataError as err:
        parser.exit(2, f"error: {err}\n")
    logger.info("wrote %s: %d tokens", path, num_tokens)


def cli() -> None:
    """The console entry point: ``main`` on this process's arguments."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
