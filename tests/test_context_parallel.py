"""Context parallelism on CPU (all-gathered k/v): the single-device losses, balanced or not."""

from __future__ import annotations

import pytest
import torch

from autopar.config import ConfigError
from autopar.parallel.context_parallel import shard_sequence
from autopar.training.preflight import check_job

from jobs import assert_fp32_parity, debug_job, parity_runs, tiny_job


def test_head_tail_shards_pair_early_and_late_chunks():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 0, 2, head_tail=True).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 1, 2, head_tail=True).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(x, 1, 2, head_tail=False).tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]


def test_head_tail_gives_every_rank_the_same_causal_work():
    seq, cp = 64, 4
    work = []
    for rank in range(cp):
        positions = shard_sequence(torch.arange(seq).view(1, seq), rank, cp, head_tail=True)
        work.append(int((positions + 1).sum()))  # a query at position p attends to p + 1 keys
    assert len(set(work)) == 1


def cp_job(*flags: str):
    return debug_job(*flags)


def test_ring_attention_on_cpu_is_refused_with_the_fix():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: ring attention is allowed")
    job = cp_job("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", "ring")
    with pytest.raises(ConfigError, match=r"context_parallel_impl='ring' needs CUDA.*allgather"):
        check_job(job, 2)


def test_unbalanced_cp_needs_only_cp_chunks():
    job = cp_job(
        "--parallelism.context_parallel_degree",
        "4",
        "--training.seq_len",
        "68",
        "--parallelism.context_parallel_load_balancer",
        "none",
    )
    check_job(job, 4)
    job.parallelism.context_parallel_load_balancer = "headtail"
    with pytest.raises(ConfigError, match="seq_len=68 is not divisible by 8"):
        check_job(job, 4)


PLANS = [
    f"{plan},lb={lb}"
    for lb in ("headtail", "none")
    for plan in ("cp=2", "cp=4", "cp=2,dp_shard=2", "cp=2,tp=2", "cp=2,pp=2")
]


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    return parity_runs(tiny_job(tmp_path_factory.mktemp("cp"), tie_word_embeddings=False), PLANS)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_context_parallel_matches_single_device(cp_runs, plan):
    reference, run = cp_runs[plan]
    # fp32: attention over gathered k/v with a positional mask is the same math as one
    # device's causal SDPA; only summation order differs
    assert_fp32_parity(run, reference)
