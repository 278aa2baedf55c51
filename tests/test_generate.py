"""Incremental decoding (``autopar.models.generation``): greedy tokens equal transformers'
``generate`` for every family, the state continues exactly (a chunked prefill equals a whole
one, the logits along a generated sequence equal one forward over it), and sampling with a
seed is reproducible."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.models import build_model, from_hf, get_flavor
from autopar.models.generation import Decoder, generate
from autopar.models.generation.generate import same_lengths, sample
from autopar.models.generation.sampling import Sampling
from autopar.models.qwen3_5.delta_rule_steps import delta_rule_steps

from jobs import tiny_args

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5, 17, 3],
    [int(t) for t in torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(2))],
    [9],
]
"""Ragged: one token, three, and 70 (past one of the delta-rule kernel's 64-token chunks)."""
NEW = 32


def hf_pair(family: str, tmp_path):
    """(a randomized transformers model of ``family``, ours loaded from its saved folder)."""
    if family.startswith("qwen3.5"):
        from test_qwen3_5 import hf_model

        hf = hf_model("moe-text" if family.endswith("moe") else "dense-text")
    elif family == "qwen3-moe":
        from test_moe import hf_moe_for, moe_args

        hf = hf_moe_for(moe_args())
    else:
        from test_models import hf_model_for, parity_args

        hf = hf_model_for(parity_args(family, kv_ratio=2, tied=False))
    with torch.no_grad():  # sharper logits: random tiny models have near-ties HF's own cache flips
        hf.lm_head.weight.mul_(10)
    hf.save_pretrained(tmp_path)
    return hf, from_hf(tmp_path, dtype=torch.float32).eval()


def hf_generate(hf, prompt: list[int]) -> list[int]:
    """HF ``generate(do_sample=False)``, cached."""
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
    )
    return hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_argmax_along(hf, prompt: list[int], new: list[int]) -> list[int]:
    """The argmax of HF's full forward at every generated position of ``prompt + new``: the
    greedy tokens, by definition, where they equal ``new``."""
    logits = hf(torch.tensor([prompt + new])).logits[0, len(prompt) - 1 : -1]
    return logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe"])
def test_greedy_tokens_equal_transformers(family, tmp_path):
    """Against the argmax of HF's full forward for every prompt, and against HF's
    ``generate`` for the short ones: on the 70-token prompt HF's ``generate`` (cached or not)
    of Qwen3-MoE and Qwen3.5 picks one token, near position 80, whose logits differ from its
    own forward over the same tokens (34.33 vs 34.30 for Qwen3.5), where ours agree with the
    forward."""
    hf, ours = hf_pair(family, tmp_path)
    ragged = generate(ours, PROMPTS, NEW)
    assert ragged == [hf_argmax_along(hf, p, new) for p, new in zip(PROMPTS, ragged)]
    assert [ragged[0], ragged[2]] == [hf_generate(hf, p) for p in (PROMPTS[0], PROMPTS[2])]


def tiny(family: str):
    """A randomly initialised tiny model: ``tiny_args`` for Qwen3, the debug flavor for Qwen3.5."""
    args = get_flavor("qwen3.5", "debug") if family == "qwen3.5" else tiny_args(family)
    model = build_model(args)
    model.init_weights(seed=3)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_a_chunked_prefill_equals_a_whole_one(family):
    model = tiny(family)
    prompt = torch.tensor([PROMPTS[1]])
    whole = Decoder(model, 1, 80).forward(prompt, slice(None), torch.tensor([0]))
    chunked = Decoder(model, 1, 80)
    pieces = [
        chunked.forward(prompt[:, s : s + 23], slice(None), torch.tensor([s])) for s in range(0, 70, 23)
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_a_prefill_runs_the_head_on_each_prompts_last_position_only():
    model = tiny("qwen3")
    seen = []
    model.lm_head.register_forward_hook(lambda module, inputs, out: seen.append(inputs[0].shape[1]))
    prompt = torch.tensor([PROMPTS[1], PROMPTS[1]])
    last = Decoder(model, 2, 80).last_logits(prompt, slice(None), torch.tensor([0, 0]))
    assert seen == [1]
    whole = Decoder(model, 2, 80).forward(prompt, slice(None), torch.tensor([0, 0]))
    torch.testing.assert_close(last, whole[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_logits_along_a_generated_sequence_equal_one_forward(family):
    model = tiny(family)
    prompt = PROMPTS[1][:20]
    new = generate(model, [prompt], 12)[0]
    decoder = Decoder(model, 1, 32)
    steps = [decoder.forward(torch.tensor([prompt]), slice(None), torch.tensor([0]))]
    for i, token in enumerate(new[:-1]):
        steps.append(decoder.forward(torch.tensor([[token]]), slice(None), torch.tensor([20 + i])))
    full = model(torch.tensor([prompt + new[:-1]]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_delta_rule_steps_equal_the_chunked_kernel_from_an_entry_state(tokens):
    """Outputs and exit state, from a random entry state, at Qwen3.5's grouped heads (8 value
    heads reading 4 key heads, dk 16, dv 24); fp32, a few tokens: rounding only."""
    gen = torch.Generator().manual_seed(tokens)
    q, k = (torch.randn(2, tokens, 4, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, tokens, 8, 24, generator=gen)
    g = -torch.rand(2, tokens, 8, generator=gen) * 2
    beta = torch.rand(2, tokens, 8, generator=gen)
    entry = torch.randn(2, 4, 2, 16, 24, generator=gen)
    out, _, exit_state = torch.ops.autopar.gated_delta_rule(q, k, v, g, beta, None, entry, None)
    step_out, step_exit = delta_rule_steps(q, k, v, g, beta, entry)
    torch.testing.assert_close(step_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_exit, exit_state, rtol=1e-5, atol=1e-5)


class KernelCalls(TorchDispatchMode):
    """Counts the chunked delta-rule kernel's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.chunked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.chunked += func.name().startswith("autopar::gated_delta_rule")
        return func(*args, **(kwargs or {}))


def test_a_decode_step_runs_the_delta_rule_token_by_token_and_a_prompt_by_chunks():
    model = tiny("qwen3.5")
    decoder = Decoder(model, 1, 80)
    with KernelCalls() as calls:
        decoder.forward(torch.tensor([PROMPTS[1]]), slice(None), torch.tensor([0]))
    assert calls.chunked == 3  # one per Gated DeltaNet layer
    with KernelCalls() as calls:
        decoder.forward(torch.tensor([[4]]), slice(None), torch.tensor([70]))
    assert calls.chunked == 0


def compiled_tokens_equal_eager_after_one_compile(family: str) -> None:
    """A ragged batch of three: the same tokens, one graph for all 11 decode steps, no break."""
    model = tiny(family)
    graphs, breaks = counters["stats"]["unique_graphs"], counters["graph_break"].total()
    assert generate(model, PROMPTS, 12, compiled=True) == generate(model, PROMPTS, 12)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert counters["graph_break"].total() == breaks


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_the_decode_step_traces_into_one_graph(family, monkeypatch):
    """Tracing only (the aot_eager backend: dynamo and functionalization of the cache writes,
    no code generation), so that CI checks in seconds that the step compiles once."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compiled_tokens_equal_eager_after_one_compile(family)


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_compiled_greedy_tokens_equal_eager_and_compile_once(family):
    """Inductor, as ``[generate] compile`` runs it: 20-35 s a model cold on two CPU cores."""
    compiled_tokens_equal_eager_after_one_compile(family)


def test_a_ragged_batch_gives_each_prompt_its_own_tokens():
    """Two prompts of three tokens side by side are prefilled as one batch, the rest alone."""
    model = tiny("qwen3.5")
    prompts = [PROMPTS[0], [7, 8, 9], *PROMPTS[1:]]
    assert same_lengths(prompts) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    together = generate(model, prompts, 6)
    assert together == [generate(model, [p], 6)[0] for p in prompts]


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_a_prompt_repeated_in_a_batch_is_prefilled_once_and_each_copy_continues_alone(family):
    """GRPO samples each prompt num_generations times: the copies share one prefill, their
    KV cache and Gated DeltaNet states copied, and each continues as the prompt alone would."""
    model = tiny(family)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    widths = []
    model.layers["0"].register_forward_hook(lambda module, inputs, out: widths.append(inputs[0].shape[:2]))
    greedy = Sampling(0.0, 0, 1.0, 0)
    together = sample(model, prompts, 6, greedy)
    assert widths[:3] == [torch.Size([1, 70]), torch.Size([1, 3]), torch.Size([1, 1])]  # the prefills
    assert set(widths[3:]) == {torch.Size([5, 1])}  # then the decode steps of every row
    for row, prompt in enumerate(prompts):
        alone = sample(model, [prompt], 6, greedy)
        assert together.tokens[row] == alone.tokens[0]
        torch.testing.assert_close(together.logps[row], alone.logps[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_forwards_padded_to_a_multiple_of_tokens_sample_as_unpadded_ones(family):
    """Sequence parallelism splits each forward's tokens evenly: padded to multiples of 3 (a
    70-token prompt, a 3-token one, one-token decode steps), the padding enters no cache or
    delta-rule state, and every token and log-probability is the unpadded run's."""
    model = tiny(family)
    draw = Sampling(1.0, 20, 1.0, 4)
    plain = sample(model, PROMPTS, 12, draw)
    padded = sample(model, PROMPTS, 12, draw, multiple=3)
    assert padded.tokens == plain.tokens
    for ours, theirs in zip(padded.logps, plain.logps, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ():
    model = tiny("qwen3")
    draw = {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
    first = generate(model, PROMPTS, 16, seed=7, **draw)
    assert generate(model, PROMPTS, 16, seed=7, **draw) == first
    assert generate(model, PROMPTS, 16, seed=8, **draw) != first


def test_generation_stops_at_a_stop_id_and_keeps_it():
    model = tiny("qwen3")
    free = generate(model, [PROMPTS[0]], 16)[0]
    stop = free[5]
    assert generate(model, [PROMPTS[0]], 16, stop_ids={stop})[0] == free[: free.index(stop) + 1]


@pytest.mark.parametrize(
    "prompts,message",
    [([[]], "prompt 0 is empty"), ([[1], [2] * 120], "prompt 1 has 120 tokens")],
)
def test_a_prompt_that_cannot_run_is_one_line(prompts, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny("qwen3"), prompts, 16)
