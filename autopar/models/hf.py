"""HF safetensors in and out: reading and writing checkpoint folders, one file and one shard at
a time, with the names of ``hf_names`` and the config of ``hf_config``.
Tied embeddings: HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is true, and we
do the same; on load a tied checkpoint that does carry one is accepted only if it equals the
embedding, so a silently untied checkpoint cannot load as tied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from autopar.models.args import ModelArgs
from autopar.models.family import build_model
from autopar.models.hf_config import CONFIG_FILE, HFCheckpointError, hf_config_from_args, read_hf_config
from autopar.models.hf_files import (
    SINGLE_FILE,
    check_folder,
    open_safetensors,
    shard_file,
    tensor_files,
    write_index,
)
from autopar.models.hf_layout import HFLayout, Piece
from autopar.models.hf_names import (
    MTP_PREFIX,
    PASSED_THROUGH,
    detect_layout,
    hf_pieces,
    hf_tensors,
    join_parts,
    to_hf_name,
)
from autopar.models.qwen import Qwen
from autopar.models.qwen3_5.hf import mtp_num_hidden_layers

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""The safetensors dtypes of weights autopar loads (as safetensors names them)."""


def _read(file: Path, hf_name: str) -> torch.Tensor:
    with open_safetensors(file) as f:
        return f.get_tensor(hf_name)


def _expected_shapes(pieces: Iterable[Piece]) -> dict[str, tuple[int, ...]]:
    """HF name -> its whole shape (a fused tensor's from the slices it holds)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for piece in pieces:
        shape = list(piece.shape)
        if piece.part is not None:
            dim, _, stop = piece.part
            shape[dim] = max(stop, shapes.get(piece.hf_name, shape)[dim])
        shapes[piece.hf_name] = tuple(shape)
    return shapes


def _read_piece(file: Path, piece: Piece) -> torch.Tensor:
    with open_safetensors(file) as f:
        if piece.part is None:
            return f.get_tensor(piece.hf_name)
        dim, start, stop = piece.part
        return f.get_slice(piece.hf_name)[(slice(None),) * dim + (slice(start, stop),)]


class HFTensors(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint under our names, checked against the model ``args``
    (names and shapes, from the file headers) and read from disk only when asked for, so a
    rank that holds one shard of one stage never loads the whole model. A vision-language
    checkpoint's text model loads; its vision tower and MTP head are left on disk, as a text
    checkpoint's MTP head is for a model built without one (``passed_through``)."""

    def __init__(self, path: str | Path, args: ModelArgs) -> None:
        path = Path(path)
        files = tensor_files(path)
        self.layout = detect_layout(files)
        params = _meta_params(args)
        ours = {n: hf_pieces(args, n, tuple(p.shape), self.layout) for n, p in params.items()}
        expected = _expected_shapes(p for pieces in ours.values() for p in pieces)
        missing = sorted(set(expected) - set(files))
        carried = passed_through(files, self.layout, args)
        extra = sorted(set(files) - set(expected) - {"lm_head.weight"} - carried)
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
            with open_safetensors(files[hf_name]) as f:
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
        embedding = f"{self.layout.prefix}embed_tokens.weight"
        if args.tie_word_embeddings and "lm_head.weight" in files:
            head = _read(files["lm_head.weight"], "lm_head.weight")
            if not torch.equal(head, _read(files[embedding], embedding)):
                raise HFCheckpointError(
                    f"{files['lm_head.weight']}: tie_word_embeddings=true but lm_head.weight "
                    f"differs from {embedding}; set tie_word_embeddings=false"
                )
        self._files = {n: [(files[p.hf_name], p) for p in pieces] for n, pieces in ours.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        pieces = self._files[name]
        if len(pieces) == 1:
            return _read_piece(*pieces[0])
        parts: dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(file for file, _ in pieces):  # each file opened once
            with open_safetensors(file) as f:
                parts.update({p.hf_name: f.get_tensor(p.hf_name) for where, p in pieces if where == file})
        return torch.stack([parts[p.hf_name] for _, p in pieces])

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _meta_params(args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(build_model(args).named_parameters())


def from_hf(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    mtp: bool = False,
) -> Qwen:
    """Load an HF Qwen2.5 / Qwen3 / Qwen3.5 checkpoint directory (a Qwen3.5 vision-language
    one too: its text model) as a ``Qwen`` module. ``dtype=None`` keeps the checkpoint's dtype.
    ``mtp``: also load the folder's multi-token-prediction head (``mtp.*``; Qwen3.5 only).
    """
    check_folder(Path(path))
    args = read_hf_config(path)
    if mtp:
        args = dataclasses.replace(args, mtp_num_hidden_layers=head_layers(path, args))
    tensors = HFTensors(path, args)
    if dtype is None:
        dtype = tensors["embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model


def head_layers(path: str | Path, args: ModelArgs) -> int:
    """The layers of the multi-token-prediction head in the HF folder ``path``; one line
    naming the folder when it has none (not Qwen3.5, no ``mtp_num_hidden_layers``, or no
    ``mtp.*`` tensors)."""
    config_path = Path(path) / CONFIG_FILE
    layers = mtp_num_hidden_layers(json.loads(config_path.read_text()), str(config_path), HFCheckpointError)
    if not args.hybrid or not layers or f"{MTP_PREFIX}fc.weight" not in tensor_files(Path(path)):
        raise HFCheckpointError(
            f"{path}: no multi-token-prediction head (a Qwen3.5 config.json with mtp_num_hidden_layers "
            "> 0 and mtp.* tensors); load it without mtp, or from the released checkpoint that has one"
        )
    return layers


def _shard_groups(
    sizes: dict[str, int], hf_names: dict[str, set[str]], max_shard_bytes: int
) -> list[list[str]]:
    """Our names in shards of at most ``max_shard_bytes``, never splitting names that share
    an HF tensor (slices of one fused tensor are written together)."""
    groups: list[list[str]] = [[]]
    size = 0
    previous: set[str] = set()
    for name, nbytes in sizes.items():
        fused_with_previous = bool(hf_names[name] & previous)
        if groups[-1] and size + nbytes > max_shard_bytes and not fused_with_previous:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
        previous = hf_names[name]
    return groups


def save_hf_streaming(
    layout: Mapping[str, tuple[torch.Size, torch.dtype]],
    load: Callable[[list[str]], Mapping[str, torch.Tensor]],
    args: ModelArgs,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    hf_layout: HFLayout | None = None,
) -> None:
    """Write config.json and safetensors one shard at a time: ``layout`` gives each of our
    parameter names its (shape, dtype), ``load(names)`` returns those tensors. Memory stays
    at one shard (``max_shard_bytes``), whatever the model size. Tied models get no
    ``lm_head.weight``, as HF writes them. ``hf_layout``: where the tensors sit (the text
    model's names by default; a vision-language source's, see ``carry_through``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = {
        n: spec
        for n, spec in layout.items()
        if not (args.tie_word_embeddings and to_hf_name(n) == "lm_head.weight")
    }
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (shape, dtype) in names.items()}
    hf_names = {
        n: {p.hf_name for p in hf_pieces(args, n, tuple(shape), hf_layout)} for n, (shape, _) in names.items()
    }
    groups = _shard_groups(sizes, hf_names, max_shard_bytes)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file = SINGLE_FILE if len(groups) == 1 else shard_file(i, len(groups))
        tensors = load(group)
        parts = [part for n in group for part in hf_tensors(args, n, tensors[n], hf_layout)]
        shard = {hf_name: t.detach().contiguous().cpu() for hf_name, t in join_parts(parts).items()}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(groups) > 1:
        write_index(path, weight_map)
    dtype = names["embed_tokens.weight"][1]
    (path / CONFIG_FILE).write_text(json.dumps(hf_config_from_args(args, dtype), indent=2) + "\n")


def save_hf_like(
    layout: Mapping[str, tuple[torch.Size, torch.dtype]],
    load: Callable[[list[str]], Mapping[str, torch.Tensor]],
    args: ModelArgs,
    path: str | Path,
    source: str | Path | None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """``save_hf_streaming`` in the layout of ``source`` (the HF folder the run started from;
    None: the text model's own): from a vision-language source, its vision tower, MTP head
    and config.json come along, and the folder loads and serves as the whole model did."""
    hf_layout = checkpoint_layout(source) if source is not None else HFLayout()
    save_hf_streaming(layout, load, args, path, max_shard_bytes, hf_layout)
    if source is not None and (
        hf_layout.vision_language or passed_through(tensor_files(Path(source)), hf_layout, args)
    ):
        carry_through(source, path, skip=(MTP_PREFIX,) if args.mtp_num_hidden_layers else ())


def passed_through(names: Iterable[str], layout: HFLayout, args: ModelArgs) -> set[str]:
    """The tensors of a folder that a load of ``args`` leaves on disk and an export carries
    over unchanged: a vision-language folder's vision tower and MTP head, and a text folder's
    MTP head when the model is built without one (a folder a head was trained into, reloaded
    for plain training or sampling)."""
    if layout.vision_language:
        prefixes: tuple[str, ...] = PASSED_THROUGH
    elif not args.mtp_num_hidden_layers:
        prefixes = (MTP_PREFIX,)
    else:
        return set()
    return {n for n in names if n.startswith(prefixes)}


def checkpoint_layout(path: str | Path) -> HFLayout:
    """Where the tensors of the HF checkpoint folder ``path`` sit."""
    return detect_layout(tensor_files(Path(path)))


def carry_through(source: str | Path, out: str | Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Make ``out``, a text model exported in the vision-language layout of ``source``, the
    source's whole model again: the tensors text training leaves alone (vision tower, MTP
    head) copied unchanged, one source file at a time, into shards numbered after the text
    model's, and the source's config.json in the text model's dtype. ``skip``: prefixes the
    export wrote itself (the MTP head, when it was loaded and trained). Returns the names of
    the tensors carried."""
    source, out = Path(source), Path(out)
    files = tensor_files(source)
    carried: dict[Path, list[str]] = {}
    passed = (n for n in files if n.startswith(PASSED_THROUGH) and not (skip and n.startswith(skip)))
    for name in sorted(passed):
        carried.setdefault(files[name], []).append(name)
    if carried:
        _add_shards(out, list(carried.items()))
    _copy_config(source, out)
    return [n for names in carried.values() for n in names]


def _add_shards(out: Path, carried: list[tuple[Path, list[str]]]) -> None:
    """One scheme for the whole folder, as transformers reads it (a ``model.safetensors``
    beside an index is read alone): the text model's files renamed to the first of
    ``model-0000k-of-0000n`` shards (renaming never rewrites a tensor), each source file's
    carried tensors one more, and an index naming every tensor."""
    by_file: dict[str, list[str]] = {}
    for name, file in tensor_files(out).items():
        by_file.setdefault(file.name, []).append(name)
    written = sorted(by_file.items())
    count = len(written) + len(carried)
    weight_map: dict[str, str] = {}
    for k, (file, names) in enumerate(written, start=1):
        (out / file).rename(out / shard_file(k, count))  # "-of-{count}" is new: no name is taken
        weight_map.update(dict.fromkeys(names, shard_file(k, count)))
    for k, (source_file, names) in enumerate(carried, start=len(written) + 1):
        with open_safetensors(source_file) as f:
            tensors = {n: f.get_tensor(n) for n in names}
        save_file(tensors, str(out / shard_file(k, count)), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard_file(k, count)))
    write_index(out, weight_map)


def _copy_config(source: Path, out: Path) -> None:
    """The source's config.json, its dtype the exported text model's: transformers loads in
    the config's dtype, so a bf16 source's would round an fp32 export."""
    dtype = json.loads((out / CONFIG_FILE).read_text())["dtype"]
    config = json.loads((source / CONFIG_FILE).read_text())
    config["dtype"] = dtype
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            section.update({k: dtype for k in ("dtype", "torch_dtype") if k in section})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


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
