"""FP8 linears, swapped in after construction: Transformer Engine or torchao.

Which linears: every ``nn.Linear`` whose name matches none of ``float8.filter_fqns`` (the
head by default, whose error would reach the loss directly) and whose dims are multiples
of 16 (what FP8 GEMMs need). Qwen3.5's multi-token-prediction head (``mtp.*``) is converted
as the trunk: its ``fc`` and its layer's projections, not its router or shared-expert gate.
Parameter names do not change, so checkpoints and HF export work as in high precision.

What each backend composes with:

| backend | one device | FSDP2 | TP / SP | compile |
| --- | --- | --- | --- | --- |
| torchao (tensorwise) | yes | yes, with optional FP8 all-gather | yes (FP8 TP styles) | yes |
| torchao (rowwise, rowwise_with_gw_hp) | yes | yes | no | yes |
| te (delayed / current) | yes | yes | no (TE has its own TP; DTensor TP is refused) | no (refused) |

LoRA adapts torchao's FP8 linears (the adapters stay in high precision beside them), not
Transformer Engine's. Transformer Engine and torchao are optional and imported only when
asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from autopar.config.errors import ConfigError
from autopar.config.sections import Float8
from autopar.models.args import ModelArgs
from autopar.models.family import build_model, family_of

TE_HINT = 'pip install "transformer_engine[pytorch]" (needs CUDA and a matching torch build)'
TORCHAO_HINT = 'pip install torchao (or: pip install -e ".[float8]")'


def resolve_backend(cfg: Float8, device_type: str) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "te" if device_type == "cuda" else "torchao"


def resolve_recipe(cfg: Float8, backend: str) -> str:
    if cfg.recipe == "default":
        return "delayed" if backend == "te" else "tensorwise"
    return cfg.recipe


FILTER_ALIASES = {"output": "lm_head"}
"""torchtitan's module names in ``filter_fqns`` that are ours under another name."""


def _filters(filter_fqns: list[str]) -> list[str]:
    return [FILTER_ALIASES.get(f, f) for f in filter_fqns]


def eligible(
    filter_fqns: list[str], high_precision: tuple[str, ...] = ()
) -> Callable[[nn.Module, str], bool]:
    """Whether a module becomes an FP8 linear: a linear outside ``filter_fqns`` and the
    family's ``high_precision`` ones, both of whose dims FP8 GEMMs take."""
    filters = _filters(filter_fqns)

    def keep_fp8(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and not any(f in fqn for f in filters)
            and not fqn.endswith(high_precision)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    return keep_fp8


def output_head_in_fp8(cfg: Float8, args: ModelArgs) -> bool:
    """Whether FP8 converts the output head ``lm_head``: enabled, outside ``filter_fqns``
    (which holds it by default) and with dims FP8 GEMMs take."""
    if not cfg.enable:
        return False
    with torch.device("meta"):
        head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
    return eligible(cfg.filter_fqns, family_of(args).high_precision)(head, "lm_head")


def check_float8_filter(cfg: Float8, args: ModelArgs) -> None:
    """Every ``filter_fqns`` item names some module (a misspelt one would silently put the
    layer it meant to protect into FP8), and some linear is left to convert."""
    if not cfg.enable:
        return
    with torch.device("meta"):
        names = [fqn for fqn, _ in build_model(args).named_modules()]
    for item, name in zip(cfg.filter_fqns, _filters(cfg.filter_fqns)):
        if not any(name in fqn for fqn in names):
            raise ConfigError(
                f"float8.filter_fqns item {item!r} matches no module of the model (names look like "
                "'lm_head', 'layers.0.mlp.down_proj'); fix it, or that layer runs in FP8"
            )
    keep = eligible(cfg.filter_fqns, family_of(args).high_precision)
    with torch.device("meta"):
        count = sum(keep(m, fqn) for fqn, m in build_model(args).named_modules())
    if count == 0:
        raise ConfigError(
            "float8.enable=true converts no linear of this model: FP8 GEMMs need both dims multiples "
            f"of 16 (hidden_size={args.hidden_size}, intermediate_size={args.intermediate_size}, "
            f"head_dim={args.head_dim}) outside float8.filter_fqns={cfg.filter_fqns}; set "
            "--float8.enable false, or use a model whose dims qualify"
        )


def check_float8(cfg: Float8, device_type: str, tp_degree: int, compiled: bool, lora: bool) -> None:
    """Refuse a float8 setup that cannot run, naming the field and the fix."""
    if not cfg.enable:
        return
    backend = resolve_backend(cfg, device_type)
    if lora and backend == "te":
        raise ConfigError(
            "lora.enable with float8.backend te (auto's choice on CUDA): LoRA adapts torchao's FP8 "
            "linears, not Transformer Engine's; set --float8.backend torchao (or float8.enable = false)"
        )
    recipe = resolve_recipe(cfg, backend)
    recipes = {"te": ("delayed", "current"), "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    allowed = recipes[backend]
    if recipe not in allowed:
        raise ConfigError(f"float8.recipe={recipe!r} is not a {backend} recipe; use one of {list(allowed)}")
    if backend == "te":
        if device_type != "cuda":
            raise ConfigError("float8.backend='te' needs CUDA; on CPU use --float8.backend torchao")
        if compiled:
            raise ConfigError(
                "float8.backend='te' does not compose with compile.enable=true (Transformer Engine's "
                "FP8 autocast and modules break the compiled graphs); use --float8.backend torchao, "
                "which compiles, or --compile.enable false"
            )
        if tp_degree > 1:
            raise ConfigError(
                "float8.backend='te' does not compose with DTensor tensor parallel "
                f"(tensor_parallel_degree={tp_degree}); use --float8.backend torchao"
            )
        _import_te()
    else:
        _import_torchao()
        if tp_degree > 1 and recipe != "tensorwise":
            raise ConfigError(
                f"float8.recipe={recipe!r} with tensor_parallel_degree={tp_degree}: torchao's FP8 "
                "TP styles use tensorwise scaling; use --float8.recipe tensorwise"
            )
    if cfg.enable_fsdp_float8_all_gather and (backend != "torchao" or recipe != "tensorwise"):
        raise ConfigError("float8.enable_fsdp_float8_all_gather needs backend torchao with recipe tensorwise")


def _import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        raise ConfigError(f"float8.backend='te' needs Transformer Engine: {TE_HINT}") from None
    return te


def _import_torchao():
    try:
        import torchao.float8 as ao
    except ImportError:
        raise ConfigError(f"float8.backend='torchao' needs torchao: {TORCHAO_HINT}") from None
    return ao


def apply_float8(model: nn.Module, cfg: Float8, device_type: str) -> int:
    """Swap eligible linears for FP8 ones (on the meta model); returns how many."""
    backend = resolve_backend(cfg, device_type)
    recipe = resolve_recipe(cfg, backend)
    keep = eligible(cfg.filter_fqns, family_of(model.args).high_precision)
    targets = [fqn for fqn, m in model.named_modules() if keep(m, fqn)]
    if backend == "torchao":
        ao = _import_torchao()
        config = ao.Float8LinearConfig.from_recipe_name(recipe)
        if cfg.enable_fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        ao.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    else:
        te = _import_te()
        for fqn in targets:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            setattr(
                parent,
                child,
                te.Linear(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    params_dtype=linear.weight.dtype,
                    device=linear.weight.device,
                ),
            )
    return len(targets)


def te_autocast(cfg: Float8):
    """The context TE FP8 layers run under (forward only, as TE requires)."""
    te = _import_te()
    from transformer_engine.common import recipe as te_recipe

    if resolve_recipe(cfg, "te") == "current":
        fp8_recipe = te_recipe.Float8CurrentScaling()
    else:
        fp8_recipe = te_recipe.DelayedScaling(
            fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
        )
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def after_optimizer_step(parts: list[nn.Module], cfg: Float8) -> None:
    """torchao FP8 all-gather keeps one weight scale per FSDP parameter; refresh it from
    the new weights in one fused pass instead of per layer at the next forward."""
    if cfg.enable and cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp:
        ao = _import_torchao()
        for part in parts:
            ao.precompute_float8_dynamic_scale_for_fsdp(part)
