"""Parquet files and ``datasets.save_to_disk`` folders are data as JSONL is: the same tokens in
the same order (so the same losses), read a chunk at a time, and one line for a bad column."""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from autopar.config import ConfigError  # noqa: E402
from autopar.data import ByteTokenizer, DataError, build_samples  # noqa: E402
from autopar.data.chat import CHAT_EXAMPLE, CHATML_TOKENIZER, ChatFormat  # noqa: E402
from autopar.data.prepare import prepare  # noqa: E402
from autopar.data.tokenizer import build_tokenizer  # noqa: E402
from autopar.data.tokens import BUILTIN_DATASETS, read_learned, read_prepared  # noqa: E402
from autopar.training.preflight import check_job  # noqa: E402

from jobs import TOOLS, chat_job, one_process_trainer, tiny_job  # noqa: E402


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def corpus_rows(field: str = "text") -> list[dict]:
    """The shipped corpus as one row per paragraph."""
    text = "\n".join(p.read_text() for p in sorted(BUILTIN_DATASETS["autopar_corpus"].glob("*.txt")))
    return [{field: paragraph} for paragraph in text.split("\n\n") if paragraph.strip()]


def save_to_disk(rows: list[dict], folder: Path, shards: int = 3) -> Path:
    """A folder as ``datasets.Dataset.save_to_disk(folder, num_shards=shards)`` writes it: Arrow
    stream files ``data-0000i-of-0000n.arrow`` named by ``state.json``, and ``dataset_info.json``.
    Written with pyarrow: ``datasets`` brings ``dill``, whose import (inside ``import torch``)
    needs a writable temporary directory, which the full-disk checks take away."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    step = -(-table.num_rows // shards)
    for i, name in enumerate(names):
        with pa.ipc.new_stream(str(folder / name), table.schema) as writer:
            writer.write_table(table.slice(i * step, step))
    state = {"_data_files": [{"filename": name} for name in names], "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def losses(job) -> list[float]:
    return [m.loss for m in one_process_trainer(job).train()]


def test_a_parquet_chat_set_trains_with_the_losses_of_the_same_jsonl(tmp_path):
    table = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(jsonl_rows(CHAT_EXAMPLE)), table, row_group_size=5)
    steps = ("--training.steps", "3")
    from_jsonl = losses(chat_job(tmp_path / "jsonl", *steps))
    from_parquet = losses(chat_job(tmp_path / "parquet", *steps, "--training.dataset_path", str(table)))
    assert from_parquet == from_jsonl  # the same tokens in the same order: bit for bit


def test_an_arrow_text_set_trains_with_the_losses_of_the_same_jsonl(tmp_path):
    rows = corpus_rows("content")
    folder = save_to_disk(rows, tmp_path / "saved")
    assert len(list(folder.glob("data-*.arrow"))) > 1  # several shards, read in state.json's order
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", rows)
    steps = ("--training.steps", "3", "--training.dataset_text_field", "content")
    from_jsonl = losses(tiny_job(tmp_path / "jsonl", *steps, "--training.dataset_path", str(jsonl)))
    from_arrow = losses(tiny_job(tmp_path / "arrow", *steps, "--training.dataset_path", str(folder)))
    assert from_arrow == from_jsonl


def chat_rows() -> tuple[list[dict], list[dict]]:
    """Conversations with and without tools, and the same in ShareGPT's form."""
    messages = jsonl_rows(CHAT_EXAMPLE)[:6]
    with_tools = [{**row, "tools": TOOLS} for row in messages[:3]] + [
        {**row, "tools": None} for row in messages[3:]
    ]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [
        {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in row["messages"]]}
        for row in messages
    ]
    return with_tools, sharegpt


def test_tools_and_sharegpt_rows_give_the_windows_of_the_same_jsonl(tmp_path):
    with_tools, sharegpt = chat_rows()
    tables, lines = tmp_path / "tables", tmp_path / "lines"
    tables.mkdir(), lines.mkdir()
    pq.write_table(pa.Table.from_pylist(with_tools), tables / "a.parquet", row_group_size=2)
    sharegpt_tools = [{**row, "tools": json.dumps(TOOLS)} for row in sharegpt]  # as the Hub's sets hold them
    pq.write_table(pa.Table.from_pylist(sharegpt_tools), tables / "b.parquet")
    write_jsonl(lines / "a.jsonl", [{k: v for k, v in r.items() if v is not None} for r in with_tools])
    write_jsonl(lines / "b.jsonl", sharegpt_tools)
    chat, tokenizer = ChatFormat(str(CHATML_TOKENIZER)), build_tokenizer(str(CHATML_TOKENIZER))
    expected, got = (
        build_samples("", str(folder), [], tokenizer, 16, 0, chat=chat, document_masking=True)
        for folder in (lines, tables)
    )
    assert got.num_windows == expected.num_windows > 10
    for i in range(got.num_windows):
        np.testing.assert_array_equal(got.sample(i), expected.sample(i))
        np.testing.assert_array_equal(got.targets(i), expected.targets(i))
        np.testing.assert_array_equal(got.documents(i), expected.documents(i))


def test_prepare_reads_tables_as_it_reads_jsonl(tmp_path):
    rows = corpus_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "corpus.parquet", row_group_size=7)
    write_jsonl(tmp_path / "corpus.jsonl", rows)
    from_table, _ = prepare([str(tmp_path / "corpus.parquet")], str(tmp_path / "a"), None)
    from_jsonl, _ = prepare([str(tmp_path / "corpus.jsonl")], str(tmp_path / "b"), None)
    np.testing.assert_array_equal(
        read_prepared(from_table, ByteTokenizer()), read_prepared(from_jsonl, ByteTokenizer())
    )
    for suffix in (".idx", ".bin"):
        assert from_table.with_suffix(suffix).read_bytes() == from_jsonl.with_suffix(suffix).read_bytes()


def test_prepare_reads_a_chat_table_with_its_learned_mask(tmp_path):
    chat = ChatFormat(str(CHATML_TOKENIZER))
    pq.write_table(
        pa.Table.from_pylist(jsonl_rows(CHAT_EXAMPLE)), tmp_path / "chat.parquet", row_group_size=4
    )
    from_table, _ = prepare(
        [str(tmp_path / "chat.parquet")], str(tmp_path / "a"), str(CHATML_TOKENIZER), chat
    )
    from_jsonl, _ = prepare([str(CHAT_EXAMPLE)], str(tmp_path / "b"), str(CHATML_TOKENIZER), chat)
    for suffix in (".bin", ".idx", ".mask"):
        assert from_table.with_suffix(suffix).read_bytes() == from_jsonl.with_suffix(suffix).read_bytes()
    assert read_learned(from_table).any()


def peak_bytes_reading(path: Path, steps: int) -> int:
    """Peak bytes Python and numpy allocate to open a table and read ``steps`` batches of 4
    sequences of 512 tokens."""
    tracemalloc.start()
    try:
        samples = build_samples("", str(path), [], ByteTokenizer(), 512, 0)
        for index in range(4 * steps):
            samples.sample(index)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_flat_as_the_table_grows(tmp_path):
    # 2 KB documents in row groups of 16: each file is far larger than a batch (4 x 512
    # tokens); 8x the rows must not cost 8x the memory. What grows is 8 bytes a row (its end
    # offset: 0.4% of a 2 KB row) and a window (the epoch's order, as for any dataset), never
    # the text or its tokens (an int64 a byte).
    rng = np.random.default_rng(0)
    words = np.array(["tensor", "mesh", "shard", "replica", "token", "window", "rank", "step"])
    for rows in (256, 2048):
        text = [" ".join(rng.choice(words, 300)) for _ in range(rows)]
        pq.write_table(pa.table({"text": text}), tmp_path / f"{rows}.parquet", row_group_size=16)
    small, large = (peak_bytes_reading(tmp_path / f"{rows}.parquet", steps=8) for rows in (256, 2048))
    assert pq.ParquetFile(tmp_path / "2048.parquet").metadata.num_row_groups == 128
    assert large < 1.5 * small, (small, large)
    assert large < 2048 * 2000 / 4, (small, large)  # a quarter of the text's bytes


def bad_tables(tmp_path: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (table, dataset_format, the one line it gets)."""
    cases = {
        "no text column": (
            {"body": ["a"]},
            "text",
            r"no column 'text' \(its columns: body\); set training.dataset_text_field",
        ),
        "text not a string": ({"text": [1, 2]}, "text", r"column 'text' is int64, not text"),
        "null text": ({"text": ["a", "b", None]}, "text", r"row 2, column 'text': None, not a string"),
        "no messages column": (
            {"text": ["a"]},
            "chat",
            r"no column 'messages' \(or ShareGPT's 'conversations'\)",
        ),
        "messages a string": (
            {"messages": ["hi"]},
            "chat",
            r"column 'messages' is string, not a list of messages",
        ),
        "unknown role": (
            {"messages": [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]]},
            "chat",
            r"row 1: messages\[0\]: unknown role 'robot'",
        ),
    }
    out = {}
    for name, (columns, data_format, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.parquet"
        pq.write_table(pa.table(columns), path)
        out[name] = (path, data_format, message)
    return out


@pytest.mark.parametrize(
    "case",
    [
        "no text column",
        "text not a string",
        "null text",
        "no messages column",
        "messages a string",
        "unknown role",
    ],
)
def test_a_bad_table_is_one_line_naming_the_file_row_and_column(tmp_path, case):
    path, data_format, message = bad_tables(tmp_path)[case]
    chat = ChatFormat(str(CHATML_TOKENIZER)) if data_format == "chat" else None
    tokenizer = build_tokenizer(str(CHATML_TOKENIZER))
    with pytest.raises(DataError, match=rf"^{path}: {message}") as err:
        build_samples("", str(path), [], tokenizer, 8, 0, chat=chat)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["no text column", "text not a string", "no messages column"])
def test_a_tables_missing_or_mistyped_column_is_refused_before_any_work(tmp_path, case):
    path, data_format, message = bad_tables(tmp_path)[case]
    job = (chat_job if data_format == "chat" else tiny_job)(
        tmp_path / "run", "--training.dataset_path", str(path)
    )
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        check_job(job, 1)


def windows_of(path: Path, section: str = "training", **kw) -> list[np.ndarray]:
    samples = build_samples("", str(path), [], ByteTokenizer(), 16, 0, section, **kw)
    return [samples.sample(i) for i in range(samples.num_windows)]


def assert_same_windows(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected) > 2
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


TRAIN, TEST = corpus_rows()[:6], [{"text": "the test split, which training must never see"}] * 3


@pytest.mark.parametrize("with_dataset_dict_json", [True, False])
def test_a_datasetdict_folder_trains_on_its_train_split_and_says_so(tmp_path, caplog, with_dataset_dict_json):
    for split, rows in (("train", TRAIN), ("test", TEST)):  # as DatasetDict.save_to_disk lays it out
        save_to_disk(rows, tmp_path / "dd" / split)
    if with_dataset_dict_json:
        (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with caplog.at_level("INFO", logger="autopar"):
        got = windows_of(tmp_path / "dd")
    assert_same_windows(got, windows_of(tmp_path / "dd" / "train"))
    assert "holds the splits test, train; training reads 'train'" in caplog.text


@pytest.mark.parametrize(
    "layout",
    [
        ("train/0000.parquet", "test/0000.parquet"),  # the Hub's parquet conversion
        ("data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"),  # hf download
    ],
)
def test_a_folder_of_parquet_splits_trains_on_train_and_validates_on_test(tmp_path, layout):
    for name, rows in zip(layout, (TRAIN, TEST)):
        (tmp_path / "ds" / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ds" / name)
    (tmp_path / "ds" / "README.md").write_text("# the dataset card, not data")
    assert_same_windows(windows_of(tmp_path / "ds"), windows_of(tmp_path / "ds" / layout[0]))
    test = windows_of(tmp_path / "ds", "validation")
    assert_same_windows(test, windows_of(tmp_path / "ds" / layout[1]))


def test_jsonl_splits_are_read_as_table_splits_are(tmp_path, caplog):
    write_jsonl(tmp_path / "train.jsonl", TRAIN), write_jsonl(tmp_path / "test.jsonl", TEST)
    (tmp_path / "README.md").write_text("# the dataset card: " + "not data " * 20)
    (tmp_path / ".cache").mkdir()
    write_jsonl(tmp_path / ".cache" / "leftover.jsonl", TEST)  # what hf download leaves: hidden
    with caplog.at_level("INFO", logger="autopar"):
        got = windows_of(tmp_path)
    assert_same_windows(got, windows_of(tmp_path / "train.jsonl"))
    assert "training reads 'train' (1 file(s))" in caplog.text


def test_prepare_writes_the_train_split_of_a_folder_of_splits(tmp_path, caplog):
    for split, rows in (("train", TRAIN), ("test", TEST)):
        save_to_disk(rows, tmp_path / "dd" / split)
    with caplog.at_level("INFO", logger="autopar"):
        whole, _ = prepare([str(tmp_path / "dd")], str(tmp_path / "a"), None)
    train, _ = prepare([str(tmp_path / "dd" / "train")], str(tmp_path / "b"), None)
    assert whole.read_bytes() == train.read_bytes()
    assert "prepare reads 'train' (3 file(s)); to read another, point --input at its folder" in caplog.text


@pytest.mark.parametrize(
    "files, message",
    [
        (
            ("train/a.parquet", "test/b.parquet", "c.parquet"),
            r"holds the files of splits test, train and files of none \(c.parquet\), an unknown layout",
        ),
        (
            ("data/train_sft-00000-of-00001.parquet", "data/test_sft-00000-of-00001.parquet"),
            r"holds the splits test_sft, train_sft, and training reads 'train'; point training.dataset_path",
        ),
        (
            ("a.parquet", "b.jsonl"),
            r"holds tables \(a.parquet\) and text or JSONL files \(b.jsonl\); a folder is read as one kind",
        ),
    ],
    ids=["files of no split", "no train split", "tables and jsonl"],
)
def test_a_folder_of_unknown_layout_is_refused_in_one_line(tmp_path, files, message):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            write_jsonl(tmp_path / name, TRAIN)
        else:
            pq.write_table(pa.Table.from_pylist(TRAIN), tmp_path / name)
    with pytest.raises(DataError, match=rf"^{tmp_path}: {message}") as err:
        windows_of(tmp_path)
    assert "\n" not in str(err.value)


def test_a_datasetdict_folder_without_split_folders_is_one_line(tmp_path):
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=rf"^{tmp_path}: has dataset_dict.json but no split's folder"):
        windows_of(tmp_path)
    save_to_disk(TRAIN, tmp_path / "train")
    pq.write_table(pa.Table.from_pylist(TEST), tmp_path / "stray.parquet")
    with pytest.raises(DataError, match=r"but stray.parquet is in no split's folder"):
        windows_of(tmp_path)


def test_a_hub_dataset_name_is_refused_with_the_way_to_local_files(tmp_path):
    job = tiny_job(tmp_path, "--training.dataset_path", "HuggingFaceH4/ultrachat_200k")
    with pytest.raises(
        ConfigError, match=r"no such file or folder; a Hub dataset name\? autopar reads local files"
    ):
        check_job(job, 1)


def test_without_pyarrow_a_table_gets_the_line_that_installs_it(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'autopar\[data\]'"):
        build_samples("", str(tmp_path / "a.parquet"), [], ByteTokenizer(), 8, 0)
