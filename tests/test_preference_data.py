"""Preference records become TRL 1.16's token ids; bad records get one line naming the field.

The reference ids are TRL's own (``tests/dpo_fixtures/*_ids.json``, written by
``make_trl_fixtures.py`` with trl installed); these tests never import trl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.data.chat import CHATML_TOKENIZER, ChatFormat
from autopar.data.errors import DataError
from autopar.data.preference import PREFERENCE_EXAMPLE, Pair, load_pairs, truncate
from autopar.data.preference_example import make_pairs
from autopar.data.preference_records import extract_prompt

FIXTURES = Path(__file__).parent / "dpo_fixtures"
TOKENIZER = str(CHATML_TOKENIZER)


def trl_ids(group: str) -> dict:
    return json.loads((FIXTURES / f"{group}_ids.json").read_text())


def as_lists(pair: Pair) -> dict[str, list[int]]:
    return {
        "prompt_ids": pair.prompt.tolist(),
        "chosen_ids": pair.chosen.tolist(),
        "rejected_ids": pair.rejected.tolist(),
    }


def ours(group: str, source: Path | None = None) -> list[dict[str, list[int]]]:
    fixture = trl_ids(group)
    template = fixture["chat_template"]
    chat = ChatFormat(TOKENIZER, template=template) if template else None
    pairs = load_pairs(source or FIXTURES / fixture["records"], chat, TOKENIZER).pairs
    return [as_lists(pair) for pair in pairs]


@pytest.mark.parametrize(
    "group",
    ["plain", "conversational", "implicit_conversational", "implicit_plain", "qwen3_thinking"],
)
def test_records_tokenize_to_trls_ids(group):
    # plain: eos appended unless present, a prompt token merging into the completion;
    # conversational: system message, tools, a tool call, multi-turn; implicit prompts;
    # qwen3_thinking: chat_template_kwargs reach the template, the prompt split where ids diverge
    assert ours(group) == trl_ids(group)["ids"]


def test_implicit_prompt_splits_as_trls_extract_prompt():
    # the space before the first difference goes to the completions; identical texts keep
    # their last character (TRL's loop leaves its last index)
    assert extract_prompt("The sky is blue.", "The sky is green.", "x") == ("The sky is", " blue.", " green.")
    assert extract_prompt("Same", "Same", "x") == ("Sam", "e", "e")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    other = [turns[0], {"role": "assistant", "content": "Go away"}]
    assert extract_prompt(turns, other, "x") == (turns[:1], turns[1:], other[1:])


def test_fixtures_say_which_trl_wrote_them():
    assert trl_ids("plain")["trl"] == "1.16.0"
    assert trl_ids("plain")["eos_token"] == "<|im_end|>"


def test_save_to_disk_folder_reads_as_its_jsonl():
    assert ours("conversational", FIXTURES / "conversational_saved") == trl_ids("conversational")["ids"]


def test_parquet_reads_as_its_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = next((FIXTURES / "conversational_saved").glob("*.arrow"))
    pq.write_table(pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all(), tmp_path / "train.parquet")
    assert ours("conversational", tmp_path / "train.parquet") == trl_ids("conversational")["ids"]


def test_identical_completions_are_allowed_and_counted():
    # plain.jsonl row 4 says " yes" both ways
    assert load_pairs(FIXTURES / "plain.jsonl", None, TOKENIZER).identical == 1


def test_keep_start_cuts_each_sequence_as_trls_collator():
    # TRL's batch of the kept rows (chosen rows, then rejected rows), right-padded
    losses = json.loads((FIXTURES / "plain_losses.json").read_text())["losses"]
    trl = next(entry for entry in losses if entry["name"] == "sigmoid_truncated")
    max_length = trl["dpo_config"]["max_length"]
    pairs = load_pairs(FIXTURES / "plain.jsonl", None, TOKENIZER).pairs
    kept = [truncate(pairs[row], max_length, "keep_start", f"row {row}") for row in trl["rows"]]
    width = len(trl["batch"]["input_ids"][0])
    pad = ChatFormat(TOKENIZER).pad_id()
    ids, mask = [], []
    for side in ("chosen", "rejected"):
        for pair, _ in kept:
            completion = getattr(pair, side)
            short = width - pair.prompt.size - completion.size
            ids.append(pair.prompt.tolist() + completion.tolist() + [pad] * short)
            mask.append([0] * pair.prompt.size + [1] * completion.size + [0] * short)
    assert ids == trl["batch"]["input_ids"]
    assert mask == trl["batch"]["completion_mask"]
    assert sum(cut for _, cut in kept) == 2


def test_prompt_filling_max_length_is_one_line_naming_the_row():
    # TRL drops this pair (its prompt is 25 tokens) without a word; autopar says so
    with pytest.raises(
        DataError,
        match=r"plain\.jsonl:5: the prompt alone is 25 tokens and fills max_length=12, leaving no completion "
        r"token; raise --dpo.max_length \(-1: half of --training.seq_len\)",
    ):
        load_pairs(FIXTURES / "plain.jsonl", None, TOKENIZER, max_length=12)


def test_refuse_mode_names_the_row_that_is_too_long():
    pairs = load_pairs(FIXTURES / "plain.jsonl", None, TOKENIZER).pairs
    with pytest.raises(DataError, match=r"x:2: the pair is 19 tokens, longer than max_length=12"):
        truncate(pairs[1], 12, "refuse", "x:2")
    assert truncate(pairs[0], 64, "refuse", "x:1") == (pairs[0], False)


USER = [{"role": "user", "content": "Hi"}]
ANSWER = [{"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "a", "rejected": "b"}, r':1: no "chosen"; a preference record holds'),
        ({"prompt": "a", "chosen": "b"}, r':1: no "rejected"'),
        ({"prompt": "a", "chosen": "", "rejected": "b"}, r':1, "chosen": an empty completion'),
        ({"prompt": USER, "chosen": ANSWER, "rejected": []}, r':1, "rejected": an empty completion'),
        (
            {"prompt": "a", "chosen": 3, "rejected": "b"},
            r':1, "chosen": must be a string or a list of messages',
        ),
        (
            {"prompt": USER, "chosen": [{"role": "assistant", "content": 5}], "rejected": ANSWER},
            r""":1, "chosen": messages\[0\]: 'content' of a assistant message must be a string""",
        ),
        (
            {"prompt": USER, "chosen": ANSWER, "rejected": ANSWER, "tools": {"name": "f"}},
            r':1: "tools" must be a list of function specs',
        ),
        (
            {"prompt": USER, "chosen": ANSWER, "rejected": ANSWER, "tools": "{oops"},
            r':1: "tools" is a string but not JSON',
        ),
        ({"prompt": "a", "chosen": ANSWER, "rejected": ANSWER}, r':1: "prompt" must be lists of messages'),
        ({"prompt": [], "chosen": ANSWER, "rejected": ANSWER}, r':1, "prompt": an empty list of messages'),
        (
            {"prompt": "a", "chosen": "b", "rejected": ANSWER},
            r':1: "chosen" and "rejected" must both be text',
        ),
        (
            {"chosen": "xa", "rejected": "yb"},
            r':1: no "prompt" and "chosen" and "rejected" share no beginning',
        ),
        (
            {"prompt": USER, "chosen": ANSWER, "rejected": ANSWER, "chat_template_kwargs": "x"},
            r':1: "chat_template_kwargs" must be an object',
        ),
        ([1, 2], r":1: a preference record is an object"),
        (
            {"prompt": USER, "chosen": [{"role": "user", "content": "Hello"}], "rejected": ANSWER},
            r':1, "chosen": messages\[0\] is a user message; a completion holds the assistant',
        ),
        (
            {"prompt": USER, "chosen": ANSWER, "rejected": [*ANSWER, {"role": "system", "content": "x"}]},
            r':1, "rejected": messages\[1\] is a system message',
        ),
    ],
)
def test_bad_record_is_one_line_naming_file_row_and_field(tmp_path, record, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message) as raised:
        load_pairs(path, None, TOKENIZER)
    assert str(raised.value).startswith(f"{path}:1") and "\n" not in str(raised.value)


def test_table_without_chosen_column_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a"], "rejected": ["b"]}), tmp_path / "train.parquet")
    with pytest.raises(
        DataError, match=r"train\.parquet: no column 'chosen' \(its columns: prompt, rejected\)"
    ):
        load_pairs(tmp_path / "train.parquet", None, TOKENIZER)


def test_table_row_error_names_the_row_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": ["a", "b"], "chosen": ["c", ""], "rejected": ["d", "e"]}), tmp_path / "t.parquet"
    )
    with pytest.raises(DataError, match=r't\.parquet: row 1, "chosen": an empty completion'):
        load_pairs(tmp_path / "t.parquet", None, TOKENIZER)


def test_shipped_example_is_what_its_script_writes():
    lines = PREFERENCE_EXAMPLE.read_text().splitlines()
    assert [json.loads(line) for line in lines] == make_pairs.pairs()


def test_shipped_example_fits_the_debug_tokenizer_and_short_sequences():
    shipped = load_pairs(PREFERENCE_EXAMPLE, None, TOKENIZER, max_length=64, truncation="refuse")
    assert (len(shipped.pairs), shipped.identical, shipped.truncated) == (300, 0, 0)


def test_plain_records_with_a_tokenizer_naming_no_eos_are_one_line(tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((CHATML_TOKENIZER / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(DataError, match=r"tokenizer: tokenizer_config\.json names no eos_token"):
        load_pairs(tmp_path / "pairs.jsonl", None, str(folder))


def test_tools_as_a_list_read_as_their_json_string(tmp_path):
    record = json.loads((FIXTURES / "conversational.jsonl").read_text().splitlines()[2])
    record["tools"] = json.loads(record["tools"])
    (tmp_path / "pairs.jsonl").write_text(json.dumps(record) + "\n")
    assert ours("conversational", tmp_path / "pairs.jsonl") == trl_ids("conversational")["ids"][2:3]


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    lines = PREFERENCE_EXAMPLE.read_text(encoding="utf-8")
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    with_mark = load_pairs(tmp_path / "bom.jsonl", None, TOKENIZER).pairs
    assert [as_lists(p) for p in with_mark] == [
        as_lists(p) for p in load_pairs(PREFERENCE_EXAMPLE, None, TOKENIZER).pairs
    ]


def shared_start_pairs(path: Path, count: int, differ: bool = False) -> None:
    """Plain pairs whose completions share a long beginning and differ at the end only (all
    but the first when ``differ``, whose completions differ at once)."""
    records = [
        {
            "prompt": "Count on:",
            "chosen": " one two three four five six",
            "rejected": " one two three four five nine",
        }
        for _ in range(count)
    ]
    if differ:
        records[0] = {"prompt": "Count on:", "chosen": " one", "rejected": " nine"}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_truncation_that_leaves_every_pair_identical_is_one_line(tmp_path):
    """Cut before the completions differ, every pair has chosen = rejected: DPO would learn
    nothing (loss log 2, no gradient), so the data is refused naming the length to raise."""
    shared_start_pairs(tmp_path / "pairs.jsonl", 4)
    with pytest.raises(
        DataError,
        match=r"every pair's chosen and rejected completions are the same tokens.*max_length=8.*--dpo.max_length",
    ):
        load_pairs(tmp_path / "pairs.jsonl", None, TOKENIZER, max_length=8)


def test_pairs_truncation_left_identical_are_counted_for_the_start_up_line(tmp_path):
    shared_start_pairs(tmp_path / "pairs.jsonl", 4, differ=True)
    loaded = load_pairs(tmp_path / "pairs.jsonl", None, TOKENIZER, max_length=8)
    assert (loaded.truncated, loaded.identical, loaded.made_identical) == (3, 3, 3)
