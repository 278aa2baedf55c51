"""Fine-tuning on conversations: the loss is the mean over the learned (assistant) tokens of
the global batch, on one device and under every plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autopar.config import ConfigError
from autopar.data.chat import CHAT_EXAMPLE, CHATML_TOKENIZER, ChatFormat, load_chat
from autopar.data.loader import IGNORE_INDEX, StepLoader, build_samples
from autopar.data.tokenizer import build_tokenizer
from autopar.distributed import single_process
from autopar.parity import Case, run_cases
from autopar.trainer import Trainer
from autopar.validate import validate

from jobs import assert_same_training, tiny_job

CHAT_VOCAB = 576
"""The tiny model's vocabulary, room for the shipped ChatML tokenizer's 512 ids."""


def chat_job(folder, *flags: str):
    return tiny_job(
        folder,
        "--training.dataset_format",
        "chat",
        "--training.dataset_path",
        str(CHAT_EXAMPLE),
        "--model.tokenizer_path",
        str(CHATML_TOKENIZER),
        *flags,
        vocab_size=CHAT_VOCAB,
    )


def chat_samples(seq_len: int, loss_on: str = "assistant"):
    chat = ChatFormat(str(CHATML_TOKENIZER), None, loss_on)
    return build_samples(
        "", str(CHAT_EXAMPLE), [], build_tokenizer(str(CHATML_TOKENIZER)), seq_len, 0, chat=chat
    )


def test_an_epoch_learns_every_assistant_token_once_and_never_a_pad():
    tokens, learned = load_chat(CHAT_EXAMPLE, ChatFormat(str(CHATML_TOKENIZER)))
    samples = chat_samples(seq_len=32)
    assert 0 <= samples.tokens.size - tokens.size < 32 and not samples.learned[tokens.size :].any()
    seen = sum(int(samples.targets(i).sum()) for i in range(samples.num_windows))
    assert seen == int(learned[1:].sum())  # the stream's first token is nobody's target


def test_labels_are_ignored_exactly_where_a_token_is_not_learned():
    samples = chat_samples(seq_len=32)
    (batch,) = StepLoader(samples, 4, 4, 0, 1, torch.device("cpu")).next_step()
    masks = np.stack([samples.targets(i) for i in range(4)])
    rows = np.stack([samples.sample(i) for i in range(4)])
    assert torch.equal(batch.labels == IGNORE_INDEX, torch.from_numpy(~masks))
    assert torch.equal(batch.labels[torch.from_numpy(masks)], torch.from_numpy(rows[:, 1:][masks]))


def test_the_first_step_loss_is_the_mean_over_the_learned_tokens(tmp_path):
    job = chat_job(tmp_path)
    trainer = Trainer(job, validate(job, 1), single_process())
    loader = trainer.loader
    (batch,) = StepLoader(loader.samples, loader.global_batch, 2, 0, 1, torch.device("cpu")).next_step()
    with torch.no_grad():
        logits = trainer.parts[0](batch.inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
    records = trainer.train()
    assert records[0].loss == pytest.approx(expected.item(), rel=1e-5)
    assert (batch.labels == IGNORE_INDEX).any() and (batch.labels != IGNORE_INDEX).any()


def test_what_is_learned_follows_loss_on(tmp_path):
    losses = {}
    for loss_on in ("assistant", "all"):
        job = chat_job(tmp_path / loss_on, "--training.loss_on", loss_on, "--training.steps", "1")
        losses[loss_on] = Trainer(job, validate(job, 1), single_process()).train()[0].loss
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
        validate(chat_job(tmp_path, *flags), 1)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2", "cp=2"])
def test_chat_fine_tuning_under_a_plan_matches_one_device(chat_parity, plan):
    reference, run = chat_parity[plan]
    assert_same_training(run, reference, loss_rtol=1e-5, norm_rtol=1e-5)


@pytest.fixture(scope="module")
def chat_parity(tmp_path_factory):
    plans = ["dp_shard=2", "tp=2", "pp=2", "cp=2"]
    base = chat_job(tmp_path_factory.mktemp("chat"), "--training.local_batch_size", "2")
    return dict(zip(plans, run_cases([Case(base, plan) for plan in plans], steps=4)))
