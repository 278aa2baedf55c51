"""Data: tokenizers, prepared token files, packing, blends, and exactly-resumable loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from autopar.data import ByteTokenizer, DataError, PackedWindows, StepLoader, build_samples
from autopar.data.dataset import Blend
from autopar.data.prepare import prepare
from autopar.data.tokens import BUILTIN_DATASETS, load_tokens, read_prepared


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world, " * 40)
    (folder / "b.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 9}) for i in range(20)))
    return folder


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "naive cafe: 3 < 4"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode("\u00e9")) < 256 and tok.eos_id == 256 and tok.vocab_size == 257


def test_hf_tokenizer_json_is_used(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the cat sat on the mat"] * 20,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    from autopar.data import HFTokenizer

    ours = HFTokenizer(tmp_path)
    assert ours.eos_id == tok.token_to_id("<|endoftext|>")
    assert ours.encode("the cat") == tok.encode("the cat").ids


def test_text_and_jsonl_documents_end_with_eos(text_dir):
    tokens = load_tokens(text_dir, ByteTokenizer())
    assert (tokens == 256).sum() == 1 + 20  # one text file + 20 jsonl lines
    assert tokens.dtype == np.uint16


def test_prepare_writes_a_memory_map_equal_to_direct_tokenization(text_dir, tmp_path):
    path, count = prepare([str(text_dir)], str(tmp_path / "out" / "mix"), None)
    mapped = read_prepared(path, ByteTokenizer())
    assert isinstance(mapped, np.memmap) and mapped.size == count
    np.testing.assert_array_equal(mapped, load_tokens(text_dir, ByteTokenizer()))
    ends = np.fromfile(path.with_suffix(".idx"), dtype=np.int64)
    assert len(ends) == 21 and ends[-1] == count  # one text file + 20 jsonl lines
    assert (mapped[ends - 1] == 256).all()


def test_prepare_refuses_to_overwrite(text_dir, tmp_path):
    prepare([str(text_dir)], str(tmp_path / "mix"), None)
    with pytest.raises(DataError, match="already exists"):
        prepare([str(text_dir)], str(tmp_path / "mix"), None)


@pytest.mark.parametrize("own", ["notes.json", "notes.idx", "notes.mask"])
def test_prepare_never_overwrites_a_file_beside_its_output(text_dir, tmp_path, own):
    (tmp_path / own).write_text("the user's own file")
    with pytest.raises(DataError, match=f"{own}: already exists"):
        prepare([str(text_dir)], str(tmp_path / "notes"), None)
    assert (tmp_path / own).read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own, "text"])  # nothing written


def test_prepared_data_from_another_tokenizer_is_refused(text_dir, tmp_path):
    path, _ = prepare([str(text_dir)], str(tmp_path / "mix"), None)
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["tokenizer"] = "hf:0123"
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="prepared with tokenizer 'hf:0123'"):
        read_prepared(path, ByteTokenizer())


def edit_meta(path, **changes) -> None:
    meta_path = path.with_suffix(".json")
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), **changes}))


def cut_last_bytes(file, count: int) -> None:
    file.write_bytes(file.read_bytes()[:-count])


def reorder_two_document_ends(path) -> None:
    ends = np.fromfile(path.with_suffix(".idx"), dtype=np.int64)
    ends[[3, 4]] = ends[[4, 3]]
    ends.tofile(path.with_suffix(".idx"))


DAMAGE = {
    "truncated tokens": (
        lambda p: cut_last_bytes(p, 2),
        r"mix\.bin: \d+ bytes, but mix\.json says \d+ uint16 tokens",
    ),
    "truncated index": (
        lambda p: cut_last_bytes(p.with_suffix(".idx"), 8),
        r"mix\.idx: \d+ bytes, but 21 documents",
    ),
    "index out of order": (
        reorder_two_document_ends,
        r"mix\.idx: document 4 ends at \d+, not after the one before",
    ),
    "index short of the stream": (
        lambda p: np.arange(1, 22, dtype=np.int64).tofile(p.with_suffix(".idx")),
        r"the last document ends at 21, the stream has \d+ tokens",
    ),
    "dtype wrong for the vocabulary": (
        lambda p: edit_meta(p, dtype="uint32"),
        r"dtype 'uint32', but a 257-token",
    ),
    "metadata not JSON": (lambda p: p.with_suffix(".json").write_text("{"), r"mix\.json: not readable JSON"),
    "metadata incomplete": (
        lambda p: p.with_suffix(".json").write_text("{}"),
        r"mix\.json: lacks \['version'",
    ),
    "index missing": (lambda p: p.with_suffix(".idx").unlink(), r"needs mix\.bin, mix\.idx and mix\.json"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_prepared_dataset_is_refused_at_open_naming_the_file(text_dir, tmp_path, damage):
    path, _ = prepare([str(text_dir)], str(tmp_path / "mix"), None)
    harm, message = DAMAGE[damage]
    harm(path)
    with pytest.raises(DataError, match=message):
        read_prepared(path, ByteTokenizer())


def test_a_token_outside_the_vocabulary_is_refused_when_read_naming_its_position(text_dir, tmp_path):
    path, _ = prepare([str(text_dir)], str(tmp_path / "mix"), None)
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[100] = 60000  # a flipped byte
    tokens.tofile(path)
    samples = build_samples("unused", str(path), [], ByteTokenizer(), seq_len=16, seed=0)
    with pytest.raises(
        DataError, match=r"mix\.bin: token 60000 at position 100 is outside the 257-token vocabulary"
    ):
        for index in range(samples.num_windows):
            samples.sample(index)


def test_bad_jsonl_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object with a \"text\" field"):
        load_tokens(bad, ByteTokenizer())


def test_windows_cover_every_target_once_per_epoch():
    tokens = np.arange(41, dtype=np.uint16)
    windows = PackedWindows(tokens, seq_len=8, seed=0)
    assert windows.num_windows == 5
    targets = np.concatenate([windows.sample(j)[1:] for j in range(5)])
    np.testing.assert_array_equal(np.sort(targets), np.arange(1, 41))
    assert not np.array_equal(windows.sample(0), windows.sample(5)) or windows.num_windows == 1


def test_too_short_dataset_names_the_fix():
    with pytest.raises(DataError, match=r"cannot fill one sequence of training\.seq_len=64"):
        PackedWindows(np.arange(10, dtype=np.uint16), seq_len=64, seed=0)


def test_blend_follows_weights_and_is_reproducible():
    a = PackedWindows(np.zeros(1001, dtype=np.uint16), 10, seed=0)
    b = PackedWindows(np.ones(1001, dtype=np.uint16), 10, seed=1)
    blend, again_blend = Blend([a, b], [0.25, 0.75], seed=3), Blend([a, b], [0.25, 0.75], seed=3)
    first = [int(blend.sample(j)[0]) for j in range(4000)]
    again = [int(again_blend.sample(j)[0]) for j in range(4000)]
    assert first == again
    assert np.mean(first) == pytest.approx(0.75, abs=0.03)


def _loader(samples, dp_rank=0, dp_size=1, local=2, global_batch=8):
    return StepLoader(global_batch, local, dp_rank, dp_size, torch.device("cpu"), samples=samples)


def test_data_parallel_ranks_split_the_same_global_batch():
    samples = PackedWindows(np.arange(5000, dtype=np.uint16), 16, seed=0)
    single = torch.cat([b.inputs for b in _loader(samples, local=2).next_step()])
    ranks = [_loader(samples, r, 2, local=2).next_step() for r in range(2)]
    split = torch.cat([ranks[r][m].inputs for m in range(2) for r in range(2)])
    torch.testing.assert_close(split, single, rtol=0, atol=0)


def test_labels_are_inputs_shifted_by_one():
    samples = PackedWindows(np.arange(5000, dtype=np.uint16), 16, seed=0)
    batch = _loader(samples).next_step()[0]
    torch.testing.assert_close(batch.inputs[:, 1:], batch.labels[:, :-1], rtol=0, atol=0)


def test_loader_resumes_exactly_from_its_state():
    samples = PackedWindows(np.arange(3000, dtype=np.uint16), 16, seed=5)
    uninterrupted = _loader(samples)
    seen = [uninterrupted.next_step() for _ in range(30)]  # crosses several epochs
    first = _loader(samples)
    for _ in range(11):
        first.next_step()
    resumed = _loader(PackedWindows(np.arange(3000, dtype=np.uint16), 16, seed=5))
    resumed.load_state_dict(first.state_dict())
    for step in range(11, 30):
        for got, want in zip(resumed.next_step(), seen[step]):
            torch.testing.assert_close(got.inputs, want.inputs, rtol=0, atol=0)


def test_builtin_corpus_is_shipped_and_trains_a_byte_model():
    tokens = load_tokens(BUILTIN_DATASETS["autopar_corpus"], ByteTokenizer())
    assert tokens.size > 30_000
    samples = build_samples("autopar_corpus", None, [], ByteTokenizer(), seq_len=256, seed=0)
    assert samples.sample(0).shape == (257,)
