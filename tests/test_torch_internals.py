"""The private torch names autopar leans on, in one list: a torch upgrade that moves or drops
one fails here by name, before it fails somewhere deep in a dry run or a pipeline step.
Checked against torch 2.11 (the GPU image) and 2.13 (CI). Each entry says where it is used."""

from __future__ import annotations

import importlib

import pytest
import torch

INTERNALS = {
    # (module, dotted attribute): where and why
    ("torch.distributed.distributed_c10d", "_world.pg_map"): "distributed.set_timeout: every group's timeout",
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"): "distributed.set_timeout",
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"): "dry_run: caches keyed by meshes",
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"): "dry_run",
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"): "dry_run",
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator._propagate_tensor_meta_non_cached",
    ): "dry_run: patched so fake-tensor sharding is not cached across groups",
    ("torch.distributed.pipelining._utils", "InferenceMode.STATIC"): "dry_run: stages skip shape inference",
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"): "dry_run: peak memory per category",
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"): "dry_run: the fake process group",
    ("torch._guards", "active_fake_mode"): "dry_run",
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode"): "dry_run",
    ("torch.utils._python_dispatch", "_pop_mode_temporarily"): "dry_run",
    ("torch.utils._python_dispatch", "TorchDispatchMode"): "plans.activation_checkpoint, dry_run",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
    ): "plans.activation_checkpoint",
    ("torch.distributed._functional_collectives", "all_reduce"): "loss, plans.context_parallel",
    (
        "torch.distributed.tensor.experimental._attention",
        "_cp_options",
    ): "plans.context_parallel: rotate method",
    ("torch._subclasses.fake_tensor", "is_fake"): "plans.expert_parallel",
    ("torch._functorch.config", "donated_buffer"): "pipelining.schedule: split backward of compiled graphs",
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten"): "plans.mesh: one world mesh, several views",
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"): "plans.mesh",
}
OPS = ["_c10d_functional.wait_tensor", "_c10d_functional.all_to_all_single", "_c10d_functional.all_reduce"]
"""Operators the dry run and per-op activation checkpointing recognise by name."""


@pytest.mark.parametrize(("module", "name"), INTERNALS, ids=[f"{m}.{n}" for m, n in INTERNALS])
def test_a_private_torch_name_autopar_uses_is_still_there(module, name):
    value = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(value, part), (
            f"torch {torch.__version__}: {module}.{name} is gone ({INTERNALS[module, name]})"
        )
        value = getattr(value, part)


@pytest.mark.parametrize("op", OPS)
def test_a_collective_operator_autopar_recognises_is_still_there(op):
    namespace, name = op.split(".")
    assert hasattr(getattr(torch.ops, namespace), name), f"torch {torch.__version__}: torch.ops.{op} is gone"
