"""``python -m autopar.generate --generate.adapters PATH``: a LoRA run sampled with its job's
config, the base its checkpoint settings load and the adapters it trained (its DCP checkpoint
or its exported peft folder) merged in, gives the trained model's greedy tokens; and one line
for adapters that cannot go on the base."""

from __future__ import annotations

import json

import pytest
import torch

from autopar.cli.generate import main
from autopar.config import to_toml
from autopar.data.tokenizer import build_tokenizer
from autopar.models import build_model, get_flavor, save_hf
from autopar.models.generation import generate

from jobs import chat_hf_base, chat_job, one_process_trainer

STEPS = 6
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA SFT run of the tiny chat model from its HF base, saving its checkpoint and
    exporting the adapter folder and the merged model; its job written as a TOML."""
    folder = tmp_path_factory.mktemp("lora")
    base, source = chat_hf_base(folder)
    job = chat_job(
        folder / "run",
        *("--model.hf_assets_path", str(source), "--model.tokenizer_path", str(source)),
        *("--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf", "true"),
        *("--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "0.05"),
        *("--training.steps", str(STEPS), "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)),
        *("--checkpoint.last_save_in_hf", "true", "--lora.merge_on_export", "true"),
    )
    trainer = one_process_trainer(job)
    trainer.train()
    (folder / "lora.toml").write_text(to_toml(job))
    other = build_model(get_flavor("qwen3", "debug"))  # another base (wider)
    other.init_weights(seed=1)
    save_hf(other.state_dict(), other.args, folder / "other")
    (folder / "prompts.jsonl").write_text(
        json.dumps({"prompt": "Hello there"}) + "\n" + json.dumps(CHAT) + "\n"
    )
    return folder, base.eval(), trainer.parts[0].eval()


def sample(folder, *flags: str) -> tuple[int, list[list[int]]]:
    """Greedy tokens of the run's prompts from the CLI under ``flags``."""
    output = folder / "out.jsonl"
    output.unlink(missing_ok=True)
    argv = ["--generate.prompts", str(folder / "prompts.jsonl"), "--generate.output", str(output)]
    code = main([*argv, "--generate.max_new_tokens", "16", *flags])
    return code, [
        json.loads(line)["new_ids"] for line in output.read_text().splitlines()
    ] if code == 0 else []


def in_memory(folder, model) -> list[list[int]]:
    """``model``'s greedy tokens of the run's prompts, as the CLI renders and stops them."""
    tokenizer = build_tokenizer(str(folder / "Qwen3-tiny"))
    records = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    stops = {tokenizer.eos_id, tokenizer.encode("<|im_end|>")[0]}
    with torch.no_grad():
        return generate(model, [r["prompt_ids"] for r in records], 16, stop_ids=stops)


@pytest.mark.parametrize("adapters", ["checkpoint/step-6", "hf/step-6"])
def test_the_runs_adapters_over_its_base_give_the_trained_models_tokens(lora_run, adapters):
    """From the DCP checkpoint (the adapters only; rank and alpha from the job's [lora]) and
    from the exported peft folder; fp32: merging changes only the order of two sums."""
    folder, base, trained = lora_run
    code, tokens = sample(
        folder,
        "--job.config",
        str(folder / "lora.toml"),
        "--generate.adapters",
        str(folder / "run" / adapters),
    )
    assert code == 0
    assert tokens == in_memory(folder, trained)
    assert tokens != in_memory(folder, base)  # the adapters changed the greedy tokens: the check can fail


def test_the_merged_export_loaded_as_an_hf_folder_gives_the_same_tokens(lora_run):
    folder, _, trained = lora_run
    merged = str(folder / "run" / "hf" / "step-6-merged")
    flags = ("--checkpoint.initial_load_path", merged, "--checkpoint.initial_load_in_hf", "true")
    code, tokens = sample(folder, "--job.config", str(folder / "lora.toml"), "--lora.enable", "false", *flags)
    assert code == 0 and tokens == in_memory(folder, trained)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ("--generate.adapters", "{folder}/nowhere"),
            "holds neither adapter_config.json nor a DCP checkpoint",
        ),
        (
            ("--generate.adapters", "{run}/checkpoint/step-6", "--lora.enable", "false"),
            "pass that run's --job.config",
        ),
        (
            ("--generate.adapters", "{run}/checkpoint/step-6", "--lora.rank", "8"),
            "adapters of rank 4, and lora.rank = 8",
        ),
        (
            (
                "--checkpoint.initial_load_path",
                "{run}/checkpoint/step-6",
                "--checkpoint.initial_load_in_hf",
                "false",
            ),
            "is a LoRA run's checkpoint, which holds its adapters only; load the run's base there and give",
        ),
        (
            ("--generate.adapters", "{run}/hf/step-6", "--checkpoint.initial_load_path", "{folder}/other"),
            "load the base that run trained on",
        ),
    ],
)
def test_adapters_that_cannot_go_on_the_base_are_one_line(lora_run, capsys, flags, message):
    folder, _, _ = lora_run
    run = folder / "run"
    flags = tuple(f.format(folder=folder, run=run) for f in flags)
    code, _ = sample(folder, "--job.config", str(folder / "lora.toml"), *flags)
    err = capsys.readouterr().err
    assert code == 2
    assert "generate.adapters" in err and message in err and len(err.strip().splitlines()) == 1


def test_a_peft_folder_of_qwen35s_fused_linear_merges_into_its_pieces(tmp_path):
    """peft's one adapter on HF's ``in_proj_qkv`` (A shared, B stacked) goes on our q, k and v
    pieces: the merged model's logits are the adapted model's (fp32: order of sums)."""
    from autopar.cli.generate_adapters import merge_adapters, read_adapters
    from autopar.config.sections import LoRA
    from autopar.parallel.lora import apply_lora
    from autopar.training.checkpointing.adapters import save_adapter

    from jobs import debug_job

    lora = LoRA(enable=True, rank=4, alpha=8.0, target_modules=["in_proj_qkv", "o_proj"])
    adapted, plain = (build_model(get_flavor("qwen3.5", "debug")) for _ in range(2))
    adapted.init_weights(seed=2)
    plain.load_state_dict(adapted.state_dict())
    apply_lora(adapted, lora, torch.float32)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.05)
    save_adapter({n: p for n, p in adapted.named_parameters() if ".lora_" in n}, lora, tmp_path, adapted.args)
    merge_adapters(plain, *read_adapters(str(tmp_path), debug_job()), str(tmp_path), debug_job())
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), adapted(tokens), rtol=0, atol=1e-5)
