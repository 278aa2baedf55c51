"""Reward functions (``[rl] reward_funcs``), their scores, and GRPO's advantages, as TRL 1.16's
``GRPOTrainer`` computes them.

A function is named ``"package.module:function"`` or ``"path/to/file.py:function"`` and
called with TRL's signature, ``f(prompts=..., completions=..., completion_ids=..., **columns)``;
it returns one number (or None: does not apply) per completion. Rewards are weighted and summed
(None left out); a completion no function scored has no reward and advantage 0. Advantages are
``(reward - group mean) / (std + 1e-4)``, the std the group's (``scale_rewards = "group"``),
the batch's, or none at all, NaN-aware and with torch's unbiased std, as TRL's.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.config.errors import ConfigError
from autopar.data.errors import DataError

RewardFunction = Callable[..., Sequence[float | None]]


@dataclass(frozen=True)
class Reward:
    name: str
    """The function's own name (TRL's reward_func_names): its metrics' ``rewards/<name>/``."""
    fn: RewardFunction
    spec: str


def load_rewards(specs: Sequence[str]) -> list[Reward]:
    """The job's reward functions, each imported now: one ConfigError naming the spec for one
    that does not import, is missing or is not callable."""
    if not specs:
        raise ConfigError(
            'rl.reward_funcs is empty; name at least one reward function, e.g. ["autopar.rewards:answer_match"]'
        )
    return [_load(spec) for spec in specs]


def _load(spec: str) -> Reward:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(
            f"rl.reward_funcs item {spec!r} is not 'package.module:function' or 'path/to/file.py:function'"
        )
    try:
        module = _module_of(where)
    except Exception as err:  # the user's module: whatever it raises on import
        raise ConfigError(
            f"rl.reward_funcs item {spec!r}: {where} does not import ({type(err).__name__}: {err})"
        ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"rl.reward_funcs item {spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"rl.reward_funcs item {spec!r}: {name} is not callable")
    return Reward(getattr(fn, "__name__", name), fn, spec)


def _module_of(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        spec = importlib.util.spec_from_file_location(f"autopar_reward_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(where)


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, list[Any]],
    step: int,
) -> torch.Tensor:
    """(N, F) fp32 every function's rewards, NaN where one returned None; one DataError naming
    the function and the step for one that raises, or returns the wrong number of values, a
    non-number or an infinite or NaN one."""
    out = torch.full((len(completions), len(rewards)), math.nan)
    for i, reward in enumerate(rewards):
        where = f"step {step}: reward function {reward.name} ({reward.spec})"
        try:
            values = list(
                reward.fn(
                    prompts=list(prompts),
                    completions=list(completions),
                    completion_ids=completion_ids,
                    **columns,
                )
            )
        except Exception as err:  # the user's code: whatever it raises
            raise DataError(f"{where} raised {type(err).__name__}: {err}") from err
        if len(values) != len(completions):
            raise DataError(
                f"{where} returned {len(values)} rewards for {len(completions)} completions; return one each"
            )
        for row, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(
                    f"{where} returned {value!r} for completion {row}; return a finite number, or None where it "
                    "does not apply"
                )
            out[row, i] = float(value)
    return out


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """torch's unbiased std ignoring NaN (TRL's ``nanstd``): NaN where fewer than two values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


@dataclass(frozen=True)
class Advantages:
    rewards: torch.Tensor
    """(N,) the weighted sum of each completion's rewards (NaN where none applied)."""
    advantages: torch.Tensor
    """(N,) what its tokens are pushed by."""
    std_zero: torch.Tensor
    """(N,) whether the std it was scaled by is 0 (``frac_reward_zero_std``)."""


def advantages(per_function: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> Advantages:
    """GRPO's advantages of a whole step's completions (N = prompts x ``group``, in groups)."""
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights[None]).nansum(dim=1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    std_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(rewards, torch.nan_to_num(advantage, nan=0.0), std_zero)
