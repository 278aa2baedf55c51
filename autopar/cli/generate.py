"""Sample from a model: ``python -m autopar.generate --job.config FILE --generate.prompts
PROMPTS.jsonl [--section.field VALUE ...]`` (also ``autopar-generate``), or talk to it with
``--generate.chat true`` (``cli/chat.py``).

The model, tokenizer and weights come from where training takes them: an HF folder
(``checkpoint.initial_load_path`` with ``checkpoint.initial_load_in_hf``), a run's DCP
checkpoint (``checkpoint.initial_load_path``), else the flavor's initial weights; a LoRA
run's adapters over them with ``generate.adapters``. One process,
fp32 on CPU or the first GPU. Writes one JSONL record per prompt: prompt_ids, new_ids, text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from autopar.cli.chat import chat
from autopar.cli.generate_adapters import merge_adapters, read_adapters
from autopar.cli.generate_output import check_output, output_path, write_records
from autopar.config import ConfigError, JobConfig, help_text
from autopar.config.checks import require
from autopar.config.sections import Generate
from autopar.data import DataError
from autopar.data.chat_template import template_text
from autopar.data.prompts import check_vocabulary, read_prompts, stop_ids
from autopar.data.tokenizer import build_tokenizer
from autopar.models import build_model, from_hf
from autopar.models.generation import generate
from autopar.models.generation.generate import check_prompts
from autopar.models.generation.speculative import Acceptance, speculative_generate
from autopar.models.hf_config import HFCheckpointError
from autopar.models.qwen import Qwen
from autopar.parallel.mesh import tp_split_sizes
from autopar.parallel.replicated_experts import split_experts
from autopar.parallel.tensor_parallel import apply_tp
from autopar.parallel.torch_internals import key_compile_cache_on_vector_isa
from autopar.parallel.world import World, init_world
from autopar.training.checkpointing.dcp_state import read_model_tensors
from autopar.training.checkpointing.initial_load import check_dcp_weights, reading_weights
from autopar.training.resolve import model_args, parse_job, tokenizer_path

NO_HEAD = (
    "generate.speculative=mtp drafts with the model's multi-token-prediction head, and {where} has "
    "none; load a Qwen3.5 HF folder with mtp.* tensors, or use --generate.speculative off"
)


def check_sampling(settings: Generate) -> None:
    """Sampling settings in their ranges (transformers' and vLLM's), before any work: out of
    range they would sample at a negative temperature, drop every token (top_p 0) or give
    empty outputs (max_new_tokens 0)."""
    require(settings.max_new_tokens >= 1, f"generate.max_new_tokens={settings.max_new_tokens} must be >= 1")
    require(
        settings.temperature >= 0,
        f"generate.temperature={settings.temperature} must be >= 0 (0: greedy decoding)",
    )
    require(
        0 < settings.top_p <= 1,
        f"generate.top_p={settings.top_p} must be in (0, 1] (1: all tokens); for greedy decoding use "
        "--generate.temperature 0",
    )
    require(settings.top_k >= 0, f"generate.top_k={settings.top_k} must be >= 0 (0: all tokens)")


def check_speculation(job: JobConfig) -> None:
    """One line for speculative settings that cannot run, before any work."""
    settings = job.generate
    if settings.speculative == "off":
        return
    if settings.draft_tokens < 1:
        raise ConfigError(f"generate.draft_tokens={settings.draft_tokens} must be at least 1")
    if settings.compile:
        raise ConfigError(
            "generate.speculative=mtp runs eagerly (its verification forwards vary in length); "
            "use --generate.compile false"
        )


def check_parallelism(job: JobConfig, world: World) -> None:
    """Generation splits the model over every process by tensor parallelism, expert
    parallelism or both (each over all the processes): one line for another plan, or for a
    setting that runs on one process only."""
    degrees = {
        "tensor_parallel_degree": job.parallelism.tensor_parallel_degree,
        "expert_parallel_degree": job.parallelism.expert_parallel_degree,
    }
    for field, degree in degrees.items():
        if degree not in (1, world.size):
            raise ConfigError(
                f"parallelism.{field}={degree} with {world.size} process(es): generation splits the model "
                f"over every process or none; set it to {world.size} or 1"
            )
    if world.size > 1 and set(degrees.values()) == {1}:
        raise ConfigError(
            f"{world.size} processes with parallelism.tensor_parallel_degree=1 and expert_parallel_degree=1: "
            f"generation splits the model over every process; set --parallelism.tensor_parallel_degree "
            f"{world.size} (or expert_parallel_degree {world.size} for a mixture of experts)"
        )
    if world.size > 1 and job.generate.compile:
        raise ConfigError("generate.compile runs on one process; use --generate.compile false under torchrun")


def check_chat(job: JobConfig, world: World) -> None:
    """One line for a chat that cannot run: it is one process's, plain decoding, no file."""
    settings = job.generate
    if not settings.chat:
        return
    if world.size > 1:
        raise ConfigError("generate.chat runs on one process; start it without torchrun")
    if settings.speculative != "off":
        raise ConfigError("generate.chat streams plain decoding; use --generate.speculative off")
    if settings.prompts is not None:
        raise ConfigError(
            f"generate.chat with generate.prompts={settings.prompts!r}: one or the other (the chat reads "
            "your turns from the terminal)"
        )


def split_model(model: Qwen, world: World, tensor_parallel: bool, expert_parallel: bool) -> None:
    """Split ``model`` over all ranks, which all decode the same prompts. ``tensor_parallel``:
    training's tensor-parallel plan without sequence or loss parallel (every rank gets whole
    logits, so all choose the same tokens); each attention and Gated DeltaNet layer then runs
    on its rank's heads, and the decoder's caches, built from what the kernels see, hold those
    heads only; an MTP head is split by the head's plan and drafts from whole logits too.
    ``expert_parallel``: each rank holds its share of every mixture's experts
    (``parallel/replicated_experts.py``)."""
    if world.size == 1:
        return
    args = model.args
    sizes = tp_split_sizes(args) if tensor_parallel else {}
    if expert_parallel and not args.moe:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={world.size} splits a mixture's experts, and this model "
            f"({args.family}) is dense; use --parallelism.tensor_parallel_degree {world.size} alone"
        )
    if expert_parallel:
        sizes["num_experts"] = args.num_experts
    for field, size in sizes.items():
        if size % world.size:
            plan = "expert" if field == "num_experts" else "tensor"
            raise ConfigError(
                f"parallelism.{plan}_parallel_degree={world.size} does not divide the model's {field}={size}"
            )
    mesh = init_device_mesh(world.device.type, (world.size,), mesh_dim_names=("ranks",))
    if tensor_parallel:
        apply_tp(model, mesh, args, sequence_parallel=False, loss_parallel=False)
    if expert_parallel:
        split_experts(model, mesh, args)


def load_model(job: JobConfig, device: torch.device) -> Qwen:
    """The job's model in fp32 with the weights its checkpoint settings name (with its MTP
    head under ``generate.speculative=mtp``), and ``generate.adapters`` merged into them."""
    path = job.generate.adapters
    adapters = None if path is None else read_adapters(path, job)  # a bad path: before the model
    model = load_base(job, device)
    if adapters is not None:
        merge_adapters(model, *adapters, path, job)
    return model


def load_base(job: JobConfig, device: torch.device) -> Qwen:
    """The model of the checkpoint settings, before any adapters."""
    checkpoint = job.checkpoint
    head = job.generate.speculative == "mtp"
    if checkpoint.initial_load_path is not None and checkpoint.initial_load_in_hf:
        try:
            model = from_hf(checkpoint.initial_load_path, dtype=torch.float32, mtp=head)
        except HFCheckpointError as err:
            if not head:
                raise ConfigError(f"checkpoint.initial_load_path: {err}") from None
            raise ConfigError(NO_HEAD.format(where=checkpoint.initial_load_path)) from None
        return model.to(device).eval()
    args = model_args(job)
    if head and not args.mtp_num_hidden_layers:
        raise ConfigError(NO_HEAD.format(where=f"model {job.model.name}/{job.model.flavor}"))
    path, field = checkpoint.initial_load_path, "checkpoint.initial_load_path"
    if path is not None:
        check_dcp_weights(Path(path), field)
    with torch.device(device):
        model = build_model(args)
    if checkpoint.initial_load_path is None:
        model.init_weights(seed=job.debug.seed)
    else:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        check_saved_model(path, shapes)
        with reading_weights(path, field):
            model.load_state_dict(read_model_tensors(path, shapes), strict=False)
    return model.eval()


def check_saved_model(path: str, shapes: dict[str, torch.Size]) -> None:
    """One line for a DCP folder without the job's weights: a LoRA run's (its adapters only),
    or another model's."""
    saved = {
        k.removeprefix("model."): torch.Size(v.size)
        for k, v in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if k.startswith("model.")
    }
    wrong = [n for n, shape in shapes.items() if saved.get(n) != shape]
    if not wrong:
        return
    if any(".lora_" in n for n in saved):
        raise ConfigError(
            f"checkpoint.initial_load_path={path} is a LoRA run's checkpoint, which holds its adapters "
            "only; load the run's base there and give this folder as --generate.adapters"
        )
    found = "not in it" if wrong[0] not in saved else f"{list(saved[wrong[0]])} there"
    raise ConfigError(
        f"checkpoint.initial_load_path={path} does not hold the job's model ({wrong[0]} is {found}, "
        f"{list(shapes[wrong[0]])} in the model); pass the --job.config of the run that saved it"
    )


def summary(stats: list[Acceptance], draft_tokens: int) -> str:
    """The CLI's line on a speculative run: acceptance and tokens per forward over all prompts."""
    total = Acceptance(
        *(sum(getattr(s, f) for s in stats) for f in ("drafted", "accepted", "forwards", "tokens"))
    )
    record = total.record()
    return (
        f"speculative mtp, {draft_tokens} draft tokens: accepted {total.accepted}/{total.drafted} "
        f"({record['rate']:.1%}), {record['tokens_per_forward']:.2f} tokens per forward"
    )


def run(job: JobConfig) -> tuple[Path | None, str | None]:
    """Generate for every prompt of the job and write the output file (rank 0); its path and,
    with speculation, the summary line. Under torchrun every rank runs its share of the model.
    With ``generate.chat`` a conversation in the terminal instead (no file)."""
    settings = job.generate
    check_sampling(settings)
    check_speculation(job)
    if not settings.chat:
        check_output(job)
    world = init_world(job.comm.init_timeout_seconds)
    check_parallelism(job, world)
    check_chat(job, world)
    path = tokenizer_path(job)
    tokenizer = build_tokenizer(path)
    template = template_text(path, job.training.chat_template)
    if settings.chat:
        model = load_model(job, world.device)
        replies = chat(model, tokenizer, template, settings, stop_ids(tokenizer), read_turn, write_now)
        return None, f"{replies} replies"
    prompts = read_prompts(settings.prompts, tokenizer, template, "generate.prompts")
    model = load_model(job, world.device)
    try:
        check_prompts(prompts, settings.max_new_tokens, model.args.max_position_embeddings)
    except ValueError as err:
        raise DataError(f"{settings.prompts}: {err}") from None
    check_vocabulary(prompts, model.args.vocab_size, settings.prompts)
    parallelism = job.parallelism
    split_model(model, world, parallelism.tensor_parallel_degree > 1, parallelism.expert_parallel_degree > 1)
    stops = stop_ids(tokenizer)
    sampling = (settings.temperature, settings.top_p, settings.top_k, settings.seed, stops)
    stats: list[Acceptance] | None = None
    if settings.speculative == "mtp":
        new, stats = speculative_generate(
            model, prompts, settings.max_new_tokens, settings.draft_tokens, *sampling
        )
    else:
        if settings.compile:
            key_compile_cache_on_vector_isa()
        new = generate(model, prompts, settings.max_new_tokens, *sampling, compiled=settings.compile)
    output = output_path(job)
    if world.is_main:
        records = [
            {"prompt_ids": p, "new_ids": ids, "text": tokenizer.decode([t for t in ids if t not in stops])}
            for p, ids in zip(prompts, new)
        ]
        for record, acceptance in zip(records, stats or []):
            record["acceptance"] = acceptance.record()
        write_records(output, records, settings.overwrite)
    if not world.is_main:
        return None, None
    return output, None if stats is None else summary(stats, settings.draft_tokens)


def read_turn() -> str:
    return input("> ")


def write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        output, speculation = run(parse_job(argv))
        if dist.is_initialized():
            dist.destroy_process_group()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    if speculation:
        print(speculation)
    if output is not None:  # rank 0's
        print(f"wrote {output}")
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))
