"""Parallel degrees: every impossible combination is refused before any process group exists."""

from __future__ import annotations

import pytest

from autopar.config import ConfigError
from autopar.config.sections import Parallelism
from autopar.parallel.mesh import ParallelDims
from autopar.training.preflight import check_job

from jobs import debug_job


def job_with(*flags: str):
    return debug_job(*flags)


# (world size, flags, message): the message names the field, the value and the fix.
INVALID = [
    (
        4,
        ["--parallelism.tensor_parallel_degree", "3"],
        "world size 4 is not divisible by the product of the other degrees \\(tensor_parallel_degree=3 = 3\\)",
    ),
    (
        4,
        ["--parallelism.data_parallel_shard_degree", "3"],
        "parallel degrees multiply to 3 .* but the world size is 4",
    ),
    (
        8,
        ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        "multiply to 4 .* world size is 8",
    ),
    (2, ["--parallelism.tensor_parallel_degree", "0"], "tensor_parallel_degree=0 must be >= 1"),
    (2, ["--parallelism.pipeline_parallel_degree", "-1"], "pipeline_parallel_degree=-1 must be >= 1"),
    (2, ["--parallelism.context_parallel_degree", "0"], "context_parallel_degree=0 must be >= 1"),
    (
        2,
        ["--parallelism.data_parallel_replicate_degree", "0"],
        "data_parallel_replicate_degree=0 must be >= 1",
    ),
    (
        2,
        ["--parallelism.data_parallel_shard_degree", "0"],
        "data_parallel_shard_degree=0 must be >= 1, or -1",
    ),
    (
        3,
        ["--parallelism.tensor_parallel_degree", "3"],
        "tensor_parallel_degree=3 does not divide model.num_attention_heads=8; use one of 1, 2, 4$",
    ),
    (
        8,
        ["--parallelism.tensor_parallel_degree", "8"],
        "tensor_parallel_degree=8 does not divide model.num_key_value_heads=4; use one of 1, 2, 4$",
    ),
    (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--model.intermediate_size", "383"],
        "does not divide model.intermediate_size=383",
    ),
    (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--model.vocab_size", "511"],
        "does not divide model.vocab_size=511",
    ),
    (
        4,
        ["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "66"],
        "seq_len=66 is not divisible by 4 = tensor_parallel_degree=4 \\(sequence parallel\\)",
    ),
    (
        2,
        ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
        "seq_len=66 is not divisible by 4 = 2 x context_parallel_degree=2 .*; use a multiple of 4, e.g. 64 or 68$",
    ),
    (
        4,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.seq_len",
            "68",
        ],
        "seq_len=68 is not divisible by 8",
    ),
    (
        8,
        ["--parallelism.pipeline_parallel_degree", "8"],
        "pipeline_parallel_degree=8 is more stages than num_hidden_layers=4",
    ),
    (
        2,
        ["--training.global_batch_size", "10"],
        "global_batch_size=10 is not a multiple of local_batch_size x data-parallel degree = 8 x 2 = 16",
    ),
    (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--training.global_batch_size", "24"],
        "not a multiple of .* = 8 x 4 = 32",
    ),
]


@pytest.mark.parametrize("world, flags, message", INVALID)
def test_invalid_degrees_are_refused_with_the_numbers(world, flags, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job_with(*flags), world_size=world)


def test_the_table_has_at_least_fifteen_cases():
    assert len(INVALID) >= 15


def test_tp_without_sequence_parallel_does_not_need_seq_len_divisible():
    job = job_with(
        "--parallelism.tensor_parallel_degree",
        "4",
        "--training.seq_len",
        "66",
        "--parallelism.enable_sequence_parallel",
        "false",
    )
    check_job(job, world_size=4)


def test_shard_degree_minus_one_takes_the_remaining_ranks():
    dims = ParallelDims.resolve(Parallelism(tensor_parallel_degree=2, pipeline_parallel_degree=2), 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == (1, 4, 1, 2, 2)
    assert dims.dp == 4 and dims.fsdp_enabled
