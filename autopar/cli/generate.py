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
from autopar.data.chat_template import template_text
from autopar.data.prompts import check_vocabulary, read_prompts, stop_ids
from autopar.data.tokenizer import build_tokenizer
from autopar.models import build_model, from_hf
from autopar.models.generation import generate
from autopar.models.generation.generate import check_prompts
from autopar.models.qwen import Qwen
from autopar.training.dcp_state import read_model_tensors
from autopar.training.resolve import model_args, parse_job, tokenizer_path


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


def run(job: JobConfig) -> Path:
    """Generate for every prompt of the job and write the output file; its path."""
    settings = job.generate
    path = tokenizer_path(job)
    tokenizer = build_tokenizer(path)
    template = template_text(path, job.training.chat_template)
    prompts = read_prompts(settings.prompts, tokenizer, template, "generate.prompts")
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
