"""LoRA as a transformation of a built model: frozen base weights, trainable low-rank adapters.

Each targeted ``nn.Linear`` becomes a ``LoRALinear`` (its class swapped, as FSDP2 swaps in its
own), gaining ``lora_A`` (rank x in) and ``lora_B`` (out x rank):
``y = base(x) + alpha / rank * B(A(dropout(x)))``, peft's formula and initialization (A
Kaiming-uniform, B zero, so training starts from the base model). The base weight keeps its
name, so HF loading, DCP and export see the model they always did; every parameter but the
adapters is frozen, so the optimizer, gradient norm and clipping see only adapters.

A mixture of experts' stacked weights are adapted when ``target_modules`` names ``experts``
(opt in: they multiply the adapters by the expert count): ``LoRAExperts`` adds, per expert,
one A shared by gate and up (E, r, H) with its B (E, 2I, r), gate's rows first, and down's A
(E, r, I) and B (E, H, r): peft's adapters on the fused ``gate_up_proj`` and ``down_proj`` of
transformers' experts, run as grouped GEMMs on the routed rows beside the base's.

Applied after tensor and expert parallelism and before FSDP: the adapters follow their base's
placement (``ADAPTER_PLACEMENTS``). A column-parallel base (weight sharded on its output)
keeps A replicated and B sharded on its output; a row-parallel base (sharded on its input)
shards A on its input and keeps B replicated, so the adapter's partial sum joins the base's
in the same reduction. Expert adapters are split over the experts as the experts are. FSDP
then shards adapters as any other parameter.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig, LoRA
from autopar.models.args import ModelArgs
from autopar.models.dtypes import DTYPES
from autopar.models.family import build_model, family_of
from autopar.models.moe import ExpertKernel, ExpertMatmul, Experts, on_expert_rows
from autopar.models.qwen import canonical_name, named_generator
from autopar.parallel.expert_parallel import RoutedExperts, local
from autopar.parallel.materialize import FullValue
from autopar.parallel.mixed_precision import compute_dtype, store_frozen
from autopar.parallel.pipelining.schedule import stage_modules
from autopar.parallel.pipelining.split import prune

ADAPTER_PLACEMENTS: dict[Placement, tuple[Placement, Placement]] = {
    Shard(0): (Replicate(), Shard(0)),  # column-parallel base: A whole, B on the output shards
    Shard(1): (Shard(1), Replicate()),  # row-parallel base: A on the input shards, B whole
    Replicate(): (Replicate(), Replicate()),
}
"""The base weight's tensor-parallel placement -> (A's, B's)."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a trainable low-rank update beside its frozen weight. Over
    another linear class (torchao's FP8 one), ``lora_class`` puts it first in a subclass, so
    the base's own forward runs under the adapters."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    adapters_off = False
    """Run the base alone (``adapters_off``: a preference job's reference is the base model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            return super().forward(x)
        return super().forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.out_features}, lora_scaling={self.scaling:g}"


class LoRAExperts(Experts):
    """``Experts`` with trainable low-rank updates of every expert's projections."""

    scaling: float
    adapters_off = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            return super().forward(x, counts)
        return run_lora_experts(
            x, counts, dict(self.named_parameters(recurse=False)), self.scaling, self.kernel
        )


class RoutedLoRAExperts(RoutedExperts):
    """Expert-parallel ``LoRAExperts``: this rank's experts with their adapters' shards."""

    scaling: float
    adapters_off = False

    def local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            return super().local_experts(x, counts)
        tensors = {name: local(p) for name, p in self.named_parameters(recurse=False)}
        return run_lora_experts(x, counts, tensors, self.scaling, self.kernel)


def run_lora_experts(
    x: torch.Tensor, counts: torch.Tensor, w: dict[str, torch.Tensor], scaling: float, kernel: ExpertKernel
) -> torch.Tensor:
    """``models.moe.run_experts`` plus each projection's ``scaling * B_e A_e`` on expert e's
    rows, as (rows @ A_e.T) @ B_e.T: rank-wide, never the (E, out, in) update. ``w``: the
    experts' weights and adapters by parameter name (this rank's slice under EP)."""
    inter = w["gate_proj"].shape[1]

    def swiglu(matmul: ExpertMatmul) -> torch.Tensor:
        update = matmul(matmul(x, w["lora_gate_up_A"]), w["lora_gate_up_B"]) * scaling  # (N, 2I)
        gate = matmul(x, w["gate_proj"]) + update[:, :inter]
        up = matmul(x, w["up_proj"]) + update[:, inter:]
        hidden = F.silu(gate) * up
        down = matmul(matmul(hidden, w["lora_down_A"]), w["lora_down_B"]) * scaling
        return matmul(hidden, w["down_proj"]) + down

    return on_expert_rows(swiglu, x, counts, list(w.values()), kernel)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """While inside, every adapted module of ``model`` runs its frozen base alone: the model
    LoRA started from, with no second copy of the weights (a preference job's reference)."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts, RoutedLoRAExperts))]
    for module in adapted:
        module.adapters_off = True
    try:
        yield
    finally:
        for module in adapted:
            module.adapters_off = False


@functools.cache
def lora_class(base: type[nn.Linear]) -> type[LoRALinear]:
    """The adapted class of a ``base`` linear class: one per class, not per module, so
    compiled blocks share their guards."""
    if base is nn.Linear:
        return LoRALinear
    return type(f"LoRA{base.__name__}", (LoRALinear, base), {})


def targeted(model: nn.Module, targets: list[str]) -> Iterator[tuple[str, nn.Module]]:
    """The linears (and, for an ``experts`` entry, the experts) named by ``targets``: an entry
    matches a module whose name ends with it (``q_proj``, ``attention.q_proj``,
    ``layers.0.mlp.down_proj``), as peft matches; an HF linear we split (``in_proj_qkv``)
    names its pieces."""
    targets = expand_fused(targets, family_of(model.args).fused_linears)
    for path, module in adaptable(model):
        if any(path == t or path.endswith(f".{t}") for t in targets):
            yield path, module


def expand_fused(targets: list[str], fused: dict[str, tuple[str, ...]]) -> list[str]:
    """``targets`` with each entry that names an HF fused linear replaced by our pieces of it
    (``in_proj_qkv`` -> ``in_proj_q``, ``in_proj_k``, ``in_proj_v``)."""
    expanded = []
    for target in targets:
        for hf, pieces in fused.items():
            leaf = hf.rpartition(".")[2]
            if f".{hf}".endswith(f".{target}") or target.endswith(f".{hf}"):
                prefix = target.removesuffix(leaf)
                expanded += [prefix + piece.rpartition(".")[2] for piece in pieces]
                break
        else:
            expanded.append(target)
    return expanded


def _share_fused_a(targets: list[tuple[str, nn.Module]], fused: dict[str, tuple[str, ...]]) -> None:
    """The pieces of one HF fused linear share the first piece's A, as peft's single adapter
    on the fused linear does (its B is theirs stacked): exactly peft's parametrization."""
    for pieces in fused.values():
        leaves = [p.rpartition(".")[2] for p in pieces]
        firsts = {path.removesuffix(leaves[0]): m for path, m in targets if path.endswith(f".{leaves[0]}")}
        for path, module in targets:
            prefix = path.removesuffix(path.rpartition(".")[2])
            if path.rpartition(".")[2] in leaves[1:] and prefix in firsts:
                module.lora_A = firsts[prefix].lora_A


def adaptable(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module LoRA can adapt: the linears (FP8 ones too) and the mixtures' experts;
    not adapters, and not a linear adapted already."""
    for name, module in model.named_modules():
        linear = isinstance(module, nn.Linear) and not isinstance(module, LoRALinear)
        if (linear and ".lora_" not in f".{name}") or isinstance(module, Experts):
            yield canonical_name(name), module


def apply_lora(model: nn.Module, cfg: LoRA, compute_dtype: torch.dtype) -> int:
    """Freeze ``model`` and give each targeted linear (or experts) its adapters (on the
    model's device, meta before materializing); the frozen weights take ``cfg.base_dtype``.
    Returns how many modules got adapters."""
    model.requires_grad_(False)
    targets = list(targeted(model, cfg.target_modules))
    for _, module in targets:
        if isinstance(module, Experts):
            _add_expert_adapters(module, cfg)
        else:
            _add_adapters(module, cfg)
    _share_fused_a(targets, family_of(model.args).fused_linears)
    store_frozen(model, base_storage_dtype(cfg, compute_dtype))
    return len(targets)


def base_storage_dtype(cfg: LoRA, compute_dtype: torch.dtype) -> torch.dtype:
    """The frozen base's dtype: ``auto`` stores it in the compute dtype (no fp32 master copy
    where compute is bf16)."""
    return compute_dtype if cfg.base_dtype == "auto" else DTYPES[cfg.base_dtype]


def _add_adapters(module: nn.Linear, cfg: LoRA) -> None:
    weight = module.weight
    device = weight.device
    lora_A = nn.Linear(module.in_features, cfg.rank, bias=False, device=device)
    lora_B = nn.Linear(cfg.rank, module.out_features, bias=False, device=device)
    if isinstance(weight, DTensor):
        (placement,) = weight.placements
        for adapter, place in zip((lora_A, lora_B), ADAPTER_PLACEMENTS[placement]):
            local = distribute_tensor(
                adapter.weight.detach(), weight.device_mesh, [place], src_data_rank=None
            )
            adapter.weight = nn.Parameter(local)
    module.__class__ = lora_class(type(module))
    module.lora_A, module.lora_B = lora_A, lora_B
    module.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    module.scaling = cfg.alpha / cfg.rank


def _add_expert_adapters(module: Experts, cfg: LoRA) -> None:
    experts, inter, hidden = module.gate_proj.shape
    shapes = {
        "lora_gate_up_A": (experts, cfg.rank, hidden),
        "lora_gate_up_B": (experts, 2 * inter, cfg.rank),
        "lora_down_A": (experts, cfg.rank, inter),
        "lora_down_B": (experts, hidden, cfg.rank),
    }
    for name, shape in shapes.items():
        value = torch.empty(shape, device=module.gate_proj.device)
        if isinstance(module, RoutedExperts):  # split over the experts as the weights are
            value = distribute_tensor(value, module.mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(value))
    module.__class__ = RoutedLoRAExperts if isinstance(module, RoutedExperts) else LoRAExperts
    module.scaling = cfg.alpha / cfg.rank


def adapter_values(base: FullValue, seed: int, device: torch.device) -> FullValue:
    """``base``'s values, and peft's initial adapters: A uniform in +-1/sqrt(in) (Kaiming-
    uniform with a = sqrt(5)) from a generator seeded by (seed, name), B zero."""

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        name = canonical_name(name)
        if name.endswith(("lora_B.weight", "_B")) and ".lora_" in name:
            return torch.zeros(shape, device=device)
        if name.endswith(("lora_A.weight", "_A")) and ".lora_" in name:
            bound = 1 / math.sqrt(shape[-1])
            return (
                torch.empty(shape).uniform_(-bound, bound, generator=named_generator(seed, name)).to(device)
            )
        return base(name, shape)

    return value


def _check_fused_pieces(cfg: LoRA, args: ModelArgs) -> None:
    """A piece of an HF fused linear is not a target of its own: its adapter would have no
    name on the HF model (the peft folder names the fused linear)."""
    for hf, pieces in family_of(args).fused_linears.items():
        leaves = {p.rpartition(".")[2] for p in pieces}
        named = [t for t in cfg.target_modules if t.rpartition(".")[2] in leaves]
        if named:
            raise ConfigError(
                f"lora.target_modules entry {named[0]!r} is autopar's split of HF's {hf.rpartition('.')[2]}; "
                f"name {hf.rpartition('.')[2]!r} (peft's name for the fused linear), which adapts all of it"
            )


def check_lora(job: JobConfig, args: ModelArgs, device_type: str) -> None:
    """Refuse, before anything is built, a LoRA job that would train nothing somewhere or
    pair LoRA with what it does not run with; one line naming the field and the fix."""
    cfg = job.lora
    if not cfg.enable:
        return
    if cfg.rank < 1:
        raise ConfigError(f"lora.rank = {cfg.rank}: an adapter needs rank >= 1 (8 or 16 are usual)")
    if cfg.alpha <= 0:
        raise ConfigError(
            f"lora.alpha = {cfg.alpha}: the update is scaled by alpha / rank, so give alpha > 0"
        )
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"lora.dropout = {cfg.dropout}: give a probability in [0, 1)")
    with torch.device("meta"):
        model = build_model(args)
    _check_fused_pieces(cfg, args)
    names = sorted({path.rpartition(".")[2] for path, _ in adaptable(model)})
    for target in cfg.target_modules:
        if not any(True for _ in targeted(model, [target])):
            raise ConfigError(
                f"lora.target_modules entry {target!r} matches no linear of {job.model.name}/{job.model.flavor}; "
                f"what it can adapt is {', '.join(names)} (an entry matches names ending with it)"
            )
    if cfg.dropout > 0 and any(isinstance(m, Experts) for _, m in targeted(model, cfg.target_modules)):
        raise ConfigError(
            f"lora.dropout = {cfg.dropout} with experts in lora.target_modules: an expert's adapter "
            "shares its input with the base (peft refuses dropout there too); set lora.dropout = 0"
        )
    if cfg.dropout > 0 and job.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            f"lora.dropout = {cfg.dropout} with tensor_parallel_degree > 1: the tensor-parallel ranks would "
            "draw different dropout masks on the same replicated input; set lora.dropout = 0"
        )
    if cfg.dropout > 0 and job.compile.enable and job.activation_checkpoint.mode != "none":
        raise ConfigError(
            f"lora.dropout = {cfg.dropout} with compile.enable and activation_checkpoint.mode = "
            f"{job.activation_checkpoint.mode}: the compiled recompute is not checked to replay the forward's "
            "dropout masks; set lora.dropout = 0, --activation_checkpoint.mode none or --compile.enable false"
        )
    compute = compute_dtype(job, torch.device(device_type))
    if base_storage_dtype(cfg, compute).itemsize < compute.itemsize:
        raise ConfigError(
            f"lora.base_dtype = {cfg.base_dtype} below the {compute} compute dtype "
            "(training.mixed_precision_param): store the base in the compute dtype with lora.base_dtype = auto"
        )
    if job.parallelism.pipeline_parallel_degree > 1:
        for stage, names in enumerate(stage_modules(job.parallelism, args)):
            part = prune(copy.deepcopy(model), names)
            if not any(True for _ in targeted(part, cfg.target_modules)):
                raise ConfigError(
                    f"pipeline stage {stage} holds {names}, where LoRA trains nothing (lora.target_modules "
                    f"{cfg.target_modules}); give it a block with parallelism.module_fqns_per_model_part, "
                    "add lm_head to lora.target_modules, or use fewer stages (pipeline_parallel_degree, or a "
                    "schedule with one stage per rank)"
                )
