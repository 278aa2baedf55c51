"""``training.sdpa_backend`` pins the attention kernel: the pinned one is what runs, training
is the same number on every kernel, and a kernel the device lacks is a config error."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.config import ConfigError
from autopar.distributed import single_process
from autopar.planner.memory import predict
from autopar.plans.materialize import seeded_values
from autopar.plans.mesh import ParallelDims, build_meshes
from autopar.plans.parallelize import build_parts
from autopar.trainer import Trainer
from autopar.validate import validate

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


def _attention_ops(job) -> set[object]:
    args = validate(job, 1, "cpu")
    built = build_parts(
        args,
        job,
        build_meshes(ParallelDims.resolve(job.parallelism, 1), "cpu"),
        torch.device("cpu"),
        seeded_values(args, 0, torch.device("cpu")),
    )
    with _Ops() as ops:
        built.parts[0](torch.zeros((1, 32), dtype=torch.long))
    return ops.seen


@pytest.mark.parametrize(("backend", "flash_runs"), [("auto", True), ("flash", True), ("math", False)])
def test_the_pinned_backend_is_the_kernel_that_runs(tmp_path, backend, flash_runs):
    job = tiny_job(tmp_path, "--training.sdpa_backend", backend)
    assert (CPU_FLASH in _attention_ops(job)) == flash_runs


def test_every_cpu_backend_trains_the_same_numbers(tmp_path):
    runs = {}
    for backend in ("flash", "math"):
        job = tiny_job(tmp_path / backend, "--training.sdpa_backend", backend)
        runs[backend] = Trainer(job, validate(job, 1, "cpu"), single_process()).train()
    for flash, math in zip(runs["flash"], runs["math"], strict=True):
        assert flash.loss == pytest.approx(math.loss, rel=1e-5)
        assert flash.grad_norm == pytest.approx(math.grad_norm, rel=1e-4)


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_cuda_kernel_on_cpu_is_a_config_error_naming_what_cpu_has(tmp_path, backend):
    with pytest.raises(
        ConfigError, match=r"sdpa_backend='(efficient|cudnn)' is a CUDA kernel.*'flash', 'math'"
    ):
        validate(tiny_job(tmp_path, "--training.sdpa_backend", backend), 1, "cpu")


def test_flash_on_cuda_with_document_masking_is_a_config_error(tmp_path):
    job = tiny_job(tmp_path, "--training.sdpa_backend", "flash", "--training.document_masking", "true")
    with pytest.raises(ConfigError, match="takes no attention mask on CUDA, and document masking needs one"):
        validate(job, 1, "cuda")
    validate(job, 1, "cpu")  # CPU's flash kernel takes masks


def test_the_planner_refuses_the_math_kernel_it_does_not_model(tmp_path):
    job = tiny_job(tmp_path, "--training.sdpa_backend", "math")
    with pytest.raises(ConfigError, match="sdpa_backend='math' saves a seq_len x seq_len attention matrix"):
        predict(validate(job, 8, "cuda"), job, 8)
