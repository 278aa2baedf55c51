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
from autopar.parallel.world import World

from jobs import debug_job, tiny_args, tiny_moe_args

pytestmark = pytest.mark.slow  # two processes

PROMPTS = [
    [5, 17, 3],
    [int(t) for t in torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(2))],
    [9],
]
"""Ragged: three tokens, 70 (past one 64-token chunk of the delta-rule kernel) and one."""
NEW = 12


def tiny(family: str):
    """A tiny random model (the debug flavor for Qwen3.5, ``-moe`` a mixture of experts), its
    output head sharpened against near-ties."""
    flavor = "debug-moe" if family.endswith("-moe") else "debug"
    if family.startswith("qwen3.5"):
        args = get_flavor("qwen3.5", flavor)
    else:
        args = tiny_args(family) if flavor == "debug" else tiny_moe_args()
    model = build_model(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model.eval()


DRAW = {"temperature": 1.0, "top_k": 20, "seed": 4}
"""Sampled tokens: a seed, temperature 1, top-k 20."""

PLANS = {"tp": (True, False), "ep": (False, True), "tp+ep": (True, True)}
"""Generation's plans: ``split_model``'s (tensor_parallel, expert_parallel)."""


def greedy_and_sampled(model) -> tuple:
    return generate(model, PROMPTS, NEW), generate(model, PROMPTS, NEW, **DRAW)


def _on_each_rank(folder: str) -> dict[str, object]:
    """Each family's tokens in one process (before splitting) and under each plan that
    applies, sampled ones included; speculation under TP; then the CLI under TP and EP (the
    plain one last: it closes the process group)."""
    from autopar.cli.generate import main, run, split_model
    from autopar.parallel.world import init_world
    from autopar.training.resolve import parse_job

    world = init_world()
    results: dict[str, object] = {}
    for family in ("qwen3", "qwen3.5"):
        model = tiny(family)
        alone = greedy_and_sampled(model)
        split_model(model, world, *PLANS["tp"])
        assert model.layers["0"].mlp.gate_proj.weight.to_local().shape[0] == model.args.intermediate_size // 2
        results[family, "tp"] = alone, greedy_and_sampled(model)
    for family, plan in (("qwen3-moe", "ep"), ("qwen3.5-moe", "tp+ep")):  # one plan each: CI's time
        alone = greedy_and_sampled(tiny(family))
        model = tiny(family)
        split_model(model, world, *PLANS[plan])
        assert model.layers["0"].mlp.experts.gate_proj.to_local().shape[0] == model.args.num_experts // 2
        results[family, plan] = alone, greedy_and_sampled(model)
    results["mtp", "tp"] = speculation_alone_and_split(world, "debug", "tp")
    results["mtp", "ep"] = speculation_alone_and_split(world, "debug-moe", "tp+ep")
    ranks = str(world.size)
    experts = [
        "--model.name",
        "qwen3.5",
        "--model.flavor",
        "debug-moe",
        "--parallelism.expert_parallel_degree",
        ranks,
    ]
    results["cli ep"] = (
        run(parse_job([*cli_argv(folder, Path(folder) / "ep.jsonl"), *experts]))[0] is not None
    )
    tp = ["--parallelism.tensor_parallel_degree", ranks]
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


def speculation_alone_and_split(world, flavor: str, plan: str) -> tuple:
    """MTP speculation's tokens and acceptance (greedy, and sampled without EP) in one process and with
    the model and its head split by ``plan`` (the head's layer on half the heads; under EP,
    the head's experts split too)."""
    from autopar.cli.generate import split_model

    model = tiny_with_head(flavor)
    draws = [{}] if PLANS[plan][1] else [{}, DRAW]  # the mixture greedy only: CI's time
    runs = [speculative_generate(model, PROMPTS, NEW, 2, **draw) for draw in draws]
    split_model(model, world, *PLANS[plan])
    heads = model.mtp.layers["0"].self_attn.q_proj.weight.to_local().shape[0]
    assert heads == model.args.num_attention_heads * model.args.head_dim  # q and its gate, halved
    if PLANS[plan][1]:
        assert model.mtp.layers["0"].mlp.experts.gate_proj.to_local().shape[0] == model.args.num_experts // 2
    return runs, [speculative_generate(model, PROMPTS, NEW, 2, **draw) for draw in draws]


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    (folder / "prompts.jsonl").write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    return folder, run_on_ranks(_on_each_rank, 2, str(folder), timeout_s=300)


@pytest.mark.parametrize(
    "family,plan",
    [
        ("qwen3", "tp"),
        ("qwen3.5", "tp"),
        ("qwen3-moe", "ep"),
        ("qwen3.5-moe", "tp+ep"),
    ],
)
def test_two_ranks_give_one_process_tokens(by_rank, family, plan):
    """Greedy and sampled: every rank, every prompt. Under EP each rank holds half the experts
    and runs them on their rows; fp32, and each row is summed with zeros only: bit for bit."""
    for alone, split in (rank[family, plan] for rank in by_rank[1]):
        assert split == alone


@pytest.mark.parametrize("plan", ["tp", "ep"])
def test_two_ranks_speculate_as_one_process(by_rank, plan):
    """MTP drafts under TP (the dense debug Qwen3.5, greedy and sampled), and under TP + EP
    (its MoE, whose head has experts too; greedy): the head split by its plan, its argmax over
    whole logits, so every rank drafts, keeps and samples as one process does; the same
    acceptance too."""
    for alone, split in (rank["mtp", plan] for rank in by_rank[1]):
        assert split == alone


def test_two_ranks_cli_writes_one_process_tokens(by_rank, tmp_path, capsys):
    """Under TP: plain, and speculative with the same acceptance line; under EP, the MoE."""
    from autopar.cli.generate import main

    folder, ranks = by_rank
    assert [rank["cli"] for rank in ranks] == [0, 0]
    assert main(cli_argv(folder, tmp_path / "one.jsonl")) == 0
    assert (tmp_path / "one.jsonl").read_text() == (folder / "out.jsonl").read_text()
    assert main([*cli_argv(folder, tmp_path / "mtp.jsonl"), *SPECULATIVE]) == 0
    assert (tmp_path / "mtp.jsonl").read_text() == (folder / "mtp.jsonl").read_text()
    assert ranks[0]["cli mtp"] in capsys.readouterr().out
    assert ranks[0]["cli ep"] and not ranks[1]["cli ep"]  # rank 0 writes
    assert (
        main(
            [
                *cli_argv(folder, tmp_path / "ep.jsonl"),
                "--model.name",
                "qwen3.5",
                "--model.flavor",
                "debug-moe",
            ]
        )
        == 0
    )
    assert (tmp_path / "ep.jsonl").read_text() == (folder / "ep.jsonl").read_text()


@pytest.mark.parametrize("field", ["tensor_parallel_degree", "expert_parallel_degree"])
def test_a_degree_other_than_the_process_count_is_one_line(tmp_path, capsys, field):
    from autopar.cli.generate import main

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    argv = ["--model.tokenizer_path", "chatml", "--generate.prompts", str(tmp_path / "p.jsonl")]
    assert main([*argv, f"--parallelism.{field}", "2"]) == 2
    err = capsys.readouterr().err
    assert f"parallelism.{field}=2 with 1 process(es)" in err and len(err.strip().splitlines()) == 1


TWO = World(rank=0, size=2, local_rank=0, device=torch.device("cpu"))
"""Two processes, as the checks before any process group see them."""


def test_two_processes_without_a_plan_are_one_line():
    from autopar.cli.generate import check_parallelism
    from autopar.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"2 processes with parallelism\.tensor_parallel_degree=1 and expert_"
    ):
        check_parallelism(debug_job(), TWO)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            tiny_args("qwen3"),
            r"expert_parallel_degree=2 splits a mixture's experts, and this model \(qwen3\) is dense",
        ),
        (tiny_moe_args(num_experts=3), "expert_parallel_degree=2 does not divide the model's num_experts=3"),
    ],
)
def test_experts_that_cannot_split_are_one_line(args, message):
    from autopar.cli.generate import split_model
    from autopar.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        split_model(build_model(args), TWO, tensor_parallel=False, expert_parallel=True)
