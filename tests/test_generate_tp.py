"""Tensor-parallel generation: two gloo ranks sharding the model with training's TP plan (the
decoder's caches then hold each rank's heads) give the tokens one process gives, for Qwen3 and
for Qwen3.5 (whose Gated DeltaNet state is split by head too); and ``python -m
autopar.generate`` under two ranks writes them. One spawn serves every check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar.cli.spawn import run_on_ranks
from autopar.models import build_model, get_flavor
from autopar.models.generation import generate

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

    from autopar.cli.generate import main, tensor_parallel
    from autopar.parallel.world import init_world

    world = init_world()
    results: dict[str, object] = {}
    for family in ("qwen3", "qwen3.5"):
        model = tiny(family)
        draw = {"temperature": 1.0, "top_k": 20, "seed": 4}
        alone = (generate(model, PROMPTS, NEW), generate(model, PROMPTS, NEW, **draw))
        tensor_parallel(model, world)
        assert model.layers["0"].mlp.gate_proj.weight.to_local().shape[0] == model.args.intermediate_size // 2
        results[family] = (alone, (generate(model, PROMPTS, NEW), generate(model, PROMPTS, NEW, **draw)))
    output = Path(folder) / "out.jsonl"
    argv = ["--model.tokenizer_path", "chatml", "--generate.prompts", str(Path(folder) / "prompts.jsonl")]
    argv += ["--generate.output", str(output), "--generate.max_new_tokens", "8"]
    results["cli"] = main([*argv, "--parallelism.tensor_parallel_degree", str(dist.get_world_size())])
    return results


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


def test_tp2_cli_writes_one_process_tokens(by_rank, tmp_path):
    from autopar.cli.generate import main

    folder, ranks = by_rank
    assert [rank["cli"] for rank in ranks] == [0, 0]
    sharded = (folder / "out.jsonl").read_text()
    argv = ["--model.tokenizer_path", "chatml", "--generate.prompts", str(folder / "prompts.jsonl")]
    assert (
        main([*argv, "--generate.output", str(tmp_path / "one.jsonl"), "--generate.max_new_tokens", "8"]) == 0
    )
    assert (tmp_path / "one.jsonl").read_text() == sharded


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
