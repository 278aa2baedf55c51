"""Split a built model into pipeline stages by pruning.

A stage is the same ``Qwen`` class with the parts it does not run removed (embedding and
head set to None, other layers deleted), so its parameters keep their single-device names
and checkpoints move freely between pipeline degrees. Which modules a stage holds is data:
a list of module names per stage, computed evenly or given by the user.
"""

from __future__ import annotations

import copy
import functools
from typing import Literal

from torch import nn

from autopar.config.errors import ConfigError

HEAD = ("norm", "lm_head")
EMBEDDING = "embed_tokens"
BESIDE_HEAD = ("mtp",)
"""Modules a model may have that read the output head's input and weight (Qwen3.5's
multi-token-prediction head): they go where ``lm_head`` goes, so a split never names them."""
StageStyle = Literal["loop", "v"]


def even_split(
    num_layers: int, num_stages: int, first_stage_less: int, last_stage_less: int
) -> list[list[str]]:
    """Module names per stage, balancing layers with the embedding counted as
    ``first_stage_less`` layers and the head as ``last_stage_less`` layers."""
    stages = _even_split(num_layers, num_stages, first_stage_less, last_stage_less)
    return [list(names) for names in stages]


def even_split_count(num_layers: int, num_stages: int, first_stage_less: int, last_stage_less: int) -> int:
    """``len(even_split(...))``, checked alike, without copying the split (the planner checks
    a hundred thousand candidate plans)."""
    return len(_even_split(num_layers, num_stages, first_stage_less, last_stage_less))


@functools.lru_cache(maxsize=1024)
def _even_split(
    num_layers: int, num_stages: int, first_stage_less: int, last_stage_less: int
) -> tuple[tuple[str, ...], ...]:
    """``even_split``, cached for the planner, which asks for the same splits many times."""
    units = num_layers + first_stage_less + last_stage_less
    base, extra = divmod(units, num_stages)
    sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    sizes[0] -= first_stage_less
    sizes[-1] -= last_stage_less
    if num_stages == 1:
        return ((EMBEDDING, *(f"layers.{i}" for i in range(num_layers)), *HEAD),)
    if min(sizes) < 0 or sum(sizes) != num_layers:
        raise ConfigError(
            f"cannot split {num_layers} layers into {num_stages} stages with "
            f"pipeline_parallel_first_stage_less_layers={first_stage_less} and "
            f"last_stage_less_layers={last_stage_less}; lower them or use fewer stages"
        )
    stages: list[tuple[str, ...]] = []
    start = 0
    for i, size in enumerate(sizes):
        names = [f"layers.{j}" for j in range(start, start + size)]
        start += size
        if i == 0:
            names.insert(0, EMBEDDING)
        if i == num_stages - 1:
            names.extend(HEAD)
        stages.append(tuple(names))
    return tuple(stages)


def check_split(stages: list[list[str]], num_layers: int) -> None:
    """Every layer exactly once and in order, the embedding first, the head last."""
    where: dict[str, int] = {}
    for s, names in enumerate(stages):
        for name in names:
            if name in where:
                raise ConfigError(
                    f"parallelism.module_fqns_per_model_part: {name!r} is in stage {where[name]} "
                    f"and stage {s}; each module belongs to exactly one stage"
                )
            where[name] = s
    expected = {EMBEDDING, *HEAD} | {f"layers.{i}" for i in range(num_layers)}
    unknown = sorted(set(where) - expected)
    if unknown:
        raise ConfigError(
            f"parallelism.module_fqns_per_model_part: {unknown[0]!r} is not a module of this "
            f"model; use embed_tokens, layers.0 ... layers.{num_layers - 1}, norm, lm_head"
        )
    missing = sorted(expected - set(where), key=lambda n: (len(n), n))
    if missing:
        raise ConfigError(f"parallelism.module_fqns_per_model_part: {missing[0]!r} is in no stage")
    if where[EMBEDDING] != 0 or any(where[h] != len(stages) - 1 for h in HEAD):
        raise ConfigError(
            "parallelism.module_fqns_per_model_part: embed_tokens must be in the first stage "
            "and norm, lm_head in the last"
        )
    order = [where[f"layers.{i}"] for i in range(num_layers)]
    if order != sorted(order):
        raise ConfigError("parallelism.module_fqns_per_model_part: layers must run in order across stages")


def stage_ids(pp_rank: int, pp_size: int, num_stages: int, style: StageStyle) -> list[int]:
    """Stages a rank runs: every pp_size-th one (loop) or one down and one back up (V)."""
    if style == "v":
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp_size))


def prune(model: nn.Module, keep: list[str]) -> nn.Module:
    """A copy of the (meta-device) ``model`` holding only the modules in ``keep`` (and, with
    ``lm_head``, those ``BESIDE_HEAD``)."""
    stage = copy.deepcopy(model)
    kept = set(keep)
    for name in [EMBEDDING, *HEAD]:
        if name not in kept:
            setattr(stage, name, None)
    for name in BESIDE_HEAD:
        if getattr(stage, name, None) is not None and "lm_head" not in kept:
            setattr(stage, name, None)
    for i in list(stage.layers.keys()):
        if f"layers.{i}" not in kept:
            del stage.layers[i]
    return stage
