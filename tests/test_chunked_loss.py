"""The chunked cross-entropy: the plain loss and gradients, without fp32 logits for the whole
micro-batch, on one device and under every plan."""

from __future__ import annotations

import pytest
import torch

from autopar.config import ConfigError
from autopar.data.loader import IGNORE_INDEX
from autopar.distributed import single_process
from autopar.loss import chunk_loss_and_grad, chunked_token_loss_sum, token_loss_sum
from autopar.trainer import Trainer
from autopar.validate import validate

from jobs import assert_same_training, parity_runs, tiny_job


def logits_and_labels(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 101, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, 101, (3, 37), generator=generator)
    labels[0, :9] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("chunk", [1, 16, 111, 4096])  # one row, uneven chunks, exactly all, more than all
def test_chunked_loss_and_gradient_equal_the_plain_ones(chunk):
    logits, labels = logits_and_labels()
    plain = token_loss_sum(logits, labels)
    (expected,) = torch.autograd.grad(plain / 7, logits)
    chunked = chunked_token_loss_sum(logits, labels, chunk)
    (got,) = torch.autograd.grad(chunked / 7, logits)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)
    assert (got.view(-1, 101)[:9] == 0).all()  # ignored targets get no gradient


def test_a_compiled_chunk_kernel_computes_the_same():
    logits, labels = logits_and_labels()
    kernel = torch.compile(chunk_loss_and_grad, backend="aot_eager")
    plain = chunked_token_loss_sum(logits, labels, 16)
    compiled = chunked_token_loss_sum(logits, labels, 16, kernel)
    torch.testing.assert_close(compiled, plain, rtol=1e-6, atol=0)


def test_bf16_logits_keep_a_bf16_gradient_close_to_the_plain_one():
    logits, labels = logits_and_labels(torch.bfloat16)
    (expected,) = torch.autograd.grad(token_loss_sum(logits, labels), logits)
    (got,) = torch.autograd.grad(chunked_token_loss_sum(logits, labels, 16), logits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3)


def test_training_with_a_chunked_loss_matches_the_plain_loss(tmp_path):
    runs = {}
    for chunk in ("0", "24"):
        job = tiny_job(tmp_path / chunk, "--training.loss_chunk_tokens", chunk, "--training.steps", "3")
        runs[chunk] = Trainer(job, validate(job, 1), single_process()).train()
    for plain, chunked in zip(runs["0"], runs["24"], strict=True):
        assert (chunked.loss, chunked.grad_norm) == pytest.approx((plain.loss, plain.grad_norm), rel=1e-5)


def test_a_chunked_loss_with_vocab_parallel_loss_is_refused(tmp_path):
    job = tiny_job(
        tmp_path,
        "--training.loss_chunk_tokens",
        "64",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    )
    with pytest.raises(ConfigError, match="disable_loss_parallel true"):
        validate(job, 2)


PLANS = ["dp_shard=2", "pp=2", "cp=2", "tp=2,loss_parallel=false"]


@pytest.fixture(scope="module")
def chunked_parity(tmp_path_factory):
    base = tiny_job(tmp_path_factory.mktemp("chunked"), "--training.loss_chunk_tokens", "24")
    return parity_runs(base, PLANS, steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_a_chunked_loss_under_a_plan_matches_one_device(chunked_parity, plan):
    reference, run = chunked_parity[plan]
    assert_same_training(run, reference, loss_rtol=1e-5, norm_rtol=1e-5)
