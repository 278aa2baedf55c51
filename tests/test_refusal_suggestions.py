"""A refusal that offers values offers only values that are accepted: over a grid of tiny
model shapes and parallel degrees, every value a degree or sequence-length refusal suggests,
plugged back in, passes every rule of its kind (a TP degree offered for the query heads
must also split the k/v heads, the widths and the vocabulary)."""

from __future__ import annotations

import dataclasses
import itertools
import re

from autopar.config import ConfigError
from autopar.config.sections import Parallelism
from autopar.models.args import ModelArgs
from autopar.models.flavors import get_flavor
from autopar.parallel.context_parallel import check_cp
from autopar.parallel.mesh import ParallelDims, check_model_split
from autopar.parallel.pipelining.schedule import check_pipeline

SHAPES = {
    "qwen3 8 heads / 4 kv": get_flavor("qwen3", "debug"),
    "qwen3 12 heads / 3 kv, odd widths": get_flavor(
        "qwen3", "debug", num_attention_heads=12, num_key_value_heads=3, intermediate_size=120, vocab_size=510
    ),
    "qwen3 6 heads / 6 kv": get_flavor("qwen3", "debug", num_attention_heads=6, num_key_value_heads=6),
    "qwen3 moe, 6 experts": get_flavor("qwen3", "debug-moe", num_experts=6),
    "qwen3 moe, 8 experts": get_flavor("qwen3", "debug-moe"),
    "qwen3.5 hybrid": get_flavor("qwen3.5", "debug"),
    "qwen3.5 hybrid, 6 value heads": get_flavor(
        "qwen3.5", "debug", linear_num_key_heads=2, linear_num_value_heads=6
    ),
}

SUGGESTS = re.compile(r"use one of|e\.g\.|at least|at most|set it to|multiple of")
"""Words with which a refusal offers values; each such refusal must be one the test reads."""

OFFERS = [
    re.compile(r"^parallelism\.(\w+)=\d+ .*; use one of ([\d, ]+)$"),
    re.compile(r"^parallelism\.(\w+)=\d+ .*; set it to (\d+)$"),
    re.compile(r"^parallelism\.(pipeline_parallel_degree)=\d+ .*; use at most (\d+)$"),
    re.compile(r"^(training\.seq_len)=\d+ .*; use a multiple of \d+, e\.g\. ([\d or]+)$"),
    re.compile(r"^(training\.seq_len)=\d+ .*; use a seq_len of at least (\d+)$"),
]
"""How each refusal that offers values words them: (the field, the values)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One grid point: a plan on its own world (the product of its degrees)."""

    args: ModelArgs
    cfg: Parallelism
    seq_len: int

    def refusal(self) -> str | None:
        """The first rule this plan breaks, or None."""
        cfg = self.cfg
        world = (
            cfg.data_parallel_replicate_degree
            * cfg.data_parallel_shard_degree
            * cfg.context_parallel_degree
            * cfg.tensor_parallel_degree
            * cfg.pipeline_parallel_degree
        )
        try:
            dims = ParallelDims.resolve(cfg, world, self.args.num_experts)
            check_model_split(
                dims,
                self.args,
                self.seq_len,
                cfg.enable_sequence_parallel,
                head_tail=cfg.context_parallel_load_balancer == "headtail",
            )
        except ConfigError as err:
            return str(err)
        return None

    def with_value(self, field: str, value: int) -> Case:
        if field == "training.seq_len":
            return dataclasses.replace(self, seq_len=value)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, **{field: value}))


def grid() -> list[Case]:
    cases = []
    for args, tp, cp, ep, shard, pp, seq_len, sp, balancer in itertools.product(
        SHAPES.values(), range(1, 9), (1, 2, 3), (1, 2, 3, 4), (1, 2), (1, 5), (8, 64, 66), (True, False),
        ("headtail", "none"),
    ):  # fmt: skip
        cfg = Parallelism(
            tensor_parallel_degree=tp,
            context_parallel_degree=cp,
            expert_parallel_degree=ep,
            data_parallel_shard_degree=shard,
            pipeline_parallel_degree=pp,
            enable_sequence_parallel=sp,
            context_parallel_load_balancer=balancer,
        )
        cases.append(Case(args, cfg, seq_len))
    return cases


def offered(message: str) -> tuple[str, list[int]] | None:
    """The field a refusal names and the values it offers for it, or None if it offers none."""
    for pattern in OFFERS:
        found = pattern.match(message)
        if found:
            return found[1], [int(v) for v in re.findall(r"\d+", found[2])]
    assert not SUGGESTS.search(message), f"a refusal offers values this test cannot read: {message}"
    return None


def test_every_offered_value_passes_every_rule_of_its_kind():
    refused: dict[str, int] = {}
    for case in grid():
        message = case.refusal()
        if message is None or (offer := offered(message)) is None:
            continue
        field, values = offer
        kind = message.split("=")[0]  # every rule of a kind names the same setting first
        refused[kind] = refused.get(kind, 0) + 1
        assert values, message
        for value in values:
            again = case.with_value(field, value).refusal()
            assert again is None or not again.startswith(kind + "="), (
                f"{message}\n  but {field}={value} is refused: {again}"
            )
    # the grid reaches each kind of refusal that offers values
    assert set(refused) == {
        "parallelism.tensor_parallel_degree",
        "parallelism.expert_parallel_degree",
        "parallelism.pipeline_parallel_degree",
        "training.seq_len",
    }, refused


def test_every_local_batch_size_a_pipeline_refusal_offers_runs_its_schedule():
    args = get_flavor("qwen3", "debug", tie_word_embeddings=False, num_hidden_layers=12)
    offered_by = set()
    for pp, schedule, local_batch, mbs in itertools.product(
        (2, 3, 4), ("1F1B", "Interleaved1F1B", "DualPipeV"), range(1, 25), (1, 2, 3)
    ):
        if local_batch % mbs:
            continue
        cfg = Parallelism(
            pipeline_parallel_degree=pp,
            pipeline_parallel_schedule=schedule,
            pipeline_parallel_microbatch_size=mbs,
        )
        try:
            check_pipeline(cfg, args, local_batch)
            continue
        except ConfigError as err:
            message = str(err)
        found = re.search(r"; use (?:a )?training\.local_batch_size (?:of at least )?(.*)$", message)
        assert found or not SUGGESTS.search(message), message
        for value in re.findall(r"(?:^|or )(\d+)", found[1]) if found else []:
            offered_by.add(message.split()[0])
            check_pipeline(cfg, args, int(value))  # raises if the offered size is refused
    assert offered_by == {"1F1B", "DualPipeV", "Interleaved1F1B"}


CP_FLAGS = {
    "--parallelism.context_parallel_impl": "impl",
    "--parallelism.pipeline_parallel_degree": "pp",
    "--activation_checkpoint.mode": "ac_mode",
    "--compile.enable": "compiled",
}
"""The flags a context-parallel refusal may offer, as the knobs of ``cp_refusal``."""


def cp_refusal(impl: str, device: str, compiled: bool, ac_mode: str, masking: bool, pp: int) -> str | None:
    cfg = Parallelism(context_parallel_degree=2, context_parallel_impl=impl, pipeline_parallel_degree=pp)
    try:
        check_cp(cfg, device, compiled, ac_mode, masking)
    except ConfigError as err:
        return str(err)
    return None


def test_the_flags_a_context_parallel_refusal_offers_first_break_no_rule_of_their_own():
    offered = 0
    for knobs in itertools.product(
        ("auto", "ring", "allgather"), ("cpu", "cuda"), (True, False), ("none", "full"), (True, False), (1, 2)
    ):
        message = cp_refusal(*knobs)
        if message is None:
            continue
        first = message.split("; use ", 1)[1].split(" or ")[0]  # the first fix offered, whole
        flags = re.findall(r"(--[\w.]+) (\w+)", first)
        assert flags, message
        changed = dict(zip(("impl", "device", "compiled", "ac_mode", "masking", "pp"), knobs))
        for flag, value in flags:
            changed[CP_FLAGS[flag]] = {"true": True, "false": False}.get(
                value, int(value) if value.isdigit() else value
            )
        again = cp_refusal(**changed)  # may still break a rule the job broke besides: not one the fix set
        assert again is None or not any(flag.split(".")[-1] in again for flag, _ in flags), (
            f"{message}\n  but {first} is refused: {again}"
        )
        offered += 1
    assert offered > 0
