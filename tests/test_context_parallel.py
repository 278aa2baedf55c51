"""Context parallelism on CPU (all-gathered k/v): the single-device losses, balanced or not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.config import ConfigError
from autopar.config.sections import Parallelism
from autopar.data.loader import Batch
from autopar.models import Qwen
from autopar.models.flavors import get_flavor
from autopar.parallel.context_parallel import ContextParallel, shard_sequence, unshard_sequence
from autopar.parallel.sdpa_backend import apply_attention_kernel
from autopar.training.preflight import check_job

from jobs import assert_fp32_parity, debug_job, parity_runs, tiny_job


def test_head_tail_shards_pair_early_and_late_chunks():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 0, 2, head_tail=True).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 1, 2, head_tail=True).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(x, 1, 2, head_tail=False).tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("head_tail", [True, False])
@pytest.mark.parametrize("size", [2, 4])
def test_every_ranks_shards_unshard_to_the_whole_sequence(head_tail, size):
    x = torch.arange(3 * 32 * 2).view(3, 32, 2)
    parts = [shard_sequence(x, rank, size, head_tail) for rank in range(size)]
    assert torch.equal(unshard_sequence(parts, head_tail), x)


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
    if lb == "headtail" or plan in ("cp=2", "cp=2,tp=2")
]
HEAVY_PLANS = ["cp=4,lb=none", "cp=2,dp_shard=2,lb=none", "cp=2,pp=2,lb=none"]
"""The other plans without the load balancer (the balancer changes which tokens a rank holds,
not how the plans compose): python -m pytest -m heavy."""


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    return parity_runs(tiny_job(tmp_path_factory.mktemp("cp"), tie_word_embeddings=False), PLANS)


@pytest.mark.heavy
def test_the_other_plans_without_the_load_balancer_match_single_device(tmp_path):
    for reference, run in parity_runs(tiny_job(tmp_path, tie_word_embeddings=False), HEAVY_PLANS).values():
        assert_fp32_parity(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_context_parallel_matches_single_device(cp_runs, plan):
    reference, run = cp_runs[plan]
    # fp32: attention over gathered k/v with a positional mask is the same math as one
    # device's causal SDPA; only summation order differs
    assert_fp32_parity(run, reference)


class _KeyHeads(TorchDispatchMode):
    """The head count of every tensor all-gathered and of every key CPU flash attention gets."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[int] = []
        self.attended: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default and args[0].dim() == 4:
            self.gathered.append(args[0].shape[1])
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.attended.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank_mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _forward_backward(model: torch.nn.Module, cp: ContextParallel | None) -> list[torch.Tensor]:
    tokens = torch.randint(0, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    if cp is None:
        logits = model(tokens)
    else:
        with cp(Batch(tokens, tokens)) as (local, positions):
            logits = model(local.inputs, positions)
    logits.square().mean().backward()
    return [logits, *(p.grad for p in model.parameters())]


def test_all_gather_cp_gathers_grouped_kv_heads_and_expands_them_after_where_the_kernel_needs(one_rank_mesh):
    def model() -> Qwen:
        torch.manual_seed(0)
        built = Qwen(get_flavor("qwen3", "debug"))  # 8 query heads share 4 k/v heads
        built.init_weights(seed=0)
        apply_attention_kernel(built, True)  # what model_groups_kv gives all-gather CP
        return built

    reference = _forward_backward(model(), None)
    cp = ContextParallel(Parallelism(context_parallel_degree=2), one_rank_mesh, "cpu", expand_kv=True)
    with _KeyHeads() as seen:
        expanded = _forward_backward(model(), cp)
    layers = get_flavor("qwen3", "debug").num_hidden_layers
    assert seen.gathered == [4] * 2 * layers  # k and v, grouped
    assert seen.attended == [8] * layers
    for a, b in zip(expanded, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
