"""The chunked cross-entropy: the plain loss and gradients, without fp32 logits for the whole
micro-batch, on one device and under every plan."""

from __future__ import annotations

import pytest
import torch

from autopar.cli.parity import Case, run_cases
from autopar.data.loader import IGNORE_INDEX
from autopar.training.loss import chunk_loss_and_grad, chunked_token_loss_sum, token_loss_sum

from jobs import assert_fp32_parity, chat_job, one_process_trainer, tiny_job


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
        runs[chunk] = one_process_trainer(job).train()
    for plain, chunked in zip(runs["0"], runs["24"], strict=True):
        assert (chunked.loss, chunked.grad_norm) == pytest.approx((plain.loss, plain.grad_norm), rel=1e-5)


PLANS = ["dp_shard=2", "pp=2", "cp=2", "tp=2,loss_parallel=false", "tp=2"]
"""``tp=2`` is vocab-parallel: each rank's chunk holds half the vocabulary's columns."""
CHAT_PLANS = ["tp=2", "tp=2,compile.enable=true,compile.components=loss"]
"""Conversations: prompt tokens are ignored targets, which each vocabulary half must skip."""


@pytest.fixture(scope="module")
def chunked_parity(tmp_path_factory):
    chunked = ("--training.loss_chunk_tokens", "24")
    base = tiny_job(tmp_path_factory.mktemp("chunked"), *chunked)
    chat = chat_job(tmp_path_factory.mktemp("chat"), *chunked)
    cases = [Case(base, plan) for plan in PLANS] + [Case(chat, plan) for plan in CHAT_PLANS]
    runs = run_cases(cases, steps=4)
    return dict(zip(PLANS + [f"chat:{plan}" for plan in CHAT_PLANS], runs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS + [f"chat:{plan}" for plan in CHAT_PLANS])
def test_a_chunked_loss_under_a_plan_matches_one_device(chunked_parity, plan):
    reference, run = chunked_parity[plan]
    assert_fp32_parity(run, reference)


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_compiled_loss_compiles_with_the_jobs_backend(chunk):
    """``compile.backend`` reaches the loss as it reaches the blocks (it took inductor's)."""
    from autopar.training.train_context import TrainContext

    graphs = []

    @torch._dynamo.register_backend(name=f"autopar_recording_{chunk}")
    def recording(graph, inputs):
        graphs.append(graph)
        return graph.forward

    context = TrainContext(
        False, compile_loss=True, loss_chunk_tokens=chunk, compile_backend=f"autopar_recording_{chunk}"
    )
    logits, labels = logits_and_labels()
    torch.testing.assert_close(
        context.loss_fn(logits, labels), token_loss_sum(logits, labels), rtol=1e-6, atol=0
    )
    assert graphs
