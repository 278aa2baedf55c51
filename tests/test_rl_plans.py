"""A replayed RL step trains as one device does under every plan it runs under: the policy
loss's per-token weights, its per-completion sums (GSPO) across context-parallel ranks, a
mixture's experts across expert-parallel ranks, Qwen3.5's delta rule across CP ranks, each
pipeline micro-batch's completions and a reference's log-probabilities through a pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.config.sections import JobConfig
from autopar.data.tokens import BUILTIN_DATASETS
from autopar.training.metrics.logger import read_metrics

from jobs import (
    CHAT_VOCAB,
    assert_fp32_parity,
    assert_same_training,
    hybrid_job,
    moe_job,
    parity_runs,
    tiny_job,
)

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
    "pp=2",
]

HYBRID_PLANS = ["dp_shard=2", "cp=2"]
LORA_PLANS = ["dp_shard=2", "cp=2"]
"""LoRA with beta > 0 and its adapters bypassed for the reference: under CP each rank's
shard of the reference's log-probabilities is gathered back into whole rows."""


def replay_job(folder: Path, kind: str) -> JobConfig:
    """The replayed fixture step as ``kind`` trains it."""
    if kind == "dense":
        return tiny_job(folder / kind, *REPLAY, vocab_size=CHAT_VOCAB)
    if kind == "gspo":
        return tiny_job(
            folder / kind, *REPLAY, "--rl.importance_sampling_level", "sequence", vocab_size=CHAT_VOCAB
        )
    if kind == "moe":
        return moe_job(folder / kind, *REPLAY, f"--model.vocab_size={CHAT_VOCAB}")
    if kind == "hybrid":
        return hybrid_job(folder / kind, *REPLAY, vocab_size=CHAT_VOCAB)
    if kind == "reference":  # beta > 0 with a frozen copy as reference
        return tiny_job(folder / kind, *REPLAY, "--rl.beta", "0.04", vocab_size=CHAT_VOCAB)
    if kind == "corrected":  # pi_old recomputed forward only under the plan, TRL's sequence mask
        correction = ("--rl.importance_correction", "sequence_mask", "--rl.importance_cap_max", "1.5")
        return tiny_job(folder / kind, *REPLAY, *correction, vocab_size=CHAT_VOCAB)
    if kind == "hsdp":  # four data ranks need four groups: the fixture's in groups of two
        return tiny_job(folder / kind, *REPLAY, *pairs_replay(folder), vocab_size=CHAT_VOCAB)
    assert kind == "lora"
    lora = (
        "--lora.enable",
        "true",
        "--lora.rank",
        "4",
        "--rl.beta",
        "0.04",
        "--rl.reference",
        "adapters_off",
    )
    return tiny_job(folder / kind, *REPLAY, *lora, vocab_size=CHAT_VOCAB)


def pairs_replay(folder: Path) -> tuple[str, ...]:
    """Overrides replaying the fixture's completions in groups of two (eight groups of the
    same rewards and log-probs), two a data rank: a step of four prompts, one per rank of a
    2 x 2 HSDP mesh."""
    records = [json.loads(line) for line in (FIXTURES / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    for i, record in enumerate(records):
        record["group"] = i // 2
    (folder / "pairs").mkdir(parents=True, exist_ok=True)
    (folder / "pairs" / "step-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return (
        "--rl.replay",
        str(folder / "pairs"),
        "--rl.num_generations",
        "2",
        "--training.local_batch_size",
        "2",
    )


def replayed_runs(folder: Path, plans: dict[str, list[str]]) -> dict:
    """ "kind plan" -> (one device's run, the plan's) for each kind's plans."""
    out = {}
    for kind, kind_plans in plans.items():
        runs = parity_runs(replay_job(folder, kind), kind_plans, steps=1)
        out |= {f"{kind} {plan}": run for plan, run in runs.items()}
    return out


PLANS = {
    "dense": DENSE_PLANS,
    "gspo": ["cp=2"],
    "moe": ["dp_shard=2,ep=2"],
    "hybrid": HYBRID_PLANS,
    "lora": LORA_PLANS,
}
HEAVY_PLANS = {
    "dense": ["tp=2,dp_shard=2"],  # four ranks
    "hsdp": ["dp_replicate=2,dp_shard=2"],
    "moe": ["dp_shard=2", "tp=2", "cp=2"],
    "hybrid": ["tp=2", "pp=2,schedule=Interleaved1F1B"],  # four layers: one stage each interleaved
    "reference": ["pp=2", "cp=2"],  # forward only through a pipeline; gathered from CP shards
    "lora": ["pp=2"],  # the reference through the policy's own schedule
    "corrected": ["dp_shard=2", "cp=2", "pp=2"],
}
"""More replayed plans (python -m pytest -m heavy): each mechanism keeps a case above."""
CASES = [f"{kind} {plan}" for kind, plans in PLANS.items() for plan in plans]
HEAVY_CASES = [f"{kind} {plan}" for kind, plans in HEAVY_PLANS.items() for plan in plans]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return replayed_runs(tmp_path_factory.mktemp("rl_plans"), PLANS)


@pytest.fixture(scope="module")
def heavy_runs(tmp_path_factory):
    return replayed_runs(tmp_path_factory.mktemp("rl_heavy_plans"), HEAVY_PLANS)


def assert_replayed_parity(run, reference, case: str) -> None:
    if "compile" in case:  # inductor fuses and reorders sums: 1e-4, as every compiled plan
        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_replayed_rl_step_under_a_plan_equals_one_device(runs, case):
    reference, run = runs[case]
    assert_replayed_parity(run, reference, case)


@pytest.mark.heavy
@pytest.mark.parametrize("case", HEAVY_CASES)
def test_a_replayed_rl_step_under_more_plans_equals_one_device(heavy_runs, case):
    reference, run = heavy_runs[case]
    assert_replayed_parity(run, reference, case)


LIVE = (
    "--training.dataset_format",
    "prompts",
    "--training.dataset",
    "rl_example",
    "--model.tokenizer_path",
    str(CHATML),
    "--rl.reward_funcs",
    "autopar.rewards:letter_share",
    "--rl.num_generations",
    "4",
    "--rl.max_completion_length",
    "8",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--training.seq_len",
    "32",
    "--validation.enable",
    "true",
    "--validation.dataset",
    "rl_example",
    "--validation.local_batch_size",
    "4",
    "--validation.steps",
    "1",
)
"""The toy task, sampled live: 2 prompts x 4 completions a step; validated after the last
(held-out prompts sampled and scored the same way)."""
LIVE_PLANS = ["dp_shard=2", "tp=2,sp=false", "tp=2", "cp=2"]
MOE_LIVE_PLANS = ["dp_shard=2,ep=2"]
"""An expert-parallel group samples its ranks' prompts together, in step."""
HYBRID_LIVE_PLANS = ["tp=2", "cp=2"]
"""Qwen3.5 under TP + SP (the padded forwards leave the Gated DeltaNet states alone) and under CP
(each rank decodes its rows alone, its delta rule's state passing set aside)."""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """plan -> (its step records, its completions of each step); one device under ""."""
    from autopar.cli.parity import plan_job, run_plan

    from jobs import each_on_ranks

    folder = tmp_path_factory.mktemp("rl_live")
    base = tiny_job(folder / "base", *LIVE, vocab_size=CHAT_VOCAB)
    families = {
        "": (base, LIVE_PLANS),
        "moe ": (moe_job(folder / "moe", *LIVE, f"--model.vocab_size={CHAT_VOCAB}"), MOE_LIVE_PLANS),
        "qwen3.5 ": (hybrid_job(folder / "hybrid", *LIVE, vocab_size=CHAT_VOCAB), HYBRID_LIVE_PLANS),
    }
    jobs = {
        family + plan: plan_job(job, plan, 2, str(folder / (family + plan or "one")))
        for family, (job, plans) in families.items()
        for plan in ["", *plans]
    }
    for family in families:
        run_plan("", jobs[family])
    plans = [
        (plan, jobs[family + plan]) for family, (_, family_plans) in families.items() for plan in family_plans
    ]
    each_on_ranks(run_plan, 2, plans)
    out = {}
    for plan, job in jobs.items():
        dump = Path(job.job.dump_folder)
        records = [r for r in read_metrics(dump / "metrics.jsonl") if "reward" in r or "val_reward" in r]
        steps = [
            [json.loads(line) for line in (dump / "rollouts" / f"step-{n}.jsonl").read_text().splitlines()]
            for n in (1, 2)
        ]
        out[plan] = (records, steps)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [
        "",
        *LIVE_PLANS,
        "moe ",
        *(f"moe {p}" for p in MOE_LIVE_PLANS),
        "qwen3.5 ",
        *(f"qwen3.5 {p}" for p in HYBRID_LIVE_PLANS),
    ],
)
def test_sampled_log_probs_equal_the_trainers_under_a_plan(live, plan):
    records, _ = live[plan]
    # fp32: the decode step's logits and the packed training forward's differ in sums only;
    # the held-out pass's too
    steps = [r for r in records if "reward" in r]
    (held_out,) = [r for r in records if "val_reward" in r]
    assert len(steps) == 2 and all(r["sampling/logp_diff_max"] <= 1e-5 for r in steps), records
    assert held_out["val_sampling/logp_diff_max"] <= 1e-5, held_out


@pytest.mark.slow
def test_a_compiled_qwen3_5_samples_with_its_blocks_run_eagerly(tmp_path):
    # compiled, each prefill length recompiled the blocks past dynamo's limit and the run died
    from autopar.cli.parity import plan_job, run_plan

    from jobs import each_on_ranks

    plan = "dp_shard=2,compile.enable=true"
    job = plan_job(
        hybrid_job(tmp_path / "base", *LIVE, vocab_size=CHAT_VOCAB), plan, 2, str(tmp_path / "run")
    )
    each_on_ranks(run_plan, 2, [(plan, job)])
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    assert len(records) == 2 and all(r["sampling/logp_diff_max"] <= 1e-5 for r in records), records


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2,sp=false", "tp=2", "qwen3.5 tp=2"])
def test_live_sampling_under_tensor_parallel_draws_one_devices_completions(live, plan):
    """With sequence parallelism too: each forward padded to split evenly over the ranks."""
    one_records, one = live[plan.removesuffix("tp=2,sp=false").removesuffix("tp=2")]
    tp_records, tp = live[plan]
    for ours, theirs in zip(tp, one, strict=True):
        assert [r["completion_ids"] for r in ours] == [r["completion_ids"] for r in theirs]
    # the held-out pass too: the same completions, so the same rewards and lengths
    held_out = [next(r for r in records if "val_reward" in r) for records in (tp_records, one_records)]
    for name in ("val_reward", "val_completions/mean_length", "val_completions/max_length"):
        assert held_out[0][name] == held_out[1][name], name
