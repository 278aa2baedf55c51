"""Plan combinations no other parity test runs, each equal to one device in fp32.

Each case trains 3 steps of a tiny fp32 model (a wrong gradient shows in step 2's loss and
in every gradient norm) and compares every step's loss and gradient norm with single-device
eager up to fp32's order of sums (``jobs.FP32_LOSS_RTOL``, ``FP32_NORM_RTOL``).
"""

from __future__ import annotations

import pytest

from autopar.cli.parity import Case, run_cases

from jobs import MOE_FLAGS, assert_fp32_parity, assert_same_training, tiny_job

pytestmark = pytest.mark.slow

# global batch 8 from local batch 2: two micro-steps of accumulation wherever dp is 2,
# four where it is 1 (so pipelining also runs under accumulation)
ACCUMULATING = ("--training.global_batch_size", "8")
REGATHER = "activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=op_regather"
CASES = {
    # name: (plan, the job's flags beyond the tiny model's)
    "DDP alone": ("dp_replicate=2", []),
    "HSDP x TP": ("dp_replicate=2,dp_shard=2,tp=2", []),
    "PP with accumulation": ("pp=2", []),
    "PP x TP with accumulation": ("pp=2,tp=2", []),
    "PP x FSDP x TP with accumulation": ("pp=2,dp_shard=2,tp=2", []),  # eight ranks, beside HSDP x TP
    "TP degree 4": ("tp=4", ["--model.num_key_value_heads=4"]),
    "full AC x TP": ("tp=2,activation_checkpoint.mode=full", []),
    "per-op AC x PP": (
        "pp=2,activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=op",
        [],
    ),
    "full AC x CP": ("cp=2,activation_checkpoint.mode=full", []),
    # compiled: full checkpointing recomputes by policy (plain checkpointing failed under TP)
    "full AC x TP + SP, compiled": ("tp=2,activation_checkpoint.mode=full,compile.enable=true", []),
    "every other block's AC x FSDP x TP, compiled": (
        "dp_shard=2,tp=2,activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=2,"
        "compile.enable=true",
        [],
    ),
    # SP's gathered inputs gathered again in backward (and bitwise what keeping them gives)
    "per-op AC regathering x TP + SP": (f"tp=2,{REGATHER}", []),
    # and with what the planner pairs it with (Qwen3.5's pipeline x TP is in test_qwen3_5_plans)
    "per-op AC regathering x PP x TP": (f"pp=2,tp=2,{REGATHER}", []),
    "per-op AC regathering x CP x TP": (f"cp=2,tp=2,{REGATHER}", []),
    "per-op AC regathering x FSDP x TP x EP": (f"dp_shard=2,tp=2,ep=2,{REGATHER}", MOE_FLAGS),
}


@pytest.fixture(scope="module")
def combination_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("combinations")
    cases = [Case(tiny_job(tmp, *ACCUMULATING, *flags), plan) for plan, flags in CASES.values()]
    return dict(zip(CASES, run_cases(cases, steps=3)))


@pytest.mark.parametrize("name", CASES)
def test_combination_matches_single_device(combination_runs, name):
    reference, run = combination_runs[name]
    if "compiled" in name:  # inductor fuses and reorders fp32 reductions
        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)
