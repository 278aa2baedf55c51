"""Fine-tuning on conversations: the loss is the mean over the learned (assistant) tokens of
the global batch, on one device and under every plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autopar.config import ConfigError
from autopar.data.chat import CHAT_EXAMPLE, CHATML_TOKENIZER, ChatFormat, encode, load_chat
from autopar.data.loader import IGNORE_INDEX, StepLoader, build_samples
from autopar.data.tokenizer import build_tokenizer
from autopar.training.preflight import check_job
from autopar.training.resolve import model_args

from jobs import assert_fp32_parity, chat_job, one_process_trainer, parity_runs


def chat_samples(seq_len: int, loss_on: str = "assistant"):
    chat = ChatFormat(str(CHATML_TOKENIZER), None, loss_on)
    return build_samples(
        "", str(CHAT_EXAMPLE), [], build_tokenizer(str(CHATML_TOKENIZER)), seq_len, 0, chat=chat
    )


def test_an_epoch_learns_every_assistant_token_once_and_never_a_pad():
    tokens, learned, _ = load_chat(CHAT_EXAMPLE, ChatFormat(str(CHATML_TOKENIZER)))
    samples = chat_samples(seq_len=32)
    assert 0 <= samples.tokens.size - tokens.size < 32 and not samples.learned[tokens.size :].any()
    seen = sum(int(samples.targets(i).sum()) for i in range(samples.num_windows))
    assert seen == int(learned[1:].sum())  # the stream's first token is nobody's target


def test_labels_are_ignored_exactly_where_a_token_is_not_learned():
    samples = chat_samples(seq_len=32)
    (batch,) = StepLoader(4, 4, 0, 1, torch.device("cpu"), samples=samples).next_step()
    masks = np.stack([samples.targets(i) for i in range(4)])
    rows = np.stack([samples.sample(i) for i in range(4)])
    assert torch.equal(batch.labels == IGNORE_INDEX, torch.from_numpy(~masks))
    assert torch.equal(batch.labels[torch.from_numpy(masks)], torch.from_numpy(rows[:, 1:][masks]))


def assert_first_step_is_the_masked_mean(job) -> None:
    """Step 1's logged loss equals cross-entropy over the learned tokens of its batch, by hand."""
    trainer = one_process_trainer(job)
    loader = trainer.loader
    (batch,) = StepLoader(
        loader.global_batch, 2, 0, 1, torch.device("cpu"), samples=loader.samples
    ).next_step()
    with torch.no_grad():
        logits = trainer.parts[0](batch.inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
    assert (batch.labels == IGNORE_INDEX).any() and (batch.labels != IGNORE_INDEX).any()
    assert trainer.train()[0].loss == pytest.approx(expected.item(), rel=1e-5)


def test_the_first_step_loss_is_the_mean_over_the_learned_tokens(tmp_path):
    assert_first_step_is_the_masked_mean(chat_job(tmp_path))


def test_what_is_learned_follows_loss_on(tmp_path):
    losses = {}
    for loss_on in ("assistant", "all"):
        job = chat_job(tmp_path / loss_on, "--training.loss_on", loss_on, "--training.steps", "1")
        losses[loss_on] = one_process_trainer(job).train()[0].loss
    assert losses["assistant"] != pytest.approx(losses["all"], rel=1e-5)  # fp32 runs agree to 1e-6


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--model.tokenizer_path", "none"), "needs the model's tokenizer"),
        (("--training.chat_template", "nope"), "chat template 'nope': no such file"),
    ],
)
def test_chat_settings_that_cannot_work_are_config_errors(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        check_job(chat_job(tmp_path, *flags), 1)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2", "cp=2"])
def test_chat_fine_tuning_under_a_plan_matches_one_device(chat_parity, plan):
    reference, run = chat_parity[plan]
    assert_fp32_parity(run, reference)


@pytest.fixture(scope="module")
def chat_parity(tmp_path_factory):
    plans = ["dp_shard=2", "tp=2", "pp=2", "cp=2"]
    base = chat_job(tmp_path_factory.mktemp("chat"), "--training.local_batch_size", "2")
    return parity_runs(base, plans, steps=4)


def prepare_chat(folder, loss_on: str = "assistant"):
    from autopar.data.prepare import prepare

    chat = ChatFormat(str(CHATML_TOKENIZER), None, loss_on)
    path, _ = prepare([str(CHAT_EXAMPLE)], str(folder / f"sft_{loss_on}"), str(CHATML_TOKENIZER), chat)
    return path


def test_prepared_chat_holds_the_tokens_mask_and_conversation_ends(tmp_path):
    from autopar.data.chat import encode_files
    from autopar.data.tokens import read_learned, read_prepared

    path = prepare_chat(tmp_path)
    tokens, learned, ends = encode_files([CHAT_EXAMPLE], ChatFormat(str(CHATML_TOKENIZER)))
    assert np.array_equal(read_prepared(path, build_tokenizer(str(CHATML_TOKENIZER))), tokens)
    assert np.array_equal(read_learned(path), learned)
    assert np.array_equal(np.fromfile(path.with_suffix(".idx"), dtype=np.int64), ends)


def test_training_on_prepared_chat_is_the_masked_mean(tmp_path):
    assert_first_step_is_the_masked_mean(
        chat_job(tmp_path / "run", "--training.dataset_path", str(prepare_chat(tmp_path)))
    )


def test_a_blend_of_prepared_text_and_chat_masks_only_the_chat_rows(tmp_path):
    from autopar.data.prepare import prepare
    from autopar.data.tokens import BUILTIN_DATASETS

    chat = prepare_chat(tmp_path)
    corpus = str(BUILTIN_DATASETS["autopar_corpus"])
    text, _ = prepare([corpus], str(tmp_path / "text"), str(CHATML_TOKENIZER))
    tokenizer = build_tokenizer(str(CHATML_TOKENIZER))
    samples = build_samples("", None, [f"0.5:{chat}", f"0.5:{text}"], tokenizer, 32, 0)
    (batch,) = StepLoader(16, 16, 0, 1, torch.device("cpu"), samples=samples).next_step()
    masks = [samples.targets(i) for i in range(16)]
    assert any(m is None for m in masks) and any(m is not None for m in masks)
    for row, mask in zip(batch.labels, masks):
        expected = np.zeros(32, bool) if mask is None else ~mask
        assert torch.equal(row == IGNORE_INDEX, torch.from_numpy(expected))


def test_prepared_chat_with_another_loss_on_is_refused(tmp_path):
    from autopar.data.errors import DataError

    job = chat_job(tmp_path / "run", "--training.dataset_path", str(prepare_chat(tmp_path, "all")))
    with pytest.raises(DataError, match=r"prepared with loss_on='all', but training\.loss_on='assistant'"):
        one_process_trainer(job)


def test_a_bad_chat_line_leaves_nothing_prepared(tmp_path):
    import json

    from autopar.data.errors import DataError
    from autopar.data.prepare import prepare

    bad = tmp_path / "in" / "chats.jsonl"
    bad.parent.mkdir()
    good = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    bad.write_text(f"{good}\n{json.dumps({'messages': [{'role': 'robot', 'content': 'x'}]})}\n")
    chat = ChatFormat(str(CHATML_TOKENIZER))
    with pytest.raises(DataError, match=r"chats.jsonl:2: messages\[0\]: unknown role 'robot'"):
        prepare([str(bad.parent)], str(tmp_path / "out" / "sft"), str(CHATML_TOKENIZER), chat)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_sft_walk_through_takes_an_hf_folder_and_gives_one_transformers_chats_with(tmp_path):
    """The path docs/hf_and_finetuning.md shows: HF folder in (weights, ChatML tokenizer, template), chat JSONL,
    assistant-only loss with packed conversations masked, HF folder out that transformers
    loads, tokenizes conversations with and computes our logits with."""
    import json

    transformers = pytest.importorskip("transformers")

    from jobs import TINY_MODEL, chat_hf_base, hf_folder_flags

    base, source = chat_hf_base(tmp_path)
    job = chat_job(
        tmp_path / "run",
        *hf_folder_flags(source),
        "--model.tokenizer_path",
        str(source),
        "--training.document_masking",
        "true",
        "--training.steps",
        "2",
    )
    assert model_args(job).hidden_size == TINY_MODEL["hidden_size"]
    trainer = one_process_trainer(job)
    trainer.train()
    out = tmp_path / "run" / "hf" / "step-2"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = json.loads(CHAT_EXAMPLE.read_text().splitlines()[0])["messages"]
    ids, _ = encode(messages, str(source))
    assert tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.decode(ids)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = trainer.parts[0](tokens)
    assert not torch.allclose(ours, base(tokens), atol=1e-3)  # it trained
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
