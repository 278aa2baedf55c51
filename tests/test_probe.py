"""The device probe and the planner's use of it: the probe measures this machine and writes a
profile that round-trips; the time model's terms follow the profile's figures (numbers, not
shapes); ``parallelism.auto`` plans an unknown GPU with its own probed figures; a bad profile
is one line naming the file and the fix."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from autopar.cli.plan import main as plan_main
from autopar.cli.plan_check import far_off, spearman
from autopar.cli.probe import job_shapes, machine_probe
from autopar.cli.probe import main as probe_main
from autopar.cli.spawn import run_on_ranks
from autopar.config import ConfigError
from autopar.models.family import build_model
from autopar.parallel.mesh import ParallelDims
from autopar.planner.auto import auto_job
from autopar.planner.devices import PRESETS
from autopar.planner.machine import PROBE_VERSION, cache_path, probed_device, spec_from_profile
from autopar.planner.measured import (
    CAST_BYTES,
    cast_seconds,
    forward_op_share,
    ops_per_micro_batch,
    optimizer_seconds,
)
from autopar.planner.params import meta_model
from autopar.planner.probe import (
    device_name,
    initialized_model,
    probe_attention,
    probe_checkpoint_overheads,
    probe_job_step,
    probe_op_overhead,
    probe_plan_overheads,
    probe_recurrence,
    run_probe,
    timed,
)
from autopar.planner.profile import (
    COLLECTIVES,
    AttentionPoint,
    CollectivePoint,
    DeviceProfile,
    MatmulPoint,
    ModelStepPoint,
    RecurrencePoint,
    load_profile,
    model_key,
)
from autopar.planner.rates import compute_rate, compute_rates
from autopar.planner.time import StepTime, predict_time, tokens_per_step
from autopar.training.metrics.flops import delta_rule_flops, flops_per_token
from autopar.training.resolve import model_args
from tests.jobs import debug_job

ROOT = Path(__file__).resolve().parents[1]


def flat_profile(
    flops: float = 1e11, bus: float = 1e9, memory: float = 1e10, op_s: float = 1e-5
) -> DeviceProfile:
    """A CPU profile with the same figure at every measured point, so predictions can be
    computed by hand."""
    matmul = tuple(
        MatmulPoint(dtype, s, s, s, flops) for dtype in ("float32", "bfloat16") for s in (64, 1024)
    )
    collectives = tuple(
        CollectivePoint(op, 2, size, bus) for op in COLLECTIVES for size in (1 << 16, 1 << 23)
    )
    return DeviceProfile(
        "test cpu", "cpu", torch.__version__, None, None, 2, 2, 8.0, matmul, memory, None, collectives, op_s
    )


def test_the_probe_on_cpu_writes_a_profile_whose_figures_are_positive_and_round_trip(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert probe_main(["--output", str(path), "--job.config", "debug_model", "--training.seq_len", "64"]) == 0
    assert "host -> device  n/a (CPU)" in capsys.readouterr().out
    profile = load_profile(path)
    assert profile.device_type == "cpu" and profile.torch == torch.__version__ and profile.world_size == 1
    assert profile.host_bytes_per_s is None and profile.cuda is None and profile.collectives == ()
    assert profile.memory_gib > 0 and profile.memory_bytes_per_s > 0 and profile.op_overhead_s > 0
    assert {p.dtype for p in profile.matmul} == {"float32", "bfloat16"}
    assert all(p.flops_per_s > 0 for p in profile.matmul)
    # the job's own GEMMs: 8 sequences x 64 tokens through the debug model's q/k/v (8 + 2 x 4
    # heads of 32) and its vocabulary head (512)
    shapes = {(p.m, p.n, p.k) for p in profile.matmul}
    assert {(512, 512, 128), (512, 128, 256)} <= shapes
    # and the job's whole model, a step of one sequence and of 4 of its 8, in the float32 a CPU
    # trains in
    one, four = profile.model_steps
    args = model_args(debug_job("--training.seq_len", "64"))
    assert profile.model_step(args, "float32") == (one, four)
    assert [(s.batch, s.seq) for s in (one, four)] == [(1, 64), (4, 64)]
    assert all(0 < s.seconds < 10 for s in (one, four))
    assert DeviceProfile.from_json(json.loads(path.read_text())) == profile


def test_a_run_as_long_as_the_long_run_bound_is_timed_once_and_a_short_one_after_a_warm_up():
    calls = []

    def sleep(seconds: float):
        return lambda: (calls.append(seconds), time.sleep(seconds))

    assert timed(sleep(0.05), torch.device("cpu"), long_run_s=0.04) >= 0.05 and len(calls) == 1
    calls.clear()
    assert timed(sleep(0.001), torch.device("cpu"), repeats=3, long_run_s=0.04) < 0.04 and len(calls) == 4


def test_a_job_given_by_its_flags_alone_is_probed_like_one_given_by_a_config():
    by_flags = job_shapes(["--model.name", "qwen3.5", "--model.flavor", "debug", "--training.seq_len", "64"])
    by_config = job_shapes(["--job.config", "debug_model_qwen3.5", "--training.seq_len", "64"])
    assert by_flags[1:] == by_config[1:] and by_flags[3] is not None and by_flags[2]  # step, recurrence
    assert job_shapes([]) == ([], [], [], None)


@pytest.mark.heavy  # compiling on this CPU: 7 s
def test_a_compiling_jobs_step_is_timed_compiled_as_well_as_eager():
    *_, step = job_shapes(
        ["--job.config", "debug_model", "--training.seq_len", "32", "--compile.enable", "true"]
    )
    eager_one, eager, compiled_one, compiled = probe_job_step(torch.device("cpu"), step)
    assert [s.compiled for s in (eager_one, eager, compiled_one, compiled)] == [False, False, True, True]
    profile = dataclasses.replace(flat_profile(), model_steps=(eager_one, eager, compiled_one, compiled))
    args = step[0]
    assert profile.model_step(args, "float32", compiled=True) == (compiled_one, compiled)
    assert profile.model_step(args, "float32") == (eager_one, eager)


@pytest.fixture(scope="module")
def two_rank_profile() -> DeviceProfile:
    return machine_probe(torch.device("cpu"), 2)


def test_collectives_are_measured_on_two_gloo_ranks_per_op_and_message_size(two_rank_profile):
    profile = two_rank_profile
    assert profile.world_size == 2 and profile.local_world_size == 2
    measured = {(c.op, c.group, c.bytes) for c in profile.collectives}
    assert measured == {(op, 2, size) for op in COLLECTIVES for size in (1 << 16, 1 << 20, 1 << 23)}
    assert all(c.bus_bytes_per_s > 0 and math.isfinite(c.bus_bytes_per_s) for c in profile.collectives)


def test_tensor_and_context_parallel_machinery_is_timed_per_op_on_two_ranks(two_rank_profile):
    plans = dict(two_rank_profile.plan_op_overhead_s)
    assert set(plans) == {"tp", "cp"} and all(s > 0 and math.isfinite(s) for s in plans.values())


def test_fsdps_own_cost_per_call_is_timed_on_two_ranks(two_rank_profile):
    # measured here: about 1.5 ms a call on two gloo ranks, beside about 0.25 on one
    assert 0 < two_rank_profile.fsdp_call_s < 0.1


def hybrid_job_on_rank() -> tuple:
    """A rank's part of timing the debug Qwen3.5's own TP and CP passes and its model step."""
    args = model_args(debug_job("--model.name", "qwen3.5"))
    device = torch.device("cpu")
    return probe_plan_overheads(device, args), probe_job_step(device, (args, (2,), 64, False))


def test_a_hybrid_jobs_own_model_is_timed_under_tp_and_cp_and_its_step_by_the_slowest_rank():
    (overheads, steps), (others, their_steps) = run_on_ranks(hybrid_job_on_rank, 2, timeout_s=300)
    assert overheads == others and steps == their_steps  # both ranks keep the same figures
    assert {plan for plan, _ in overheads} == {"tp", "cp"} and all(s > 0 for _, s in overheads)
    (step,) = steps
    assert step.model == model_key(model_args(debug_job("--model.name", "qwen3.5"))) and step.seconds > 0


def fsdp2(*flags: str):
    job = debug_job("--training.seq_len", "512", "--training.local_batch_size", "4", *flags)
    return job, model_args(job), ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1)


def test_the_compute_term_is_the_model_flops_at_the_measured_gemm_rate():
    job, args, dims = fsdp2()
    device = spec_from_profile(flat_profile(flops=1e11))
    time = predict_time(args, job, dims, device, 2)
    # 4 sequences of 512 tokens per rank at 1e11 FLOP/s: no efficiency factor between them
    expected = flops_per_token(args, 512, False) * tokens_per_step(job, dims) / 2 / 1e11
    assert time.compute == pytest.approx(expected, rel=1e-9)


def test_attention_flops_run_at_the_measured_attention_rate():
    job, args, dims = fsdp2()
    attention = tuple(AttentionPoint("float32", 1, 8, seq, 32, 2.5e10) for seq in (256, 1024))
    device = spec_from_profile(dataclasses.replace(flat_profile(flops=1e11), attention=attention))
    time = predict_time(args, job, dims, device, 2)
    # the debug model at 512 tokens: 12 x 4 layers x 8 heads x 32 x 512 attention FLOPs per token
    # at 2.5e10 FLOP/s, the rest (6 x its matmul parameters) at 1e11
    attention_flops = 12 * 4 * 8 * 32 * 512
    per_token = (flops_per_token(args, 512, False) - attention_flops) / 1e11 + attention_flops / 2.5e10
    assert time.compute == pytest.approx(per_token * tokens_per_step(job, dims) / 2, rel=1e-9)


def test_a_hybrid_models_recurrence_runs_at_the_measured_delta_rule_rate():
    job = debug_job(
        "--model.name", "qwen3.5", "--training.seq_len", "512", "--training.local_batch_size", "4"
    )
    args, dims = model_args(job), ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1)
    rule = (
        4,
        512,
        args.linear_num_key_heads,
        args.linear_num_value_heads,
        args.linear_key_head_dim,
        args.linear_value_head_dim,
    )
    slow = (RecurrencePoint("float32", *rule, 1e9),)
    device = spec_from_profile(dataclasses.replace(flat_profile(flops=1e11), recurrence=slow))
    time = predict_time(args, job, dims, device, 2)
    linear = sum(args.mixer(i) == "linear_attention" for i in range(args.num_hidden_layers))
    recurrence = linear * delta_rule_flops(args)  # per token, at 1e9 FLOP/s; the rest at 1e11
    per_token = (flops_per_token(args, 512, False) - recurrence) / 1e11 + recurrence / 1e9
    assert time.compute == pytest.approx(per_token * tokens_per_step(job, dims) / 2, rel=1e-9)


def test_attention_runs_at_the_rate_timed_at_its_own_sequence_length():
    # equal FLOPs, different kernels' speeds: one sequence of 1024 and four of 512
    fast, slow = (
        AttentionPoint("float32", 1, 8, 1024, 32, 4e10),
        AttentionPoint("float32", 4, 8, 512, 32, 1e10),
    )
    profile = dataclasses.replace(flat_profile(), attention=(fast, slow))
    assert fast.flops == slow.flops
    assert profile.attention_flops_per_s("float32", slow.flops, 512) == 1e10
    assert profile.attention_flops_per_s("float32", slow.flops, 1024) == 4e10


def test_an_all_gather_cp_rank_computes_attention_at_the_rate_timed_for_its_masked_call():
    job = debug_job(
        "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"
    )
    args, dims = model_args(job), ParallelDims.resolve(job.parallelism, 2)
    causal = tuple(AttentionPoint("float32", b, 8, 512, 32, 4e10) for b in (1, 8))
    as_cp = tuple(AttentionPoint("float32", b, 8, 512, 32, 1e10, cp=2) for b in (1, 8))
    assert as_cp[0].flops == causal[0].flops / 2  # a rank's share of the causal FLOPs

    def rates(*points: AttentionPoint):
        profile = dataclasses.replace(flat_profile(), attention=points)
        return compute_rates(job, spec_from_profile(profile), args, dims, 8)

    assert rates(*causal, *as_cp).attention == 1e10
    assert rates(*causal).attention == 4e10  # a profile without it: as one rank calls attention
    one = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1)
    profile = dataclasses.replace(flat_profile(), attention=(*causal, *as_cp))
    assert compute_rates(job, spec_from_profile(profile), args, one, 8).attention == 4e10


def test_the_probe_times_attention_as_a_cp_rank_calls_it_beside_the_causal_call():
    causal, rank = probe_attention(torch.device("cpu"), ["float32"], [(1, 2, 64, 16), (1, 2, 64, 16, 2)])
    assert (causal.cp, rank.cp) == (1, 2) and rank.flops == causal.flops / 2
    assert causal.flops_per_s > 0 and rank.flops_per_s > 0


def one_rank(*flags: str):
    job = debug_job("--training.seq_len", "512", "--training.local_batch_size", "4", *flags)
    return job, model_args(job), ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1)


def adamw_seconds(device, args) -> float:
    """A one-rank step's AdamW traffic (the probe's model step has no optimizer)."""
    return optimizer_seconds(device, sum(p.numel() for p in meta_model(args).parameters()))


@pytest.mark.parametrize("seconds", [0.4, 0.8])
def test_the_models_timed_step_is_what_the_planner_predicts_for_that_step(seconds):
    job, args, one = one_rank()
    point = ModelStepPoint(model_key(args), "float32", 4, 512, seconds)
    device = spec_from_profile(dataclasses.replace(flat_profile(), model_steps=(point,)))
    time = predict_time(args, job, one, device, 1)
    assert time.total - adamw_seconds(device, args) == pytest.approx(seconds, rel=1e-9)
    # what its GEMMs and dispatch do not explain is elementwise work, which scales with the
    # bytes a plan's blocks save: twice the sequences, twice the time (within the few bytes
    # per block that do not grow with the batch)
    double = predict_time(args, one_rank("--training.local_batch_size", "8")[0], one, device, 1)
    elementwise = time.memory_bound - adamw_seconds(device, args)
    assert double.memory_bound - adamw_seconds(device, args) == pytest.approx(2 * elementwise, rel=0.01)


def test_each_micro_batch_the_probe_timed_is_predicted_as_it_was_timed_and_others_between():
    # a step of one sequence took more than a quarter of four's: its dispatch is paid per
    # micro-batch, its elementwise rate differs with its tensors' size
    _, args, one = one_rank()
    one_seq = ModelStepPoint(model_key(args), "float32", 1, 512, 0.1)
    four_seq = ModelStepPoint(model_key(args), "float32", 4, 512, 0.3)
    device = spec_from_profile(dataclasses.replace(flat_profile(), model_steps=(one_seq, four_seq)))

    def predicted(batch: int) -> float:
        job = one_rank("--training.local_batch_size", str(batch))[0]
        return predict_time(args, job, one, device, 1).total - adamw_seconds(device, args)

    assert predicted(1) == pytest.approx(0.1, rel=1e-9)
    assert predicted(4) == pytest.approx(0.3, rel=1e-9)
    assert 0.1 < predicted(2) < 0.3


def test_per_op_checkpointing_pays_the_probed_machinery_at_every_op_of_each_recomputed_block():
    flags = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
    _, args, one = one_rank(*flags)
    plain = flat_profile(op_s=1e-5)
    probed = dataclasses.replace(plain, checkpoint_op_overhead_s=(("op", 5e-5), ("full", 2e-5)))

    def recompute(profile: DeviceProfile, *more: str) -> float:
        return predict_time(args, one_rank(*flags, *more)[0], one, spec_from_profile(profile), 1).recompute

    # beyond the plain op's dispatch and its forward's dispatch again: what the policy adds
    per_op = 5e-5 - 1e-5 * (1 + forward_op_share(args))
    assert recompute(probed) - recompute(plain) == pytest.approx(ops_per_micro_batch(args) * per_op, rel=1e-9)
    # a compiled graph holds the policy's choices: nothing to pay at run time
    assert recompute(probed, "--compile.enable", "true") == recompute(plain, "--compile.enable", "true")


def test_the_probe_times_checkpointings_machinery_above_a_plain_ops_dispatch():
    args = model_args(debug_job())
    modes = dict(probe_checkpoint_overheads(torch.device("cpu"), args))
    # per model op on 8 tokens: on this CPU 4-5 us plain, 11 us fully checkpointed, 17 us per-op
    plain = probe_op_overhead(torch.device("cpu"), args)
    assert set(modes) == {"op", "full"} and modes["op"] > 1.5 * plain and modes["full"] > plain


def test_all_gather_cp_moves_kv_at_the_rate_probed_for_its_own_gather():
    job = debug_job(
        "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"
    )
    args, dims = model_args(job), ParallelDims.resolve(job.parallelism, 2)
    even = flat_profile(bus=1e9)
    slow_own = dataclasses.replace(
        even,
        collectives=tuple(
            dataclasses.replace(p, bus_bytes_per_s=p.bus_bytes_per_s / 2) if p.op.startswith("seq_") else p
            for p in even.collectives
        ),
    )
    plain_only = dataclasses.replace(
        even, collectives=tuple(p for p in even.collectives if not p.op.startswith("seq_"))
    )

    def cp_seconds(profile: DeviceProfile) -> float:
        return predict_time(args, job, dims, spec_from_profile(profile), 2).comm_by_dim["cp"]

    assert cp_seconds(slow_own) == pytest.approx(2 * cp_seconds(even), rel=1e-9)
    assert cp_seconds(plain_only) == pytest.approx(cp_seconds(even), rel=1e-9)  # older profiles


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_jobs_prediction_reproduces_the_compiled_step_the_probe_timed(compiled):
    flag = ("--compile.enable", "true" if compiled else "false")
    job, args, one = one_rank(*flag)
    eager = ModelStepPoint(model_key(args), "float32", 4, 512, 0.8)
    fast = ModelStepPoint(model_key(args), "float32", 4, 512, 0.5, compiled=True)
    device = spec_from_profile(dataclasses.replace(flat_profile(), model_steps=(eager, fast)))
    time = predict_time(args, job, one, device, 1)
    assert time.total - adamw_seconds(device, args) == pytest.approx(0.5 if compiled else 0.8, rel=1e-9)


def test_bf16_training_pays_the_recipes_weight_and_gradient_casts_per_micro_batch(monkeypatch):
    job, args, one = one_rank("--training.mixed_precision_param", "bfloat16")
    device = spec_from_profile(flat_profile())
    params = sum(p.numel() for p in meta_model(args).parameters())
    with_casts = predict_time(args, job, one, device, 1).memory_bound
    monkeypatch.setattr("autopar.planner.measured.CAST_BYTES", 0)
    # each weight cast before the forward, each gradient after the backward: 6 bytes each
    assert with_casts - predict_time(args, job, one, device, 1).memory_bound == pytest.approx(
        2 * CAST_BYTES * params / device.hbm_bytes_per_s, rel=1e-9
    )
    monkeypatch.undo()
    float32 = one_rank("--training.mixed_precision_param", "float32")[0]
    assert cast_seconds(float32, device, params) == 0.0  # nothing to cast


def test_another_models_timed_step_leaves_the_measured_bandwidth_in_place():
    job, args, one = one_rank()
    other = model_args(debug_job("--model.name", "qwen3.5"))
    point = ModelStepPoint(model_key(other), "float32", 4, 512, 5.0)
    timed = spec_from_profile(dataclasses.replace(flat_profile(), model_steps=(point,)))
    plain = spec_from_profile(flat_profile())
    assert predict_time(args, job, one, timed, 1) == predict_time(args, job, one, plain, 1)


def test_the_probe_times_the_models_own_delta_rule_kernel():
    (point,) = probe_recurrence(torch.device("cpu"), ["float32"], [(1, 128, 1, 2, 8, 8)])
    assert (point.seq, point.value_heads, point.dk) == (128, 2, 8) and 0 < point.flops_per_s < 1e13


def test_fsdp_traffic_moves_at_the_measured_bus_bandwidth():
    job, args, dims = fsdp2()
    time = predict_time(args, job, dims, spec_from_profile(flat_profile(bus=1e9)), 2)
    # float32 on CPU: half the weights gathered twice (forward, backward) and half the float32
    # gradients reduce-scattered, 6 bytes per parameter, at 1 GB/s: no efficiency factor
    params = sum(p.numel() for p in meta_model(args).parameters())
    assert time.comm_by_dim["fsdp"] == pytest.approx(6 * params / 1e9, rel=1e-9)
    # a CPU rank's one core runs gloo's copies too, so none of it hides behind compute; a GPU's does
    assert time.exposed_comm >= time.comm_by_dim["fsdp"]
    gpu = spec_from_profile(dataclasses.replace(flat_profile(bus=1e9), device_type="cuda"))
    assert predict_time(args, job, dims, gpu, 2).exposed_comm < time.comm_by_dim["fsdp"] / 2


def test_tp_reduce_scatters_move_at_their_own_measured_rate_not_the_gathers():
    job = debug_job("--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "none")
    args, dims = model_args(job), ParallelDims.resolve(job.parallelism, 2)
    even = flat_profile(bus=1e9)
    slow_scatter = dataclasses.replace(
        even,
        collectives=tuple(
            dataclasses.replace(p, bus_bytes_per_s=p.bus_bytes_per_s / 2) if p.op == "reduce_scatter" else p
            for p in even.collectives
        ),
    )

    def tp_seconds(profile: DeviceProfile) -> float:
        return predict_time(args, job, dims, spec_from_profile(profile), 2).comm_by_dim["tp"]

    # as many reduce-scatters as gathers: half the traffic at half the rate
    assert tp_seconds(slow_scatter) / tp_seconds(even) == pytest.approx(1.5, rel=1e-9)


def test_halving_each_measured_figure_doubles_its_own_term_only():
    job, args, dims = fsdp2()
    base = spec_from_profile(flat_profile())
    slow = {
        "compute": flat_profile(flops=0.5e11),
        "comm": flat_profile(bus=0.5e9),
        "memory_bound": flat_profile(memory=0.5e10),
        "overhead": flat_profile(op_s=2e-5),
    }
    before = predict_time(args, job, dims, base, 2)

    def terms(t: StepTime) -> dict[str, float]:
        return {
            "compute": t.compute,
            "comm": t.comm_by_dim["fsdp"],
            "memory_bound": t.memory_bound,
            "overhead": t.overhead,
        }

    for name, profile in slow.items():
        after = terms(predict_time(args, job, dims, spec_from_profile(profile), 2))
        for term, value in terms(before).items():
            assert after[term] == pytest.approx(value * (2 if term == name else 1), rel=1e-9), (name, term)


def test_a_larger_gemm_runs_at_the_rate_measured_for_its_size():
    profile = flat_profile()
    fast = [dataclasses.replace(p, flops_per_s=4e11) if p.m == 1024 else p for p in profile.matmul]
    profile = dataclasses.replace(profile, matmul=tuple(fast))
    # log-log between 64^3 (1e11) and 1024^3 (4e11): 256^3 is halfway in log FLOPs
    assert profile.matmul_flops_per_s("float32", 256, 256, 256) == pytest.approx(2e11, rel=1e-9)
    assert profile.matmul_flops_per_s("float32", 4096, 4096, 4096) == 4e11  # clamped at the ends
    # a shape the probe timed (the job's own) is read as measured, not interpolated
    timed = dataclasses.replace(
        profile, matmul=(*profile.matmul, MatmulPoint("float32", 256, 256, 256, 3e11))
    )
    assert timed.matmul_flops_per_s("float32", 256, 256, 256) == 3e11
    # TP shrinks each rank's GEMMs, so the same job computes at a lower rate per FLOP
    job, args, _ = fsdp2()
    device = spec_from_profile(profile)
    dp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1)
    tp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1)
    assert compute_rate(job, device, args, tp, 4) < compute_rate(job, device, args, dp, 4) < 4e11


def test_the_overhead_term_counts_the_models_own_ops():
    job, args, dims = fsdp2()
    time = predict_time(args, job, dims, spec_from_profile(flat_profile(op_s=1e-5)), 2)
    assert ops_per_micro_batch(args) > 500  # the debug model's forward and backward, counted on meta
    assert time.overhead == pytest.approx(ops_per_micro_batch(args) * 1e-5, rel=1e-9)  # one micro-batch


def test_fsdp_pays_its_probed_cost_at_every_call_of_every_unit():
    # on this CPU FSDP's hooks, copies and waits cost about 1.5 ms a call beyond its bytes:
    # a one-sequence step of the debug model was predicted 30% fast without it
    job, args, dims = fsdp2()
    plain = predict_time(args, job, dims, spec_from_profile(flat_profile(bus=1e9)), 2)
    calls = dataclasses.replace(flat_profile(bus=1e9), fsdp_call_s=1e-3)
    timed = predict_time(args, job, dims, spec_from_profile(calls), 2)
    units = args.num_hidden_layers + 1  # the blocks and the root
    gathers = 2  # forward and backward, resharded after forward
    extra = units * (gathers + 1) * 1e-3  # and the gradients' reduce-scatter
    assert timed.comm_by_dim["fsdp"] == pytest.approx(plain.comm_by_dim["fsdp"] + extra, rel=1e-9)


def test_a_plan_pays_the_per_op_overhead_probed_for_its_machinery():
    job, args, _ = fsdp2()
    profile = dataclasses.replace(flat_profile(op_s=1e-5), plan_op_overhead_s=(("tp", 4e-5), ("cp", 2e-5)))
    device, ops = spec_from_profile(profile), ops_per_micro_batch(args)

    def overhead(dims: ParallelDims) -> float:
        return predict_time(args, job, dims, device, 2).overhead

    assert overhead(ParallelDims(1, 2, 1, 1, 1)) == pytest.approx(ops * 1e-5, rel=1e-9)
    assert overhead(ParallelDims(1, 1, 1, 2, 1)) == pytest.approx(ops * 4e-5, rel=1e-9)
    assert overhead(ParallelDims(1, 1, 2, 1, 1)) == pytest.approx(ops * 2e-5, rel=1e-9)


class CountingProbe:
    """The real CPU probe, reporting itself as a GPU that has no preset."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, device: torch.device, local_world: int) -> DeviceProfile:
        self.calls += 1
        profile = run_probe(torch.device("cpu"), local_world=local_world)
        return dataclasses.replace(profile, device="NVIDIA L40S", device_type="cuda", memory_gib=44.4)


@pytest.mark.heavy  # a probe on this CPU: 20 s; auto on a CPU plans with its probed profile by default
def test_auto_on_an_unknown_gpu_plans_with_its_probed_profile_not_an_h100s(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    probe = CountingProbe()
    argv = ["--job.config", "debug_model", "--parallelism.auto", "true", "--parallelism.auto_verify", "false"]
    job = debug_job(*argv[2:])
    _, plan, device, _ = auto_job(job, argv, 1, "cuda", 1, probe, tmp_path)
    assert probe.calls == 1 and device.name == "NVIDIA L40S" and device.memory_gib == 44.4
    assert device.profile is not None and device.bf16_flops == device.profile.peak_flops
    assert device.bf16_flops != PRESETS["h100"].bf16_flops and plan.time.overhead > 0
    cached = list(tmp_path.glob("nvidia-l40s-torch*-w1-l1.json"))
    assert len(cached) == 1 and load_profile(cached[0]) == device.profile
    again = auto_job(job, argv, 1, "cuda", 1, probe, tmp_path)[2]
    assert probe.calls == 1 and again.profile == device.profile  # read from the cache


@pytest.mark.heavy  # a second probe on this CPU: 40 s
def test_a_newer_probe_measures_again_rather_than_read_an_older_probes_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    probe = CountingProbe()
    argv = ["--job.config", "debug_model", "--parallelism.auto", "true", "--parallelism.auto_verify", "false"]
    job = debug_job(*argv[2:])
    auto_job(job, argv, 1, "cuda", 1, probe, tmp_path)
    monkeypatch.setattr("autopar.planner.machine.PROBE_VERSION", PROBE_VERSION + 1)
    auto_job(job, argv, 1, "cuda", 1, probe, tmp_path)
    assert probe.calls == 2 and len(list(tmp_path.glob("nvidia-l40s-*.json"))) == 2


def test_plan_with_a_device_profile_names_the_measured_device(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "profile.json"
    flat_profile().save(path)
    flags = ["--job.config", "debug_model", "--world-size", "2", "--gpus-per-node", "2", "--top", "2"]
    assert plan_main([*flags, "--device-profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "on 2 x test cpu (8.0 GiB, 2 per node)" in out and "/memory/op overhead |" in out


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "no such file"),
        ("{not json", "not a JSON device profile"),
        ('{"device": "x"}', "not a device profile (missing fields device_type, torch, driver"),
        ("[1, 2]", "not a device profile (a JSON list, not an object)"),
        ("bad figure", "not a device profile (memory_bytes_per_s is -1.0, not a positive number)"),
    ],
    ids=["missing", "not json", "missing field", "not an object", "negative figure"],
)
def test_a_bad_device_profile_is_one_line_naming_the_file_and_the_fix(tmp_path, capsys, content, says):
    path = tmp_path / "profile.json"
    if content == "bad figure":
        content = json.dumps(dataclasses.replace(flat_profile(), memory_bytes_per_s=-1.0).to_json())
    if content is not None:
        path.write_text(content)
    assert plan_main(["--job.config", "debug_model", "--world-size", "2", "--device-profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--device-profile {path}: {says}" in err
    assert f"write one with python -m autopar.probe --output {path}" in err


def test_spearman_is_one_for_the_same_order_and_minus_one_for_the_reverse():
    assert spearman([3.0, 2.0, 1.0], [30.0, 25.0, 1.0]) == pytest.approx(1.0)
    assert spearman([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(-1.0)
    # one swap of neighbours among four: 1 - 6 * 2 / (4 * 15)
    assert spearman([4.0, 3.0, 2.0, 1.0], [4.0, 2.0, 3.0, 1.0]) == pytest.approx(0.8)


@pytest.mark.parametrize("config", ["debug_model", "debug_model_qwen3.5"])
def test_the_probe_times_models_holding_their_initial_weights_not_whatever_memory_held(config):
    args = model_args(debug_job("--job.config", config))
    with torch.device("meta"):
        reference = build_model(args)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=0)
    timed = initialized_model(args, torch.device("cpu"))
    for (name, got), want in zip(timed.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def never_probe(device: torch.device, local_world: int) -> DeviceProfile:
    raise AssertionError("probed: the refusal came after the work")


def test_a_cache_folder_inside_a_file_is_one_line_before_any_probe(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "a_file"))
    with pytest.raises(ConfigError, match=r"AUTOPAR_CACHE_DIR=.*a_file.* cannot cache .*a_file is a file"):
        probed_device(torch.device("cpu"), 1, 1, never_probe)


def test_a_damaged_cached_profile_names_the_probes_cache_flag(tmp_path):
    path = cache_path(device_name(torch.device("cpu")), 1, 1, tmp_path)
    path.write_text("{not json")
    with pytest.raises(ConfigError) as err:
        probed_device(torch.device("cpu"), 1, 1, never_probe, tmp_path)
    assert "python -m autopar.probe --cache" in str(err.value) and "--output" not in str(err.value)


def this_machines(profile: DeviceProfile, world: int) -> DeviceProfile:
    """``profile`` as if probed here, on ``world`` processes (collectives only for 2 or more)."""
    collectives = profile.collectives if world > 1 else ()
    return dataclasses.replace(
        profile, device=device_name(torch.device("cpu")), world_size=world, collectives=collectives
    )


def test_a_one_process_profile_pricing_a_multi_rank_plan_says_its_collectives_are_guessed(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "profile.json"
    this_machines(flat_profile(), 1).save(path)
    flags = ["--job.config", "debug_model", "--world-size", "2", "--gpus-per-node", "2", "--top", "1"]
    assert plan_main([*flags, "--device-profile", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"plan note: --device-profile {path} was measured on one process: no collective was timed" in err
    assert "torchrun --nproc-per-node 2" in err


@pytest.mark.parametrize("priced", ["preset", "other device", "one process"])
def test_a_check_against_figures_not_of_this_machine_is_refused_before_any_training(
    tmp_path, capsys, monkeypatch, priced
):
    """The check trains here: predictions priced for an H100 (the default preset), another
    device's profile or one without collectives would be compared with what they never priced."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "profile.json"
    profile = {"other device": flat_profile(), "one process": this_machines(flat_profile(), 1)}.get(priced)
    device = [] if profile is None else ["--device-profile", str(path)]
    if profile is not None:
        profile.save(path)
    flags = ["--job.config", "debug_model", "--world-size", "2", "--gpus-per-node", "2", "--check", "1"]
    assert plan_main([*flags, *device, "--job.dump_folder", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("plan error: --check trains"), err
    assert {"preset": "priced for --device h100", "other device": "measured on test cpu"}.get(
        priced, "has no collectives measured"
    ) in err
    assert not (tmp_path / "runs").exists()


def test_a_check_far_from_its_prediction_is_flagged_not_reported_as_a_result():
    """The sweep's row: 6,997 tokens/s predicted, 30 measured."""
    rows = [
        {"plan": "dp_shard=2", "predicted_tokens_per_s": 1100.0, "measured_tokens_per_s": 1000.0},
        {"plan": "tp=2", "predicted_tokens_per_s": 6997.0, "measured_tokens_per_s": 30.0},
    ]
    for row in rows:
        row["error"] = row["predicted_tokens_per_s"] / row["measured_tokens_per_s"] - 1
    (note,) = far_off(rows)
    assert note.startswith("plan note: #2 tp=2: predicted 6,997 tokens/s, measured 30 (233x)")
    assert "not this machine's as it ran" in note
