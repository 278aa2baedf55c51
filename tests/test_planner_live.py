"""The planner's memory model against real runs: small fp32 models trained on 1, 2 and 4 CPU
ranks over gloo, each rank's peak measured by the same trackers as the dry run."""

from __future__ import annotations

import pytest

from autopar.cli.spawn import run_on_ranks
from autopar.config.sections import JobConfig
from autopar.parallel.mesh import ParallelDims
from autopar.planner.dry_run import measure_jobs, role_ranks
from autopar.planner.memory import predict
from autopar.training.resolve import model_args, parse_job

pytestmark = pytest.mark.slow

# blocks, head and embedding all matter at this size: 10 MiB of weights, ~100 MiB peaks
SMALL = [
    "--model.name=qwen3",
    "--model.flavor=debug",
    "--model.hidden_size=256",
    "--model.num_attention_heads=4",
    "--model.num_key_value_heads=2",
    "--model.head_dim=64",
    "--model.intermediate_size=768",
    "--model.num_hidden_layers=2",
    "--model.vocab_size=2048",
    "--training.seq_len=512",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--training.steps=10",
    "--lr_scheduler.warmup_steps=1",
]
# a mixture of experts in every block; real routing is not balanced, as the planner assumes
MOE = ["--model.num_experts=8", "--model.num_experts_per_tok=2", "--model.moe_intermediate_size=512"]
PIPELINE_2 = ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"]
PLANS = {
    1: [[], MOE],
    2: [
        [*MOE, "--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2"],
        ["--parallelism.data_parallel_shard_degree=2"],
        ["--parallelism.tensor_parallel_degree=2"],
        PIPELINE_2,
        ["--parallelism.context_parallel_degree=2"],
    ],
    4: [
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.tensor_parallel_degree=2",
            "--activation_checkpoint.mode=full",
        ],
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
        ],
        [
            *MOE,
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.expert_parallel_degree=2",
        ],
    ],
}
HEAVY_PLANS = {
    4: [
        ["--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"],
        ["--parallelism.data_parallel_shard_degree=2", *PIPELINE_2],
        [*MOE, "--parallelism.data_parallel_shard_degree=4", "--parallelism.expert_parallel_degree=2"],
    ]
}
"""FSDP x TP without AC (above with it), FSDP x PP and a four-way FSDP beside EP (each mechanism
above): four processes on two cores each; python -m pytest -m heavy."""


def cases(plans: dict[int, list[list[str]]]) -> list[tuple[int, int]]:
    return [(world, i) for world, listed in plans.items() for i in range(len(listed))]


def _job(plan: list[str], dump_folder) -> JobConfig:
    return parse_job([*SMALL, *plan, f"--job.dump_folder={dump_folder}"])


def measure(plans: dict[int, list[list[str]]], folder) -> dict:
    """{(world, plan index): (job, every rank's peak bytes by category)}; one process group
    per world size."""
    out = {}
    for world, listed in plans.items():
        jobs = [_job(plan, folder / f"w{world}-{i}") for i, plan in enumerate(listed)]
        per_rank = [measure_jobs(jobs)] if world == 1 else run_on_ranks(measure_jobs, world, jobs)
        for i, job in enumerate(jobs):
            out[(world, i)] = (job, [peaks[i] for peaks in per_rank])
    return out


def assert_predicted_within_ten_percent(job: JobConfig, per_rank: list[dict[str, int]], world: int) -> None:
    predicted = predict(model_args(job), job, world, cp_impl="allgather", device_type="cpu")
    ranks = role_ranks(ParallelDims.resolve(job.parallelism, world))
    for rank, memory in zip(ranks, predicted, strict=True):
        real = sum(per_rank[rank].values())
        assert memory.peak == pytest.approx(real, rel=0.10), (
            f"rank {rank}: {memory.parts} vs {per_rank[rank]}"
        )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return measure(PLANS, tmp_path_factory.mktemp("live"))


@pytest.mark.parametrize(("world", "plan"), cases(PLANS))
def test_predicted_peak_is_within_ten_percent_of_a_real_gloo_run(measured, world, plan):
    job, per_rank = measured[(world, plan)]
    assert_predicted_within_ten_percent(job, per_rank, world)


@pytest.mark.heavy
def test_more_four_rank_plans_are_predicted_within_ten_percent_of_a_real_gloo_run(tmp_path):
    for (world, _), (job, per_rank) in measure(HEAVY_PLANS, tmp_path).items():
        assert_predicted_within_ten_percent(job, per_rank, world)
