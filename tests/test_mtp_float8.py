"""FP8 training with Qwen3.5's multi-token-prediction head (issue 55): FP8 converts the head's
``fc`` and its layer's projections as it does the trunk's (the shared output head as
``float8.filter_fqns`` says, the router and the shared expert's gate never), a job trains the
model and the head in FP8, and the planner counts the head's FP8 weights. FSDP's equality with
one device (``FSDP_CASES``) and the refusal of the one combination that cannot run (a detached
head under FSDP's FP8 all-gather of an FP8 output head) run in ``test_mtp_training.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autopar.models import build_model, get_flavor
from autopar.parallel.float8 import apply_float8
from autopar.planner.compute_time import fp8_linear_numel
from autopar.training.metrics.logger import read_metrics
from autopar.training.resolve import model_args

from jobs import hybrid_job, one_process_trainer

FLOAT8 = ("--float8.enable", "true", "--float8.backend", "torchao")
"""torchao's FP8 linears (CPU's backend; tensorwise scaling)."""
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MOE["shared_expert_intermediate_size"] = 48


def fp8_head_job(folder, *flags: str, **model: object):
    """The tiny Qwen3.5 (``hybrid_job``: its fourth layer full attention) with a fresh
    one-layer head, in FP8."""
    return hybrid_job(folder, "--mtp.enable", "true", *FLOAT8, *flags, mtp_num_hidden_layers=1, **model)


def fp8_linears(model: torch.nn.Module, prefix: str) -> set[str]:
    """The FP8 linears under ``prefix``, named from there."""
    return {
        name.removeprefix(prefix)
        for name, module in model.named_modules()
        if name.startswith(prefix) and type(module).__name__ == "Float8Linear"
    }


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_fp8_converts_the_heads_linears_as_the_trunks_full_attention_layer(tmp_path, model):
    pytest.importorskip("torchao")
    job = fp8_head_job(tmp_path, **model)
    with torch.device("meta"):
        built = build_model(model_args(job))
    apply_float8(built, job.float8, "cpu")
    trunk = fp8_linears(built, "layers.3.")  # the trunk's full-attention layer
    assert fp8_linears(built, "mtp.") == {"fc"} | {f"layers.0.{name}" for name in trunk}
    assert "self_attn.q_proj" in trunk and "lm_head" not in fp8_linears(built, "")
    if model:  # the router is no linear; the shared expert's one-row gate stays high precision
        assert {"mlp.shared_expert.up_proj", "mlp.gate"} & trunk == {"mlp.shared_expert.up_proj"}
        assert "mlp.shared_expert_gate" not in trunk


def test_a_job_with_the_head_trains_in_fp8(tmp_path):
    """Three steps at lr 3e-3 on the shipped text: measured loss 5.77 -> 5.70 and the head's
    5.80 -> 5.71, both falling every step."""
    pytest.importorskip("torchao")
    trainer = one_process_trainer(fp8_head_job(tmp_path, "--training.steps", "3", "--optimizer.lr", "0.003"))
    model = trainer.parts[0]
    assert fp8_linears(model, "mtp.") >= {"fc", "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"}
    trainer.train()
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    for key in ("loss", "mtp_loss"):
        values = [r[key] for r in steps]
        assert len(values) == 3 and all(math.isfinite(v) for v in values), (key, values)
        assert values[2] < values[1] < values[0], (key, values)


@pytest.mark.parametrize("flavor", ["2B", "35B-A3B"])
def test_the_planner_counts_the_heads_fp8_weights(flavor):
    """The FP8 weights the planner charges (LoRA's dropped FP8 weight gradients) grow by the
    head's converted linears: fc (2H x H), the gated attention's projections (q twice as
    wide: query and gate), and the MLP, or the mixture's shared expert (its experts are no
    linears, its router and gate stay high precision)."""
    args = get_flavor("qwen3.5", flavor)
    h, q = args.hidden_size, args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    inter = args.shared_expert_intermediate_size if args.moe else args.intermediate_size
    head = 2 * h * h + h * (2 * q + 2 * kv) + q * h + 3 * h * inter
    with_head = dataclasses.replace(args, mtp_num_hidden_layers=1)
    weights = fp8_linear_numel(with_head, ("lm_head",))[0] - fp8_linear_numel(args, ("lm_head",))[0]
    assert weights == head


ONE_AT_A_TIME = ("--training.local_batch_size", "1", "--training.global_batch_size", "2")
"""FP8 scales each tensor by its own amax per forward: one device sees the sequences one at a
time, as each rank does (``test_plan_space.py``)."""
FSDP_CASES = {
    "fsdp-fp8-detach": (
        (*FLOAT8, *ONE_AT_A_TIME, "--mtp.detach", "true", "--float8.filter_fqns="),
        {},
        "dp_shard=2",
    ),
}
"""FP8 with the head under FSDP equals one device's FP8 (fp32 master weights: FP8 rounds the same
values, scaled by the same amax, to the same grid): detached, with the output head in FP8 too,
the head's logits by its gathered weight (in high precision). Run with ``test_mtp_training.py``'s
FSDP cases, in their processes: CPU's FP8 matmuls are slow (torch._scaled_mm, 23 ms each at
these sizes), so this case adds about 16 s."""
HEAVY_CASES = {"fsdp-fp8": ((*FLOAT8, *ONE_AT_A_TIME), {}, "dp_shard=2")}
"""The default: the output head in high precision, the head's logits through it (with
``test_mtp_training.py``'s heavy cases)."""
