"""A plan's settings, typed: what the planner chooses for a job, and the config field each one is.

The search enumerates ``PlanSettings``; ``apply`` makes the job that runs one, ``config`` the
``section.field`` values that its JSON and command-line overrides show.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import TypeVar

from autopar.config.sections import JobConfig
from autopar.parallel.activation_checkpoint import PER_OP_OPTIONS

CONFIG_FIELDS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "microbatch": "parallelism.pipeline_parallel_microbatch_size",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "reshard": "parallelism.fsdp_reshard_after_forward",
    "ac_mode": "activation_checkpoint.mode",
    "ac_option": "activation_checkpoint.selective_ac_option",
    "local_batch": "training.local_batch_size",
}
"""Each setting's job field, as ``section.field`` (the spelling of the command-line flags)."""

PLAN_FIELDS = tuple(CONFIG_FIELDS.values())
"""The job fields a plan consists of."""

T = TypeVar("T")

_SPLIT = {name: tuple(path.split(".")) for name, path in CONFIG_FIELDS.items()}


@dataclass(frozen=True)
class PlanSettings:
    """One plan's choices. ``ep`` is None where there is no expert degree to choose (a dense
    model): the job's value then stands, and the setting stays out of the plan's flags."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int | None
    schedule: str
    microbatch: int
    layers_per_stage: int | None
    """Layers in each pipeline stage; None: the schedule's own count of stages per rank."""
    reshard: str
    ac_mode: str
    ac_option: str
    local_batch: int

    @classmethod
    def of(cls, job: JobConfig) -> PlanSettings:
        """The job's own plan."""
        return cls(**{name: _field(job, path) for name, path in CONFIG_FIELDS.items()})

    def apply(self, job: JobConfig) -> JobConfig:
        """A shallow copy of ``job`` that runs this plan, the sections it changes copied (as
        ``dataclasses.replace`` would, without rebuilding every field: the search applies
        thousands of plans, and no section checks its fields on construction)."""
        planned = _shallow(job)
        copies: dict[str, object] = {}
        for name, (section, field) in _SPLIT.items():
            value = getattr(self, name)
            if value is None and name != "layers_per_stage":  # None there is a choice too
                continue
            if section not in copies:
                copies[section] = _shallow(getattr(job, section))
                setattr(planned, section, copies[section])
            setattr(copies[section], field, value)
        return planned

    def config(self, leave_out: Container[str] = ()) -> dict[str, str]:
        """``section.field`` to value, as the command line spells them, but for the settings
        named in ``leave_out``."""
        values = (
            (path, getattr(self, name)) for name, path in CONFIG_FIELDS.items() if name not in leave_out
        )
        return {path: str(value) for path, value in values if value is not None}

    @property
    def ac(self) -> str:
        """The checkpointing mode in one word: none, full, op or every-k."""
        if self.ac_mode != "selective":
            return self.ac_mode
        return self.ac_option if self.ac_option in PER_OP_OPTIONS else f"every-{self.ac_option}"


def _shallow(obj: T) -> T:
    """``copy.copy`` of a plain dataclass, without its pickling protocol's cost."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def _field(job: JobConfig, path: str) -> object:
    section, name = path.split(".")
    return getattr(getattr(job, section), name)


def setting_names(paths: set[str]) -> set[str]:
    """The settings that these ``section.field`` paths name (others ignored)."""
    return {name for name, path in CONFIG_FIELDS.items() if path in paths}
