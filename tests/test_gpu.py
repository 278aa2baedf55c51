"""What only a GPU can show, in one process: CUDA kernels against the CPU-proven math.

Multi-rank CUDA checks need one GPU per rank (NCCL refuses two ranks on one device, and two
ranks sharing one GPU over gloo hung on torch 2.11 in our trial), so they are not here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from autopar.cli.parity import plan_job, relative_deltas
from autopar.parallel.context_parallel import shard_sequence
from autopar.parallel.world import single_process
from autopar.training.preflight import check_job
from autopar.training.trainer import Trainer

from jobs import tiny_job

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_tail", [True, False])
def test_masked_attention_of_a_cp_shard_equals_its_rows_of_causal_attention(device, head_tail):
    """The all-gather CP attention of rank r (its queries against every key, masked by
    global positions) equals rank r's rows of the full causal attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen).to(device) for _ in range(3))  # (B, H, S, D)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    positions = torch.arange(64, device=device)
    for rank in range(4):
        local_q = shard_sequence(q, rank, 4, head_tail, dim=2)
        local_pos = shard_sequence(positions, rank, 4, head_tail, dim=0)
        mask = positions[None, :] <= local_pos[:, None]
        out = F.scaled_dot_product_attention(local_q, k, v, attn_mask=mask)
        expected = shard_sequence(full, rank, 4, head_tail, dim=2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # fp32, different kernels


def _train(job):
    records = Trainer(job, check_job(job, 1), single_process("cuda")).train()
    return [r.loss for r in records]


@pytest.mark.gpu
def test_cuda_bf16_compiled_matches_eager(tmp_path):
    flags = ("--training.mixed_precision_param", "bfloat16", "--training.seq_len", "128")
    eager = _train(plan_job(tiny_job(tmp_path, *flags), "", 5, str(tmp_path / "e")))
    compiled = _train(
        plan_job(tiny_job(tmp_path, *flags, "--compile.enable", "true"), "", 5, str(tmp_path / "c"))
    )
    # bf16 matmuls fused differently by inductor: a few bf16 ulps on the loss
    assert max(relative_deltas(compiled, eager)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_cuda_ring_attention_machinery_on_one_rank_matches_plain_forward(tmp_path, rotate):
    """A CP world of one still runs torch's ring-attention dispatch, the head-tail load
    balancer and our position buffers on the CUDA SDPA kernels; the logits must not move."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.config.sections import Parallelism
    from autopar.data.loader import Batch
    from autopar.models import Qwen, get_flavor
    from autopar.parallel.context_parallel import ContextParallel
    from autopar.parallel.sdpa_backend import apply_attention_kernel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        model = Qwen(get_flavor("qwen3", "debug")).cuda()
        model.init_weights()
        apply_attention_kernel(model, False)  # fp32: expanded heads, what native_gqa gives
        tokens = torch.randint(0, 512, (2, 64), device="cuda")
        expected = model(tokens)
        cfg = Parallelism(context_parallel_impl="ring", context_parallel_rotate_method=rotate)
        with ContextParallel(cfg, mesh, "cuda")(Batch(tokens, tokens)) as (batch, positions):
            got = model(batch.inputs, positions=positions)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32, same kernels
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn"])
def test_cuda_ring_attention_with_grouped_kv_heads_equals_expanded_ones(tmp_path, backend):
    """Whether torch's ring attention takes grouped k/v heads on each CUDA kernel (bf16, a CP
    world of one: the dispatch and the kernels; the rotation itself is shape-agnostic and runs
    grouped heads on CPU): logits and k/v projection gradients equal the expanded heads'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.config.sections import Parallelism
    from autopar.data.loader import Batch
    from autopar.models import Qwen, get_flavor
    from autopar.parallel.context_parallel import ContextParallel
    from autopar.parallel.sdpa_backend import apply_attention_kernel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        model = Qwen(get_flavor("qwen3", "debug")).cuda()  # 8 query heads, 4 k/v heads
        model.init_weights()
        model.to(torch.bfloat16)
        tokens = torch.randint(0, 512, (2, 256), device="cuda")
        cfg = Parallelism(context_parallel_impl="ring")
        results = {}
        for native in (False, True):
            apply_attention_kernel(model, native, backend)
            model.zero_grad(set_to_none=True)
            with ContextParallel(cfg, mesh, "cuda")(Batch(tokens, tokens)) as (batch, positions):
                logits = model(batch.inputs, positions=positions).float()
                logits.logsumexp(-1).mean().backward()
            attention = model.layers["0"].self_attn
            results[native] = (
                logits,
                attention.k_proj.weight.grad.float(),
                attention.v_proj.weight.grad.float(),
            )
        for got, expected in zip(results[True], results[False]):
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)  # bf16 kernels
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "masked"), [("auto", False), ("cudnn", False), ("cudnn", True)])
def test_cuda_grouped_kv_heads_run_the_fused_kernel_and_equal_expanded_ones(backend, masked):
    """Where ``native_gqa`` passes grouped k/v heads (bf16: flash or cuDNN, or a pinned cuDNN, masked
    too), the fused kernel takes them, not the math fallback, with expanded heads' numbers."""
    from torch.nn.attention import sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.models import Qwen, get_flavor
    from autopar.parallel.sdpa_backend import BACKENDS, apply_attention_kernel

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    model = Qwen(get_flavor("qwen3", "debug")).cuda()  # 8 query heads, 4 k/v heads
    model.init_weights()
    model.to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 256), device="cuda")
    documents = torch.zeros_like(tokens).index_fill_(1, torch.arange(100, 256, device="cuda"), 1)
    outputs = {}
    for native in (True, False):
        apply_attention_kernel(model, native)
        kernel = sdpa_kernel(BACKENDS[backend]) if backend != "auto" else contextlib.nullcontext()
        with kernel, Ops() as ops:
            outputs[native] = model(tokens, documents=documents if masked else None).float()
        if native:
            fused = {  # torch 2.11 on an H100 picks cuDNN's for auto (seen 2026-11-27)
                "auto": {"_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"},
                "cudnn": {"_scaled_dot_product_cudnn_attention"},
            }
            assert fused[backend] & {name.split(".")[0] for name in ops.names}, ops.names
    torch.testing.assert_close(outputs[True], outputs[False], rtol=2e-2, atol=2e-2)  # bf16 kernels


@pytest.mark.gpu
def test_cuda_memory_snapshots_are_dumped_every_profile_freq_steps(tmp_path):
    import pickle

    flags = (
        "--training.steps",
        "4",
        "--profiling.enable_memory_snapshot",
        "true",
        "--profiling.profile_freq",
        "2",
    )
    _train(tiny_job(tmp_path, *flags))
    folders = sorted(p.name for p in (tmp_path / "memory_snapshot").iterdir())
    assert folders == ["iteration_2", "iteration_4"]
    snapshot = pickle.loads(
        (tmp_path / "memory_snapshot" / "iteration_4" / "rank0_memory_snapshot.pickle").read_bytes()
    )
    assert snapshot["segments"]  # the allocator's memory, with its history


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_cuda_decoding_continues_its_state_as_one_forward_over_the_sequence(family):
    """The sampler's KV cache and delta-rule state on CUDA: the logits of a prefill and each
    one-token step equal one forward over the whole generated sequence, and the greedy tokens
    equal the CPU's."""
    from test_generate import PROMPTS, tiny

    from autopar.models.generation import Decoder, generate

    cpu_model = tiny(family)
    prompt = PROMPTS[1][:20]
    on_cpu = generate(cpu_model, [prompt], 12)[0]
    model = cpu_model.cuda()
    new = generate(model, [prompt], 12)[0]
    decoder = Decoder(model, 1, 32)
    steps = [decoder.forward(torch.tensor([prompt]).cuda(), slice(None), torch.tensor([0]).cuda())]
    for i, token in enumerate(new[:-1]):
        token_at = torch.tensor([[token]]).cuda(), slice(None), torch.tensor([20 + i]).cuda()
        steps.append(decoder.forward(*token_at))
    with torch.no_grad():
        full = model(torch.tensor([prompt + new[:-1]]).cuda())
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)  # fp32, other kernels
    assert new == on_cpu
