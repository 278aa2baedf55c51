"""``training.sdpa_backend`` pins the attention kernel: the pinned one is what runs, training
is the same number on every kernel, and a kernel the device lacks is a config error. Grouped
k/v heads reach SDPA as they are wherever the kernel takes them, with the same numbers as
expanded ones."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.config import ConfigError
from autopar.models import Qwen
from autopar.models.flavors import get_flavor
from autopar.parallel.materialize import seeded_values
from autopar.parallel.mesh import ParallelDims, build_meshes
from autopar.parallel.parallelize import build_parts
from autopar.parallel.sdpa_backend import BACKENDS, apply_attention_kernel, model_groups_kv, native_gqa
from autopar.parallel.world import single_process
from autopar.planner.memory import predict
from autopar.training.preflight import check_job
from autopar.training.trainer import Trainer

from jobs import tiny_job

CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class _Ops(TorchDispatchMode):
    """The aten ops a forward dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[object] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def _built_model(job) -> torch.nn.Module:
    """The job's model as the trainer builds it on one CPU process."""
    args = check_job(job, 1, "cpu")
    built = build_parts(
        args,
        job,
        build_meshes(ParallelDims.resolve(job.parallelism, 1), "cpu"),
        torch.device("cpu"),
        seeded_values(args, 0, torch.device("cpu")),
    )
    return built.parts[0]


def _attention_ops(job) -> set[object]:
    model = _built_model(job)
    with _Ops() as ops:
        model(torch.zeros((1, 32), dtype=torch.long))
    return ops.seen


@pytest.mark.parametrize(("backend", "flash_runs"), [("auto", True), ("flash", True), ("math", False)])
def test_the_pinned_backend_is_the_kernel_that_runs(tmp_path, backend, flash_runs):
    job = tiny_job(tmp_path, "--training.sdpa_backend", backend)
    assert (CPU_FLASH in _attention_ops(job)) == flash_runs


def test_the_kernel_a_plan_swaps_in_shows_in_the_models_repr(tmp_path):
    job = tiny_job(
        tmp_path, "--training.sdpa_backend", "math", "--training.mixed_precision_param", "bfloat16"
    )
    shown = repr(_built_model(job))
    assert "(sdpa): PinnedScaledDotProduct(native_gqa=True, backend=math)" in shown
    assert "weights cast to torch.bfloat16" in shown


def test_every_cpu_backend_trains_the_same_numbers(tmp_path):
    runs = {}
    for backend in ("flash", "math"):
        job = tiny_job(tmp_path / backend, "--training.sdpa_backend", backend)
        runs[backend] = Trainer(job, check_job(job, 1, "cpu"), single_process()).train()
    for flash, math in zip(runs["flash"], runs["math"], strict=True):
        assert flash.loss == pytest.approx(math.loss, rel=1e-5)
        assert flash.grad_norm == pytest.approx(math.grad_norm, rel=1e-4)


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_cuda_kernel_on_cpu_is_a_config_error_naming_what_cpu_has(tmp_path, backend):
    with pytest.raises(
        ConfigError, match=r"sdpa_backend='(efficient|cudnn)' is a CUDA kernel.*'flash', 'math'"
    ):
        check_job(tiny_job(tmp_path, "--training.sdpa_backend", backend), 1, "cpu")


def test_flash_on_cuda_with_document_masking_is_a_config_error(tmp_path):
    job = tiny_job(tmp_path, "--training.sdpa_backend", "flash", "--training.document_masking", "true")
    with pytest.raises(ConfigError, match="takes no attention mask on CUDA, and document masking needs one"):
        check_job(job, 1, "cuda")
    check_job(job, 1, "cpu")  # CPU's flash kernel takes masks


def test_the_planner_refuses_the_math_kernel_it_does_not_model(tmp_path):
    job = tiny_job(tmp_path, "--training.sdpa_backend", "math")
    with pytest.raises(ConfigError, match="sdpa_backend='math' saves a seq_len x seq_len attention matrix"):
        predict(check_job(job, 8, "cuda"), job, 8)


def _gqa_forward_backward(native: bool, documents: torch.Tensor | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Qwen(get_flavor("qwen3", "debug"))  # 8 query heads share 4 k/v heads
    model.init_weights(seed=0)
    apply_attention_kernel(model, native)
    tokens = torch.randint(0, model.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    logits = model(tokens, documents=documents)
    logits.float().square().mean().backward()
    return [logits, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document-mask"])
def test_grouped_kv_heads_give_what_expanded_ones_give(backend, masked):
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 48]) if masked else None
    with sdpa_kernel(BACKENDS[backend]):
        grouped = _gqa_forward_backward(True, documents)
        expanded = _gqa_forward_backward(False, documents)
    for a, b in zip(grouped, expanded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _SdpaKeyHeads(TorchDispatchMode):
    """The head count of every key that reaches CPU flash attention."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is CPU_FLASH:
            self.heads.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


def test_a_built_model_passes_grouped_kv_heads_to_cpu_flash_attention(tmp_path):
    job = tiny_job(tmp_path)  # 4 query heads, 2 k/v heads
    model = _built_model(job)
    args = model.args
    with _SdpaKeyHeads() as seen:
        model(torch.zeros((1, 32), dtype=torch.long))
    assert seen.heads == [args.num_key_value_heads] * args.num_hidden_layers


@pytest.mark.parametrize(
    ("flags", "cp_impl", "native"),
    [
        ([], "ring", True),  # bf16 flash
        (["--training.sdpa_backend", "cudnn"], "ring", True),
        (["--training.sdpa_backend", "efficient"], "ring", False),  # no grouped heads
        (["--training.mixed_precision_param", "float32"], "ring", False),  # fp32: efficient
        (["--training.document_masking", "true"], "ring", False),  # masked: efficient
        (["--training.document_masking", "true", "--training.sdpa_backend", "cudnn"], "ring", True),
        (["--parallelism.context_parallel_degree", "2"], "ring", True),  # ring around flash
        (
            ["--parallelism.context_parallel_degree", "2", "--training.sdpa_backend", "efficient"],
            "ring",
            False,
        ),
        (["--parallelism.context_parallel_degree", "2"], "allgather", False),  # masked
    ],
)
def test_cuda_groups_kv_heads_only_where_the_kernel_that_runs_takes_them(tmp_path, flags, cp_impl, native):
    job = tiny_job(tmp_path, "--training.mixed_precision_param", "auto", *flags)  # bf16 on CUDA
    assert native_gqa(job, "cuda", cp_impl) is native


@pytest.mark.parametrize(
    "flags", [[], ["--training.document_masking", "true"], ["--training.sdpa_backend", "math"]]
)
def test_cpu_always_groups_kv_heads(tmp_path, flags):
    assert native_gqa(tiny_job(tmp_path, *flags), "cpu", "allgather")


@pytest.mark.parametrize(
    ("flags", "cp_impl", "grouped"),
    [
        (["--parallelism.context_parallel_degree", "2"], "allgather", True),  # expanded after the gather
        (
            ["--parallelism.context_parallel_degree", "2", "--training.sdpa_backend", "efficient"],
            "ring",
            False,
        ),
        (["--training.mixed_precision_param", "float32"], "allgather", False),  # no CP: the kernel's choice
    ],
)
def test_all_gather_cp_gets_grouped_kv_heads_whatever_the_kernel_takes(tmp_path, flags, cp_impl, grouped):
    job = tiny_job(tmp_path, "--training.mixed_precision_param", "auto", *flags)
    assert not native_gqa(job, "cuda", cp_impl)
    assert model_groups_kv(job, "cuda", cp_impl) is grouped
