"""Compile, activation checkpointing and FP8 under plans: same numbers as eager, on CPU.

FP8 against bf16 over a long run is in ``test_float8_numerics.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.cli.parity import Case, relative_deltas, run_cases
from autopar.config.sections import ActivationCheckpoint
from autopar.models import Qwen, get_flavor
from autopar.parallel.activation_checkpoint import apply_ac, checkpointed_layers

from jobs import TINY_MODEL, assert_fp32_parity, assert_same_training, parity_runs, tiny_job


def test_compiled_block_has_no_graph_breaks():
    from torch._dynamo.utils import counters

    from autopar.config.sections import Compile
    from autopar.parallel.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    model = Qwen(get_flavor("qwen3", "debug", **TINY_MODEL))
    model.init_weights()
    apply_compile(model, Compile(enable=True, backend="aot_eager"))  # fullgraph=True inside
    model(torch.randint(0, 320, (2, 16))).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize(
    "mode, option, expected",
    [
        ("none", "op", []),
        ("full", "op", ["0", "1", "2", "3"]),
        ("selective", "op", ["0", "1", "2", "3"]),
        ("selective", "2", ["0", "2"]),
    ],
)
def test_checkpointed_layers_follow_the_mode(mode, option, expected):
    cfg = ActivationCheckpoint(mode=mode, selective_ac_option=option)
    assert checkpointed_layers(cfg, ["0", "1", "2", "3"]) == expected


@pytest.mark.parametrize(
    "mode, option",
    [("full", "op"), ("selective", "op"), ("selective", "2")],
    ids=["full", "per-op", "every-2nd"],
)
def test_checkpointed_blocks_backpropagate_in_two_passes_like_plain_ones(mode, option):
    """Zero-bubble schedules run a stage's backward as two autograd passes (input gradients
    keeping the graph, then weight gradients), so a checkpointed block recomputes twice."""
    args = get_flavor("qwen3", "debug", **TINY_MODEL)
    plain = Qwen(args)
    plain.init_weights()
    checkpointed = copy.deepcopy(plain)
    cfg = ActivationCheckpoint(mode=mode, selective_ac_option=option)
    apply_ac(checkpointed, cfg, compiled=False, recomputed_twice=True)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (plain, checkpointed):
        loss = model(tokens).pow(2).mean()
        first = torch.autograd.grad(loss, [model.embed_tokens.weight], retain_graph=True)
        second = torch.autograd.grad(loss, [p for n, p in model.named_parameters() if "layers" in n])
        grads.append([*first, *second])
    assert len(grads[0]) == len(grads[1]) > 1
    for plain_grad, checkpointed_grad in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed_grad, plain_grad)  # recompute replays the same fp32 ops


@pytest.mark.parametrize("kernel", ["autopar", "triton"])
def test_per_op_checkpointing_keeps_the_delta_rules_recurrence_whatever_its_kernel(kernel):
    """Backward recomputes the projections around each Gated DeltaNet's recurrence, not the
    recurrence: the triton kernel's, CUDA's default, ran twice (its op was not a kept one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.models import build_model
    from autopar.models.qwen3_5.triton_delta_rule import triton_problem
    from autopar.parallel.delta_rule_kernel import KERNELS, apply_delta_rule_kernel

    if kernel == "triton" and triton_problem() is not None:
        pytest.skip(triton_problem())
    recurrence = KERNELS[kernel].forward.default
    args = get_flavor("qwen3.5", "debug")
    model = build_model(args)
    model.init_weights()
    apply_delta_rule_kernel(model, kernel, "cuda")  # on this CPU: its programs interpreted
    apply_ac(model, ActivationCheckpoint("selective", "op"), compiled=False)
    ran = []

    class Recurrences(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.extend([func] if func is recurrence else [])
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with Recurrences():
        model(tokens).float().pow(2).mean().backward()
    gated_deltanets = sum(args.layer_kind(i)[0] == "linear_attention" for i in range(args.num_hidden_layers))
    assert len(ran) == gated_deltanets == 3  # once each, in forward


STEPS = 3
"""A wrong gradient shows in step 2's loss and in every gradient norm."""


AC_PLANS = [
    "activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=op",
    "activation_checkpoint.mode=selective,activation_checkpoint.selective_ac_option=2",
    "activation_checkpoint.mode=full,dp_shard=2",
]


@pytest.fixture(scope="module")
def ac_runs(tmp_path_factory):
    return parity_runs(tiny_job(tmp_path_factory.mktemp("ac"), num_hidden_layers=4), AC_PLANS, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("plan", AC_PLANS)
def test_activation_checkpointing_gives_the_same_loss_as_none(ac_runs, plan):
    reference, run = ac_runs[plan]
    # recompute replays the same fp32 ops; only FSDP's reduction order may differ
    assert_fp32_parity(run, reference)


COMPILE_PLANS = [
    "compile.enable=true",
    "compile.enable=true,dp_shard=2",
    "compile.enable=true,tp=2",
    "compile.enable=true,cp=2",
]
HEAVY_COMPILE_PLANS = ["compile.enable=true,pp=2", "compile.enable=true,dp_shard=2,tp=2,pp=2"]
"""A compiled pipeline (``test_pipeline.py`` compiles one, zero-bubble with per-op AC) and the
3D mix, every part of which compiles above; on eight processes it compiles for over a minute on
two cores: python -m pytest -m heavy."""


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    return parity_runs(tiny_job(tmp_path_factory.mktemp("compile")), COMPILE_PLANS, steps=STEPS)


def assert_compiled_matches(reference, run) -> None:
    # inductor fuses and reorders fp32 reductions; 1e-4 relative
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("plan", COMPILE_PLANS)
def test_compiled_matches_eager_single_device(compile_runs, plan):
    assert_compiled_matches(*compile_runs[plan])


@pytest.mark.heavy
def test_compiled_pipelines_and_the_3d_mix_match_eager_single_device(tmp_path):
    for reference, run in parity_runs(tiny_job(tmp_path), HEAVY_COMPILE_PLANS, steps=STEPS).values():
        assert_compiled_matches(reference, run)


def test_torchtitans_output_filter_keeps_our_head_in_high_precision():
    pytest.importorskip("torchao")
    from autopar.config.sections import Float8
    from autopar.parallel.float8 import apply_float8, check_float8_filter

    args = get_flavor("qwen3", "debug", **TINY_MODEL)
    cfg = Float8(enable=True, backend="torchao", filter_fqns=["output"])
    check_float8_filter(cfg, args)  # a name torchtitan uses is not refused
    with torch.device("meta"):
        model = Qwen(args)
    apply_float8(model, cfg, "cpu")
    assert type(model.lm_head).__name__ == "Linear"


def test_fp8_keeps_the_head_and_odd_dims_in_high_precision():
    pytest.importorskip("torchao")
    from autopar.config.sections import Float8
    from autopar.parallel.float8 import apply_float8

    with torch.device("meta"):
        model = Qwen(get_flavor("qwen3", "debug", **{**TINY_MODEL, "intermediate_size": 120}))
    count = apply_float8(model, Float8(enable=True, backend="torchao"), "cpu")
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["lm_head"] == "Linear"  # filtered by name
    assert kinds["layers.0.mlp.gate_proj"] == "Linear"  # 120 is not a multiple of 16
    assert kinds["layers.0.self_attn.q_proj"] == "Float8Linear"
    assert count == 2 * 4  # q, k, v, o per block


FP8_PLANS = ["dp_shard=2", "dp_shard=2,float8.enable_fsdp_float8_all_gather=true", "tp=2", "dp_shard=2,tp=2"]


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    pytest.importorskip("torchao")
    base = tiny_job(tmp_path_factory.mktemp("fp8"), "--float8.enable", "true", "--float8.backend", "torchao")
    return parity_runs(base, FP8_PLANS)


@pytest.mark.slow
@pytest.mark.parametrize("plan", FP8_PLANS)
def test_torchao_fp8_composes_with_fsdp_and_tp(fp8_runs, plan):
    reference, run = fp8_runs[plan]  # reference: FP8 on one device
    # Same FP8 scales (amax over the whole tensor under every plan), but a one-ulp fp32
    # difference from sum order can flip an FP8 rounding, a step of 1/8 in that element. Under
    # TP, measured on AMD EPYC over AVX2 and scalar kernels with 1 and 2 threads: at most
    # 2.1e-5 in loss and 1.3e-4 in grad norm (scalar kernels), hence 1e-4 and 1e-3.
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-3)


FP8 = ("--float8.enable", "true", "--float8.backend", "torchao")


def fp8_pipeline_case(tmp, *flags: str) -> Case:
    """FP8 under a 2-stage pipeline, one sample per micro-batch on both sides (two pipeline
    micro-batches; two accumulation steps on one device), so every GEMM scales by the same amax."""
    per_sample = tiny_job(
        tmp, *FP8, *flags, "--training.local_batch_size", "1", "--training.global_batch_size", "2"
    )
    return Case(per_sample, "pp=2,training.local_batch_size=2")


@pytest.fixture(scope="module")
def fp8_split_runs(tmp_path_factory):
    """FP8 under PP and CP, rowwise FP8 under FSDP, and the one-device fp32 run that sizes
    FP8's own rounding."""
    pytest.importorskip("torchao")
    tmp = tmp_path_factory.mktemp("fp8-split")
    base = tiny_job(tmp, *FP8)
    rowwise = tiny_job(tmp, *FP8, "--float8.recipe", "rowwise")
    cases = [
        fp8_pipeline_case(tmp),
        Case(base, "cp=2"),
        Case(tiny_job(tmp), "cp=2"),
        Case(rowwise, "dp_shard=2"),
    ]
    pp, cp, (fp32, _), fsdp_rowwise = run_cases(cases, steps=5)
    return {"pp": pp, "cp": cp, "fp32": fp32, "fsdp rowwise": fsdp_rowwise}


def assert_within_fp8_rounding(run, reference, fp32) -> None:
    """``run`` stays within twice one device's FP8 distance from fp32 (which must be visible)."""
    fp8_gap = max(relative_deltas(reference.losses, fp32.losses))
    assert fp8_gap > 1e-4 and max(relative_deltas(run.losses, reference.losses)) <= 2 * fp8_gap


@pytest.mark.slow
def test_torchao_fp8_under_pp_matches_one_device_fp8(fp8_split_runs):
    reference, run = fp8_split_runs["pp"]
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)


@pytest.mark.slow
def test_torchao_fp8_under_cp_stays_within_fp8_rounding(fp8_split_runs):
    # each CP rank scales its activations by the amax of its own part of the sequence, so
    # FP8 roundings differ from one device's; measured 0.75x of one-device FP8's distance
    # from fp32 (5 steps), bounded at 2x
    reference, run = fp8_split_runs["cp"]
    assert_within_fp8_rounding(run, reference, fp8_split_runs["fp32"])


@pytest.mark.slow
def test_rowwise_fp8_under_fsdp_matches_one_device_rowwise_fp8(fp8_split_runs):
    reference, run = fp8_split_runs["fsdp rowwise"]  # per-row scales do not see the split
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)


LORA = ("--lora.enable", "true", "--lora.rank", "4")


def test_lora_on_fp8_linears_runs_the_fp8_base_under_trainable_adapters():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from autopar.config.sections import Float8, LoRA
    from autopar.parallel.float8 import apply_float8
    from autopar.parallel.lora import LoRALinear, apply_lora

    model = Qwen(get_flavor("qwen3", "debug", **TINY_MODEL))
    model.init_weights()
    apply_float8(model, Float8(enable=True, backend="torchao"), "cpu")
    q_proj = model.layers["0"].self_attn.q_proj
    x = torch.randn(2, 8, q_proj.in_features)
    base = q_proj(x)
    assert apply_lora(model, LoRA(enable=True, rank=4), torch.float32) == 7 * len(
        model.layers
    )  # every block linear
    assert isinstance(q_proj, Float8Linear) and isinstance(q_proj, LoRALinear)
    torch.nn.init.normal_(q_proj.lora_B.weight)
    out = q_proj(x)
    update = q_proj.lora_B(q_proj.lora_A(x)) * q_proj.scaling
    torch.testing.assert_close(out, base + update, rtol=0, atol=1e-6)  # FP8 base, fp32 adapters
    out.sum().backward()
    assert q_proj.weight.grad is None and q_proj.lora_A.weight.grad is not None
    assert type(model.layers["1"].self_attn.q_proj) is type(q_proj)  # one class: compiled blocks share guards


FP8_LORA_PLANS = ["dp_shard=2", "dp_shard=2,float8.enable_fsdp_float8_all_gather=true", "tp=2", "cp=2"]


@pytest.fixture(scope="module")
def fp8_lora_runs(tmp_path_factory):
    """LoRA over FP8 base linears under each plan and a pipeline, and the fp32 LoRA run that
    sizes FP8's own rounding."""
    pytest.importorskip("torchao")
    tmp = tmp_path_factory.mktemp("fp8-lora")
    fp8_lora = tiny_job(tmp, *FP8, *LORA)
    cases = [Case(fp8_lora, plan) for plan in FP8_LORA_PLANS]
    cases += [fp8_pipeline_case(tmp, *LORA), Case(tiny_job(tmp, *LORA), "dp_shard=2")]
    runs = run_cases(cases, steps=STEPS)
    return dict(zip([*FP8_LORA_PLANS, "pp=2"], runs)) | {"fp32": runs[-1][0]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan", ["dp_shard=2", "dp_shard=2,float8.enable_fsdp_float8_all_gather=true", "pp=2"]
)
def test_lora_on_fp8_linears_under_fsdp_and_pp_matches_one_device(fp8_lora_runs, plan):
    reference, run = fp8_lora_runs[plan]  # reference: FP8 LoRA on one device; measured: equal
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)


@pytest.mark.slow
def test_lora_on_fp8_linears_under_tp_matches_one_device(fp8_lora_runs):
    # a one-ulp difference in a TP partial sum can flip an FP8 rounding (see FP8 alone above);
    # the adapters' gradient norm, smaller than the model's, shows it more: measured 1.7e-6 in
    # loss and 4.5e-4 in grad norm (Intel Xeon), hence 1e-4 and 2e-3
    reference, run = fp8_lora_runs["tp=2"]
    assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=2e-3)


@pytest.mark.slow
def test_lora_on_fp8_linears_under_cp_stays_within_fp8_rounding(fp8_lora_runs):
    # CP ranks scale by their own part's amax: measured 0.65x of FP8's own gap from fp32
    reference, run = fp8_lora_runs["cp=2"]
    assert_within_fp8_rounding(run, reference, fp8_lora_runs["fp32"])
