"""Sample from a model: ``python -m autopar.generate --job.config FILE --generate.prompts
PROMPTS.jsonl [--section.field VALUE ...]`` (also ``autopar-generate``).

The model, tokenizer and weights come from where training takes them: an HF folder
(``checkpoint.initial_load_path`` with ``checkpoint.initial_load_in_hf``), a run's DCP
checkpoint (``checkpoint.initial_load_path``), else the flavor's initial weights. One process,
fp32 on CPU or the first GPU. Writes one JSONL record per prompt: prompt_ids, new_ids, text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from autopar.config import ConfigError, JobConfig, help_text
from autopar.data import DataError
from autopar.data.chat_template import render, template_text
from autopar.data.tokenizer import Tokenizer, build_tokenizer
from autopar.models import build_model, from_hf
from autopar.models.generation import generate
from autopar.models.generation.generate import check_prompts
from autopar.models.qwen import Qwen
from autopar.training.dcp_state import read_model_tensors
from autopar.training.resolve import model_args, parse_job, tokenizer_path

END_OF_TURN = ("<|im_end|>", "<|endoftext|>")
"""Tokens that end a reply besides the tokenizer's end of text."""


def load_model(job: JobConfig, device: torch.device) -> Qwen:
    """The job's model in fp32 with the weights its checkpoint settings name."""
    checkpoint = job.checkpoint
    if checkpoint.initial_load_path is not None and checkpoint.initial_load_in_hf:
        return from_hf(checkpoint.initial_load_path, dtype=torch.float32).to(device).eval()
    with torch.device(device):
        model = build_model(model_args(job))
    if checkpoint.initial_load_path is None:
        model.init_weights(seed=job.debug.seed)
    else:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        model.load_state_dict(read_model_tensors(checkpoint.initial_load_path, shapes), strict=False)
    return model.eval()


def read_prompts(path: str | None, tokenizer: Tokenizer, template: str) -> list[list[int]]:
    """Token ids of every line of the prompts file; a bad file or line is one DataError."""
    if path is None:
        raise ConfigError('generate.prompts is unset; name a JSONL file of {"prompt": text} lines')
    if not Path(path).is_file():
        raise ConfigError(f"generate.prompts={path!r} is not a file; name a JSONL file of prompts")
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(tokenizer.encode(_prompt_text(line, template, f"{path} line {number}")))
    if not prompts:
        raise DataError(f"{path}: no prompts; write one JSON object per line")
    return prompts


def _prompt_text(line: str, template: str, where: str) -> str:
    """A line's text: its "prompt", or its "messages" rendered with the generation prompt."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg}); write one JSON object per line") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        try:
            return render(record["messages"], template, record.get("tools"), generation_prompt=True)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    raise DataError(f'{where}: expected {{"prompt": text}} or {{"messages": [...]}}')


def check_vocabulary(prompts: list[list[int]], vocab_size: int, where: str | None) -> None:
    """One line when the tokenizer gives ids the model has no embedding for."""
    for i, prompt in enumerate(prompts):
        if max(prompt, default=0) >= vocab_size:
            raise DataError(
                f"{where}: prompt {i} has token id {max(prompt)}, past the model's vocab_size={vocab_size}; "
                "use the tokenizer the model was trained with (model.tokenizer_path or model.hf_assets_path)"
            )


def stop_ids(tokenizer: Tokenizer) -> set[int]:
    """The tokenizer's end of text and the end-of-turn tokens it has."""
    ids = {tokenizer.eos_id}
    for token in END_OF_TURN:
        encoded = tokenizer.encode(token)
        if len(encoded) == 1:
            ids.add(encoded[0])
    return ids


def run(job: JobConfig) -> Path:
    """Generate for every prompt of the job and write the output file; its path."""
    settings = job.generate
    path = tokenizer_path(job)
    tokenizer = build_tokenizer(path)
    template = template_text(path, job.training.chat_template)
    prompts = read_prompts(settings.prompts, tokenizer, template)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(job, device)
    try:
        check_prompts(prompts, settings.max_new_tokens, model.args.max_position_embeddings)
    except ValueError as err:
        raise DataError(f"{settings.prompts}: {err}") from None
    check_vocabulary(prompts, model.args.vocab_size, settings.prompts)
    stops = stop_ids(tokenizer)
    new = generate(
        model, prompts, settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k,
        settings.seed, stops, compiled=settings.compile,
    )  # fmt: skip
    output = Path(settings.output or Path(job.job.dump_folder) / "generations.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as out:
        for prompt, ids in zip(prompts, new):
            text = tokenizer.decode([i for i in ids if i not in stops])
            out.write(json.dumps({"prompt_ids": prompt, "new_ids": ids, "text": text}) + "\n")
    return output


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        output = run(parse_job(argv))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))
