"""An RL job's parts: its checks, its prompts, reward functions, reference and rollouts, and
the objective over them.

For ``training.dataset_format = "prompts"`` the trainer gets the rollouts (``engine``) where
a loader stands and the policy loss (``objective``) as its objective; the batch sizes count
completions (TRL's). Live sampling runs on the job's own parts; what it cannot run under yet
is refused here in one line (a pipeline while sampling), while a replay trains under it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.config.checks import changed_fields
from autopar.config.errors import ConfigError
from autopar.config.sections import RL, JobConfig
from autopar.data.chat import ChatFormat, _tokenizer
from autopar.data.loader import Batch, dataset_path
from autopar.data.preference import PairEncoder
from autopar.data.prompt_records import PromptRecord, PromptSource, read_prompt_records
from autopar.data.prompts import stop_ids
from autopar.data.tokenizer import build_tokenizer
from autopar.models.args import ModelArgs
from autopar.parallel.context_parallel import ContextParallel, unshard_sequence
from autopar.parallel.materialize import FullValue
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import Pipeline, check_forward_only_schedule
from autopar.training.objectives.base import ForwardInputs
from autopar.training.objectives.dpo.job import (
    all_adapters_off,
    build_reference_copy,
    load_model,
    reference_dcp,
)
from autopar.training.objectives.rl.engine import Rollouts
from autopar.training.objectives.rl.loss import Columns, PolicyLoss, token_logps_and_entropy
from autopar.training.objectives.rl.objective import PolicyGradient
from autopar.training.objectives.rl.rollouts import Completion, read_replay
from autopar.training.objectives.rl.scoring import load_rewards
from autopar.training.plan_runner import PlanRunner, sum_over
from autopar.training.resolve import tokenizer_path
from autopar.training.step import TrainStep
from autopar.training.validation import Validator


def is_rl(job: JobConfig) -> bool:
    return job.training.dataset_format == "prompts"


def check_rl(job: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """``[rl]`` agrees with the data and the plan (and is not set without prompt data)."""
    cfg = job.rl
    if not is_rl(job):
        changed = changed_fields(cfg)
        if changed:
            raise ConfigError(
                f"rl.{changed[0]} is set, but training.dataset_format={job.training.dataset_format!r}; [rl] trains "
                "prompt-only data: set --training.dataset_format prompts (or leave [rl] out)"
            )
        return
    _check_numbers(cfg)
    _check_batch(job, dims)
    if cfg.replay is None:
        load_rewards(cfg.reward_funcs)
    if (
        cfg.replay is None
        and cfg.reward_weights is not None
        and len(cfg.reward_weights) != len(cfg.reward_funcs)
    ):
        raise ConfigError(
            f"rl.reward_weights={cfg.reward_weights} needs one weight per rl.reward_funcs entry"
        )
    if cfg.max_completion_length >= job.training.seq_len:
        raise ConfigError(
            f"rl.max_completion_length={cfg.max_completion_length} leaves no room for a prompt in a row of "
            f"training.seq_len={job.training.seq_len}; raise seq_len or lower max_completion_length"
        )
    _check_reference(job)
    _check_plan(job, dims, args)
    _check_validation(job, dims)
    if job.mtp.enable:
        raise ConfigError(
            "mtp.enable=true with training.dataset_format='prompts' (RL): not supported yet; turn it off"
        )


def _check_numbers(cfg: RL) -> None:
    rules = {
        "num_generations": (
            cfg.num_generations >= 2,
            "at least 2 (advantages compare a group's completions)",
        ),
        "max_completion_length": (cfg.max_completion_length >= 1, "at least 1"),
        "temperature": (cfg.temperature > 0, "> 0 (the loss reads log-probabilities at it)"),
        "top_p": (0 < cfg.top_p <= 1, "in (0, 1]"),
        "top_k": (cfg.top_k >= 0, ">= 0 (0: all tokens)"),
        "num_iterations": (cfg.num_iterations >= 1, "at least 1"),
        "epsilon": (cfg.epsilon >= 0, ">= 0"),
        "epsilon_high": (cfg.epsilon_high is None or cfg.epsilon_high >= 0, ">= 0"),
        "delta": (cfg.delta is None or cfg.delta > 1, "> 1 (it caps the ratio from above), or unset"),
        "beta": (cfg.beta >= 0, ">= 0"),
        "importance_cap_max": (cfg.importance_cap_max is None or cfg.importance_cap_max > 0, "> 0, or unset"),
        "importance_cap_min": (
            cfg.importance_cap_min is None
            or 0
            <= cfg.importance_cap_min
            < (cfg.importance_cap_max if cfg.importance_cap_max is not None else math.inf),
            ">= 0 and below importance_cap_max, or unset",
        ),
    }
    for name, (ok, rule) in rules.items():
        if not ok:
            raise ConfigError(f"rl.{name}={getattr(cfg, name)} must be {rule}")


def _check_batch(
    job: JobConfig, dims: ParallelDims, batch: str = "training.global_batch_size, else local_batch_size"
) -> None:
    training, cfg = job.training, job.rl
    completions = training.global_batch(dims.dp)
    if completions % cfg.num_generations:
        raise ConfigError(
            f"rl.num_generations={cfg.num_generations} does not divide the {completions} completions of a step "
            f"({batch} x data-parallel degree); make it a divisor"
        )
    prompts = completions // cfg.num_generations
    if prompts % dims.dp:
        raise ConfigError(
            f"a step's {prompts} prompts ({completions} completions / rl.num_generations={cfg.num_generations}) do "
            f"not split over the data-parallel degree {dims.dp}; use a batch of a multiple of "
            f"{dims.dp * cfg.num_generations} completions"
        )


def _check_validation(job: JobConfig, dims: ParallelDims) -> None:
    """``[validation]`` samples held-out prompts as the rollouts sample (``validation_job``)."""
    cfg = job.validation
    if not cfg.enable:
        return
    if job.rl.replay is not None:
        raise ConfigError(
            "validation.enable=true with rl.replay: validation samples held-out prompts, and a replay "
            "samples nothing (its model may not be the one that wrote the rollouts); turn one off"
        )
    if cfg.seq_len != -1:
        raise ConfigError(
            f"validation.seq_len={cfg.seq_len} with RL: held-out completions are packed as training's, "
            "into rows of training.seq_len; leave it at -1"
        )
    _check_batch(validation_job(job), dims, "validation.local_batch_size")


def validation_job(job: JobConfig) -> JobConfig:
    """The job its ``[validation]`` rollouts run as: validation.local_batch_size completions
    per data-parallel rank a step, one pass each, from the held-out prompts."""
    training = replace(
        job.training,
        local_batch_size=job.validation.local_batch_size,
        global_batch_size=-1,
        dataset=job.validation.dataset,
        dataset_path=job.validation.dataset_path,
    )
    return replace(job, training=training, rl=replace(job.rl, num_iterations=1))


def _check_reference(job: JobConfig) -> None:
    cfg = job.rl
    if cfg.beta == 0:
        return
    if cfg.reference == "adapters_off" and not job.lora.enable:
        raise ConfigError(
            "rl.reference='adapters_off' is the LoRA model with its adapters bypassed, and lora.enable=false; "
            "use --lora.enable true, or --rl.reference copy"
        )


def _check_plan(job: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    if dims.pp > 1:
        _check_pipelined(job, dims, args)


def _check_pipelined(job: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """A pipeline trains replayed rollouts: its micro-batches pack each pipeline micro-batch's
    completions alone (``rollouts.pack_micro_batch``), a reference runs forward only."""
    if job.rl.replay is None:
        raise ConfigError(
            f"RL sampling with pipeline_parallel_degree={dims.pp}: not supported yet (rollouts decode on each "
            "rank's whole model); sample under FSDP, TP or CP, or train --rl.replay rollouts under the pipeline"
        )
    if args.moe:
        raise ConfigError(
            f"RL with a mixture of experts under pipeline_parallel_degree={dims.pp}: not supported yet (the "
            "load-balancing loss is per row, and a pipeline packs each of its micro-batches into rows of their "
            "own); use expert or FSDP parallelism instead"
        )
    if job.rl.beta != 0:
        check_forward_only_schedule(job.parallelism, f"rl.beta={job.rl.beta} (the reference pass)")
    if recomputes(job.rl):
        check_forward_only_schedule(job.parallelism, "rl.old_logps='trainer' (a forward-only pass)")


def prompt_source(job: JobConfig) -> PromptSource:
    """The job's prompt records, tokenized (none for a replay)."""
    if job.rl.replay is not None:
        return PromptSource([], job.rl.replay)
    training = job.training
    path = str(tokenizer_path(job))
    source = dataset_path(training.dataset, training.dataset_path)
    records = read_prompt_records(source, PairEncoder(path, ChatFormat(path, training.chat_template)))
    _check_prompts_fit(records, str(source), training.seq_len, job.rl.max_completion_length)
    return PromptSource(records, str(source))


def _check_prompts_fit(records: list[PromptRecord], source: str, seq_len: int, completion: int) -> None:
    """Every prompt with a whole completion fits a row: packing places each document whole
    (its tokens but the last), so a longer one would be found only after sampling it."""
    if not records:
        return
    index, longest = max(enumerate(records), key=lambda item: len(item[1].prompt_ids))
    need = len(longest.prompt_ids) + completion - 1
    if need > seq_len:
        raise ConfigError(
            f"{source}: prompt {index + 1} is {len(longest.prompt_ids)} tokens, which with "
            f"rl.max_completion_length={completion} makes a {need}-token document, longer than "
            f"training.seq_len={seq_len}; raise seq_len to {need}, lower max_completion_length, or shorten the prompt"
        )


def rl_objective(
    runner: PlanRunner, job: JobConfig, args: ModelArgs, initial: FullValue, prompts: PromptSource
) -> tuple[PolicyGradient, list[nn.Module], Rollouts]:
    """The policy loss, the reference copy's parts (none but for beta > 0 and ``copy``), and
    the rollouts that stand for the loader."""
    cfg = job.rl
    path = str(tokenizer_path(job))
    tokenizer = build_tokenizer(path)
    decoder = _tokenizer(path)
    copy: list[nn.Module] = []
    reference = None
    if cfg.beta != 0:
        if cfg.reference == "copy":
            copy = build_reference_copy(args, job, runner.meshes, runner.device, initial, cfg.reference_path)
            dcp_path = reference_dcp(job, cfg.reference_path)
            if dcp_path is not None:
                load_model(
                    copy,
                    dcp_path,
                    "rl.reference_path" if cfg.reference_path else "checkpoint.initial_load_path",
                )
        model = (runner.pipeline_of(copy) if runner.pipeline is not None else copy[0]) if copy else None
        scope = functools.partial(all_adapters_off, runner.parts) if model is None else contextlib.nullcontext
        reference = functools.partial(_token_logps, runner, model, scope, cfg.temperature)
    recompute = None
    if recomputes(cfg):  # the policy's own forward, as it stands before the step's passes
        recompute = functools.partial(_token_logps, runner, None, contextlib.nullcontext, cfg.temperature)
    replay = read_replay(cfg.replay, args.vocab_size) if cfg.replay is not None else None
    if replay:
        _check_replay_fits(replay, job.training.seq_len)
    rollouts = Rollouts(
        job,
        runner,
        prompts.records,
        load_rewards(cfg.reward_funcs) if replay is None else [],
        lambda ids: decoder.decode(ids, skip_special_tokens=True),
        stop_ids(tokenizer),
        ChatFormat(path).pad_id(),
        reference,
        replay,
        recompute,
    )
    return (
        PolicyGradient(runner, PolicyLoss.of(cfg, job.training.loss_chunk_tokens), rollouts),
        copy,
        rollouts,
    )


def _check_replay_fits(replay: dict[int, list[Completion]], seq_len: int) -> None:
    longest = max((c for step in replay.values() for c in step), key=lambda c: c.tokens)
    if longest.tokens > seq_len:
        raise ConfigError(
            f"rl.replay: a completion of step {longest.step} makes a {longest.tokens}-token document (prompt + "
            f"completion), longer than training.seq_len={seq_len}; replay with --training.seq_len {longest.tokens} "
            "or more"
        )


class _TokenRecord:
    """A reference pass's "loss": keeps each call's per-label log-probabilities (B, S)."""

    def __init__(self, temperature: float, chunk_tokens: int = 0) -> None:
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.logps: list[torch.Tensor] = []

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output[0] if isinstance(output, tuple) else output
        logps, _ = token_logps_and_entropy(
            logits, Columns.of(target).labels, self.temperature, self.chunk_tokens
        )
        self.logps.append(logps)
        return logps.new_zeros(())


def recomputes(cfg: RL) -> bool:
    """pi_old comes from a forward of the trainer (asked for, or an importance correction's)."""
    return cfg.old_logps == "trainer" or cfg.importance_correction != "none"


@torch.no_grad()
def _token_logps(
    runner: PlanRunner,
    model: nn.Module | Pipeline | None,
    scope: Callable[[], contextlib.AbstractContextManager],
    temperature: float,
    batches: list[Batch],
) -> list[torch.Tensor]:
    """Each packed micro-batch's log-probabilities per label at ``temperature``, forward only
    under the job's plan: of ``model`` (a frozen copy's parts or pipeline), or (None) of the
    policy, inside ``scope`` (its adapters bypassed for a reference)."""
    record = _TokenRecord(temperature, runner.job.training.loss_chunk_tokens)
    device_batches = [
        Batch(b.inputs.to(runner.device), b.labels.to(runner.device), b.documents.to(runner.device))
        for b in batches
    ]
    with scope():
        calls = runner.run(device_batches, record, ForwardInputs(), backward=False, model=model)
    cp = runner.context.context_parallel
    logps = record.logps
    if runner.pipeline is not None:  # the last stage holds every pipeline micro-batch's, in order
        rows = [b.inputs.shape[0] for b in device_batches]
        width = device_batches[0].inputs.shape[1] // (1 if cp is None else cp.mesh.size())
        values = (
            torch.cat(logps[len(logps) - calls :])
            if calls
            else torch.zeros(sum(rows), width, device=runner.device)
        )
        logps = list(sum_over(values, runner, "pp").split(rows))
    if cp is not None:  # each CP rank holds its shard of every row
        logps = [_whole_rows(part, cp) for part in logps]
    return logps


def _whole_rows(local: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """(B, S) from every CP rank's (B, S / cp) shard of it."""
    parts = [torch.empty_like(local) for _ in range(cp.mesh.size())]
    dist.all_gather(parts, local.contiguous(), group=cp.mesh.get_group())
    return unshard_sequence(parts, cp.head_tail)


def rollout_validator(job: JobConfig, source: PromptSource, step: TrainStep, training: Rollouts) -> Validator:
    """``Validator`` over held-out prompts: each pass samples them under the job's plan as the
    rollouts do (from seeds of its own, the same every pass), scores them with the job's
    rewards and runs the policy loss forward on them; its metrics are the training step's,
    ``val_`` before each name (``val_reward``, ``val_completions/mean_length``...)."""
    vjob = validation_job(job)
    rollouts = Rollouts(
        vjob,
        training.runner,
        source.records,
        training.rewards,
        training.text,
        training.stop_ids,
        training.pad_id,
        training.reference,
        None,
        training.recompute,
        held_out=True,
    )
    steps = len(source.records) // rollouts.groups if job.validation.steps == -1 else job.validation.steps
    objective = PolicyGradient(
        training.runner, PolicyLoss.of(vjob.rl, vjob.training.loss_chunk_tokens), rollouts
    )
    return Validator(step, rollouts.restart, steps, objective)
