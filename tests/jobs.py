"""Small jobs shared by the tests: fp32 tiny Qwen models on the shipped corpus."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from autopar.config import JobConfig
from autopar.data.tokens import BUILTIN_DATASETS
from autopar.models import ModelArgs, Qwen, to_hf
from autopar.training.resolve import model_args, parse_job

TINY_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 320,
}
"""The tiny dense model every test builds, as a job's ``--model.*`` overrides (``TINY_FLAGS``)
or as ``tiny_args``."""

TINY_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.01,
    "num_hidden_layers": 3,
    "mlp_only_layers": (1,),
}
"""The tiny model as a Qwen3-MoE: 4 experts of width 32, top-2, a dense layer between."""


def tiny_args(family: str = "qwen3", **fields: object) -> ModelArgs:
    """``TINY_MODEL`` of a family (``qwen3``: QK-norm; ``qwen2``: q/k/v biases), ``fields``
    overriding it (a test says what it needs different)."""
    return ModelArgs(
        **{
            **TINY_MODEL,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "attention_bias": family == "qwen2",
            "qk_norm": family == "qwen3",
            "max_position_embeddings": 128,
            **fields,
        }
    )


def tiny_moe_args(**fields: object) -> ModelArgs:
    """``tiny_args`` of the Qwen3-MoE (``TINY_MOE``), ``fields`` overriding it."""
    return tiny_args("qwen3", **{**TINY_MOE, **fields})


VALID_FLAGS = ["--training.steps", "10", "--lr_scheduler.warmup_steps", "2", "--training.seq_len", "64"]
"""Flags that make the default (debug-flavor) job validate; tests of one rule add theirs."""

TINY_FLAGS = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "2",
    *(f"--model.{key}={value}" for key, value in TINY_MODEL.items()),
]
"""The tiny model at a short sequence: seconds per step on CPU."""


def debug_job(*argv: str) -> JobConfig:
    """The default job made valid by ``VALID_FLAGS``, with ``argv`` on top."""
    return parse_job([*VALID_FLAGS, *argv])


def tiny_job(dump_folder, *argv: str, name: str = "qwen3", **model: object) -> JobConfig:
    """A 5-step fp32 job of a two-layer model; ``argv`` and ``model`` override it."""
    flags = [
        *TINY_FLAGS,
        "--model.name",
        name,
        "--model.flavor",
        "debug",
        "--training.steps",
        "5",
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.lr",
        "0.01",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump_folder),
    ]
    for key, value in model.items():
        flags += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return parse_job(flags + list(argv))


def hybrid_job(dump_folder, *argv: str, **model: object) -> JobConfig:
    """``tiny_job`` of Qwen3.5 at four layers (three Gated DeltaNet, then gated attention) and
    Adam lr 1e-3 (``test_qwen3_5_plans.py`` says why)."""
    return tiny_job(
        dump_folder, "--optimizer.lr", "0.001", *argv, name="qwen3.5", **{"num_hidden_layers": 4, **model}
    )


def ac_flags(mode: str, option: str) -> str:
    """A plan's activation-checkpointing settings."""
    return f"activation_checkpoint.mode={mode},activation_checkpoint.selective_ac_option={option}"


CHAT_VOCAB = 576
"""The tiny model's vocabulary, room for the shipped ChatML tokenizer's 512 ids."""


def data_flags(dataset_format: str, path: Path) -> list[str]:
    """A job's flags reading ``path`` as ``dataset_format`` with the shipped ChatML tokenizer."""
    from autopar.data.chat import CHATML_TOKENIZER

    dataset = ["--training.dataset_format", dataset_format, "--training.dataset_path", str(path)]
    return [*dataset, "--model.tokenizer_path", str(CHATML_TOKENIZER)]


def chat_job(folder, *flags: str) -> JobConfig:
    """``tiny_job`` fine-tuning on the shipped conversations with the shipped ChatML tokenizer."""
    from autopar.data.chat import CHAT_EXAMPLE

    return tiny_job(folder, *data_flags("chat", CHAT_EXAMPLE), *flags, vocab_size=CHAT_VOCAB)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
"""A chat record's ``tools``: one function, as transformers' templates take them."""


def hf_folder_flags(source: Path) -> list[str]:
    """Flags of a job that fine-tunes the HF folder ``source`` and exports an HF folder: its
    assets and its weights read in HF's format, the last save written in it."""
    return [
        "--model.hf_assets_path",
        str(source),
        "--checkpoint.initial_load_path",
        str(source),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
    ]


QWEN3_5_TEXT = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
}
"""A tiny Qwen3.5 ``text_config`` for transformers' classes (three Gated DeltaNet layers and a
gated attention one), as the tests of Qwen3.5 jobs and exports build their source folders."""
QWEN3_5_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "num_heads": 2,
    "intermediate_size": 16,
    "out_hidden_size": 64,
    "patch_size": 2,
    "temporal_patch_size": 1,
    "spatial_merge_size": 1,
}
"""The ``vision_config`` beside ``QWEN3_5_TEXT`` (its output width is the text model's)."""
QWEN3_5_ODD = {
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 20,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
    "layer_types": [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.4},
}
"""A Qwen3.5 ``text_config`` of odd sizes, where a transposed or mis-split weight cannot match
by shape: three value heads per key head, dk 12 != dv 10, 40% rotary of head_dim 20, full
attention not every 4th (the model tests' against transformers' classes)."""
QWEN3_5_ODD_EXPERTS = {
    "num_experts": 5,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 20,
}
"""``QWEN3_5_ODD``'s mixture of experts. HF's experts run grouped GEMMs whose rows must be
multiples of 16 bytes."""


def chat_hf_base(folder: Path) -> tuple[Qwen, Path]:
    """The tiny chat model as an HF folder with the shipped ChatML tokenizer (what a
    fine-tuning job starts from): (the model, its folder ``folder/Qwen3-tiny``)."""
    import dataclasses
    import shutil

    from autopar.data.chat import CHATML_TOKENIZER

    source = folder / "Qwen3-tiny"
    base = Qwen(dataclasses.replace(model_args(chat_job(folder)), vocab_size=CHAT_VOCAB))
    base.init_weights(seed=3)
    to_hf(base, source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHATML_TOKENIZER / name, source / name)
    return base, source


def _flag_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


MOE_FLAGS = [f"--model.{key}={_flag_value(value)}" for key, value in TINY_MOE.items()]
"""``TINY_MOE`` as a job's flags."""


def moe_job(folder, *flags: str) -> JobConfig:
    """``tiny_job`` of the tiny Qwen3-MoE (``MOE_FLAGS``)."""
    return tiny_job(folder, *MOE_FLAGS, *flags)


def parity_runs(base: JobConfig, plans: list[str], steps: int = 5) -> dict:
    """plan -> (single-device reference, plan run), all plans of one world size in one group."""
    from autopar.cli.parity import Case, run_cases

    return dict(zip(plans, run_cases([Case(base, plan) for plan in plans], steps=steps)))


FP32_LOSS_RTOL, FP32_NORM_RTOL = 1e-5, 5e-5
"""fp32 plans on CPU differ from one device only in the order of sums. The tiny job's third
step follows its largest update (the gradient norm grows 5x), which amplifies that order in
the norm: measured at most 6.7e-7 in loss and 1.04e-5 in grad norm (PP x TP+SP on an Intel
Xeon; AMD EPYC stayed under 1e-5), hence 1e-5 and 5x that for the norm."""


def assert_fp32_parity(run, reference) -> None:
    """``run`` trained as one device did, up to fp32's order of sums."""
    assert_same_training(run, reference, loss_rtol=FP32_LOSS_RTOL, norm_rtol=FP32_NORM_RTOL)


def assert_same_training(run, reference, loss_rtol: float, norm_rtol: float) -> None:
    """Every step's loss and gradient norm within the given relative tolerances."""
    from autopar.cli.parity import relative_deltas

    assert len(run.losses) == len(reference.losses)
    assert max(relative_deltas(run.losses, reference.losses)) <= loss_rtol, (run.losses, reference.losses)
    assert max(relative_deltas(run.grad_norms, reference.grad_norms)) <= norm_rtol, (
        run.grad_norms,
        reference.grad_norms,
    )


def train_py(folder: Path, *flags: str) -> list[str]:
    """The command line of train.py on the tiny job writing to ``folder``."""
    return [
        sys.executable,
        "train.py",
        "--job.config",
        "train_configs/debug_model.toml",
        *TINY_FLAGS,
        "--job.dump_folder",
        str(folder),
        *flags,
    ]


def rank_env(rank: int, port: int) -> dict[str, str]:
    """What torchrun gives rank ``rank`` of two (started by hand, so a test can stop one)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_hf_folder(folder: Path, model: dict[str, object]) -> ModelArgs:
    """A tiny Qwen3 in ``folder`` as HF ships one: config.json, safetensors and a BPE
    tokenizer.json trained on the shipped corpus; returns its model args."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    args = model_args(parse_job([f"--model.{k}={v}" for k, v in model.items()]))
    network = Qwen(args)
    network.init_weights()
    to_hf(network, folder)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    corpus = [p.read_text() for p in sorted(BUILTIN_DATASETS["autopar_corpus"].glob("*.txt"))]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": eos, "eos_token_id": eos}))
    return args


def one_process_trainer(job: JobConfig):
    """A Trainer of ``job`` validated for, and built on, this one process."""
    from autopar.parallel.world import single_process
    from autopar.training.preflight import check_job
    from autopar.training.trainer import Trainer

    return Trainer(job, check_job(job, 1), single_process())


class Crashed:
    """An item whose ranks raised or died (``spawn.RankFailure``): whatever a test reads of it
    fails that test with the ranks' text, while the other items of its group are checked."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _fail(self, *_: object) -> None:
        from autopar.cli.parity import PlanFailed

        raise PlanFailed(self.text)

    __getattr__ = __iter__ = __getitem__ = _fail


def each_on_ranks(fn, world_size: int, items: list[tuple]) -> list:
    """``fn(*item)`` per item on spawned ranks sharing one group: rank 0's result each, or a
    ``Crashed`` for an item whose ranks failed (fresh ranks run the items after it)."""
    from autopar.cli.spawn import RankFailure, run_each_on_ranks

    outcomes = run_each_on_ranks(fn, world_size, items)
    return [Crashed(o.text) if isinstance(o, RankFailure) else o[0] for o in outcomes]
