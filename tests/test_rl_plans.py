"""A replayed RL step trains as one device does under every plan it runs under: the policy
loss's per-token weights, its per-completion sums (GSPO) across context-parallel ranks, a
mixture's experts across expert-parallel ranks, Qwen3.5's delta rule across CP ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.data.tokens import BUILTIN_DATASETS

from jobs import CHAT_VOCAB, assert_fp32_parity, hybrid_job, moe_job, parity_runs, tiny_job

FIXTURES = Path(__file__).parent / "grpo_fixtures"
CHATML = Path(BUILTIN_DATASETS["autopar_corpus"]).parent / "tokenizers" / "chatml"
REPLAY = (
    "--training.dataset_format",
    "prompts",
    "--model.tokenizer_path",
    str(CHATML),
    "--rl.replay",
    str(FIXTURES / "rollouts"),
    "--rl.num_generations",
    "4",
    "--rl.max_completion_length",
    "10",
    "--rl.temperature",
    "0.7",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
)
"""TRL's fixture completions (8, in groups of 4; prompt + completion up to 16 tokens, so a
32-token row holds two and context parallelism splits completions across ranks)."""

DENSE_PLANS = [
    "dp_shard=2",
    "dp_replicate=2",
    "tp=2",
    "cp=2",
    "dp_shard=2,compile.enable=true",
    "dp_shard=2,activation_checkpoint.mode=full",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_plans")
    dense = tiny_job(folder / "dense", *REPLAY, vocab_size=CHAT_VOCAB)
    gspo = tiny_job(
        folder / "gspo", *REPLAY, "--rl.importance_sampling_level", "sequence", vocab_size=CHAT_VOCAB
    )
    moe = moe_job(folder / "moe", *REPLAY, f"--model.vocab_size={CHAT_VOCAB}")
    hybrid = hybrid_job(folder / "hybrid", *REPLAY, vocab_size=CHAT_VOCAB)
    lora = tiny_job(
        folder / "lora",
        *REPLAY,
        "--lora.enable",
        "true",
        "--lora.rank",
        "4",
        "--rl.beta",
        "0.04",
        "--rl.reference",
        "adapters_off",
        vocab_size=CHAT_VOCAB,
    )
    out = {f"dense {plan}": run for plan, run in parity_runs(dense, DENSE_PLANS, steps=1).items()}
    out |= {f"gspo {plan}": run for plan, run in parity_runs(gspo, ["cp=2"], steps=1).items()}
    out |= {f"moe {plan}": run for plan, run in parity_runs(moe, ["dp_shard=2,ep=2"], steps=1).items()}
    out |= {
        f"hybrid {plan}": run for plan, run in parity_runs(hybrid, ["dp_shard=2", "cp=2"], steps=1).items()
    }
    out |= {f"lora {plan}": run for plan, run in parity_runs(lora, ["dp_shard=2"], steps=1).items()}
    return out


CASES = [
    *(f"dense {p}" for p in DENSE_PLANS),
    "gspo cp=2",
    "moe dp_shard=2,ep=2",
    "hybrid dp_shard=2",
    "hybrid cp=2",
    "lora dp_shard=2",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_replayed_rl_step_under_a_plan_equals_one_device(runs, case):
    reference, run = runs[case]
    if "compile" in case:  # inductor fuses and reorders sums: 1e-4, as every compiled plan
        from jobs import assert_same_training

        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)
