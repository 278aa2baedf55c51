"""FSDP2, HSDP, TP and TP+SP give the single-device losses and gradient norms (CPU, gloo).

Every plan runs 3 optimizer steps of an fp32 two-layer model from the same weights on the
same data (a wrong gradient shows in step 2's loss and in every gradient norm); all plans of
one world size share one process group.
"""

from __future__ import annotations

import copy

import pytest

from autopar.cli.parity import Case, relative_deltas, run_cases, run_plans

from jobs import FP32_LOSS_RTOL, FP32_NORM_RTOL, assert_fp32_parity, assert_same_training, tiny_job

pytestmark = pytest.mark.slow

MODELS = {
    "qwen3-untied": {"name": "qwen3", "tie_word_embeddings": False},
    "qwen3-tied": {"name": "qwen3", "tie_word_embeddings": True},
    "qwen2.5-tied": {"name": "qwen2.5", "tie_word_embeddings": True},
    "qwen2.5-untied": {"name": "qwen2.5", "tie_word_embeddings": False},
}
PLANS = [
    "dp_shard=2",
    "dp_replicate=2,dp_shard=2",
    "tp=2,sp=false",
    "tp=2,sp=false,loss_parallel=false",
    "tp=2",
    "dp_shard=2,tp=2",
]
VARIANT_PLANS = ["dp_shard=2", "tp=2", "tp=2,sp=false,loss_parallel=false"]
"""The plans a model variant meets differently: FSDP and TP with a tied head (one weight for
the embedding and a vocab-parallel or replicated head) and TP with Qwen2.5's q/k/v biases
(sharded with their columns). The first model runs every plan."""
KEYS = [("qwen3-untied", plan) for plan in PLANS] + [
    (model, plan) for model in list(MODELS)[1:] for plan in VARIANT_PLANS
]
STEPS = 3
# LoRA adapters follow their base's placement (A whole and B sharded on a column-parallel
# linear, the other way on a row-parallel one); FSDP shards them beside the frozen base.
LORA = ("--lora.enable", "true", "--lora.rank", "4")
LORA_PLANS = [  # FSDP and TP+SP each run inside dp_shard=2,tp=2
    "tp=2,sp=false",
    "dp_shard=2,tp=2",
    "cp=2",
    "pp=2",
]


HEAVY_KEYS = [
    ("qwen3-untied", "tp=2,loss_parallel=false"),
    ("qwen3-untied", "dp_shard=2,tp=2,loss_parallel=false"),
]
HEAVY_KEYS += [(model, "dp_shard=2,tp=2") for model in list(MODELS)[1:]] + [
    ("qwen3-lora", "dp_replicate=2,dp_shard=2")
]
HEAVY_KEYS += [
    ("qwen3-lora-op-ac", plan)
    for plan in ("tp=2,sp=false", "dp_shard=2,tp=2", "dp_shard=2,compile.enable=true")
]
"""A replicated loss beside TP (and FSDP), each variant's FSDP x TP (its FSDP and its TP run
above), LoRA under HSDP, and LoRA under per-op AC (which recomputes the adapters' low-rank B)
with TP, FSDP x TP + SP and compiled: python -m pytest -m heavy."""
LORA_OP_AC = (
    *LORA,
    "--activation_checkpoint.mode",
    "selective",
    "--activation_checkpoint.selective_ac_option",
    "op",
)


@pytest.mark.heavy
def test_the_other_model_and_plan_pairs_match_single_device(tmp_path):
    def job(model):
        if model.startswith("qwen3-lora"):
            return tiny_job(
                tmp_path, *(LORA_OP_AC if model.endswith("op-ac") else LORA), **MODELS["qwen3-untied"]
            )
        return tiny_job(tmp_path, **MODELS[model])

    runs = run_cases([Case(job(model), plan) for model, plan in HEAVY_KEYS], steps=STEPS)
    for (_, plan), (reference, run) in zip(HEAVY_KEYS, runs, strict=True):
        if "compile" in plan:  # inductor fuses and reorders fp32 reductions
            assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
        else:
            assert_fp32_parity(run, reference)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    cases = [Case(tiny_job(tmp, **MODELS[model]), plan) for model, plan in KEYS]
    keys = KEYS + [("qwen3-lora", plan) for plan in LORA_PLANS]
    cases += [Case(tiny_job(tmp, *LORA, **MODELS["qwen3-untied"]), plan) for plan in LORA_PLANS]
    return dict(zip(keys, run_cases(cases, steps=STEPS)))


@pytest.mark.parametrize(("model", "plan"), KEYS, ids=[f"{model}-{plan}" for model, plan in KEYS])
def test_plan_matches_single_device_loss_and_grad_norm(parity, model, plan):
    reference, run = parity[(model, plan)]
    assert len(reference.losses) == STEPS
    assert_fp32_parity(run, reference)


@pytest.mark.parametrize("plan", LORA_PLANS)
def test_lora_plan_matches_single_device_lora(parity, plan):
    reference, run = parity[("qwen3-lora", plan)]
    assert_fp32_parity(run, reference)


def test_training_actually_moves_the_loss(parity):
    reference, _ = parity[("qwen3-untied", "dp_shard=2")]
    assert reference.losses[-1] < reference.losses[0] - 0.5


def _resume_job(folder, plan_flags, load_step=None):
    flags = [
        "--training.steps",
        "6",
        "--training.global_batch_size",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
        *plan_flags,
    ]
    if load_step is not None:
        flags += ["--checkpoint.load_step", str(load_step)]
    job = tiny_job(folder, *flags)
    return job


FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Save under one plan at step 3, resume under the other: (uninterrupted, resumed) runs.
    The FSDP run saves in the background (checkpoint.async_mode), the TP run blocking."""
    tmp = tmp_path_factory.mktemp("reshard")
    jobs = [
        ("fsdp", _resume_job(tmp / "a", [*FSDP2, "--checkpoint.async_mode", "async"])),
        ("fsdp->tp", _resume_job(tmp / "a", TP2, load_step=3)),
        ("tp", _resume_job(tmp / "b", TP2)),
        ("tp->fsdp", _resume_job(tmp / "b", FSDP2, load_step=3)),
        # adapters saved as TP shards (B split on q/k/v/gate/up, A on o/down) come back whole
        # under FSDP, beside the same frozen base
        ("lora tp", _resume_job(tmp / "c", [*TP2, *LORA])),
        ("lora tp->fsdp", _resume_job(tmp / "c", [*FSDP2, *LORA], load_step=3)),
    ]
    runs = {r.plan: r for r in run_plans(copy.deepcopy(jobs), 2)}
    return runs


@pytest.mark.parametrize(
    "saved, resumed", [("fsdp", "fsdp->tp"), ("tp", "tp->fsdp"), ("lora tp", "lora tp->fsdp")]
)
def test_checkpoint_saved_under_one_plan_resumes_under_another(resharded, saved, resumed):
    uninterrupted, after = resharded[saved], resharded[resumed]
    assert len(after.losses) == 3  # steps 4, 5, 6
    assert max(relative_deltas(after.losses, uninterrupted.losses[3:])) <= FP32_LOSS_RTOL
    assert max(relative_deltas(after.grad_norms, uninterrupted.grad_norms[3:])) <= FP32_NORM_RTOL
