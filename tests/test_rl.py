"""On-policy RL (``[rl]``): TRL 1.16's GRPO losses, metrics and advantages on replayed
completions; the sampler's log-probabilities equal the trainer's; the toy preset learns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autopar.data.tokens import BUILTIN_DATASETS
from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import parse_job

from jobs import MOE_FLAGS, one_process_trainer

HERE = Path(__file__).parent
FIXTURES = HERE / "grpo_fixtures"
POLICY = HERE / "dpo_fixtures" / "policy"
CHATML = Path(BUILTIN_DATASETS["autopar_corpus"]).parent / "tokenizers" / "chatml"
TRL = json.loads((FIXTURES / "losses.json").read_text())
CASES = {entry["name"]: entry for entry in TRL["entries"]}
RTOL = 1e-5  # fp32, the same forward: TRL sums per row and over the batch, autopar per packed token


def replay_job(folder: Path, case: dict, *flags: str):
    """The fixture's policy trained one step on TRL's completions, under ``case``'s settings."""
    settings = [f"--rl.{key}={value}" for key, value in case["rl"].items()]
    return parse_job(
        [
            "--job.config",
            "debug_model",
            "--model.hf_assets_path",
            str(POLICY),
            "--model.tokenizer_path",
            str(CHATML),
            "--checkpoint.initial_load_path",
            str(POLICY),
            "--checkpoint.initial_load_in_hf",
            "true",
            "--checkpoint.enable",
            "false",
            "--training.mixed_precision_param",
            "float32",
            "--training.dataset_format",
            "prompts",
            "--training.local_batch_size",
            "8",
            "--training.global_batch_size",
            "8",
            "--training.seq_len",
            "32",
            "--training.steps",
            "1",
            "--rl.replay",
            str(FIXTURES / "rollouts"),
            "--rl.num_generations",
            str(TRL["num_generations"]),
            "--rl.max_completion_length",
            str(TRL["max_completion_length"]),
            "--rl.temperature",
            str(TRL["temperature"]),
            "--rl.reward_weights",
            ",".join(map(str, TRL["reward_weights"])),
            "--rl.reference_path",
            str(HERE / "dpo_fixtures" / "reference"),
            *settings,
            "--job.dump_folder",
            str(folder),
            *flags,
        ]
    )


@pytest.mark.parametrize("name", CASES)
def test_a_replayed_step_gives_trls_loss_and_metrics(tmp_path, name):
    case = CASES[name]
    trainer = one_process_trainer(replay_job(tmp_path, case))
    outcome = trainer.train_step.forward_backward(trainer.loader.next_step())
    assert outcome.loss.item() == pytest.approx(case["loss"], rel=RTOL, abs=1e-7), name
    ours = dict(zip(trainer.train_step.objective.metric_names, outcome.metrics.tolist()))
    for key, value in case["metrics"].items():
        if key in ("clip_ratio/low_min", "clip_ratio/high_max"):  # per-sequence extremes: not logged here
            continue
        assert ours[key] == pytest.approx(value, rel=RTOL, abs=1e-6), (name, key)


def test_a_correction_logs_trls_sampling_gap_and_ratio_metrics(tmp_path):
    import torch

    case = CASES["dapo_is_token_mask"]
    trainer = one_process_trainer(replay_job(tmp_path, case))
    outcome = trainer.train_step.forward_backward(trainer.loader.next_step())
    ours = dict(zip(trainer.train_step.objective.metric_names, outcome.metrics.tolist()))
    columns = trainer.loader.current[0].labels
    mask = columns[..., 0] != -100
    factors = columns[..., 6][mask]
    assert (factors == 0).any() and (factors > 0).any()  # the caps masked some tokens, kept others
    assert ours["sampling/importance_sampling_ratio/min"] == 0.0
    assert ours["sampling/importance_sampling_ratio/mean"] == pytest.approx(
        factors.double().mean().item(), rel=1e-6
    )
    assert ours["sampling/importance_sampling_ratio/max"] == pytest.approx(factors.max().item(), rel=1e-6)
    gap = ours["sampling/sampling_logp_difference/max"]
    assert 0 < ours["sampling/sampling_logp_difference/mean"] < gap
    assert ours["sampling/logp_diff_max"] <= 1e-5  # pi_old recomputed: the first pass is on-policy
    assert torch.isfinite(outcome.loss)


@pytest.mark.parametrize("name", ["dapo", "grpo_batch_scale", "bnpo_no_scale"])
def test_replayed_advantages_are_trls(tmp_path, name):
    case = CASES[name]
    trainer = one_process_trainer(replay_job(tmp_path, case))
    loader = trainer.loader
    completions = loader._replayed(1)
    assert [c.advantage for c in completions] == pytest.approx(case["advantages"], rel=1e-6, abs=1e-6)
    assert [c.reward for c in completions] == pytest.approx(case["rewards"], nan_ok=True)


def test_the_sampler_scores_its_tokens_as_the_trainer_does(tmp_path):
    job = parse_job(
        [
            "--job.config",
            "rl_debug",
            "--training.steps",
            "2",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    one_process_trainer(job).train()
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r]
    # fp32: the decode step's logits and the packed training forward's differ in sums only
    assert len(records) == 2 and all(r["sampling/logp_diff_max"] <= 1e-5 for r in records)
    rollouts = [
        json.loads(line) for line in (tmp_path / "rollouts" / "step-1.jsonl").read_text().splitlines()
    ]
    assert len(rollouts) == 32 and all(len(r["logps"]) == len(r["completion_ids"]) for r in rollouts)


def test_an_rl_step_counts_the_tokens_it_trains_not_its_rows_capacity(tmp_path):
    # completions pack several to a row: tokens/s and MFU count prompts and completions (each
    # document's tokens but its last), not local_batch_size x seq_len (2.5x as many here)
    run = ["--job.config", "rl_debug", "--training.steps", "1", "--checkpoint.enable", "false"]
    job = parse_job([*run, "--job.dump_folder", str(tmp_path)])
    one_process_trainer(job).train()
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    rollouts = [
        json.loads(line) for line in (tmp_path / "rollouts" / "step-1.jsonl").read_text().splitlines()
    ]
    assert record["tokens_seen"] == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) - 1 for r in rollouts)


@pytest.mark.heavy
def test_the_toy_preset_doubles_its_reward(tmp_path):
    # measured: the last ten steps' mean reward 3.1x the first ten's (0.045 -> 0.139), 60 steps
    job = parse_job(
        ["--job.config", "rl_debug", "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path)]
    )
    one_process_trainer(job).train()
    rewards = [r["reward"] for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r]
    assert len(rewards) == 60 and sum(rewards[-10:]) >= 2 * sum(rewards[:10])


def resumable_run(folder: Path, interval: int, *flags: str) -> list:
    """The step records of ``rl_debug``, 4 steps of two passes over each rollout's 8-token
    completions, saving every ``interval`` steps into ``folder`` (resuming from what it holds)."""
    run = ("--job.config", "rl_debug", "--training.steps", "4", "--checkpoint.interval", str(interval))
    rl = ("--rl.max_completion_length", "8", "--rl.num_iterations", "2")
    job = parse_job([*run, *rl, *flags, "--job.dump_folder", str(folder)])
    return one_process_trainer(job).train()


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(tmp_path):
    uninterrupted = resumable_run(tmp_path / "a", 2)
    shutil.rmtree(tmp_path / "a" / "checkpoint" / "step-4")  # as if it died after step 2
    resumed = resumable_run(tmp_path / "a", 2)
    assert [(r.loss, r.grad_norm) for r in resumed] == [(r.loss, r.grad_norm) for r in uninterrupted[2:]]
    rollouts = sorted(p.name for p in (tmp_path / "a" / "rollouts").iterdir())
    assert rollouts == ["step-1.jsonl", "step-2.jsonl"]


def test_a_run_resumed_inside_a_rollouts_passes_trains_on_the_completions_it_kept(tmp_path):
    uninterrupted = resumable_run(tmp_path / "a", 1, "--checkpoint.keep_latest_k", "0")
    for step in (2, 3, 4):  # as if it died after step 1, inside rollout 1's two passes
        shutil.rmtree(tmp_path / "a" / "checkpoint" / f"step-{step}", ignore_errors=True)
    resumed = resumable_run(tmp_path / "a", 1, "--checkpoint.keep_latest_k", "0")
    assert [(r.loss, r.grad_norm) for r in resumed] == [(r.loss, r.grad_norm) for r in uninterrupted[1:]]


HELD_OUT = (
    "--validation.enable",
    "true",
    "--validation.dataset",
    "rl_example",
    "--validation.local_batch_size",
    "16",
    "--validation.freq",
    "2",
    "--validation.steps",
    "1",
)


def short_run(folder: Path, *flags: str) -> list:
    """``rl_debug``'s first 4 steps, 8-token completions, without checkpoints."""
    run = ("--job.config", "rl_debug", "--training.steps", "4", "--checkpoint.enable", "false")
    job = parse_job([*run, "--rl.max_completion_length", "8", *flags, "--job.dump_folder", str(folder)])
    return one_process_trainer(job).train()


def test_validation_samples_held_out_prompts_and_leaves_training_as_it_was(tmp_path):
    plain = short_run(tmp_path / "plain")
    validated = short_run(tmp_path / "validated", *HELD_OUT)
    assert [(r.loss, r.grad_norm) for r in validated] == [(r.loss, r.grad_norm) for r in plain]
    held_out = [r for r in read_metrics(tmp_path / "validated" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in held_out] == [2, 4]
    for record in held_out:  # TRL's names, val_ before each; the sampler scored as the trainer does
        assert record["val_sampling/logp_diff_max"] <= 1e-5
        assert record["val_completions/max_length"] <= 8 and record["val_reward"] > 0
    kept = sorted(p.name for p in (tmp_path / "validated" / "rollouts").iterdir())
    assert kept == [f"step-{i}.jsonl" for i in range(1, 5)]  # training's alone, as they were
    for name in kept:
        assert (tmp_path / "validated" / "rollouts" / name).read_text() == (
            tmp_path / "plain" / "rollouts" / name
        ).read_text()


def test_every_validation_pass_samples_the_same_prompts_from_the_same_seeds(tmp_path):
    # weights that do not move: the passes at steps 2 and 4 are the same numbers
    short_run(tmp_path, *HELD_OUT, "--optimizer.lr", "0")
    first, second = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val_loss" in r]
    assert {k: v for k, v in first.items() if k not in ("step", "val_time/rollout", "val_time/scoring")} == {
        k: v for k, v in second.items() if k not in ("step", "val_time/rollout", "val_time/scoring")
    }


def test_too_few_held_out_prompts_are_refused_before_the_model_is_built(tmp_path, model_never_built):
    from autopar.data.errors import DataError

    with pytest.raises(
        DataError, match=r"holds \d+ prompts, fewer than one batch .* rl.num_generations = 512;"
    ):
        short_run(tmp_path, *HELD_OUT, "--validation.local_batch_size", "4096")


REPLAYED_UNDER_PP = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--rl.replay",
    str(FIXTURES / "rollouts"),
)


def check(*flags: str) -> None:
    from autopar.training.preflight import check_job

    world = 2 if "--parallelism.pipeline_parallel_degree" in flags else 1
    check_job(parse_job(["--job.config", "rl_debug", *flags]), world)


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--rl.num_generations", "1"), "rl.num_generations=1 must be at least 2"),
        (("--rl.num_generations", "6"), "does not divide the 32 completions"),
        (("--rl.max_completion_length", "256"), "leaves no room for a prompt"),
        (("--rl.reward_funcs", "no_such_module:f"), "no_such_module does not import"),
        (("--rl.reward_funcs", "autopar.rewards:nothing"), "has no 'nothing'"),
        (("--rl.reward_funcs", "autopar.rewards:_GSM8K"), "_GSM8K is not callable"),
        (("--rl.reward_funcs", "autopar.rewards"), "is not 'package.module:function'"),
        (("--rl.beta", "0.1", "--rl.reference", "adapters_off"), "lora.enable=false"),
        (("--rl.temperature", "0"), "rl.temperature=0.0 must be > 0"),
        (
            ("--rl.importance_cap_min", "4"),
            "rl.importance_cap_min=4.0 must be >= 0 and below importance_cap_max",
        ),
        (
            (
                *REPLAYED_UNDER_PP,
                "--rl.old_logps",
                "trainer",
                "--parallelism.pipeline_parallel_schedule",
                "DualPipeV",
            ),
            "rl.old_logps='trainer' (a forward-only pass) under parallelism.pipeline_parallel_schedule='DualPipeV'",
        ),
        (("--parallelism.pipeline_parallel_degree", "2"), "pipeline_parallel_degree=2: not supported yet"),
        ((*HELD_OUT, "--rl.replay", str(FIXTURES / "rollouts")), "validation.enable=true with rl.replay"),
        ((*HELD_OUT, "--validation.seq_len", "64"), "validation.seq_len=64 with RL"),
        ((*HELD_OUT, "--validation.local_batch_size", "6"), "does not divide the 6 completions"),
        (
            (
                *REPLAYED_UNDER_PP,
                "--rl.beta",
                "0.1",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ),
            "rl.beta=0.1 (the reference pass) under parallelism.pipeline_parallel_schedule='ZBVZeroBubble'",
        ),
        (
            (*REPLAYED_UNDER_PP, *MOE_FLAGS),
            "RL with a mixture of experts under pipeline_parallel_degree=2: not supported yet",
        ),
    ],
)
def test_a_bad_rl_setting_is_one_line_before_any_work(flags, says):
    from autopar.config.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        check(*flags)
    assert says in str(refused.value), str(refused.value)


def test_rl_settings_on_a_job_without_prompt_data_are_refused():
    from autopar.config.errors import ConfigError
    from autopar.training.preflight import check_job

    with pytest.raises(ConfigError, match=r"rl\.beta is set, but training\.dataset_format='text'"):
        check_job(parse_job(["--job.config", "debug_model", "--rl.beta", "0.1"]), 1)


def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_step(tmp_path):
    from autopar.training.faults import TrainingStopped

    bad = tmp_path / "bad_reward.py"
    bad.write_text("def broken(completions, **kw):\n    raise KeyError('answer')\n")
    job = parse_job(
        [
            "--job.config",
            "rl_debug",
            "--rl.reward_funcs",
            f"{bad}:broken",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    with pytest.raises(TrainingStopped, match=r"step 1: step 1: reward function broken .* raised KeyError"):
        one_process_trainer(job).train()


@pytest.mark.parametrize(
    "body, says",
    [
        ("return [1.0]", "returned 1 rewards for 32 completions"),
        ("return ['yes'] * len(completions)", "returned 'yes' for completion 0"),
        ("return [float('nan')] * len(completions)", "returned nan for completion 0"),
    ],
)
def test_a_reward_function_returning_what_is_not_one_number_per_completion_is_named(tmp_path, body, says):
    from autopar.training.faults import TrainingStopped

    bad = tmp_path / "odd_reward.py"
    bad.write_text(f"def odd(completions, **kw):\n    {body}\n")
    job = parse_job(
        [
            "--job.config",
            "rl_debug",
            "--rl.reward_funcs",
            f"{bad}:odd",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    with pytest.raises(TrainingStopped, match=says):
        one_process_trainer(job).train()


def test_a_replay_of_another_vocabulary_is_refused(tmp_path):
    from autopar.config.errors import ConfigError

    record = json.loads((FIXTURES / "rollouts" / "step-1.jsonl").read_text().splitlines()[0])
    record["completion_ids"] = [100_000]
    (tmp_path / "step-1.jsonl").write_text(json.dumps(record) + "\n")
    job = replay_job(tmp_path / "run", CASES["dapo"], "--rl.replay", str(tmp_path / "step-1.jsonl"))
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        one_process_trainer(job)


def test_a_replay_longer_than_a_row_is_refused_naming_the_seq_len_it_needs(tmp_path):
    from autopar.config.errors import ConfigError

    job = replay_job(tmp_path / "run", CASES["dapo"], "--training.seq_len", "12")
    with pytest.raises(ConfigError, match=r"rl.replay: a completion of step 1 makes a \d+-token document"):
        one_process_trainer(job)


def test_a_prompt_that_leaves_no_room_for_a_whole_completion_is_refused_before_any_work():
    from autopar.config.errors import ConfigError
    from autopar.training.objectives.rl.job import prompt_source

    job = parse_job(
        ["--job.config", "rl_debug", "--training.seq_len", "32", "--rl.max_completion_length", "24"]
    )
    with pytest.raises(ConfigError, match=r"prompt \d+ is \d+ tokens, .* raise seq_len to \d+"):
        prompt_source(job)


def test_the_shipped_rewards_read_gsm8k_and_boxed_answers():
    from autopar.rewards import answer_match, think_format

    completions = ["so 3 + 4 = 7\n#### 7", "the answer is \\boxed{1,234}.", "I think 8", "#### 9"]
    assert answer_match([], completions, ["Natalia sold 7 clips.\n#### 7", "1234", "8", None]) == [
        1.0,
        1.0,
        0.0,
        None,
    ]
    assert answer_match([], completions) == [None] * 4
    assert think_format([" <think>add them</think> 7", "<think>no answer</think>", "7"]) == [1.0, 0.0, 0.0]


def packed_completions(groups: int | None):
    """Four replayed completions of 3-4 tokens after 3-token prompts packed as one micro-batch
    of 16-token rows, their old log-probabilities such that every ratio clips, and the
    (B, S, V) logits of a random policy over them."""
    import torch

    from autopar.training.objectives.rl.rollouts import Completion, Packed, pack_micro_batch

    generator = torch.Generator().manual_seed(0)
    items = []
    for k in range(4):
        ids = torch.randint(0, 20, (7 - k % 2,), generator=generator).tolist()
        completion = Completion(1, k // 2, "p", ids[:3], ids[3:], "c", {}, 1.0, (-1.0) ** k, None, False)
        n = len(completion.completion_ids)
        old = [-6.0 if k % 2 == 0 else -1.0] * n  # ratios far above 1 (advantage +1) or below (-1)
        items.append(Packed(completion, [0.1] * n, old, [0.0] * n))
    batch = pack_micro_batch(items, 16, 0, groups)
    return batch, torch.randn(*batch.inputs.shape, 20, generator=generator)


def test_a_pipelines_packing_gives_each_pipeline_micro_batch_whole_completions_in_fixed_rows():
    batch, _ = packed_completions(groups=2)
    assert batch.inputs.shape == (4, 16)  # two completions per group, a row each, always
    completions = batch.labels[..., 1]
    assert {int(c) for c in completions[:2].unique()} - {-1} == {0, 1}
    assert {int(c) for c in completions[2:].unique()} - {-1} == {2, 3}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_micro_batch_cut_into_pipeline_micro_batches_sums_to_the_whole_ones_loss_and_metrics(level):
    import torch

    from autopar.training.objectives.rl.loss import Columns, PolicyLoss, policy_loss

    settings = PolicyLoss("dapo", level, 0.2, 0.2, None, 0.0, 1.0)
    batch, logits = packed_completions(groups=2)
    whole = policy_loss(settings, logits, Columns.of(batch.labels), 4, None)
    halves = [
        policy_loss(settings, logits[r], Columns.of(batch.labels[r]), 4, None)
        for r in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0])
    torch.testing.assert_close(halves[0][1] + halves[1][1], whole[1])  # clip counts over completions too
