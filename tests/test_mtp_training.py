"""Training Qwen3.5's multi-token-prediction head with the model (``[mtp]``, issue 55): the step
trains the main loss plus ``loss_scale`` times the head's, each a mean over its own targets
(the SFT mask shifted once more, never across a packed document's end); ``detach`` keeps the
head's loss out of the trunk, ``only`` trains the head alone; the head's loss and acceptance
are logged and validated; FSDP equals one device; what is not supported yet is refused in
one line; a fine-tune of a vision-language folder exports the trained head."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_mtp_float8 import FSDP_CASES as FP8_FSDP_CASES
from test_mtp_float8 import HEAVY_CASES as FP8_HEAVY_CASES

from autopar.cli.parity import Case, plan_job, run_cases
from autopar.cli.spawn import RankFailure, run_each_on_ranks
from autopar.config import ConfigError
from autopar.data.chat import CHAT_EXAMPLE, CHATML_TOKENIZER
from autopar.data.loader import IGNORE_INDEX
from autopar.models import build_model, from_hf, to_hf
from autopar.models.hf_config import read_hf_config
from autopar.training.checkpointing.adapters import peft_name
from autopar.training.metrics.logger import read_metrics
from autopar.training.preflight import check_job
from autopar.training.resolve import model_args

from jobs import (
    CHAT_VOCAB,
    QWEN3_5_TEXT,
    QWEN3_5_VISION,
    Crashed,
    ac_flags,
    assert_fp32_parity,
    data_flags,
    hf_folder_flags,
    hybrid_job,
    one_process_trainer,
)

HEAD = ("--mtp.enable", "true")
CHAT = (
    *data_flags("chat", CHAT_EXAMPLE),
    "--training.seq_len",
    "96",
    "--training.document_masking",
    "true",
)
"""The shipped conversations, packed as documents with the assistant turns as targets: the
SFT mask and document ends both shape the head's targets."""


def head_job(folder, *flags: str, **model: object):
    """The tiny Qwen3.5 (``hybrid_job``) with a fresh one-layer head, trained on chat rows."""
    return hybrid_job(folder, *CHAT, *HEAD, *flags, mtp_num_hidden_layers=1, vocab_size=CHAT_VOCAB, **model)


def hand_losses(model, batches) -> dict[str, torch.Tensor]:
    """The step's numbers written out on a plain copy of the model: the main loss and the
    head's (``mtp_logits_from`` the trunk's states, as ``mtp_logits``), each summed over its targets and divided by their count, and the
    targets whose head argmax is the token two ahead."""
    main = head = accepted = targets = head_targets = 0
    for b in batches:
        hidden, _ = model.trunk(b.inputs, documents=b.documents)  # once for both, as the step
        logits = model.lm_head(hidden)
        main = main + F.cross_entropy(
            logits.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        targets += (b.labels != IGNORE_INDEX).sum()
        head_logits = model.mtp_logits_from(hidden, b.inputs, b.documents)[0][
            :, :-1
        ]  # the last predicts nothing
        two_ahead = b.labels[:, 1:].clone()  # label i+1 is token i+2 (none across a document's end)
        if b.documents is not None:  # nor where token i+1 starts another document
            two_ahead[b.documents[:, 1:] != b.documents[:, :-1]] = IGNORE_INDEX
        head = head + F.cross_entropy(
            head_logits.flatten(0, 1), two_ahead.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        valid = two_ahead != IGNORE_INDEX
        accepted += (head_logits.argmax(-1)[valid] == two_ahead[valid]).sum()
        head_targets += valid.sum()
    return {
        "main": main / targets,
        "head": head / head_targets,
        "acceptance": accepted / head_targets,
        "head_targets": head_targets,
    }


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grad(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> None:
    """fp32, one device, the same forward: the order of sums only. Measured: at most 7e-7 of a
    tensor's largest value, but up to 1.5e-5 for the DeltaNet's decay (``A_log``, ``dt_bias``),
    whose fp32 gradients each lie 2e-4 from fp64's (cancelling sums); so within 1e-4. A
    missing, doubled or mis-scaled term is off by O(1)."""
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item(), name


def step_against_hand(tmp_path, *flags: str):
    """(the trainer after one forward/backward, its batches, a copy of its weights before it)."""
    trainer = one_process_trainer(head_job(tmp_path, *flags))
    model = trainer.parts[0]
    with torch.no_grad():  # a fresh head's pre-fc norms are 0 (x1): draw them, so a swapped input shows
        model.mtp.pre_fc_norm_embedding.weight.normal_()
    before = copy.deepcopy(model)
    batches = trainer.loader.next_step()
    outcome = trainer.train_step.forward_backward(batches)
    return trainer, batches, before, outcome


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_the_step_trains_the_main_loss_plus_a_tenth_of_the_heads(tmp_path, loss_on):
    """``assistant``: the SFT mask shapes the head's targets; ``all``: every token is one, so
    the positions at a packed document's end are what keeps them apart."""
    trainer, batches, reference, outcome = step_against_hand(tmp_path, "--training.loss_on", loss_on)
    hand = hand_losses(reference, batches)
    (hand["main"] + 0.1 * hand["head"]).backward()
    loss, (mtp_loss, _) = outcome.loss, outcome.metrics
    # fp32, one device, the same forward: the order of sums only
    torch.testing.assert_close(loss, hand["main"].detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(mtp_loss, hand["head"].detach(), rtol=1e-6, atol=0)
    ours, theirs = grads(trainer.parts[0]), grads(reference)
    assert ours.keys() == theirs.keys() and any(n.startswith("mtp.") for n in ours)
    for name, grad in theirs.items():
        assert_same_grad(ours[name], grad, name)


def test_acceptance_is_the_share_of_targets_whose_argmax_is_two_ahead(tmp_path):
    # the head alone at a high constant rate for three steps learns the frequent tokens
    # (measured 3-10% accepted), so a count off by a position or a mask would show
    fast = ("--mtp.only", "true", "--optimizer.lr", "0.05", "--training.steps", "100")
    trainer = one_process_trainer(head_job(tmp_path, *fast, "--lr_scheduler.warmup_steps", "1"))
    for _ in range(3):
        trainer.run_step()
    batches = trainer.loader.next_step()
    _, acceptance = trainer.train_step.forward_backward(batches).metrics.tolist()
    hand = hand_losses(trainer.parts[0], batches)
    assert hand["acceptance"].item() > 0.02
    assert acceptance == pytest.approx(hand["acceptance"].item(), abs=0.5 / hand["head_targets"].item())


@pytest.mark.slow
def test_acceptance_rises_over_training_on_the_shipped_chat_example(tmp_path):
    # 24 steps of 4 packed rows at 5e-3, model and head together: measured 0.035 over the
    # first six steps, 0.077 over the last six (seeded, so the same every run)
    fast = ("--training.steps", "24", "--training.local_batch_size", "4", "--optimizer.lr", "5e-3")
    one_process_trainer(head_job(tmp_path, *fast)).train()
    accepted = [r["mtp_acceptance"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    first, last = sum(accepted[:6]) / 6, sum(accepted[-6:]) / 6
    assert len(accepted) == 24 and last > 0.06 and last > 1.5 * first


def test_detach_leaves_the_trunk_gradients_of_the_main_loss_alone(tmp_path):
    trainer, batches, reference, _ = step_against_hand(tmp_path, "--mtp.detach", "true")
    hand_losses(reference, batches)["main"].backward()
    main_only = grads(reference)
    head_reference = copy.deepcopy(reference)
    head_reference.zero_grad()
    (0.1 * hand_losses(head_reference, batches)["head"]).backward()
    ours = grads(trainer.parts[0])
    for name, grad in ours.items():
        expected = grads(head_reference)[name] if name.startswith("mtp.") else main_only[name]
        assert_same_grad(grad, expected, name)
    assert ours.keys() == main_only.keys() | {n for n in grads(head_reference) if n.startswith("mtp.")}


def test_only_moves_the_head_and_nothing_else(tmp_path):
    trainer = one_process_trainer(head_job(tmp_path, "--mtp.only", "true"))
    model = trainer.parts[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.run_step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    head = {n for n in before if n.startswith("mtp.")}
    assert moved == head
    trained = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in model.named_parameters() if n.startswith("mtp.")}


def test_a_zero_loss_scale_logs_the_heads_acceptance_without_training_it(tmp_path):
    """mtp.loss_scale 0 (Megatron's factor 0): the head runs and is measured, the trunk trains
    on the main loss alone, and the head is frozen (no optimizer state, no weight decay)."""
    trainer, batches, reference, outcome = step_against_hand(tmp_path, "--mtp.loss_scale", "0")
    hand = hand_losses(reference, batches)
    hand["main"].backward()
    mtp_loss, acceptance = outcome.metrics.tolist()
    assert mtp_loss == pytest.approx(hand["head"].item(), rel=1e-6)  # fp32: the order of sums only
    assert acceptance == pytest.approx(hand["acceptance"].item(), abs=0.5 / hand["head_targets"].item())
    ours, main_only = grads(trainer.parts[0]), grads(reference)
    assert not any(n.startswith("mtp.") for n in ours)
    assert ours.keys() == {n for n in main_only if not n.startswith("mtp.")}
    for name, grad in ours.items():
        assert_same_grad(grad, main_only[name], name)
    trained = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not any(id(p) in trained for n, p in trainer.parts[0].named_parameters() if n.startswith("mtp."))


def test_lora_adapts_the_heads_linears_by_their_hf_names(tmp_path):
    trainer = one_process_trainer(head_job(tmp_path, *LORA))
    model = trainer.parts[0]
    trained = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in trained}
    assert names == {n for n, p in model.named_parameters() if ".lora_" in n}
    head = {n for n in names if n.startswith("mtp.")}
    assert head == {
        f"mtp.{m}.lora_{ab}.weight"
        for m in ("fc", "layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj", "layers.0.mlp.down_proj")
        for ab in "AB"
    }
    # peft's names: the head at the top of the HF model, as its released tensors
    assert peft_name("mtp.fc.lora_A.weight") == "base_model.model.mtp.fc.lora_A.weight"
    assert peft_name("layers.0.mlp.down_proj.lora_B.weight") == (
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    )
    outcome, _ = trainer.run_step()
    assert outcome.metrics[0] > 0


NO_HEAD_REFUSALS = [
    (("--model.name", "qwen3"), "model.name='qwen3' has no multi-token-prediction head"),
    (("--model.name", "qwen2.5"), "model.name='qwen2.5' has no multi-token-prediction head"),
    (("--model.name", "qwen3.5"), "model qwen3.5/debug has no multi-token-prediction head"),
]
"""``[mtp] enable`` on a model without the head (a Qwen3.5 flavor has none unless asked)."""
REFUSALS = [
    (("--mtp.only", "true"), "mtp.only=true without mtp.enable"),
    (("--mtp.detach", "true"), "mtp.detach=true without mtp.enable"),
    (
        (*HEAD, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"),
        "parallelism.pipeline_parallel_degree=2 with context_parallel_degree=2 and mtp.enable=true",
    ),
    (
        (*HEAD, "--mtp.only", "true", "--parallelism.pipeline_parallel_degree", "2"),
        "mtp.only=true with parallelism.pipeline_parallel_degree=2",
    ),
    ((*HEAD, "--mtp.only", "true", "--lora.enable", "true"), "mtp.only=true with lora.enable=true"),
    ((*HEAD, "--mtp.loss_scale", "-0.1"), "mtp.loss_scale=-0.1 must be >= 0"),
    (
        (*HEAD, "--mtp.only", "true", "--mtp.loss_scale", "0"),
        "mtp.only=true with mtp.loss_scale=0 trains nothing",
    ),
    (
        (*HEAD, "--mtp.detach", "true", "--lora.enable", "true", "--lora.target_modules", "q_proj,lm_head"),
        "mtp.detach=true with lm_head in lora.target_modules",
    ),
    (
        (
            *HEAD,
            "--mtp.detach",
            "true",
            "--float8.enable",
            "true",
            "--float8.filter_fqns=",
            "--float8.enable_fsdp_float8_all_gather",
            "true",
        ),
        "mtp.detach=true with float8.enable_fsdp_float8_all_gather=true and lm_head in FP8",
    ),
    (
        (*HEAD, "--mtp.detach", "true", "--parallelism.fsdp_reshard_after_forward", "always"),
        "mtp.detach=true with parallelism.fsdp_reshard_after_forward='always'",
    ),
]


@pytest.mark.parametrize(("flags", "message"), REFUSALS, ids=[m.split(" ")[0] for _, m in REFUSALS])
def test_what_the_head_does_not_run_with_is_refused_in_one_line(flags, message, tmp_path):
    job = hybrid_job(tmp_path, *flags, mtp_num_hidden_layers=1)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        check_job(job, 4)  # room for the pipeline and context-parallel degrees together
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("flags", "message"), NO_HEAD_REFUSALS, ids=["qwen3", "qwen2.5", "qwen3.5"])
def test_a_model_without_the_head_is_refused_in_one_line(flags, message, tmp_path):
    job = hybrid_job(tmp_path, *HEAD, *flags)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as err:
        check_job(job, 1)
    assert "\n" not in str(err.value)


def test_a_folder_without_the_head_is_refused_in_one_line(tmp_path):
    to_hf(build_model(model_args(hybrid_job(tmp_path))), tmp_path / "no-head")
    job = hybrid_job(tmp_path, *HEAD, "--model.hf_assets_path", str(tmp_path / "no-head"))
    job.model.overrides.clear()  # the shape is the folder's
    with pytest.raises(
        ConfigError, match=r"has no multi-token-prediction head \(mtp_num_hidden_layers"
    ) as err:
        check_job(job, 1)
    assert "\n" not in str(err.value)


def text_head_job(folder, *flags: str, **model: object):
    """The tiny Qwen3.5 with a fresh head on the shipped text (the plans' suites' job)."""
    return hybrid_job(folder, *HEAD, *flags, mtp_num_hidden_layers=1, **model)


LORA = ("--lora.enable", "true", "--lora.target_modules", "q_proj,v_proj,down_proj,fc")
"""Adapters on the trunk's and the head's attention and MLP linears (by their HF names) and on
the head's ``fc``."""
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MOE["shared_expert_intermediate_size"] = 48
FSDP_CASES = {
    "fsdp": ((), {}, "dp_shard=2"),
    "fsdp-tied": ((), {"tie_word_embeddings": True}, "dp_shard=2"),
    "fsdp-detach": (("--mtp.detach", "true"), {}, "dp_shard=2"),
    "fsdp-only": (("--mtp.only", "true"), {}, "dp_shard=2"),
    "fsdp-ac": ((), {}, f"dp_shard=2,{ac_flags('full', 'op')}"),
    "fsdp-lora": (LORA, {}, "dp_shard=2"),
    **FP8_FSDP_CASES,  # FP8 with the head (test_mtp_float8.py)
    "tp": (CHAT, {"vocab_size": CHAT_VOCAB}, "tp=2"),
    "tp-detach": (("--mtp.detach", "true"), {}, "tp=2"),
}
"""FSDP with the head in the root's group and the embedding and output head in groups of their
own (untied) or the root's (tied); the head's detached and head-only variants; the trunk's
blocks recomputed in backward (the head's layer is not); LoRA on the trunk's and the head's
linears. Tensor parallelism with sequence and loss parallel on packed chat documents (the
document gate sequence-sharded, the head's logits vocab-sharded, its acceptance combined over
the ranks), and detached (the output head's weight read as ``lm_head`` lays it out)."""
HEAVY_CASES = {
    "fsdp-moe": ((), MOE, "dp_shard=2"),
    "replicate": ((), {}, "dp_replicate=2"),
    "fsdp-compile": ((), {}, "dp_shard=2,compile.enable=true"),
    "tp-tied-only": (("--mtp.only", "true"), {"tie_word_embeddings": True}, "tp=2"),
    "tp-lora-gathered": (LORA, {}, "tp=2,sp=false,loss_parallel=false"),
    "tp-moe": ((), MOE, "tp=2"),
    "ep-moe": ((), MOE, "dp_shard=2,ep=2"),
    "fsdp-tp": (CHAT, {"vocab_size": CHAT_VOCAB}, "dp_shard=2,tp=2"),
    "pp-tp": ((), {"tie_word_embeddings": False}, "pp=2,tp=2"),
    "zbv-detach": (
        ("--mtp.detach", "true", "--training.local_batch_size", "4"),
        {"tie_word_embeddings": False},
        "pp=2,schedule=ZBVZeroBubble",
    ),
    **FP8_HEAVY_CASES,  # FP8 with the head (test_mtp_float8.py)
}
"""A mixture's head (its router in the load-balancing loss), replicated data parallelism, and
the trunk's blocks compiled (the head runs eager); under tensor parallelism, tied with the head
alone, with the sequence and the logits whole and LoRA, a mixture's head (its experts whole on
each rank); a mixture's head under expert parallelism (its experts split as the trunk's), and
FSDP over tensor parallelism (four ranks); the head on the last pipeline stage under tensor
parallelism (four ranks), and detached under a zero-bubble V schedule (the first and last
stage on one rank, the backward split in two): the same machinery again, at more spawns' and
the compiler's cost."""


def data_parallel_runs(folder, cases: dict) -> dict:
    """case -> (one device, two gloo ranks), every case in one process group, three steps."""
    jobs = [Case(text_head_job(folder, *flags, **model), plan) for flags, model, plan in cases.values()]
    return dict(zip(cases, run_cases(jobs, steps=3)))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return data_parallel_runs(tmp_path_factory.mktemp("mtp_fsdp"), FSDP_CASES)


@pytest.fixture(scope="module")
def heavy_runs(tmp_path_factory):
    return data_parallel_runs(tmp_path_factory.mktemp("mtp_heavy"), HEAVY_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", FSDP_CASES)
def test_data_parallel_with_the_head_equals_one_device(fsdp_runs, case):
    reference, run = fsdp_runs[case]
    assert_fp32_parity(run, reference)


@pytest.mark.heavy
@pytest.mark.parametrize("case", HEAVY_CASES)
def test_a_mixtures_head_and_replicas_equal_one_device(heavy_runs, case):
    reference, run = heavy_runs[case]
    assert_fp32_parity(run, reference)


PIPELINE_CASES = {
    "1F1B": ((), {}, "pp=2,schedule=1F1B"),
    "Interleaved1F1B": ((), {}, "pp=2,schedule=Interleaved1F1B"),
    "1F1B-detach": (("--mtp.detach", "true"), {}, "pp=2,schedule=1F1B"),
    "Interleaved1F1B-moe": ((), MOE, "pp=2,schedule=Interleaved1F1B"),
}
"""Two pipeline ranks with the head on the last stage: one stage per rank and two per rank
(the next-token embeddings passed through a middle stage), detached (the head's loss sends
zeros back for them), and a mixture's head (the routing statistics passed beside them)."""
PIPELINE_STEP = (
    "--training.local_batch_size",
    "4",
    # Adam at its default epsilon turns the DeltaNet decay's near-zero gradients, whose fp32
    # sums differ in the 4th digit between any two orders (``assert_same_grad``), into
    # +-lr steps: 0.8% of in_proj_a's largest weight apart after two steps with the head or
    # without it (measured). At 1e-4 those stay small and the weights say what the gradients do.
    "--optimizer.eps",
    "1e-4",
    "--validation.enable",
    "true",
    "--validation.dataset_path",
    str(CHAT_EXAMPLE),
    "--validation.local_batch_size",
    "4",
    "--validation.steps",
    "1",
    "--validation.freq",
    "3",
)
"""Four micro-batches of one row (1F1B needs as many as stages, Interleaved1F1B equal
rounds), validated after the last step."""


def train_and_keep(job) -> dict:
    """Train each job on this rank's process group; this rank's weights after each (as
    arrays: tensors cannot leave a spawned rank through its queue)."""
    from autopar.parallel.world import init_world
    from autopar.training.trainer import Trainer

    world = init_world()
    trainer = Trainer(job, check_job(job, world.size), world)
    trainer.train()
    return {n: p.detach().numpy().copy() for part in trainer.parts for n, p in part.named_parameters()}


def step_metrics(folder: Path) -> list[dict]:
    return [r for r in read_metrics(folder / "metrics.jsonl") if "loss" in r or "val_loss" in r]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """case -> ((one device's metrics, weights), (the pipeline's metrics, weights by rank)),
    three steps each; the pipelined jobs in one group of two ranks."""
    folder = tmp_path_factory.mktemp("mtp_pp")
    references, jobs = {}, []
    for case, (flags, model, plan) in PIPELINE_CASES.items():
        base = head_job(folder / case, *PIPELINE_STEP, *flags, tie_word_embeddings=False, **model)
        key = (flags, tuple(model.items()))
        if key not in references:
            trainer = one_process_trainer(plan_job(base, "", 3, str(folder / f"{case}-one")))
            trainer.train()
            weights = {n: p.detach().clone() for n, p in trainer.parts[0].named_parameters()}
            references[key] = (step_metrics(folder / f"{case}-one"), weights)
        jobs.append(plan_job(base, plan, 3, str(folder / f"{case}-pp")))
    outcomes = run_each_on_ranks(train_and_keep, 2, [(job,) for job in jobs])
    return {
        case: (
            references[(flags, tuple(model.items()))],
            Crashed(ran.text)
            if isinstance(ran, RankFailure)
            else (step_metrics(folder / f"{case}-pp"), ran),  # weights by rank
        )
        for (case, (flags, model, _)), ran in zip(PIPELINE_CASES.items(), outcomes, strict=True)
    }


PARITY_RTOL = {"loss": 1e-5, "mtp_loss": 1e-5, "grad_norm": 5e-5, "val_loss": 1e-5, "val_mtp_loss": 1e-5}
"""fp32, the same forward: the order of sums only (measured under a pipeline: at most 2.3e-7
of a loss, 8e-6 of a gradient norm)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_a_pipeline_with_the_head_on_its_last_stage_equals_one_device(pipeline_runs, case):
    (reference, weights), (run, by_rank) = pipeline_runs[case]
    assert [r["step"] for r in run] == [r["step"] for r in reference] == [1, 2, 3, 3]
    for ours, theirs in zip(run, reference):
        for name, value in theirs.items():
            if name in PARITY_RTOL:
                assert ours[name] == pytest.approx(value, rel=PARITY_RTOL[name]), (name, ours, theirs)
            elif name.endswith("mtp_acceptance"):  # a count of targets: the same argmax
                assert ours[name] == pytest.approx(value, abs=1e-6), (name, ours, theirs)
    assert {"val_mtp_loss", "val_mtp_acceptance"} <= run[-1].keys()
    # every weight on one stage, the head on the last
    first, last = by_rank
    assert not first.keys() & last.keys() and first.keys() | last.keys() == weights.keys()
    assert any(n.startswith("mtp.") for n in last) and not any(n.startswith("mtp.") for n in first)
    for name, expected in weights.items():
        ours = torch.from_numpy({**first, **last}[name])
        # measured: at most 1.2e-5 of a tensor's largest value; a lost term is O(1)
        assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max(), name


def vision_language_source(folder: Path) -> Path:
    """A tiny released-style Qwen3.5: transformers' vision-language model with the ChatML
    tokenizer, plus a drawn one-layer ``mtp.*`` head under its released names."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        pytest.skip("transformers >= 5.2 has the Qwen3.5 classes")
    text = {**QWEN3_5_TEXT, "vocab_size": CHAT_VOCAB}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VISION)
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(folder)
    args = dataclasses.replace(read_hf_config(folder), mtp_num_hidden_layers=1)
    with_head = build_model(args)
    with_head.init_weights(seed=1)
    to_hf(with_head, folder / "text")
    head = {n: t for n, t in load_file(folder / "text" / "model.safetensors").items() if n.startswith("mtp.")}
    shutil.rmtree(folder / "text")
    save_file({**load_file(folder / "model.safetensors"), **head}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHATML_TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """A four-step fine-tune with the head on the shipped conversations from a
    vision-language folder, validated at its end and exported: (source, run folder, trainer,
    its step log)."""
    folder = tmp_path_factory.mktemp("mtp_sft")
    source = vision_language_source(folder / "source")
    held_out = ("--validation.enable", "true", "--validation.dataset_path", str(CHAT_EXAMPLE))
    held_out += ("--validation.local_batch_size", "2", "--validation.steps", "2", "--validation.freq", "4")
    job = head_job(folder / "run", *hf_folder_flags(source), *held_out, "--training.steps", "4")
    job.model.overrides.clear()  # the shape is the folder's
    logger = logging.getLogger("autopar")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = one_process_trainer(job)
        trainer.train()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return source, folder / "run", trainer, lines


def test_a_fine_tune_logs_the_heads_loss_and_acceptance(fine_tuned):
    _, run, _, lines = fine_tuned
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 4
    assert all(r["mtp_loss"] > 0 and 0 <= r["mtp_acceptance"] <= 1 for r in steps)
    shown = [line for line in lines if line.startswith("step ")]
    assert len(shown) == 4 and all(" mtp_loss " in line and " mtp_acceptance " in line for line in shown)


def test_validation_reports_the_heads_loss_and_acceptance_of_the_same_weights(fine_tuned):
    _, run, trainer, _ = fine_tuned
    (record,) = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    validator = trainer.validator
    loader = validator.loader()  # a fresh one, from the first held-out sample
    batches = [b for _ in range(validator.steps) for b in loader.next_step()]
    with torch.no_grad():
        hand = hand_losses(trainer.parts[0], batches)
    # fp32, the same weights and batches: the order of sums only
    assert record["val_mtp_loss"] == pytest.approx(hand["head"].item(), rel=1e-5)
    assert record["val_mtp_acceptance"] == pytest.approx(hand["acceptance"].item(), abs=1e-6)


def test_the_export_carries_the_trained_head_in_the_sources_names(fine_tuned):
    source, run, trainer, _ = fine_tuned
    exported = {}
    for file in (run / "hf" / "step-4").glob("*.safetensors"):
        exported.update(load_file(file))
    before = {n: t for n, t in load_file(source / "model.safetensors").items() if n.startswith("mtp.")}
    after = {n: t for n, t in exported.items() if n.startswith("mtp.")}
    assert after.keys() == before.keys()
    assert all(not torch.equal(after[n], before[n]) for n in before)
    trained = dict(trainer.parts[0].named_parameters())
    back = from_hf(run / "hf" / "step-4", dtype=torch.float32, mtp=True)
    for name, param in back.named_parameters():
        if name.startswith("mtp."):
            assert torch.equal(param, trained[name]), name
