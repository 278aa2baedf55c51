"""Qwen3.5 under context parallelism equals one device: the Gated DeltaNet layers pass their
delta-rule states between CP ranks (``parallel/state_passing.py``) while attention gathers
k/v, in the head-tail order and the plain one, with packed documents crossing ranks, and
composed with TP, PP, FSDP, EP, activation checkpointing, compile, LoRA and bf16.

The layer tests compare one Gated DeltaNet's outputs and gradients under CP with the whole
sequence's; the plan tests train the four-layer tiny model (three DeltaNet layers, then
attention) as ``test_qwen3_5_plans.py`` does, at Adam lr 1e-3 for the reason given there.
"""

from __future__ import annotations

import pytest
import torch

from autopar.cli.spawn import run_on_ranks
from autopar.config.errors import ConfigError
from autopar.parallel.context_parallel import shard_sequence
from autopar.parallel.state_passing import local_ranges
from autopar.training.preflight import check_job

from jobs import ac_flags, assert_fp32_parity, chat_job, hybrid_job, parity_runs

STEPS = 3


def test_a_rank_holds_the_ranges_its_tokens_come_from():
    size, seq = 4, 64
    tokens = torch.arange(seq).view(1, seq)
    for rank in range(size):
        for head_tail in (True, False):
            ranges = local_ranges(rank, size, head_tail)
            width = seq // (2 * size if head_tail else size)
            expected = torch.cat([torch.arange(j * width, (j + 1) * width) for j in ranges])
            assert torch.equal(shard_sequence(tokens, rank, size, head_tail)[0], expected)


SEQ = 48
CUTS = ((0, 5, 12, 14, 30), (0, 24, 25, 40))
"""Where documents start in each row of the layer tests, over 2 CP ranks: head-tail ranges
are 12 tokens, in-order ones 24. Starts inside a range, at a range's first token (12, 24),
one token past one (25), and documents that span two or three ranges, on one rank or two."""


def _layer_gaps(head_tail: bool, packed: bool, kernel: str = "autopar") -> tuple[float, float, float]:
    """Max |CP - whole| over max |whole| of one Gated DeltaNet's outputs and input
    gradients on this rank's tokens, and of its (CP-summed) weight gradients; CP runs
    ``kernel``'s delta rule, the whole sequence autopar's (``fla_parity.py`` runs FLA's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models.flavors import get_flavor
    from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet, WholeSequence
    from autopar.parallel.delta_rule_kernel import KERNELS
    from autopar.parallel.state_passing import StatePassing

    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))["cp"]
    gen = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(get_flavor("qwen3.5", "debug"))
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        layer.core.A_log.fill_(-3.0)  # slow decay: a state that lasts across ranges
    x = torch.randn(2, SEQ, layer.in_proj_q.in_features, generator=gen, requires_grad=True)
    upstream = torch.randn(2, SEQ, layer.out_proj.out_features, generator=gen)
    documents = None
    if packed:
        documents = torch.zeros(2, SEQ, dtype=torch.long)
        for row, starts in enumerate(CUTS):
            for i, start in enumerate(starts):
                documents[row, start:] = i

    def run(sequence, x, documents, upstream):
        layer.core.sequence = sequence
        layer.zero_grad()
        out = layer(x, documents)
        (x_grad,) = torch.autograd.grad(out, x, upstream, retain_graph=True)
        out.backward(upstream)
        return out.detach(), x_grad, [p.grad.clone() for p in layer.parameters()]

    out, x_grad, weight_grads = run(WholeSequence(), x, documents, upstream)
    shard = lambda t: None if t is None else shard_sequence(t, rank, size, head_tail)  # noqa: E731
    local_x = shard(x.detach()).requires_grad_()
    cp_out, cp_x_grad, cp_weight_grads = run(
        StatePassing(mesh, head_tail, KERNELS[kernel]), local_x, shard(documents), shard(upstream)
    )
    for grad in cp_weight_grads:
        dist.all_reduce(grad)

    def gap(ours: torch.Tensor, whole: torch.Tensor) -> float:
        return ((ours - whole).abs().max() / whole.abs().max()).item()

    weights = max(gap(ours, whole) for ours, whole in zip(cp_weight_grads, weight_grads))
    return gap(cp_out, shard(out)), gap(cp_x_grad, shard(x_grad)), weights


def _layer_cases() -> dict[tuple[bool, bool], tuple[float, float, float]]:
    return {(ht, packed): _layer_gaps(ht, packed) for ht in (True, False) for packed in (False, True)}


@pytest.fixture(scope="module")
def layer_gaps() -> dict[tuple[bool, bool], tuple[float, float, float]]:
    by_rank = run_on_ranks(_layer_cases, 2)
    return {case: tuple(max(r[case][i] for r in by_rank) for i in range(3)) for case in by_rank[0]}


@pytest.mark.parametrize("packed", [False, True], ids=["one document", "documents crossing ranks"])
@pytest.mark.parametrize("head_tail", [True, False], ids=["head-tail", "in order"])
def test_a_gated_deltanet_layer_under_cp_computes_the_whole_sequence(layer_gaps, head_tail, packed):
    outputs, inputs, weights = layer_gaps[head_tail, packed]
    # fp32, relative to the largest value: measured <= 4.1e-7, 7e-7 with the weights' sum
    # over ranks; a rank entering its ranges with a zero state instead: 0.3 and more
    assert max(outputs, inputs, weights) <= 1e-5, (outputs, inputs, weights)


PLANS = [
    "cp=2",
    "cp=2,tp=2",
    "cp=2,pp=2",
    f"cp=2,pp=2,schedule=ZBVZeroBubble,{ac_flags('full', 'op')}",
    f"cp=2,{ac_flags('selective', 'op')}",
    "cp=2,compile.enable=true",
]
DOCUMENT_PLANS = ["cp=2", "cp=2,tp=2"]
"""On the shipped conversations, packed: documents start inside ranges and cross ranks."""
HEAVY_PLANS = [
    "cp=4",
    "cp=2,dp_shard=2",
    f"cp=2,{ac_flags('full', 'op')}",
    "cp=2,parallelism.context_parallel_load_balancer=none",
]
HEAVY_DOCUMENT_PLANS = ["cp=4", "cp=2,dp_shard=2"]
"""Four ranks (CP alone and beside FSDP: the two-rank plans show each exchange), full AC
(ZBV's case above checkpoints fully too), the in-order layout (the layer tests above pass its
states between ranks), and packed documents likewise: python -m pytest -m heavy."""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    return parity_runs(hybrid_job(tmp_path_factory.mktemp("qwen3_5_cp")), PLANS, steps=STEPS)


def documents_job(folder):
    """The 4-layer Qwen3.5 on the shipped conversations, packed with document masking."""
    return chat_job(
        folder,
        "--optimizer.lr",
        "0.001",
        "--training.seq_len",
        "64",
        "--training.document_masking",
        "true",
        "--model.name",
        "qwen3.5",
        "--model.num_hidden_layers",
        "4",
    )


@pytest.fixture(scope="module")
def document_plans(tmp_path_factory):
    return parity_runs(
        documents_job(tmp_path_factory.mktemp("qwen3_5_cp_documents")), DOCUMENT_PLANS, steps=STEPS
    )


@pytest.mark.heavy
def test_more_context_parallel_plans_match_single_device(tmp_path):
    runs = parity_runs(hybrid_job(tmp_path / "plans"), HEAVY_PLANS, steps=STEPS)
    runs |= parity_runs(documents_job(tmp_path / "documents"), HEAVY_DOCUMENT_PLANS, steps=STEPS)
    for reference, run in runs.values():
        assert_fp32_parity(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_context_parallel_plan_matches_single_device(plans, plan):
    reference, run = plans[plan]
    assert_fp32_parity(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("plan", DOCUMENT_PLANS)
def test_packed_documents_under_context_parallel_match_single_device(document_plans, plan):
    reference, run = document_plans[plan]
    assert_fp32_parity(run, reference)


def test_document_masking_with_cp_and_pp_is_refused_with_one_line(tmp_path):
    job = hybrid_job(
        tmp_path,
        "--training.document_masking",
        "true",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
    )
    with pytest.raises(ConfigError, match="not per pipeline micro-batch"):
        check_job(job, 4, "cpu")


def test_ranges_shorter_than_the_convolution_reads_are_refused(tmp_path):
    job = hybrid_job(tmp_path, "--training.seq_len", "16", "--parallelism.context_parallel_degree", "4")
    with pytest.raises(ConfigError, match="fewer than the 3 the Gated DeltaNet's convolution reads"):
        check_job(job, 4, "cpu")


def test_state_passing_moves_the_maps_whatever_the_sequence_length():
    """Counted from the collectives one layer issues (fake process group, fake tensors): each
    rank receives the other ranges' maps (4 HV dk (dk + dv) bytes each) forward and their
    gradients backward, plus the convolution's 3-token halos, at any sequence length."""
    from autopar.cli.bench_state_passing import state_passing_bytes
    from autopar.models.flavors import get_flavor

    args = get_flavor("qwen3.5", "debug")
    cp, others = 4, 2 * 4 - 2  # head-tail: 8 ranges, 2 of them this rank's
    key, value = args.linear_key_head_dim, args.linear_value_head_dim
    maps = 4 * args.linear_num_value_heads * key * (key + value)
    channels = 2 * args.linear_num_key_heads * key + args.linear_num_value_heads * value
    halos = 3 * channels * 2  # bf16
    expected = 2 * others * (maps + halos)
    for seq in (256, 4096):
        assert state_passing_bytes(args, seq, cp, True, torch.bfloat16) == expected
