"""MTP speculative decoding (``autopar.models.generation.speculative``): greedy output is plain
greedy decoding's whether the head's drafts are all kept, all refused or some of each (so the
Gated DeltaNet state rolls back to any token of a verification); sampled drafts are kept by
the standard rule, so the first token kept is distributed as the model's own; a seed repeats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.models import build_model, get_flavor
from autopar.models.generation import Decoder, generate, speculative
from autopar.models.generation.sampling import Sampling
from autopar.models.generation.speculative import accept, speculative_generate

PROMPTS = [
    [5, 17, 3],
    [9],
    [int(t) for t in torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(2))],
]
"""Ragged: three tokens, one, and 70 (past one 64-token chunk of the delta-rule kernel)."""
NEW = 16


def tiny_with_head(flavor: str):
    """The debug Qwen3.5 (dense or MoE) with a random one-layer MTP head, its output head
    sharpened (random tiny models have near-ties that fp32 rounding would decide)."""
    model = build_model(dataclasses.replace(get_flavor("qwen3.5", flavor), mtp_num_hidden_layers=1))
    model.init_weights(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model.eval()


@pytest.fixture(scope="module")
def model_and_plain():
    """The dense model and its plain greedy tokens (the MoE one: the test below and ``-m heavy``)."""
    model = tiny_with_head("debug")
    return model, generate(model, PROMPTS, NEW)


def test_greedy_speculation_equals_plain_greedy_for_a_mixture_of_experts():
    model = tiny_with_head("debug-moe")
    assert speculative_generate(model, PROMPTS[:2], NEW, 2)[0] == generate(model, PROMPTS[:2], NEW)


@pytest.mark.heavy
@pytest.mark.parametrize("agree", [True, False])
def test_greedy_speculation_equals_plain_greedy_for_a_mixture_of_experts_kept_or_refused(monkeypatch, agree):
    model = tiny_with_head("debug-moe")
    truth = generate(model, PROMPTS[2:], NEW)[0]
    forced_drafter(monkeypatch, truth, len(PROMPTS[2]), agree)
    assert speculative_generate(model, PROMPTS[2:], NEW, 3)[0] == [truth]


def forced_drafter(monkeypatch, truth: list[int], prompt_length: int, agree: bool) -> None:
    """The head still runs (its cache is written as ever), but its drafts are replaced by the
    greedy tokens at their places (``agree``) or by other tokens: every draft is kept, or none."""
    real = speculative.draft

    def forced(decoder, hidden, following, start, count, sampling, generator):
        _drafts, probs = real(decoder, hidden, following, start, count, sampling, generator)
        first = start + hidden.shape[1] + 1 - prompt_length  # index in truth of the first draft
        right = torch.tensor(truth[first : first + count], dtype=torch.long)
        return (right if agree else (right + 1) % 512), probs

    monkeypatch.setattr(speculative, "draft", forced)


def test_greedy_speculation_equals_plain_greedy_with_the_random_head(model_and_plain):
    model, plain = model_and_plain
    new, _ = speculative_generate(model, PROMPTS, NEW, 2)
    assert new == plain


@pytest.mark.parametrize("agree", [True, False])
def test_greedy_speculation_equals_plain_greedy_whether_drafts_are_kept_or_refused(
    model_and_plain, monkeypatch, agree
):
    model, plain = model_and_plain
    prompt, truth = PROMPTS[2], plain[2]
    forced_drafter(monkeypatch, truth, len(prompt), agree)
    new, (stats,) = speculative_generate(model, [prompt], NEW, 3)
    assert new == [truth]
    if agree:  # 1 token from the prefill, three rounds of 4 (3 drafts + the bonus), one of 3
        assert (stats.accepted, stats.drafted, stats.forwards) == (11, 11, 5)
        assert stats.record()["tokens_per_forward"] == pytest.approx(16 / 5)
    else:
        assert stats.accepted == 0 and stats.forwards == NEW
        assert stats.record()["tokens_per_forward"] == 1.0


def test_speculation_stops_at_a_stop_id_and_keeps_it(model_and_plain):
    model, plain = model_and_plain
    stop = plain[0][6]
    new, _ = speculative_generate(model, [PROMPTS[0]], NEW, 2, stop_ids={stop})
    assert new[0] == plain[0][: plain[0].index(stop) + 1]


def test_sampled_speculation_repeats_with_its_seed_and_seeds_differ(model_and_plain):
    model, _ = model_and_plain
    draw = {"temperature": 1.0, "top_k": 50}
    first = speculative_generate(model, PROMPTS[:1], 8, 2, seed=7, **draw)[0]
    assert speculative_generate(model, PROMPTS[:1], 8, 2, seed=7, **draw)[0] == first
    assert speculative_generate(model, PROMPTS[:1], 8, 2, seed=8, **draw)[0] != first


def test_the_acceptance_rule_keeps_the_models_distribution():
    """Drafts drawn from q, kept with min(1, p/q), else replaced from max(0, p - q): the first
    kept token is distributed as p. 3000 draws over 4 tokens: a standard error of at most
    0.0091 a frequency, so 0.04 is over four of them."""
    p_logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(3000):
        token = torch.multinomial(q, 1, generator=generator)
        kept = accept(token, q[None], torch.stack([p_logits, p_logits]), sampling, generator)
        counts[kept[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), p_logits.softmax(0), rtol=0, atol=0.04)


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_models_next_token():
    logits = torch.nn.functional.one_hot(torch.tensor([4, 6, 1, 2]), 8).float()  # argmax 4, 6, 1, 2
    generator = torch.Generator()
    assert accept(torch.tensor([4, 6, 1]), None, logits, Sampling(), generator) == [4, 6, 1, 2]
    assert accept(torch.tensor([4, 5, 1]), None, logits, Sampling(), generator) == [4, 6]
    assert accept(torch.tensor([0, 6, 1]), None, logits, Sampling(), generator) == [4]


@pytest.mark.parametrize(
    "kwargs,message",
    [({"draft_tokens": 0}, "draft_tokens=0 must be at least 1")],
)
def test_bad_speculation_settings_are_one_line(model_and_plain, kwargs, message):
    with pytest.raises(ValueError, match=message):
        speculative_generate(model_and_plain[0], PROMPTS, NEW, **kwargs)


def test_a_model_without_a_head_cannot_speculate():
    model = build_model(get_flavor("qwen3.5", "debug")).eval()
    with pytest.raises(ValueError, match="MTP head"):
        speculative_generate(model, PROMPTS, NEW, 2)


def test_the_heads_cached_logits_equal_its_logits_over_the_whole_sequence():
    """The head run in two pieces through the decoder's cache (as rounds catch it up) gives
    ``mtp_logits`` of one forward over the sequence; fp32: rounding only."""
    model = tiny_with_head("debug")
    tokens = torch.tensor([PROMPTS[2][:30]])
    decoder = Decoder(model, 1, 32)
    hidden, _ = decoder.hidden(tokens, slice(None), torch.tensor([0]))
    pieces = [
        decoder.head(hidden[:, start:end], tokens[:, start + 1 : end + 1], slice(None), torch.tensor([start]))
        for start, end in ((0, 20), (20, 29))
    ]
    logits = model.lm_head(torch.cat(pieces, dim=1))  # (1, 29, V)
    torch.testing.assert_close(logits, model.mtp_logits(tokens), rtol=1e-5, atol=1e-4)
