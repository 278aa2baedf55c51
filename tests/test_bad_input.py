"""Bad input, as users type it: every malformed config, flag, file or folder gets one line
naming the field and the fix, exit code 2, no traceback, and nothing written to disk.

Each case runs ``autopar.cli.train.main`` (what train.py runs) in this process on the tiny job; the flags before the
case's own make a job that would otherwise train.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from autopar.cli.bench import main as bench_main
from autopar.cli.train import main as train_main
from autopar.data.chat import CHAT_EXAMPLE, CHATML_TOKENIZER
from autopar.data.prepare import main as prepare_main
from autopar.data.prepare import prepare
from autopar.data.tokens import source_files
from autopar.models import Qwen, to_hf
from autopar.parallel.lora import apply_lora
from autopar.training.checkpointing.dcp_state import ModelState
from autopar.training.resolve import model_args

from jobs import CHAT_VOCAB, TINY_FLAGS, tiny_job

CHAT = (
    f"--training.dataset_format chat --training.dataset_path {CHAT_EXAMPLE} --model.vocab_size {CHAT_VOCAB}"
)
"""Chat fine-tuning on the shipped conversations; a case adds its tokenizer or template."""
BROKEN_TEMPLATES = {
    "tok_syntax": "{% for m in messages %}{{ m.content }}",
    "tok_filter": "{{ messages | no_such_filter }}",
    "tok_undefined": "{{ messages[0].content.no_such_method() }}",
}
"""Tokenizer folders whose tokenizer_config.json chat_template is broken, by how."""
HF_CONFIG_CHANGES = {
    "hf_size_as_text": {"hidden_size": "64"},
    "hf_size_as_float": {"num_hidden_layers": 2.0},
    "hf_zero_heads": {"num_key_value_heads": 0},
    "hf_nan_eps": {"rms_norm_eps": float("nan")},
    "hf_infinite_theta": {"rope_theta": float("inf")},
    "hf_bool_as_text": {"tie_word_embeddings": "false"},
    "hf_rope_not_object": {"rope_parameters": "default"},
}
"""Whole HF model folders whose config.json has one value of the wrong type or range."""


def save_dcp(folder: Path, job_folder: Path, lora: bool = False, **fields: object) -> None:
    """A DCP checkpoint of the tiny model with ``fields`` changed (under ``lora``: its
    adapters only, as a LoRA run saves them) in ``folder``."""
    job = tiny_job(job_folder)
    model = Qwen(dataclasses.replace(model_args(job), **fields))
    if lora:
        apply_lora(model, dataclasses.replace(job.lora, enable=True), torch.float32)
    dcp.save(
        {"model": ModelState([model], "trained" if lora else "all")}, checkpoint_id=str(folder), no_dist=True
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Broken files of every kind a user might point a job at."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "short.txt").write_text("tiny")
    (folder / "syntax.toml").write_text("[training\nsteps = 3\n")
    (folder / "section.toml").write_text("[trainig]\nsteps = 3\n")
    (folder / "type.toml").write_text('[training]\nsteps = "ten"\n')
    (folder / "a_file").write_text("not a folder")
    (folder / "tok").mkdir()
    (folder / "tok" / "tokenizer.json").write_text("{")
    (folder / "latin1.txt").write_bytes("caf\u00e9 au lait, ".encode("latin-1") * 200)
    (folder / "number.jsonl").write_text('{"text": "a fine line of text"}\n{"text": 5}\n')
    os.mkfifo(folder / "fifo")
    (folder / "text").mkdir()
    (folder / "text" / "doc.txt").write_text("a document long enough for a few sequences " * 20)
    prepared, _ = prepare([str(folder / "text")], str(folder / "cut"), None)
    prepared.write_bytes(prepared.read_bytes()[:-2])
    hf = folder / "hf"
    to_hf(Qwen(model_args(tiny_job(folder / "unused"))), hf)
    shutil.copytree(hf, folder / "hf_whole")
    shard = hf / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for name, template in {**BROKEN_TEMPLATES, "tok_not_json": None}.items():
        (folder / name).mkdir()
        (folder / name / "tokenizer.json").write_bytes((CHATML_TOKENIZER / "tokenizer.json").read_bytes())
        config = json.dumps({"chat_template": template}) if template else '{"chat_template": "x",'
        (folder / name / "tokenizer_config.json").write_text(config)
    (folder / "syntax.jinja").write_text("{% if messages %}\n{{ messages[0] }\n{% endif %}")
    for name, change in HF_CONFIG_CHANGES.items():
        shutil.copytree(folder / "hf_whole", folder / name)
        config = json.loads((folder / name / "config.json").read_text())
        (folder / name / "config.json").write_text(json.dumps({**config, **change}))
    shutil.copytree(folder / "hf_whole", folder / "hf_int8")
    tensors = load_file(folder / "hf_whole" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file({**tensors, q: tensors[q].to(torch.int8)}, folder / "hf_int8" / "model.safetensors")
    shutil.copytree(folder / "hf_whole", folder / "hf_nan_weight")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "hf_nan_weight" / "model.safetensors")
    save_dcp(folder / "dcp_4_layers", folder / "unused", num_hidden_layers=4)
    save_dcp(folder / "dcp_wider_mlp", folder / "unused", intermediate_size=96)
    save_dcp(folder / "dcp_adapters", folder / "unused", lora=True)
    save_dcp(folder / "dcp_bad_metadata", folder / "unused")
    (folder / "dcp_bad_metadata" / ".metadata").write_bytes(b"not a pickle")
    return folder


CASES = {
    # unknown and misspelt names
    "section misspelt": ("--trainig.steps 5", "unknown config section 'trainig'; did you mean 'training'?"),
    "field misspelt": ("--training.stpes 5", "did you mean 'training.steps'?"),
    "model field misspelt": ("--model.hidden_sizee 64", "did you mean 'model.hidden_size'?"),
    "degree misspelt": (
        "--parallelism.tensor_paralel_degree 2",
        "did you mean 'parallelism.tensor_parallel_degree'",
    ),
    # wrong types and choices
    "int as word": ("--training.steps ten", "training.steps='ten' is not an int"),
    "float as word": ("--optimizer.lr fast", "optimizer.lr='fast' is not a number"),
    "bool as word": (
        "--checkpoint.enable maybe",
        "checkpoint.enable='maybe' is not a bool; use true or false",
    ),
    "int as float": ("--training.seq_len 3.5", "training.seq_len='3.5' is not an int"),
    "unknown choice": (
        "--activation_checkpoint.mode sometimes",
        "is not one of ['none', 'full', 'selective']",
    ),
    "regather with nothing gathered": (
        "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op_regather",
        "selective_ac_option='op_regather' gathers sequence parallelism's inputs again in backward, and this "
        "plan gathers none",
    ),
    "unknown model": ("--model.name llama", "model.name='llama' is not one of"),
    "unknown flavor": ("--model.flavor 9B", "model.flavor='9B' is unknown for qwen3"),
    "unknown dtype": (
        "--training.mixed_precision_param float16",
        "mixed_precision_param='float16' is not one",
    ),
    # command-line syntax
    "flag without value": ("--training.steps", "--training.steps needs a value"),
    "flag without dashes": ("training.steps=5", "flags look like --training.steps 20"),
    "dry run without world size": ("--dry-run", "--dry-run needs --world-size N"),
    # numbers out of range
    "zero steps": ("--training.steps 0", "training.steps=0 must be >= 1"),
    "zero batch": ("--training.local_batch_size 0", "training.local_batch_size=0 must be >= 1"),
    "one-token sequence": ("--training.seq_len 1", "training.seq_len=1 must be >= 2"),
    "negative lr": ("--optimizer.lr -1", "optimizer.lr=-1.0 must be a finite number >= 0"),
    "nan lr": ("--optimizer.lr nan", "optimizer.lr=nan must be a finite number"),
    "huge lr": ("--optimizer.lr 1e400", "optimizer.lr=inf must be a finite number"),
    "beta of one": ("--optimizer.beta2 1.0", "optimizer.beta2=1.0 must be in [0, 1)"),
    "negative warmup": ("--lr_scheduler.warmup_steps -1", "lr_scheduler.warmup_steps=-1 must be >= 0"),
    "negative clip": ("--training.max_norm -1", "training.max_norm=-1.0 must be >= 0"),
    "negative rope theta": ("--model.rope_theta -1", "model.rope_theta=-1.0 must be a finite number > 0"),
    "zero norm eps": ("--model.rms_norm_eps 0", "model.rms_norm_eps=0.0 must be a finite number > 0"),
    "negative init range": ("--model.initializer_range -0.02", "initializer_range=-0.02 must be a finite"),
    "zero head dim": ("--model.head_dim 0", "model.head_dim=0 must be positive"),
    "negative seed": ("--debug.seed -1", "debug.seed=-1 must be >= 0"),
    "zero timeout": ("--comm.train_timeout_seconds 0", "comm.train_timeout_seconds=0 must be >= 1"),
    "zero checkpoint interval": ("--checkpoint.interval 0", "checkpoint.interval=0 must be >= 1"),
    "zero log interval": ("--metrics.log_freq 0", "metrics.log_freq=0 must be >= 1"),
    # plans that cannot run
    "tp not dividing the world": ("--parallelism.tensor_parallel_degree 3", "world size 1 is not divisible"),
    "dp past the world": ("--parallelism.data_parallel_shard_degree 2", "but the world size is 1"),
    "pp past the world": ("--parallelism.pipeline_parallel_degree 2", "world size 1 is not divisible"),
    "uneven global batch": ("--training.global_batch_size 3", "global_batch_size=3 is not a multiple"),
    "heads not grouping": (
        "--model.num_key_value_heads 3",
        "is not a multiple of model.num_key_value_heads=3",
    ),
    "sequence past the model": ("--training.seq_len 100000", "exceeds model.max_position_embeddings"),
    "vocabulary below the tokenizer": ("--model.vocab_size 100", "model.vocab_size=100 is smaller than"),
    "float8 filter matching nothing": (
        "--float8.enable true --float8.filter_fqns lm_hed",
        "float8.filter_fqns item 'lm_hed' matches no module",
    ),
    "te on cpu": ("--float8.enable true --float8.backend te", "float8.backend='te' needs CUDA"),
    "unknown compile backend": ("--compile.enable true --compile.backend nope", "compile.backend='nope'"),
    # files and folders
    "missing toml": ("--job.config {inputs}/none.toml", "none.toml"),
    "toml syntax": ("--job.config {inputs}/syntax.toml", "syntax.toml"),
    "toml unknown section": ("--job.config {inputs}/section.toml", "did you mean 'training'?"),
    "toml wrong type": ("--job.config {inputs}/type.toml", "training.steps='ten' is not an int"),
    "dataset not UTF-8": (
        "--training.dataset_path {inputs}/latin1.txt",
        "latin1.txt: not UTF-8 text (byte 3",
    ),
    "jsonl text not a string": (
        "--training.dataset_path {inputs}/number.jsonl",
        'number.jsonl:2: "text" is int 5',
    ),
    "dataset is a pipe": ("--training.dataset_path {inputs}/fifo", "fifo: not a regular file or folder"),
    "missing dataset": ("--training.dataset_path {inputs}/none", "training.dataset_path="),
    "unknown dataset": ("--training.dataset nope", "training.dataset='nope' is not built in"),
    "dataset too short": ("--training.dataset_path {inputs}/short.txt", "cannot fill one sequence"),
    "truncated prepared dataset": ("--training.dataset_path {inputs}/cut.bin", "the file is truncated"),
    "missing tokenizer": ("--model.tokenizer_path {inputs}/none", "no tokenizer.json there"),
    "corrupt tokenizer": (
        "--model.tokenizer_path {inputs}/tok",
        "tok/tokenizer.json: not a readable HF tokenizer",
    ),
    "missing hf assets": ("--model.hf_assets_path {inputs}/none", "/none': no such folder; download"),
    "missing initial weights": ("--checkpoint.initial_load_path {inputs}/none", "no such folder"),
    "initial weights of a deeper model": (
        "--checkpoint.initial_load_path {inputs}/dcp_4_layers",
        "was saved from another model than qwen3/debug: layers.2.",
    ),
    "initial weights of another mlp width": (
        "--checkpoint.initial_load_path {inputs}/dcp_wider_mlp",
        "is [96, 64] in the checkpoint, [128, 64] in the model",
    ),
    "initial weights of adapters only": (
        "--checkpoint.initial_load_path {inputs}/dcp_adapters",
        "is not in the checkpoint",
    ),
    "initial weights with damaged metadata": (
        "--checkpoint.initial_load_path {inputs}/dcp_bad_metadata",
        "dcp_bad_metadata/.metadata is not readable",
    ),
    "hf load without a path": ("--checkpoint.initial_load_in_hf true", "needs checkpoint.initial_load_path"),
    "truncated safetensors": (
        "--checkpoint.initial_load_path {inputs}/hf --checkpoint.initial_load_in_hf true",
        "model.safetensors: not a readable safetensors file",
    ),
    "missing load step": ("--checkpoint.enable true --checkpoint.load_step 5", "no complete checkpoint"),
    "negative load step": ("--checkpoint.enable true --checkpoint.load_step -5", "load_step=-5: use -1"),
    "empty dump folder": ("--job.dump_folder=", "job.dump_folder is empty"),
    "load step without checkpoints": (
        "--checkpoint.enable false --checkpoint.load_step 5",
        "needs checkpoint.enable=true",
    ),
    # HF config.json values and weights
    "hf size as text": (
        "--model.hf_assets_path {inputs}/hf_size_as_text",
        "hidden_size='64' must be an integer",
    ),
    "hf size as float": (
        "--model.hf_assets_path {inputs}/hf_size_as_float",
        "num_hidden_layers=2.0 must be an integer",
    ),
    "hf zero heads": (
        "--model.hf_assets_path {inputs}/hf_zero_heads",
        "num_key_value_heads=0 must be an integer >= 1",
    ),
    "hf nan eps": (
        "--model.hf_assets_path {inputs}/hf_nan_eps",
        "rms_norm_eps=nan must be a finite number > 0",
    ),
    "hf infinite theta": (
        "--model.hf_assets_path {inputs}/hf_infinite_theta",
        "rope_theta=inf must be a finite",
    ),
    "hf bool as text": (
        "--model.hf_assets_path {inputs}/hf_bool_as_text",
        "tie_word_embeddings='false' must be true or false",
    ),
    "hf rope not an object": (
        "--model.hf_assets_path {inputs}/hf_rope_not_object",
        "rope_parameters='default' must be an object",
    ),
    "hf int8 weight": (
        "--checkpoint.initial_load_path {inputs}/hf_int8 --checkpoint.initial_load_in_hf true",
        "'model.layers.0.self_attn.q_proj.weight' is I8, not one of",
    ),
    "nan lora alpha": ("--lora.enable true --lora.alpha nan", "lora.alpha=nan must be a finite number"),
    "infinite weight decay": ("--optimizer.weight_decay inf", "optimizer.weight_decay=inf must be a finite"),
    # chat templates and tokenizer configs
    "template file syntax": (
        f"{CHAT} --model.tokenizer_path {CHATML_TOKENIZER} --training.chat_template {{inputs}}/syntax.jinja",
        "syntax.jinja: chat template line 2: unexpected '}'",
    ),
    "tokenizer template syntax": (
        f"{CHAT} --model.tokenizer_path {{inputs}}/tok_syntax",
        "tok_syntax/tokenizer_config.json chat_template: chat template line 1: Unexpected end of template",
    ),
    "tokenizer template unknown filter": (
        f"{CHAT} --model.tokenizer_path {{inputs}}/tok_filter",
        "No filter named 'no_such_filter'",
    ),
    "tokenizer template failing to render": (
        f"{CHAT} --model.tokenizer_path {{inputs}}/tok_undefined",
        "chat template failed on this conversation: UndefinedError",
    ),
    "tokenizer config not json": (
        f"{CHAT} --model.tokenizer_path {{inputs}}/tok_not_json",
        "tok_not_json/tokenizer_config.json: not JSON (",
    ),
    "list items apart": (
        "--dpo.loss_type sigmoid sft",
        "unexpected argument 'sft' after --dpo.loss_type sigmoid: dpo.loss_type is a list, its items "
        "comma-separated: --dpo.loss_type sigmoid,sft",
    ),
    # blends
    "nan blend weight": ("--training.dataset_blend nan:{inputs}/cut", "finite positive weight"),
    "blend without path": ("--training.dataset_blend 0.5", "is not 'weight:path'"),
    "blend of text": ("--training.dataset_blend 1:{inputs}/text", "is not a prepared dataset"),
    # outputs
    "dump folder is a file": ("--job.dump_folder {inputs}/a_file", "job.dump_folder: cannot write"),
    "checkpoint folder where nothing can be made": (
        "--checkpoint.enable true --checkpoint.folder /proc/autopar_checkpoints",
        "checkpoint.folder: cannot write /proc/autopar_checkpoints: nothing can be created in /proc",
    ),
    "float8 converting no linear": (
        "--float8.enable true --float8.backend torchao --model.hidden_size=72",
        "float8.enable=true converts no linear of this model",
    ),
    "checkpoint folder under a file": (
        "--checkpoint.enable true --checkpoint.folder {inputs}/a_file/ck",
        "checkpoint.folder: cannot write",
    ),
}


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in f.rglob("*")}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_gets_one_line_exit_2_and_writes_nothing(case, inputs, tmp_path, capsys):
    flags, expected = CASES[case]
    argv = flags.format(inputs=inputs).split()
    config = [] if "--job.config" in argv else ["--job.config", "train_configs/debug_model.toml"]
    before = snapshot(inputs, tmp_path)
    code = train_main(
        [*config, *TINY_FLAGS, "--training.steps", "3", "--job.dump_folder", str(tmp_path / "out"), *argv]
    )
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].split(":")[0] in ("config error", "data error"), err[-2000:]
    assert expected in lines[0]
    assert snapshot(inputs, tmp_path) == before


def test_weights_that_are_not_finite_are_refused_before_step_1_naming_their_folder(inputs, tmp_path, capsys):
    hf = inputs / "hf_nan_weight"
    flags = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "true"]
    code = train_main(
        ["--job.config", "debug_model", *TINY_FLAGS, "--job.dump_folder", str(tmp_path), *flags]
    )
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"config error: the weights loaded from {hf} are not finite (NaN or inf); re-download or "
        "re-export them, or start from other weights"
    )
    assert "Traceback" not in err and not (tmp_path / "metrics.jsonl").exists()


LAUNCH_ENVIRONMENTS = {
    "rank without a world": ({"RANK": "1"}, "environment RANK=1 with WORLD_SIZE=unset (1)"),
    "world without a rendezvous": ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT"),
    "rank not a number": ({"RANK": "first"}, "environment RANK='first' must be a non-negative integer"),
}


@pytest.mark.parametrize("case", LAUNCH_ENVIRONMENTS, ids=list(LAUNCH_ENVIRONMENTS))
def test_launch_variables_set_by_hand_get_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    env, expected = LAUNCH_ENVIRONMENTS[case]
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = train_main(
        ["--job.config", "debug_model", *TINY_FLAGS, "--job.dump_folder", str(tmp_path / "out")]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_bench_with_zero_timed_steps_gets_one_line_exit_2(capsys):
    assert bench_main(["--steps", "0", "--job.config", "debug_model"]) == 2
    assert capsys.readouterr().err.strip() == "config error: --steps 0 must be >= 1"


@pytest.mark.parametrize(
    ("source", "output", "expected"),
    [
        ("text", "{inputs}/prepared_here/", "is a folder; give a file prefix"),
        ("latin1.txt", "{tmp}/latin", "latin1.txt: not UTF-8 text"),
    ],
    ids=["output a folder", "input not UTF-8"],
)
def test_prepare_refuses_with_one_line_exit_2_and_writes_nothing(
    source, output, expected, inputs, tmp_path, capsys
):
    (inputs / "prepared_here").mkdir(exist_ok=True)
    before = snapshot(inputs, tmp_path)
    with pytest.raises(SystemExit) as stop:
        prepare_main(
            ["--input", str(inputs / source), "--output", output.format(inputs=inputs, tmp=tmp_path)]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and expected in err[0], err
    assert snapshot(inputs, tmp_path) == before


def test_a_text_folder_names_the_files_it_ignores(tmp_path, caplog):
    (tmp_path / "doc.txt").write_text("some text")
    (tmp_path / "tokens.bin").write_bytes(bytes(8))
    assert source_files(tmp_path) == [tmp_path / "doc.txt"]
    assert "ignoring 1 file(s) that are not .txt/.md/.jsonl: tokens.bin" in caplog.text
