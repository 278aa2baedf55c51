"""HF safetensors in and out: a name-mapping adapter between HF Qwen checkpoints and ``Qwen``.

Our parameter names are HF's without the ``model.`` prefix, so the mapping is a prefix, except
for Qwen3-MoE's experts: our stacked ``layers.N.mlp.experts.gate_proj`` (E, I, H) is HF's
``model.layers.N.mlp.experts.{e}.gate_proj.weight`` for every expert e (what transformers
writes, v4 and v5 alike; v5 stacks them only in memory).
Tied embeddings: HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is true, and we
do the same; on load a tied checkpoint that does carry one is accepted only if it equals the
embedding, so a silently untied checkpoint cannot load as tied.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from autopar.models.args import ModelArgs
from autopar.models.dtypes import dtype_name
from autopar.models.hf_fields import ConfigFields
from autopar.models.qwen import Qwen, canonical_name

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""The safetensors dtypes of weights autopar loads (as safetensors names them)."""


class HFCheckpointError(ValueError):
    """An HF checkpoint directory that does not describe a model autopar can load."""


def to_hf_name(name: str) -> str:
    name = canonical_name(name)
    return name if name == "lm_head.weight" else f"model.{name}"


def hf_pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of the tensors that hold our parameter ``name``: itself, or one per
    expert of a stacked expert weight."""
    name = canonical_name(name)
    module, _, leaf = name.rpartition(".")
    if module.endswith("mlp.experts") and leaf in _EXPERT_WEIGHTS:
        return [(f"model.{module}.{e}.{leaf}.weight", tuple(shape[1:])) for e in range(shape[0])]
    return [(to_hf_name(name), tuple(shape))]


def hf_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our parameter ``name`` as the HF tensors that hold it."""
    pieces = hf_pieces(name, tuple(tensor.shape))
    if len(pieces) == 1:
        return {pieces[0][0]: tensor}
    return {hf_name: part for (hf_name, _), part in zip(pieces, tensor.unbind(0), strict=True)}


def args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelArgs:
    """ModelArgs from an HF config dict; raises HFCheckpointError on what we cannot model."""
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: model_type={model_type!r} is not supported; autopar loads "
            f"{sorted(_ARCHITECTURES)} (Qwen2.5, Qwen3 and Qwen3-MoE)"
        )
    fields = ConfigFields(config, source, HFCheckpointError)
    rope = ConfigFields(fields.mapping("rope_parameters"), f"{source} rope_parameters", HFCheckpointError)
    scaling = fields.mapping("rope_scaling")
    rope_type = rope.config.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise HFCheckpointError(f"{source}: rope type {rope_type!r} is not supported; only 'default'")
    if fields.bool("use_sliding_window"):
        raise HFCheckpointError(f"{source}: use_sliding_window=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act={config['hidden_act']!r}; Qwen uses 'silu'")
    is_qwen3 = model_type in ("qwen3", "qwen3_moe")
    if is_qwen3 and fields.bool("attention_bias"):
        raise HFCheckpointError(
            f"{source}: attention_bias=true for qwen3 would put a bias on o_proj, "
            "which no released Qwen3 has and autopar does not model"
        )
    heads = fields.int("num_attention_heads")
    head_dim = fields.int("head_dim", None)
    return ModelArgs(
        vocab_size=fields.int("vocab_size"),
        hidden_size=fields.int("hidden_size"),
        intermediate_size=fields.int("intermediate_size"),
        num_hidden_layers=fields.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.int("num_key_value_heads", heads),
        head_dim=head_dim or fields.int("hidden_size") // heads,
        rope_theta=rope.float("rope_theta", fields.float("rope_theta", 10000.0)),
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        attention_bias=not is_qwen3,
        qk_norm=is_qwen3,
        max_position_embeddings=fields.int("max_position_embeddings", 32768),
        initializer_range=fields.float("initializer_range", 0.02),
        **(_moe_args(fields) if model_type == "qwen3_moe" else {}),
    )


def _moe_args(fields: ConfigFields) -> dict[str, Any]:
    """The Qwen3-MoE fields of an HF config (v5 spells num_experts num_local_experts)."""
    return {
        "num_experts": fields.int("num_experts", fields.int("num_local_experts", None)),
        "num_experts_per_tok": fields.int("num_experts_per_tok"),
        "moe_intermediate_size": fields.int("moe_intermediate_size"),
        "norm_topk_prob": fields.bool("norm_topk_prob", False),
        "decoder_sparse_step": fields.int("decoder_sparse_step", 1),
        "mlp_only_layers": fields.ints("mlp_only_layers"),
        "router_aux_loss_coef": fields.float("router_aux_loss_coef", 0.001, zero_ok=True),
    }


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json transformers needs to rebuild ``args`` (v4 and v5 field spellings)."""
    moe = {
        "num_experts": args.num_experts,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
    }
    return {
        **(moe if args.moe else {}),
        "architectures": [_ARCHITECTURES[args.model_type]],
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.initializer_range,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": not args.qk_norm,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_hidden_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def read_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs of the HF checkpoint directory ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise HFCheckpointError(f"{config_path}: not found; an HF checkpoint needs a config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{config_path}: not a JSON object but {type(config).__name__}")
    return args_from_hf_config(config, str(config_path))


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    """``safe_open`` whose failure names the file (a truncated download fails here, at its header)."""
    try:
        handle = safe_open(file, framework="pt")
    except SafetensorError as err:
        raise HFCheckpointError(
            f"{file}: not a readable safetensors file ({err}); the download is incomplete or damaged"
        ) from None
    with handle as f:
        yield f


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise HFCheckpointError(f"{path / INDEX_FILE}: not an index with a weight_map ({err})") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise HFCheckpointError(f"{file}: listed in {INDEX_FILE} but not found")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise HFCheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _read(file: Path, hf_name: str) -> torch.Tensor:
    with _open(file) as f:
        return f.get_tensor(hf_name)


class HFTensors(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint under our names, checked against the model ``args``
    (names and shapes, from the file headers) and read from disk only when asked for, so a
    rank that holds one shard of one stage never loads the whole model."""

    def __init__(self, path: str | Path, args: ModelArgs) -> None:
        path = Path(path)
        files = _tensor_files(path)
        params = _meta_params(args)
        ours = {n: hf_pieces(n, tuple(p.shape)) for n, p in params.items()}
        expected = {hf_name: shape for pieces in ours.values() for hf_name, shape in pieces}
        missing = sorted(set(expected) - set(files))
        extra = sorted(set(files) - set(expected) - {"lm_head.weight"})
        if missing:
            raise HFCheckpointError(
                f"{path}: {len(missing)} tensor(s) missing from the checkpoint, first {missing[0]!r}"
            )
        if extra:
            raise HFCheckpointError(
                f"{path}: {len(extra)} unexpected tensor(s) in {files[extra[0]].name}, first "
                f"{extra[0]!r}; the config.json does not describe these weights"
            )
        for hf_name, shape in expected.items():
            with _open(files[hf_name]) as f:
                piece = f.get_slice(hf_name)
                found, dtype = tuple(piece.get_shape()), piece.get_dtype()
            if found != shape:
                raise HFCheckpointError(
                    f"{files[hf_name]}: tensor {hf_name!r} has shape {list(found)}, the config "
                    f"expects {list(shape)}"
                )
            if dtype not in FLOAT_DTYPES:  # an integer (quantized) weight would be cast silently
                raise HFCheckpointError(
                    f"{files[hf_name]}: tensor {hf_name!r} is {dtype}, not one of {sorted(FLOAT_DTYPES)}; "
                    "autopar loads unquantized weights: use the model's original (bf16) checkpoint"
                )
        if args.tie_word_embeddings and "lm_head.weight" in files:
            head = _read(files["lm_head.weight"], "lm_head.weight")
            if not torch.equal(head, _read(files["model.embed_tokens.weight"], "model.embed_tokens.weight")):
                raise HFCheckpointError(
                    f"{files['lm_head.weight']}: tie_word_embeddings=true but lm_head.weight "
                    "differs from model.embed_tokens.weight; set tie_word_embeddings=false"
                )
        self._files = {n: [(files[hf_name], hf_name) for hf_name, _ in pieces] for n, pieces in ours.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        pieces = self._files[name]
        if len(pieces) == 1:
            return _read(*pieces[0])
        parts: dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(file for file, _ in pieces):  # each file opened once
            with _open(file) as f:
                parts.update({hf_name: f.get_tensor(hf_name) for where, hf_name in pieces if where == file})
        return torch.stack([parts[hf_name] for _, hf_name in pieces])

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _meta_params(args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(Qwen(args).named_parameters())


def from_hf(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Qwen:
    """Load an HF Qwen2.5 / Qwen3 checkpoint directory as a ``Qwen`` module.

    ``dtype=None`` keeps the checkpoint's dtype.
    """
    args = read_hf_config(path)
    tensors = HFTensors(path, args)
    if dtype is None:
        dtype = tensors["embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = Qwen(args)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model


def _shard_groups(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def save_hf_streaming(
    layout: Mapping[str, tuple[torch.Size, torch.dtype]],
    load: Callable[[list[str]], Mapping[str, torch.Tensor]],
    args: ModelArgs,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json and safetensors one shard at a time: ``layout`` gives each of our
    parameter names its (shape, dtype), ``load(names)`` returns those tensors. Memory stays
    at one shard (``max_shard_bytes``), whatever the model size. Tied models get no
    ``lm_head.weight``, as HF writes them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = {
        n: spec
        for n, spec in layout.items()
        if not (args.tie_word_embeddings and to_hf_name(n) == "lm_head.weight")
    }
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (shape, dtype) in names.items()}
    groups = _shard_groups(sizes, max_shard_bytes)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file = SINGLE_FILE if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = load(group)
        shard = {
            hf_name: t.detach().contiguous().cpu()
            for n in group
            for hf_name, t in hf_tensors(n, tensors[n]).items()
        }
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    dtype = names["embed_tokens.weight"][1]
    (path / CONFIG_FILE).write_text(json.dumps(hf_config_from_args(args, dtype), indent=2) + "\n")


ASSET_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""What an HF model folder holds besides its config and weights."""
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def copy_assets(source: str | Path, out: str | Path) -> list[str]:
    """Make the exported model folder ``out`` complete from ``source`` (the model folder it
    came from, or a tokenizer.json): tokenizer files, generation config, and the token ids
    of the source's config.json. Without a generation config there, one is written from
    those ids. Returns the names of the files written."""
    source, out = Path(source), Path(out)
    folder = source if source.is_dir() else source.parent
    written = []
    for name in ASSET_FILES:
        origin = source if (name == "tokenizer.json" and source.is_file()) else folder / name
        if origin.is_file():
            shutil.copyfile(origin, out / name)
            written.append(name)
    config_path = out / CONFIG_FILE
    config = json.loads(config_path.read_text())
    if (folder / CONFIG_FILE).is_file():
        theirs = json.loads((folder / CONFIG_FILE).read_text())
        config.update({k: theirs[k] for k in TOKEN_ID_FIELDS if k in theirs})
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    if "generation_config.json" not in written:
        ids = {k: config[k] for k in TOKEN_ID_FIELDS if config.get(k) is not None}
        (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
        written.append("generation_config.json")
    return written


def save_hf(
    state: Mapping[str, torch.Tensor],
    args: ModelArgs,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write full tensors under our names as an HF checkpoint folder."""
    layout = {n: (t.shape, t.dtype) for n, t in state.items()}
    save_hf_streaming(layout, lambda names: {n: state[n] for n in names}, args, path, max_shard_bytes)


def to_hf(model: Qwen, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a single-device ``model`` as an HF checkpoint that ``from_pretrained`` loads."""
    state = {name: (p if dtype is None else p.to(dtype)) for name, p in model.named_parameters()}
    save_hf(state, model.args, path)
