"""Chunked token log-probabilities (``training.loss_chunk_tokens`` for DPO and RL): the whole
computation's values and gradients without the whole vocabulary's float32 values."""

from __future__ import annotations

import pytest
import torch
from test_dpo import preference_job
from test_rl_plans import REPLAY

from autopar.data.loader import IGNORE_INDEX
from autopar.training.metrics.logger import read_metrics
from autopar.training.objectives.rl.loss import token_logps_and_entropy
from autopar.training.token_logps import chunked_token_logps

from jobs import CHAT_VOCAB, one_process_trainer, tiny_job


def logits_and_labels(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 37, 101, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, 101, (3, 37), generator=generator)
    labels[0, :9] = IGNORE_INDEX
    return logits, labels


def weighted_grad(logps: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The gradient of a sum of the log-probabilities with a different weight on each."""
    weights = torch.linspace(-2.0, 3.0, logps.numel()).view(logps.shape)
    (grad,) = torch.autograd.grad((logps * weights).sum(), logits)
    return grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 16, 111, 4096])  # one row, uneven chunks, exactly all, more than all
def test_chunked_log_probs_entropies_and_gradients_equal_the_whole_ones(chunk, temperature):
    logits, labels = logits_and_labels()
    whole, whole_entropy = token_logps_and_entropy(logits, labels, temperature)
    chunked, entropy = chunked_token_logps(logits, labels, chunk, temperature, entropy=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    # measured 1.4e-6 on entropies of ~4.6 nats: a row dot's order of sums
    torch.testing.assert_close(entropy, whole_entropy, rtol=1e-5, atol=1e-5)
    got = weighted_grad(chunked, logits)
    torch.testing.assert_close(got, weighted_grad(whole, logits), rtol=1e-5, atol=1e-7)
    assert (chunked[0, :9] == 0).all() and (got[0, :9] == 0).all()  # ignored targets: nothing


def test_bf16_logits_get_a_bf16_gradient_close_to_the_whole_ones():
    logits, labels = logits_and_labels(torch.bfloat16)
    whole, _ = token_logps_and_entropy(logits, labels, 0.7)
    chunked, _ = chunked_token_logps(logits, labels, 16, 0.7)
    got = weighted_grad(chunked, logits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)  # float32 of the same bf16 logits
    torch.testing.assert_close(got, weighted_grad(whole, logits), rtol=2e-2, atol=2e-3)


def test_a_forward_without_gradient_forms_no_vocabulary_wide_gradient(monkeypatch):
    import autopar.training.token_logps as module

    kept = []
    kernel = module.chunk_logps
    monkeypatch.setattr(module, "chunk_logps", lambda *a, **k: kept.append(a[2]) or kernel(*a, **k))
    logits, labels = logits_and_labels()  # logits that require a gradient, under no_grad
    with torch.no_grad():
        logps, _ = chunked_token_logps(logits, labels, 16)
    assert logps.grad_fn is None and kept and not any(kept)
    torch.testing.assert_close(logps, token_logps_and_entropy(logits, labels, 1.0)[0].detach())


def records(folder) -> list[dict]:
    return [r for r in read_metrics(folder / "metrics.jsonl") if "loss" in r]


def assert_same_runs(chunked, whole, names: tuple[str, ...]) -> None:
    """The chunked run's losses, gradient norms and ``names`` as the whole run's, up to fp32's
    order of sums (measured below 2e-7 on this CPU)."""
    for a, b in zip(chunked, whole, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-5
        )
        assert [a[n] for n in names] == pytest.approx([b[n] for n in names], rel=1e-5, abs=1e-6)


def test_dpo_with_chunked_log_probs_trains_as_without(tmp_path):
    for chunk in ("0", "24"):
        job = preference_job(tmp_path / chunk, "--training.steps", "3", "--training.loss_chunk_tokens", chunk)
        one_process_trainer(job).train()
    names = ("rewards/chosen", "rewards/margins", "logps/rejected")
    assert_same_runs(records(tmp_path / "24"), records(tmp_path / "0"), names)


RL_FLAGS = (
    *REPLAY,
    "--rl.beta",
    "0.04",
    "--rl.importance_correction",
    "sequence_mask",
    "--training.steps",
    "1",
)
"""TRL's replayed step at temperature 0.7, with a reference copy and pi_old recomputed: the
policy loss, the reference's and the recomputation's forward-only log-probabilities."""


def test_an_rl_step_with_chunked_log_probs_trains_as_without(tmp_path):
    for chunk in ("0", "5"):
        flags = (*RL_FLAGS, "--training.loss_chunk_tokens", chunk)
        one_process_trainer(tiny_job(tmp_path / chunk, *flags, vocab_size=CHAT_VOCAB)).train()
    assert_same_runs(records(tmp_path / "5"), records(tmp_path / "0"), ("entropy", "kl"))


@pytest.mark.slow
def test_vocab_parallel_chunks_under_tensor_parallel_give_one_devices_step(tmp_path):
    """Each TP rank's chunk holds half the vocabulary: the log-probabilities, entropies and
    gradients combine across the two (no rank gathers the logits)."""
    from autopar.cli.parity import plan_job, run_plan

    from jobs import each_on_ranks

    base = tiny_job(tmp_path / "base", *RL_FLAGS, vocab_size=CHAT_VOCAB)
    whole = plan_job(base, "", 1, str(tmp_path / "whole"))
    chunked = plan_job(base, "tp=2,training.loss_chunk_tokens=5", 1, str(tmp_path / "tp"))
    run_plan("", whole)
    (outcome,) = each_on_ranks(run_plan, 2, [("tp=2", chunked)])
    assert outcome.losses  # the ranks ran (a crash fails here with their text)
    assert_same_runs(records(tmp_path / "tp"), records(tmp_path / "whole"), ("entropy", "kl"))
