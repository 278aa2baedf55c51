"""``validation.sample_prompts``: every ``validation.freq`` steps the model's greedy replies to
the prompts are logged and appended to ``<dump_folder>/samples.jsonl`` with the step."""

from __future__ import annotations

import copy
import json

import pytest

from autopar.cli.parity import run_plans
from autopar.config import ConfigError
from autopar.data.prompts import stop_ids
from autopar.data.tokenizer import build_tokenizer
from autopar.models import build_model
from autopar.models.generation import generate
from autopar.training.preflight import check_job

from jobs import one_process_trainer, tiny_job

PROMPTS = [{"prompt": "Once upon a time"}, {"prompt": "The"}]


def sampling_job(tmp_path, *flags: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return tiny_job(
        tmp_path,
        "--training.steps",
        "4",
        "--validation.freq",
        "2",
        "--validation.sample_prompts",
        str(prompts),
        "--generate.max_new_tokens",
        "6",
        *flags,
    )


def test_the_replies_at_each_validation_step_are_the_trained_weights_greedy_ones(tmp_path):
    job = sampling_job(tmp_path)
    trainer = one_process_trainer(job)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 2, 4, 4]
    tokenizer = build_tokenizer(None)
    prompts = [tokenizer.encode(p["prompt"]) for p in PROMPTS]
    assert [r["prompt_ids"] for r in records[2:]] == prompts
    model = build_model(trainer.args)
    model.load_state_dict(trainer.parts[0].state_dict())
    stops = stop_ids(tokenizer)
    assert [r["new_ids"] for r in records[2:]] == generate(model.eval(), prompts, 6, stop_ids=stops)
    assert all(0 < len(r["new_ids"]) <= 6 for r in records)
    assert records[0]["new_ids"] != records[2]["new_ids"] or records[1]["new_ids"] != records[3]["new_ids"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ("--validation.sample_prompts", "none.jsonl"),
            "validation.sample_prompts='none.jsonl' is not a file",
        ),
        (
            ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
            "validation.sample_prompts with pipeline_parallel_degree=2",
        ),
        (("--lora.enable", "true"), "validation.sample_prompts with lora.enable=true"),
    ],
)
def test_sample_prompts_that_cannot_run_are_refused_naming_the_field(tmp_path, flags, message):
    job = sampling_job(tmp_path, *flags)
    with pytest.raises(ConfigError, match=message):
        check_job(job, 2 if "--parallelism.pipeline_parallel_degree" in flags else 1)


def sample_records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fsdp_and_tp_ranks_sample_what_one_process_samples(tmp_path):
    """Two ranks each: the weights gathered from their shards give one process's replies
    (fp32, 4 steps: the plans' sums differ by rounding only, far from the logits' gaps)."""
    reference = sampling_job(tmp_path / "one", "--training.global_batch_size", "4")
    one_process_trainer(reference).train()
    plans = {
        "fsdp": ("--parallelism.data_parallel_shard_degree", "2"),
        "tp": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"),
    }
    jobs = [
        (plan, sampling_job(tmp_path / plan, "--training.global_batch_size", "4", *flags))
        for plan, flags in plans.items()
    ]
    for run in run_plans(copy.deepcopy(jobs), 2):
        assert run.losses  # a plan whose ranks failed raises here, with their text
    expected = [(r["step"], r["new_ids"]) for r in sample_records(tmp_path / "one")]
    for plan in plans:
        assert [(r["step"], r["new_ids"]) for r in sample_records(tmp_path / plan)] == expected, plan
