"""Tensor-parallel generation: two gloo ranks sharding the model with training's TP plan (the
decoder's caches then hold each rank's heads) give the tokens one process gives, for Qwen3 and
for Qwen3.5 (whose Gated DeltaNet state is split by head too), with MTP speculation too (the
head split by its plan); and ``python -m autopar.generate`` under two ranks writes them. One
spawn serves every check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_speculative import tiny_with_head

from autopar.cli.spawn import run_on_ranks
from autopar.models import build_model, get_flavor
from autopar.models.generation import generate
from autopar.models.generation.speculative import speculative_generate

from jobs import tiny_args

pytestmark = pytest.mark.slow  # two processes

PROMPTS = [
    [5, 17, 3],
    [int(t) for t in torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(2))],
    [9],
]
"""Ragged: three tokens, 70 (past one 64-token chunk of the delta-rule kernel) and one."""
NEW = 12


def tiny(family: str):
    """A tiny random model (the debug flavor for Qwen3.5), its output head sharpened against near-ties."""
    model = build_model(get_flavor("qwen3.5", "debug") if family == "qwen3.5" else tiny_args(family))
    model.init_weights(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model.eval()


def _on_each_rank(folder: str) -> dict[str, object]:
    """Each family's tokens in one process (before sharding) and under TP, sampled ones
    included; then the CLI's output under TP (last: it closes the process group)."""
    import torch.distributed as dist

    from autopar.cli.generate import main, run, tensor_parallel
    from autopar.parallel.world import init_world
    from autopar.training.resolve import parse_job

    world = init_world()
    results: dict[str, object] = {}
    for family in ("qwen3", "qwen3.5"):
        model = tiny(family)
        draw = {"temperature": 1.0, "top_k": 20, "seed": 4}
        alone = (generate(model, PROMPTS, NEW), generate(model, PROMPTS, NEW, **draw))
        tensor_parallel(model, world)
        assert model.layers["0"].mlp.gate_proj.weight.to_local().shape[0] == model.args.intermediate_size // 2
        results[family] = (alone, (generate(model, PROMPTS, NEW), generate(model, PROMPTS, NEW, **draw)))
    results["mtp"] = speculation_alone_and_sharded(world)
    tp = ["--parallelism.tensor_parallel_degree", str(dist.get_world_size())]
    results["cli mtp"] = run(parse_job([*cli_argv(folder, Path(folder) / "mtp.jsonl"), *SPECULATIVE, *tp]))[1]
    results["cli"] = main([*cli_argv(folder, Path(folder) / "out.jsonl"), *tp])
    return results


SPECULATIVE = ("--model.name", "qwen3.5", "--model.flavor", "debug", "--model.mtp_num_hidden_layers", "1")
SPECULATIVE += ("--generate.speculative", "mtp", "--generate.draft_tokens", "2")
"""The debug Qwen3.5 with a fresh one-layer MTP head, drafting two tokens a round."""


def cli_argv(folder, output) -> list[str]:
    """The CLI on the prompts file of ``folder``, 8 new tokens written to ``output``."""
    argv = ["--model.tokenizer_path", "chatml", "--generate.prompts", str(Path(folder) / "prompts.jsonl")]
    return [*argv, "--generate.output", str(output), "--generate.max_new_tokens", "8"]


def speculation_alone_and_sharded(world) -> tuple:
    """MTP speculation's tokens and acceptance (greedy, then sampled) in one process and with
    the model and its head split by TP (the head's layer on half the heads)."""
    from autopar.cli.generate import tensor_parallel

    model = tiny_with_head("debug")
    draw = {"temperature": 1.0, "top_k": 20, "seed": 4}
    runs = [
        speculative_generate(model, PROMPTS, NEW, 2),
        speculative_generate(model, PROMPTS, NEW, 2, **draw),
    ]
    tensor_parallel(model, world)
    heads = model.mtp.layers["0"].self_attn.q_proj.weight.to_local().shape[0]
    assert heads == model.args.num_attention_heads * model.args.head_dim  # q and its gate, halved
    sharded = [
        speculative_generate(model, PROMPTS, NEW, 2),
        speculative_generate(model, PROMPTS, NEW, 2, **draw),
    ]
    return runs, sharded


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    (folder / "prompts.jsonl").write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    return folder, run_on_ranks(_on_each_rank, 2, str(folder), timeout_s=300)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_tp2_tokens_equal_one_process_tokens(by_rank, family):
    """Greedy and sampled (a seed, temperature 1, top-k 20): every rank, every prompt."""
    for alone, sharded in (rank[family] for rank in by_rank[1]):
        assert sharded == alone


def test_tp2_speculation_gives_one_process_tokens_and_acceptance(by_rank):
    """MTP drafts under TP: the head split by its plan, its argmax over whole logits, so every
    rank drafts, keeps and samples as one process does (greedy and sampled)."""
    for alone, sharded in (rank["mtp"] for rank in by_rank[1]):
        assert sharded == alone


def test_tp2_cli_writes_one_process_tokens(by_rank, tmp_path, capsys):
    """Plain, and speculative with the same acceptance line."""
    from autopar.cli.generate import main

    folder, ranks = by_rank
    assert [rank["cli"] for rank in ranks] == [0, 0]
    assert main(cli_argv(folder, tmp_path / "one.jsonl")) == 0
    assert (tmp_path / "one.jsonl").read_text() == (folder / "out.jsonl").read_text()
    assert main([*cli_argv(folder, tmp_path / "mtp.jsonl"), *SPECULATIVE]) == 0
    assert (tmp_path / "mtp.jsonl").read_text() == (folder / "mtp.jsonl").read_text()
    assert ranks[0]["cli mtp"] in capsys.readouterr().out


def test_a_tensor_parallel_degree_other_than_the_process_count_is_one_line(tmp_path, capsys):
    from autopar.cli.generate import main

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    argv = ["--model.tokenizer_path", "chatml", "--generate.prompts", str(tmp_path / "p.jsonl")]
    assert main([*argv, "--parallelism.tensor_parallel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "parallelism.tensor_parallel_degree=2 with 1 process(es)" in err
        and len(err.strip().splitlines()) == 1
    )
