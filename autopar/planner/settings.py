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


def _by_section() -> dict[str, tuple[tuple[str, str], ...]]:
    """Each job section a plan sets, and its (setting, field) pairs."""
    sections: dict[str, list[tuple[str, str]]] = {}
    for name, path in CONFIG_FIELDS.items():
        section, field = path.split(".")
        sections.setdefault(section, []).append((name, field))
    return {section: tuple(pairs) for section, pairs in sections.items()}


_BY_SECTION = _by_section()


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
        """A shallow copy of ``job`` that runs this plan, the sections it sets copied (as
        ``dataclasses.replace`` would, without rebuilding every field: the search applies
        a hundred thousand plans, and no section checks its fields on construction)."""
        values = self.__dict__
        sections = dict(job.__dict__)
        for section, fields in _BY_SECTION.items():
            fields_of = dict(sections[section].__dict__)
            for name, field in fields:
                value = values[name]
                if value is not None or name == "layers_per_stage":  # None there is a choice too
                    fields_of[field] = value
            sections[section] = _with_dict(sections[section], fields_of)
        return _with_dict(job, sections)

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


def _with_dict(obj: T, fields: dict[str, object]) -> T:
    """An object of ``obj``'s plain dataclass type holding ``fields`` (``copy.copy`` with
    changes, without its pickling protocol's cost)."""
    new = object.__new__(type(obj))
    new.__dict__ = fields
    return new


def _field(job: JobConfig, path: str) -> object:
    section, name = path.split(".")
    return getattr(getattr(job, section), name)


def setting_names(paths: set[str]) -> set[str]:
    """The settings that these ``section.field`` paths name (others ignored)."""
    return {name for name, path in CONFIG_FIELDS.items() if path in paths}
