"""Write TRL 1.16's token ids, losses and metrics for the preference records below.

Run with the interpreter that has trl (``/work/venvtrl/bin/python
tests/dpo_fixtures/make_trl_fixtures.py``); the tests read what it writes and never import
trl. Everything is deterministic: the tiny policy and reference are seeded, fp32, eager
attention, and batches are built by TRL's own collator from the records in file order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl import DPOConfig, DPOTrainer

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TOKENIZER = ROOT / "autopar" / "data" / "tokenizers" / "chatml"
QWEN3_TEMPLATE = ROOT / "autopar" / "data" / "templates" / "qwen3.jinja"
MAX_LENGTH = 1024
TRUNCATED_MAX_LENGTH = {"plain": 12, "conversational": 80}
"""Per group: drops the record whose prompt fills it and truncates some others."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    }
]

PLAIN = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {
        "prompt": "Count from 3:",
        "chosen": " 3 4 5 6 7 8",
        "rejected": " 3 5 4",
    },
    {"prompt": "Repeat: the cat sat", "chosen": " the cat sat<|im_end|>", "rejected": " sat cat the"},
    {"prompt": "Say yes.", "chosen": " yes", "rejected": " yes"},
    {
        "prompt": "Write a long sentence about the sea and the wind over the water:",
        "chosen": " The wind moves over the sea and the water rises in long grey waves.",
        "rejected": " Sea.",
    },
    {"prompt": "Hello", "chosen": " world", "rejected": "world!"},
]
"""Plain records: eos appended when missing (the third already ends with it), chosen equal
to rejected, different lengths, a completion without a leading space (tokens may merge
across the prompt boundary)."""

CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": "What color is the sky?"}],
        "chosen": [{"role": "assistant", "content": "It is blue."}],
        "rejected": [{"role": "assistant", "content": "It is green."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Is water wet?"},
        ],
        "chosen": [{"role": "assistant", "content": "Yes."}],
        "rejected": [{"role": "assistant", "content": "Water is a liquid that makes things wet, so yes."}],
    },
    {
        "prompt": [{"role": "user", "content": "What is the weather in Paris?"}],
        "chosen": [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            }
        ],
        "rejected": [{"role": "assistant", "content": "It is sunny in Paris."}],
        "tools": json.dumps(TOOLS),
    },
    {
        "prompt": [
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "Another one."},
        ],
        "chosen": [{"role": "assistant", "content": "Pear."}],
        "rejected": [{"role": "assistant", "content": "Apple."}],
    },
    {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "chosen": [{"role": "assistant", "content": "Hi."}],
        "rejected": [{"role": "assistant", "content": "Hi."}],
    },
    {
        "prompt": [{"role": "user", "content": "Count from 1 to 5."}],
        "chosen": [{"role": "assistant", "content": "1 2 3 4 5"}],
        "rejected": [{"role": "assistant", "content": "1 3 2 5 4 6 7"}],
    },
]
"""Conversational records: a system message, tools (a JSON string, as Arrow holds them), a
tool call in the chosen answer, a multi-turn prompt, chosen equal to rejected."""

IMPLICIT_CONVERSATIONAL = [
    {
        "chosen": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another."},
            {"role": "assistant", "content": "Blue."},
        ],
        "rejected": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another."},
            {"role": "assistant", "content": "Red again."},
        ],
    },
    {
        "chosen": [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok"}],
        "rejected": [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok"}],
    },
]
"""No prompt: TRL's extract_prompt splits at the shared prefix of messages (identical
conversations: all but the last message)."""

IMPLICIT_PLAIN = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "One two three", "rejected": "One two four"},
    {"chosen": "Same text", "rejected": "Same text"},
]
"""No prompt, plain: extract_prompt splits strings at the first differing character and
gives a space before it to the completions."""

QWEN3_THINKING = [
    {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    {
        "prompt": [{"role": "user", "content": "What is 3 + 3?"}],
        "chosen": [{"role": "assistant", "content": "6"}],
        "rejected": [{"role": "assistant", "content": "7"}],
        "chat_template_kwargs": {"enable_thinking": True},
    },
]
"""Qwen3's template with ``chat_template_kwargs``: without thinking the generation prompt
ends in an empty think block."""

LOSSES: list[dict[str, Any]] = [
    {"name": "sigmoid", "loss_type": ["sigmoid"], "beta": 0.1},
    {"name": "sigmoid_beta0.5", "loss_type": ["sigmoid"], "beta": 0.5},
    {"name": "ipo", "loss_type": ["ipo"], "beta": 0.1},
    {"name": "hinge", "loss_type": ["hinge"], "beta": 0.1},
    {"name": "robust", "loss_type": ["robust"], "beta": 0.1, "label_smoothing": 0.1},
    {"name": "sigmoid_sft", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.1},
    {"name": "sigmoid_truncated", "loss_type": ["sigmoid"], "beta": 0.1},
]


BATCH_KEPT = ("sigmoid", "sigmoid_truncated")
"""The entries that also keep TRL's collated batch (chosen rows, then rejected rows), the same
for every loss at one max_length."""


def tiny_qwen3(seed: int) -> Qwen3ForCausalLM:
    """A tiny fp32 Qwen3 on the chatml vocabulary; a large init spread so log-probs differ."""
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="eager",
        dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def dpo_config(loss: dict[str, Any], batch_size: int) -> DPOConfig:
    options = {k: v for k, v in loss.items() if k != "name"}
    options.setdefault("max_length", MAX_LENGTH)
    return DPOConfig(
        output_dir=str(HERE / "_trl_output"),
        per_device_train_batch_size=batch_size,
        padding_free=False,
        bf16=False,  # DPOConfig's default is True: bf16 autocast on CPU too
        precompute_ref_log_probs=False,
        report_to="none",
        use_cpu=True,
        dataset_num_proc=None,
        gradient_checkpointing=False,
        **options,
    )


def config_fields(config: DPOConfig) -> dict[str, Any]:
    """The DPOConfig fields that decide tokenization, truncation and the loss."""
    names = [
        "beta",
        "loss_type",
        "loss_weights",
        "label_smoothing",
        "max_length",
        "truncation_mode",
        "padding_free",
        "precompute_ref_log_probs",
        "ld_alpha",
        "f_divergence_type",
        "use_weighting",
        "pad_to_multiple_of",
        "disable_dropout",
        "bf16",
    ]
    return {name: getattr(config, name) for name in names}


def tokenizer(template: Path | None = None) -> Any:
    found = AutoTokenizer.from_pretrained(str(TOKENIZER))
    if template is not None:
        found.chat_template = template.read_text(encoding="utf-8")
    return found


def trainer(records: list[dict[str, Any]], loss: dict[str, Any], processing: Any) -> DPOTrainer:
    return DPOTrainer(
        model=tiny_qwen3(0),
        ref_model=tiny_qwen3(1),
        args=dpo_config(loss, len(records)),
        train_dataset=as_dataset([{**record, "row": i} for i, record in enumerate(records)]),
        processing_class=processing,
    )


def as_dataset(records: list[dict[str, Any]]) -> Dataset:
    """The records as a Dataset with every field in every row (None where a record lacks it:
    ``Dataset.from_list`` keeps only the first record's keys, as a JSON file's loader would not)."""
    names = list(dict.fromkeys(name for record in records for name in record))
    return Dataset.from_list([{name: record.get(name) for name in names} for record in records])


def token_ids(records: list[dict[str, Any]], processing: Any) -> list[dict[str, list[int]]]:
    """TRL's prompt / chosen / rejected ids of every record (no truncation)."""
    built = trainer(records, {"name": "ids", "loss_type": ["sigmoid"]}, processing)
    return [
        {
            "prompt_ids": row["prompt_ids"],
            "chosen_ids": row["chosen_ids"],
            "rejected_ids": row["rejected_ids"],
        }
        for row in built.train_dataset
    ]


def recording(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record the (chosen, rejected) summed completion log-probs of every forward of ``model``:
    the very numbers ``compute_loss`` uses."""
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = model.forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        found.append(out.log_probs.detach().sum(dim=1).chunk(2))
        return out

    model.forward = recorded
    return found


def loss_fixture(records: list[dict[str, Any]], loss: dict[str, Any], processing: Any) -> dict[str, Any]:
    """TRL's loss, metrics and per-sequence log-probs on one batch of all records, in order."""
    built = trainer(records, loss, processing)
    rows = list(built.train_dataset)
    batch = built._prepare_inputs(built.data_collator(rows))
    policy, reference = recording(built.model), recording(built.ref_model)
    built.model.train()
    loss_value = built.compute_loss(built.model, batch)
    (policy_chosen, policy_rejected), (reference_chosen, reference_rejected) = policy[0], reference[0]
    fixture = {
        "name": loss["name"],
        "dpo_config": config_fields(built.args),
        "rows": [r["row"] for r in rows],
        "loss": loss_value.item(),
        "metrics": {k: v[-1] for k, v in built._metrics["train"].items()},
        "logps": {
            "policy_chosen": policy_chosen.tolist(),
            "policy_rejected": policy_rejected.tolist(),
            "reference_chosen": reference_chosen.tolist(),
            "reference_rejected": reference_rejected.tolist(),
        },
    }
    if loss["name"] in BATCH_KEPT:
        fixture["batch"] = {k: batch[k].tolist() for k in ("input_ids", "completion_mask")}
    return fixture


def write_records(name: str, records: list[dict[str, Any]]) -> None:
    """The records as JSONL (tools kept as TRL saw them: a JSON string)."""
    with (HERE / f"{name}.jsonl").open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def write(name: str, body: dict[str, Any]) -> None:
    header = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    text = json.dumps({**header, **body}, separators=(",", ":"))
    (HERE / f"{name}.json").write_text(text + "\n", encoding="utf-8")


def save_models() -> None:
    for name, seed in (("policy", 0), ("reference", 1)):
        folder = HERE / name
        shutil.rmtree(folder, ignore_errors=True)
        tiny_qwen3(seed).save_pretrained(str(folder), safe_serialization=True)
        (folder / "generation_config.json").unlink(missing_ok=True)


def main() -> None:
    chatml = tokenizer()
    groups = {
        "plain": (PLAIN, chatml, None),
        "conversational": (CONVERSATIONAL, chatml, None),
        "implicit_conversational": (IMPLICIT_CONVERSATIONAL, chatml, None),
        "implicit_plain": (IMPLICIT_PLAIN, chatml, None),
        "qwen3_thinking": (QWEN3_THINKING, tokenizer(QWEN3_TEMPLATE), "qwen3"),
    }
    for name, (records, processing, template) in groups.items():
        write_records(name, records)
        write(
            f"{name}_ids",
            {
                "records": f"{name}.jsonl",
                "tokenizer": "autopar/data/tokenizers/chatml",
                "chat_template": template,
                "eos_token": processing.eos_token,
                "ids": token_ids(records, processing),
            },
        )
    as_dataset(CONVERSATIONAL).save_to_disk(str(HERE / "conversational_saved"))
    save_models()
    for name in ("plain", "conversational"):
        records, processing, _ = groups[name]
        truncated = {"max_length": TRUNCATED_MAX_LENGTH[name]}
        fixtures = [
            loss_fixture(
                records, {**loss, **(truncated if loss["name"].endswith("truncated") else {})}, processing
            )
            for loss in LOSSES
        ]
        write(
            f"{name}_losses",
            {"records": f"{name}.jsonl", "policy": "policy", "reference": "reference", "losses": fixtures},
        )
    shutil.rmtree(HERE / "_trl_output", ignore_errors=True)


if __name__ == "__main__":
    main()
