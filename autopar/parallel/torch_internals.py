"""Every private torch name autopar imports or patches, in one module: a torch upgrade is one
file to read. Checked against torch 2.11 (the GPU image), 2.13 (CI) and 2.15.0 (the CUDA wheel
run on CPU); ``tests/test_torch_internals.py`` fails by name when one of ``LEANED_ON`` moves or
goes, and fails when a module outside this one imports a private torch name.

Private *operators* (``torch.ops._c10d_functional.*``, ``torch._grouped_mm``) are called where
they are used and listed in that test; everything reached through a private module or
attribute is here, each beside the reason autopar needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _redistribute
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_map

CHECKED_WITH = ("2.11", "2.13", "2.15")
"""The torch versions every name below was checked against (and the whole suite passed on):
the supported range is their first to their last; a newer torch is warned about at start-up."""

LEANED_ON = {
    # (module, dotted attribute): why autopar needs it
    ("torch.distributed._functional_collectives", "all_reduce"): "collectives that compile (loss, CP, EP)",
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd"): "EP token dispatch",
    (
        "torch.distributed._functional_collectives",
        "_maybe_wrap_tensor",
    ): "gloo: functional collectives wait at once",
    (
        "torch.distributed._functional_collectives",
        "_are_we_tracing",
    ): "gloo: functional collectives wait at once",
    ("torch._guards", "active_fake_mode"): "dry run: which fake mode allocates",
    ("torch._subclasses.fake_tensor", "is_fake"): "EP: fake routing counts in the dry run",
    ("torch._subclasses.fake_tensor", "FakeTensorMode"): "dry run: tensors without storage",
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"): "dry run: peak memory by category",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
    ): "activation checkpointing",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "CheckpointWrapper",
    ): "compile: a checkpointed block's inside",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "_CHECKPOINT_WRAPPED_MODULE",
    ): "compile: a checkpointed block's inside",
    ("torch.nn.utils.stateless", "_reparametrize_module"): "mixed precision: cast weights for one call",
    ("torch.overrides", "_get_current_function_mode_stack"): "AC: recompute under the forward's modes",
    (
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
    ): "per-op AC, the dry run's tracker and the probe's op counter",
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode"): "dry run",
    ("torch.utils._python_dispatch", "_pop_mode_temporarily"): "dry run",
    ("torch.utils._pytree", "tree_map"): "AC",
    ("torch.utils._pytree", "tree_flatten"): "dry run",
    ("torch.distributed.distributed_c10d", "_world.pg_map"): "set_group_timeouts: every group",
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"): "set_group_timeouts",
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten"): "mesh: one world mesh, several views",
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"): "mesh: the loss view",
    (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "FSDPParamGroup",
    ): "RL rollouts: FSDP's weights kept gathered, then each group's post_forward_mesh_info back",
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"): "RL rollouts: each module's param groups",
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"): "forget_sharding_caches",
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"): "forget_sharding_caches",
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"): "forget_sharding_caches",
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator._propagate_tensor_meta_non_cached",
    ): "sharding_propagation_untracked",
    ("torch.distributed.pipelining._utils", "InferenceMode.STATIC"): "assume_static_stage_metadata",
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"): "fake_store: the dry run's process group",
    (
        "torch.distributed.tensor.experimental._attention",
        "_cp_options.enable_load_balance",
    ): "ring_attention_options",
    ("torch.distributed.tensor.experimental._attention", "set_rotate_method"): "ring_attention_options",
    ("torch._functorch.config", "donated_buffer"): "keep_donated_buffers: split-backward pipelines",
    (
        "torch._dynamo.config",
        "automatic_dynamic_shapes",
    ): "static_shapes: the probe's and the dry run's compiled steps",
    ("torch._inductor", "config.cpp.simdlen"): "key_compile_cache_on_vector_isa",
    ("torch._inductor.cpu_vec_isa", "pick_vec_isa"): "key_compile_cache_on_vector_isa",
}

LEANED_ON_BEFORE = {
    # (module, dotted attribute): (the first torch version that does without it, why before it)
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._warmup_p2p"): (
        "2.15",
        "assume_static_stage_metadata: the warm-up vote 2.15 skips under a fake group by itself",
    ),
}
"""Names autopar needs only on torch older than the version given beside each."""

__all__ = [
    "FSDPMemTracker",
    "FakeTensorMode",
    "TorchDispatchMode",
    "active_fake_mode",
    "checkpoint_wrapper",
    "checkpointed_inside",
    "funcol",
    "function_mode_stack",
    "is_fake",
    "reparametrize_module",
    "tree_flatten",
    "tree_map",
]

reparametrize_module = _reparametrize_module
"""functional_call's own reparametrization: swaps tensors into a module for one call without
calling the module again (functional_call would, and reach a patched forward twice)."""

function_mode_stack = _get_current_function_mode_stack
"""The torch-function modes active now (CP's attention mode among them)."""


def checkpointed_inside(block: nn.Module) -> nn.Module:
    """The module a checkpoint wrapper wraps (``block`` itself when it wraps none)."""
    return getattr(block, _CHECKPOINT_WRAPPED_MODULE) if isinstance(block, CheckpointWrapper) else block


def set_group_timeouts(seconds: int, skip_desc: str) -> None:
    """Bound every live process group's collectives (but the one described ``skip_desc``):
    torch has no public way to change a made group's timeout."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group.group_desc != skip_desc:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh``'s one dimension seen as several: views of one world mesh share its groups."""
    return mesh._unflatten(0, sizes, names)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Several dimensions of ``mesh`` as one, named ``name``."""
    return mesh._flatten(name)


def forget_sharding_caches() -> None:
    """Drop DTensor's cached sharding and redistribution decisions. They are keyed by device
    meshes, which compare equal across process groups (rank layout and names, not the
    group), so a later fake group would be handed a destroyed group's meshes (a flattened
    mesh inside a cached redistribution, under CP x TP): "Could not resolve the process group"."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python and the C++ dispatch fast path's caches
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@contextlib.contextmanager
def sharding_propagation_untracked(tracker_types: tuple[type, ...]) -> Iterator[None]:
    """Run DTensor's shape propagation outside the dispatch mode on top when it is one of
    ``tracker_types``. Propagation runs each op once more on whole-tensor (unsharded) fakes,
    which a real run never allocates; a memory tracker must not count them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: ShardingPropagator, op_schema: object) -> object:
        if not isinstance(_get_current_dispatch_mode(), tracker_types):
            return original(self, op_schema)
        with _pop_mode_temporarily():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def assume_static_stage_metadata(schedule: object) -> None:
    """Stand in for a schedule's warm-up vote, in which the pipeline ranks agree whether every
    stage's metadata is static: a fake process group carries no data to vote with, and the
    caller knows the answer (its stages were given complete static shapes). torch >= 2.15
    has no such vote under a fake group: complete metadata is enough there."""
    from torch.distributed.pipelining._utils import InferenceMode

    if not hasattr(schedule, "_warmup_p2p"):
        return

    def vote(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote  # type: ignore[attr-defined]


def torch_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``2.15.0+cu132`` -> ``(2, 15)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def untested_torch_warning(version: str = torch.__version__) -> str | None:
    """One line when ``version`` is newer than every torch autopar was checked with, else None."""
    if torch_version(version) <= max(map(torch_version, CHECKED_WITH)):
        return None
    return (
        f"torch {version} is newer than the versions autopar was tested with "
        f"({CHECKED_WITH[0]} to {CHECKED_WITH[-1]}); if something fails, try torch {CHECKED_WITH[-1]}"
    )


def fake_store() -> dist.Store:
    """The store of torch's ``fake`` backend: collectives that move no data, for the dry run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextlib.contextmanager
def ring_attention_options(rotate_method: str, load_balance: bool) -> Iterator[None]:
    """torch's ring attention, while inside: how k/v pass between ranks (``allgather`` or
    ``alltoall``) and whether sequences are load-balanced (head-tail sharding)."""
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    set_rotate_method(rotate_method)
    previous = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = load_balance
    try:
        yield
    finally:
        _cp_options.enable_load_balance = previous


def keep_donated_buffers() -> contextlib.AbstractContextManager:
    """AOT autograd keeps the buffers it would donate to the backward: needed where a backward
    runs with ``retain_graph`` (a split backward's input pass, before its weight pass)."""
    return torch._functorch.config.patch(donated_buffer=False)


def static_shapes() -> contextlib.AbstractContextManager:
    """torch.compile keeps a static graph per input shape rather than recompiling one with
    dynamic sizes when a second shape arrives: a graph per batch, as a job compiling its one
    shape gets (the probe times two batches on one compiled model)."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def forget_compiled_graphs() -> None:
    """Drop every graph torch.compile made in this process, and its recompile counts: a dry
    run then compiles as a fresh job does, neither reusing the graphs of earlier dry runs nor
    running past the recompile limit after many shapes (which stops a full graph)."""
    torch._dynamo.reset()


@contextlib.contextmanager
def fsdp_weights_gathered(modules: list[nn.Module]) -> Iterator[None]:
    """Every FSDP2 module among ``modules`` gathered once and kept gathered through the block
    (no reshard after each forward, so forwards run without FSDP's collectives), then resharded
    and given back its own reshard-after-forward setting (FSDP2 has a setter, no getter: the
    setting lives in each param group's ``post_forward_mesh_info``)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in modules if isinstance(m, FSDPModule)]
    saved = [[g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups] for m in fsdp]
    for module in fsdp:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, infos in zip(fsdp, saved, strict=True):
            for group, info in zip(module._get_fsdp_state()._fsdp_param_groups, infos, strict=True):
                group.post_forward_mesh_info = info
            module.reshard()


def funcols_wait_at_once() -> None:
    """Make eager functional collectives on CPU tensors wait as they are issued (``wait_tensor``
    at once) instead of returning an ``AsyncCollectiveTensor`` waited at its first use; traced
    ones are untouched (they wait in the graph already). For gloo, whose collectives run on
    its own worker threads anyway, this costs nothing measurable.

    Why: CI's multi-rank tests aborted about one run in two (torch 2.13, gloo) with
    ``malloc(): unaligned tcache chunk detected`` or SIGSEGV; both stacks captured stop in
    the async path, creating the wrapper for EP's ``all_to_all_single_autograd``
    (``_wrap_tensor_autograd``) and in ``AsyncCollectiveTensor.__torch_dispatch__ -> wait_tensor``
    under compiled PP + CP: a freed small chunk was written while the main thread went on
    past a collective a gloo thread was still completing. Waiting at once leaves no
    collective in flight while Python allocates. Idempotent."""
    original = funcol._maybe_wrap_tensor
    if getattr(original, "waits_at_once", False):
        return

    def wait_at_once(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not funcol._are_we_tracing():
            return funcol.wait_tensor(tensor)
        return original(tensor)

    wait_at_once.waits_at_once = True  # type: ignore[attr-defined]
    funcol._maybe_wrap_tensor = wait_at_once


def key_compile_cache_on_vector_isa() -> None:
    """Make inductor's on-disk cache key name this process's CPU vector ISA (idempotent; a
    width the user set is kept). Call before compiling.

    torch (2.13 at least) keys a cached graph on the thread count its C++ kernels were written
    for, but not on the vector ISA they were written for (AVX2, AVX-512 or none, which
    ``ATEN_CPU_CAPABILITY`` chooses), while the kernels are rebuilt for the ISA of the process
    that loads them. A graph written under ``ATEN_CPU_CAPABILITY=avx2`` (8-float vectors) and
    loaded by an AVX-512 process (16-float vectors) stores 16 floats where it steps by 8: a heap
    overrun, seen as "double free or corruption" in a compiled run on two gloo ranks whose
    cache an earlier AVX2 run had filled. Setting ``cpp.simdlen`` to the width of the ISA
    inductor picks (which picks the same ISA) puts the ISA in the cache key."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is None:
        config.cpp.simdlen = pick_vec_isa().bit_width()
