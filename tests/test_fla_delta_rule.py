"""``training.delta_rule_kernel = "fla"``: FLA's Triton kernels equal autopar's delta rule.

On a CPU the kernels run in Triton's interpreter, in a process of their own
(``tests/fla_parity.py`` says why); on CUDA they run compiled. Either way the numbers are held
against autopar's kernel, which ``test_delta_rule.py`` holds against the token-by-token rule.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.config import ConfigError
from autopar.models.qwen3_5.fla_delta_rule import _cu_seqlens, hopper_triton_problem
from autopar.parallel.delta_rule_kernel import check_kernel_installed
from autopar.training.preflight import check_job

from jobs import hybrid_job, tiny_job

HAS_FLA = all(importlib.util.find_spec(name) for name in ("fla", "triton"))
WHY_APART = (
    "with FLA installed, transformers runs its own Qwen3.5 on FLA's kernels, which fail on a CPU "
    "and so break the HF comparisons; run this file in an environment of its own (tests/fla_parity.py)"
)
INTERPRETER_TOLERANCE = 2e-5
"""fp32 in Triton's interpreter: at most 2e-6 of the largest value measured (output and
every gradient), so tenfold margin; a missed document start gives 0.34."""


def test_cu_seqlens_start_a_sequence_at_each_row_and_each_document():
    documents = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 2, 2]])  # row 1 continues row 0's id
    assert _cu_seqlens(documents).tolist() == [0, 4, 6, 8, 9, 10, 12]


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_FLA, reason=f"needs fla-core and triton, which the test extra leaves out: {WHY_APART}"
)
def test_fla_kernel_equals_autopar_kernel_in_triton_interpreter():
    """Outputs and gradients, in fp32: of the op (plain, grouped value heads, packed
    documents), of its run from an entry state and its range map (context parallelism's
    needs), of a Gated DeltaNet layer compiled with fullgraph=True, and of a layer passing
    states over two CP ranks (head-tail and in order, documents crossing ranks)."""
    script = Path(__file__).with_name("fla_parity.py")
    root = str(script.parent.parent)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    worst = {case: max(found.values()) for case, found in errors.items()}
    expected = {
        "plain",
        "grouped_values",
        "documents",
        "grouped_values_entry",
        "documents_entry",
        "layer_compiled",
    }
    assert set(worst) == expected | {"layer_cp"}
    assert max(worst.values()) < INTERPRETER_TOLERANCE, worst


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="fla-core is not installed: pip install 'autopar[fla]'")
def test_fla_kernel_equals_autopar_kernel_on_cuda():
    """fp32 inputs; FLA's fp32 dots run in TF32 (10-bit mantissa) on Hopper, ours in fp32."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fla_parity import CASES, compare, compare_entry, compare_layer

    worst = {name: max(compare(case, "cuda", torch.float32).values()) for name, case in CASES.items()}
    for name in ("grouped_values", "documents"):
        worst[f"{name}_entry"] = max(compare_entry(CASES[name], "cuda", torch.float32).values())
    worst["layer_compiled"] = max(compare_layer("cuda", compiled=True).values())
    print(json.dumps(worst))
    assert max(worst.values()) < 1e-2, worst


def test_fla_kernel_is_refused_on_cpu(tmp_path):
    job = hybrid_job(tmp_path, "--training.delta_rule_kernel", "fla")
    with pytest.raises(ConfigError, match="delta_rule_kernel='fla' runs Triton CUDA kernels; on cpu"):
        check_job(job, 1, "cpu")


def test_fla_kernel_is_refused_for_a_model_without_gated_deltanet_layers(tmp_path):
    job = tiny_job(tmp_path, "--training.delta_rule_kernel", "fla")
    with pytest.raises(ConfigError, match="which qwen3 has none of"):
        check_job(job, 1, "cuda")


def test_fla_kernel_of_another_version_is_refused_where_the_job_runs(tmp_path, monkeypatch):
    job = hybrid_job(tmp_path, "--training.delta_rule_kernel", "fla")
    monkeypatch.setattr(
        "autopar.parallel.delta_rule_kernel.fla_version_problem", lambda: "fla-core 0.5.1 is installed"
    )
    with pytest.raises(
        ConfigError, match=r"delta_rule_kernel=.fla.: fla-core 0\.5\.1 is installed; or use autopar"
    ):
        check_kernel_installed(job)


@pytest.mark.parametrize(
    ("capability", "triton", "tilelang", "refused"),
    [
        ((9, 0), "3.6.0", False, True),  # H100 with torch 2.11's Triton: seen refused by fla-core
        ((9, 0), "3.4.0+git5389ed79", False, True),
        ((9, 0), "3.7.1", False, False),
        ((9, 0), "3.3.1", False, False),
        ((9, 0), "3.6.0", True, False),  # tilelang replaces the broken kernel
        ((8, 0), "3.6.0", False, False),  # A100: not Hopper
        ((10, 0), "3.6.0", False, False),
    ],
)
def test_fla_kernel_is_refused_on_hopper_with_a_triton_that_breaks_its_backward(
    capability, triton, tilelang, refused
):
    problem = hopper_triton_problem(capability, triton, tilelang)
    assert (problem is not None) == refused
    if refused:
        assert f"Triton {triton}" in problem and "triton>=3.7.1 or tilelang" in problem


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="fla-core is not installed: pip install 'autopar[fla]'")
def test_fla_kernel_trains_a_compiled_bf16_qwen3_5_like_autopar_kernel(tmp_path):
    from autopar.cli.parity import plan_job, relative_deltas
    from autopar.parallel.world import single_process
    from autopar.training.trainer import Trainer

    def losses(kernel: str) -> list[float]:
        flags = ("--training.mixed_precision_param", "bfloat16", "--training.seq_len", "256")
        base = hybrid_job(
            tmp_path, *flags, "--compile.enable", "true", "--training.delta_rule_kernel", kernel
        )
        job = plan_job(base, "", 5, str(tmp_path / kernel))
        return [r.loss for r in Trainer(job, check_job(job, 1), single_process("cuda")).train()]

    fla, ours = losses("fla"), losses("autopar")
    print(fla, ours)
    assert max(relative_deltas(fla, ours)) <= 2e-2  # bf16 GEMMs in two kernels' orders


def _block_saves(kernel: str) -> tuple[float, int]:
    """(the planner's bytes a debug Qwen3.5 Gated DeltaNet block saves, what autograd saves),
    bf16 over 1100 tokens; the activations are fake tensors, so FLA's op runs its fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from autopar.models.qwen3_5.model import HybridBlock
    from autopar.parallel.delta_rule_kernel import apply_delta_rule_kernel
    from autopar.parallel.mesh import ParallelDims
    from autopar.planner.activations import sizes
    from autopar.planner.block_bytes import block_bytes_no_ac
    from autopar.training.resolve import model_args, parse_job

    flags = ["--model.name=qwen3.5", "--model.flavor=debug", "--training.seq_len=1100"]
    job = parse_job([*flags, f"--training.delta_rule_kernel={kernel}"])
    args = model_args(job)
    block = HybridBlock(args, 0).to(torch.bfloat16)
    apply_delta_rule_kernel(block, kernel, "cpu")
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):  # not a weight
            saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(1, 1100, args.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
    z = sizes(args, job, ParallelDims(1, 1, 1, 1, 1), 1, "ring", 2, "cpu")
    return block_bytes_no_ac(z, args.layer_kind(0), args.qk_norm), sum(saved.values())


def test_planner_counts_what_fla_kernel_saves_beyond_autopar_kernel():
    """The planner's difference between the kernels equals autograd's (measured: to the
    byte; without the reciprocal norms it is 3% short)."""
    fla_predicted, fla_saved = _block_saves("fla")
    ours_predicted, ours_saved = _block_saves("autopar")
    assert fla_predicted - ours_predicted == pytest.approx(fla_saved - ours_saved, rel=1e-3)
