"""The RL step's data: completions sampled on the job's own weights under its plan, scored,
given advantages, kept, and packed into the micro-batches the policy loss trains on.

``Rollouts`` stands where a loader stands: ``next_step()`` returns this rank's micro-batches.
Every ``num_iterations`` steps it samples anew: ``global_batch_size / num_generations``
prompts a step, split over the data-parallel ranks (and each rank's completions over its
context-parallel ranks; an expert-parallel group samples its ranks' together),
``num_generations`` completions each, from the model parts being
trained (``PlanRunner``), with the sampler's log-probabilities as pi_old.
The ranks' rewards are gathered so advantages are the whole batch's (TRL's), each rank keeps
its own completions, and the main rank writes the step's to ``rollouts/step-N.jsonl``. With
``rl.replay`` it samples nothing: step N trains on the file's records of step N.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.config.sections import RL, JobConfig
from autopar.data.errors import DataError
from autopar.data.loader import IGNORE_INDEX, Batch
from autopar.data.prompt_records import PromptRecord
from autopar.models.generation.generate import Generated, sample
from autopar.models.generation.sampling import Sampling
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.torch_internals import fsdp_weights_gathered
from autopar.training.objectives.rl.rollouts import (
    Completion,
    Packed,
    pack_micro_batch,
    read_replay,
    rollout_file,
    write_rollouts,
)
from autopar.training.objectives.rl.scoring import Advantages, Reward, advantages, nanstd, score
from autopar.training.plan_runner import PlanRunner

logger = logging.getLogger("autopar")

ReferenceTokens = Callable[[list[Batch]], list[torch.Tensor]]
"""Packed micro-batches -> each one's (R, S) reference log-probability of every label."""


class Rollouts:
    """This rank's RL micro-batches, step after step (a loader)."""

    def __init__(
        self,
        job: JobConfig,
        runner: PlanRunner,
        prompts: Sequence[PromptRecord],
        rewards: Sequence[Reward],
        text: Callable[[list[int]], str],
        stop_ids: set[int],
        pad_id: int,
        reference: ReferenceTokens | None = None,
        replay: dict[int, list[Completion]] | None = None,
        recompute: ReferenceTokens | None = None,
        held_out: bool = False,
    ) -> None:
        self.job, self.runner, self.prompts, self.rewards = job, runner, prompts, rewards
        self.text, self.stop_ids, self.pad_id, self.reference, self.replay = (
            text,
            stop_ids,
            pad_id,
            reference,
            replay,
        )
        cfg, training = job.rl, job.training
        dims = runner.dims
        self.global_batch = training.global_batch(dims.dp)
        self.local_batch = training.local_batch_size
        dp_mesh = runner.meshes.get("dp")
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.dp_size = dims.dp
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None and dims.dp > 1 else None
        cp_mesh = runner.meshes.get("cp")
        self.cp_mesh = cp_mesh if cp_mesh is not None and cp_mesh.size() > 1 else None
        """Ranks that split each sampling's rows between them (context parallelism's)."""
        ep_mesh = runner.meshes.get("ep")
        self.ep_mesh = ep_mesh if ep_mesh is not None and ep_mesh.size() > 1 else None
        """Ranks whose forwards exchange tokens (expert parallelism's): they sample their rows
        together, every one of them all the rows, and go on with the first one's tokens."""
        self.sequence_split = sequence_split(job, dims)
        self.recompute = recompute
        """The trainer's own log-probabilities of packed micro-batches, where pi_old is recomputed
        (``rl.old_logps = "trainer"``, or an importance correction)."""
        self.device = runner.device
        self.vocab_size = runner.args.vocab_size
        self.groups = self.global_batch // cfg.num_generations
        """Prompts a rollout samples for, over every rank."""
        self.weights = torch.tensor(job.rl.reward_weights or [1.0] * len(rewards))
        self.reward_names = [r.name for r in rewards]
        """The reward functions' names: the job's, or a replay's records'."""
        if replay:
            self.reward_names = list(next(iter(replay.values()))[0].rewards)
        self.held_out = held_out
        """``[validation]``'s: sampled from seeds of their own, nothing written to ``rollouts/``."""
        self.consumed_samples = 0
        self.step = 0
        self.current: list[Batch] = []
        self.stats: dict[str, float] = {}
        """The last rollout's metrics (TRL's names, and the step's split in seconds)."""

    # ---- the loader's interface -------------------------------------------------------------

    def next_step(self) -> list[Batch]:
        """The next step's micro-batches: sampled (or replayed) every ``num_iterations`` steps."""
        if self.step % self.job.rl.num_iterations == 0:
            self.current = self._rollout(self.step // self.job.rl.num_iterations + 1)
        self.step += 1
        self.consumed_samples += self.global_batch
        return self.current

    def restart(self) -> Rollouts:
        """From the first rollout again: each validation pass samples the same prompts from
        the same seeds, so passes at different steps compare the policies alone."""
        self.step = self.consumed_samples = 0
        return self

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.step = self.consumed_samples // self.global_batch
        iterations = self.job.rl.num_iterations
        if self.step % iterations:  # resumed inside a rollout's passes: its kept completions again
            self.current = self._packed(self._kept(self.step // iterations + 1))

    # ---- one rollout --------------------------------------------------------------------------

    def _rollout(self, index: int) -> list[Batch]:
        """Rollout ``index`` (from 1): this rank's packed micro-batches."""
        started = time.perf_counter()
        if self.replay is not None:
            completions = self._replayed(index)
            sampled = time.perf_counter()
        else:
            completions = self._sampled(index)
            sampled = time.perf_counter()
            completions = self._scored(completions, index)
        batches = self._packed(completions)
        self.stats |= self._length_stats(completions) | {
            "time/rollout": sampled - started,
            "time/scoring": time.perf_counter() - sampled,
        }
        return batches

    def _length_stats(self, completions: list[Completion]) -> dict[str, float]:
        """TRL's ``completions/*`` over every rank's completions of the step."""
        local = torch.tensor(
            [[len(c.completion_ids), float(c.truncated)] for c in completions], dtype=torch.float64
        )
        lengths, truncated = _gathered(local, self.dp_group).unbind(1)
        return {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
        }

    def _my_groups(self, index: int) -> list[int]:
        """The prompts (their indices in the data) this rank samples in rollout ``index``: the
        data in order, epoch after epoch, each rank a contiguous share of the step's."""
        per_rank = self.groups // self.dp_size
        first = (index - 1) * self.groups + self.dp_rank * per_rank
        return [(first + g) % len(self.prompts) for g in range(per_rank)]

    def _sampled(self, index: int) -> list[Completion]:
        cfg = self.job.rl
        groups = self._my_groups(index)
        prompt_ids = [self.prompts[g].prompt_ids for g in groups for _ in range(cfg.num_generations)]
        # CP ranks hold the same weights: each samples its share of the rows, then they swap
        cp_rank, cp_size = (self.cp_mesh.get_local_rank(), self.cp_mesh.size()) if self.cp_mesh else (0, 1)
        share = slice(cp_rank * len(prompt_ids) // cp_size, (cp_rank + 1) * len(prompt_ids) // cp_size)
        key = (self.job.debug.seed, index, self.dp_rank) + ((cp_rank,) if cp_size > 1 else ())
        key += (-1,) if self.held_out else ()  # numbers only: a str's hash changes between processes
        rows, seed, agree = prompt_ids[share], hash(key) % 2**63, None
        if self.ep_mesh is not None:  # the expert group samples its ranks' rows together
            everyone: list[tuple[list[list[int]], int]] = [None] * self.ep_mesh.size()  # type: ignore[list-item]
            dist.all_gather_object(everyone, (rows, seed), group=self.ep_mesh.get_group())
            mine = self.ep_mesh.get_local_rank()
            first = sum(len(r) for r, _ in everyone[:mine])
            rows, seed, agree = [r for part, _ in everyone for r in part], everyone[0][1], self._agree
        sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, seed)
        model = self.runner.parts[0]
        modules = [m for part in self.runner.parts for m in part.modules()]
        # eager: a compiled job's blocks would recompile for every prefill length and the
        # decode step, past dynamo's limit (Qwen3.5's two kinds of block first)
        with torch.no_grad(), fsdp_weights_gathered(modules), torch.compiler.set_stance("force_eager"):
            made = sample(
                model,
                rows,
                cfg.max_completion_length,
                sampling,
                self.stop_ids,
                whole=_whole,
                agree=agree,
                multiple=self.sequence_split,
            )
        if self.ep_mesh is not None:
            own = slice(first, first + share.stop - share.start)
            made = made._replace(tokens=made.tokens[own], logps=made.logps[own])
        if self.cp_mesh is not None:
            made = self._swapped(made)
        first_group = (index - 1) * self.groups + self.dp_rank * (self.groups // self.dp_size)
        out = []
        for k, (ids, tokens, logps) in enumerate(zip(prompt_ids, made.tokens, made.logps, strict=True)):
            record = self.prompts[groups[k // cfg.num_generations]]
            truncated = tokens[-1] not in self.stop_ids
            text = self.text(tokens)
            completion = [{"role": "assistant", "content": text}] if record.conversational else text
            out.append(
                Completion(
                    index,
                    first_group + k // cfg.num_generations,
                    record.prompt,
                    list(ids),
                    tokens,
                    completion,
                    {},
                    None,
                    0.0,
                    logps,
                    truncated,
                )
            )
        return out

    def _swapped(self, made: Generated) -> Generated:
        """Every CP rank's share of the completions, in rank order (each sampled its own)."""
        assert self.cp_mesh is not None
        shares: list[tuple[list[list[int]], list[list[float]]]] = [None] * self.cp_mesh.size()  # type: ignore[list-item]
        dist.all_gather_object(shares, (made.tokens, made.logps), group=self.cp_mesh.get_group())
        return made._replace(
            tokens=[t for s in shares for t in s[0]], logps=[p for s in shares for p in s[1]]
        )

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The expert group's first rank's ``tokens``: the group's logits may differ in the last
        bits (each rank's experts see the tokens in another order), so its draws could."""
        assert self.ep_mesh is not None
        group = self.ep_mesh.get_group()
        tokens = tokens.contiguous()
        dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
        return tokens

    def _scored(self, completions: list[Completion], index: int) -> list[Completion]:
        """Every completion's rewards and advantage; the step's reward metrics."""
        records = [self.prompts[c.group % len(self.prompts)] for c in completions]
        names = sorted({k for r in records for k in r.columns})
        columns = {name: [r.columns.get(name) for r in records] for name in names}
        per_function = score(
            self.rewards,
            [c.prompt for c in completions],
            [c.completion for c in completions],
            [c.completion_ids for c in completions],
            columns,
            index,
        )
        everyone = _gathered(per_function, self.dp_group)  # (N, F), rank order = group order
        found = advantages(everyone, self.weights, self.job.rl.num_generations, self.job.rl.scale_rewards)
        mine = slice(self.dp_rank * len(completions), (self.dp_rank + 1) * len(completions))
        self._reward_stats(everyone, found, [r.name for r in self.rewards])
        scored = []
        for k, completion in enumerate(completions):
            row = everyone[mine][k]
            by_name = {r.name: (None if torch.isnan(v) else float(v)) for r, v in zip(self.rewards, row)}
            reward = found.rewards[mine][k]
            scored.append(
                replace(
                    completion,
                    rewards=by_name,
                    reward=None if torch.isnan(reward) else float(reward),
                    advantage=float(found.advantages[mine][k]),
                )
            )
        self._keep(scored)
        return scored

    def _reward_stats(self, everyone: torch.Tensor, found: Advantages, names: list[str]) -> None:
        stats = {}
        for i, name in enumerate(names):
            stats[f"rewards/{name}/mean"] = torch.nanmean(everyone[:, i]).item()
            stats[f"rewards/{name}/std"] = nanstd(everyone[:, i]).item()
        stats["reward"] = torch.nanmean(found.rewards).item()
        stats["reward_std"] = nanstd(found.rewards).item()
        stats["frac_reward_zero_std"] = found.std_zero.float().mean().item()
        self.stats = stats

    def _correction_stats(self, fixed: list[Corrected]) -> dict[str, float]:
        """TRL's names for the sampler-trainer gap over the step's learned tokens, and for the
        correction's ratios (per completion at the sequence level, else per token)."""
        gaps = torch.cat([f.gaps for f in fixed]).double()
        ratios = torch.cat([f.ratios for f in fixed]).double()
        inf = torch.tensor(math.inf, dtype=torch.float64)
        local = torch.stack(
            [
                gaps.sum(),
                torch.tensor(float(gaps.numel())),
                gaps.max() if gaps.numel() else torch.tensor(0.0),
                ratios.sum(),
                torch.tensor(float(ratios.numel())),
                ratios.max() if ratios.numel() else -inf,
                ratios.min() if ratios.numel() else inf,
            ]
        ).to(torch.float64)
        parts = _gathered(local[None], self.dp_group)
        stats = {
            "sampling/sampling_logp_difference/mean": (
                parts[:, 0].sum() / parts[:, 1].sum().clamp(min=1)
            ).item(),
            "sampling/sampling_logp_difference/max": parts[:, 2].max().item(),
        }
        if self.job.rl.importance_correction != "none":
            stats |= {
                "sampling/importance_sampling_ratio/min": parts[:, 6].min().item(),
                "sampling/importance_sampling_ratio/mean": (
                    parts[:, 3].sum() / parts[:, 4].sum().clamp(min=1)
                ).item(),
                "sampling/importance_sampling_ratio/max": parts[:, 5].max().item(),
            }
        return stats

    def _keep(self, completions: list[Completion]) -> None:
        """The step's completions, every rank's, to ``rollouts/step-N.jsonl`` (main rank)."""
        if self.held_out:
            return
        everyone = [completions]
        if self.dp_group is not None:
            everyone = [None] * self.dp_size  # type: ignore[list-item]
            dist.all_gather_object(everyone, completions, group=self.dp_group)
        if not dist.is_initialized() or dist.get_rank() == 0:
            flat = [c for part in everyone for c in part]
            write_rollouts(rollout_file(self.job.job.dump_folder, flat[0].step), flat)

    def _kept(self, index: int) -> list[Completion]:
        """This rank's share of rollout ``index`` as the run kept it (``rollouts/step-N.jsonl``):
        sampling it again would use weights already updated by its first passes."""
        path = rollout_file(self.job.job.dump_folder, index)
        if not path.is_file():
            raise DataError(
                f"resuming inside rollout {index}'s rl.num_iterations passes, but {path} is missing; restore it, "
                "or resume from a checkpoint at a multiple of rl.num_iterations"
            )
        kept = read_replay(path, self.vocab_size)[index]
        per_rank = len(kept) // self.dp_size
        return kept[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def _replayed(self, index: int) -> list[Completion]:
        """Step ``index``'s records (this rank's share), their advantages computed anew from
        their rewards as the job configures them (weights, scale)."""
        assert self.replay is not None
        step = self.replay.get(index)
        if step is None:
            raise DataError(
                f"rl.replay holds no records of step {index} (it has steps {sorted(self.replay)[:8]}...); replay "
                "a run's rollouts for every step trained, or lower training.steps"
            )
        if len(step) != self.global_batch:
            raise DataError(
                f"rl.replay: step {index} has {len(step)} completions, and a step of this job trains "
                f"{self.global_batch} (training.global_batch_size); replay with the batch it was sampled with"
            )
        names = list(step[0].rewards)
        per_function = torch.tensor(
            [[float("nan") if c.rewards.get(n) is None else c.rewards[n] for n in names] for c in step]
        )
        weights = torch.tensor(self.job.rl.reward_weights or [1.0] * len(names))
        found = advantages(per_function, weights, self.job.rl.num_generations, self.job.rl.scale_rewards)
        self._reward_stats(per_function, found, names)
        scored = [
            replace(c, reward=None if torch.isnan(r) else float(r), advantage=float(a))
            for c, r, a in zip(step, found.rewards, found.advantages, strict=True)
        ]
        per_rank = len(scored) // self.dp_size
        return scored[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    # ---- packing ------------------------------------------------------------------------------

    def _packed(self, completions: list[Completion]) -> list[Batch]:
        """This rank's completions as micro-batches of ``local_batch_size`` (in order), each
        token weighted by the loss type's normalisation over the whole step."""
        cfg = self.job.rl
        learned = [not (cfg.mask_truncated_completions and c.truncated) for c in completions]
        tokens = torch.tensor(
            [len(c.completion_ids) if kept else 0 for c, kept in zip(completions, learned)],
            dtype=torch.float64,
        )
        total = _gathered(tokens.sum()[None], self.dp_group).sum().item()  # the generation batch's tokens
        cuts = self.runner.calls_per_batch if self.runner.pipeline is not None else None
        batches = []
        for start in range(0, len(completions), self.local_batch):
            part = range(start, start + self.local_batch)
            micro_tokens = sum(tokens[i].item() for i in part)
            items = [
                Packed(
                    completions[i],
                    [
                        _token_weight(
                            cfg.loss_type, len(completions[i].completion_ids), micro_tokens, total, self
                        )
                    ]
                    * len(completions[i].completion_ids),
                    completions[i].logps or [0.0] * len(completions[i].completion_ids),
                    [0.0] * len(completions[i].completion_ids),
                    learned[i],
                )
                for i in part
            ]
            batches.append(pack_micro_batch(items, self.job.training.seq_len, self.pad_id, cuts))
        if self.recompute is not None:
            fixed = [corrected(b, t, cfg) for b, t in zip(batches, self.recompute(batches), strict=True)]
            batches = [f.batch for f in fixed]
            self.stats |= self._correction_stats(fixed)
        if self.reference is not None:
            batches = [_with_reference(b, r) for b, r in zip(batches, self.reference(batches), strict=True)]
        return [
            Batch(b.inputs.to(self.device), b.labels.to(self.device), b.documents.to(self.device))
            for b in batches
        ]


def sequence_split(job: JobConfig, dims: ParallelDims) -> int:
    """Sequence parallelism splits each forward's tokens evenly over the TP ranks: sampling
    pads its forwards to a multiple of this many tokens."""
    return dims.tp if dims.tp > 1 and job.parallelism.enable_sequence_parallel else 1


class Corrected(NamedTuple):
    """A micro-batch with the trainer's pi_old (and a correction's factors), and what was
    measured on the way: |trainer - sampler| per learned token, the correction's ratios."""

    batch: Batch
    gaps: torch.Tensor
    ratios: torch.Tensor


def corrected(batch: Batch, trainer: torch.Tensor, cfg: RL) -> Corrected:
    """``batch`` with pi_old the trainer's log-probabilities (R, S) instead of the sampler's,
    and TRL's importance-sampling factor exp(trainer - sampler) per token, or per completion
    from its tokens' summed difference, truncated to the caps or zero outside them."""
    labels = batch.labels.clone()
    trainer = trainer.to(labels.device)
    mask = labels[..., 0] != IGNORE_INDEX
    sampler = labels[..., 4]
    diff = torch.where(mask, trainer - sampler, 0.0)
    if cfg.importance_correction.startswith("sequence"):  # one ratio per completion
        ids = labels[..., 1].long()
        held = ids >= 0
        index = ids.clamp(min=0)
        count = int(ids.max().item()) + 1 if bool(held.any()) else 0
        sums = diff.new_zeros(count).index_add(0, index.flatten(), diff.flatten())
        present = diff.new_zeros(count).index_add(0, index.flatten(), held.flatten().float()) > 0
        per_completion = _capped(torch.exp(sums), cfg)
        factor = torch.where(held, per_completion[index], 1.0)
        ratios = per_completion[present]
    else:
        factor = _capped(torch.exp(diff), cfg)
        ratios = factor[mask]
    gaps = (trainer - sampler).abs()[mask]
    labels[..., 4] = torch.where(mask, trainer, sampler)
    if cfg.importance_correction != "none":
        labels[..., 6] = torch.where(mask, factor, 1.0)
    return Corrected(replace(batch, labels=labels), gaps, ratios)


def _capped(ratio: torch.Tensor, cfg: RL) -> torch.Tensor:
    """TRL's caps on importance ratios: truncated to them, or zero outside them (no mode: as is)."""
    low = cfg.importance_cap_min if cfg.importance_cap_min is not None else -math.inf
    high = cfg.importance_cap_max if cfg.importance_cap_max is not None else math.inf
    if cfg.importance_correction.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    if cfg.importance_correction.endswith("mask"):
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio


def _token_weight(
    loss_type: str, length: int, micro_tokens: float, total_tokens: float, rollouts: Rollouts
) -> float:
    """A completion token's weight in the step loss (``loss`` module docstring)."""
    completions = rollouts.global_batch
    if loss_type in ("dapo", "cispo"):
        return 1.0 / max(total_tokens, 1.0)
    if loss_type == "grpo":
        return 1.0 / (max(length, 1) * completions)
    if loss_type == "bnpo":
        return 1.0 / (max(micro_tokens, 1.0) * (completions // rollouts.local_batch))
    return 1.0 / (completions * rollouts.job.rl.max_completion_length)  # dr_grpo


def _with_reference(batch: Batch, reference: torch.Tensor) -> Batch:
    labels = batch.labels.clone()
    labels[..., 5] = reference.to(labels.device)
    return replace(batch, labels=labels)


def _gathered(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` (n, ...) of every rank of ``group``, concatenated in rank order."""
    if group is None:
        return value
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts)


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """Logits whole over the vocabulary (a vocab-parallel DTensor gathered)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits
