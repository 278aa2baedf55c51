"""Preference tuning (DPO): pairs packed into rows give each pair the log-probabilities it has
alone, and the losses are TRL's."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_bf16_parity import DATA_PARALLEL_RTOL, MULTIPLE_OF_BF16_GAP
from test_bf16_parity import STEPS as BF16_STEPS
from test_bf16_parity import gaps as bf16_gaps

from autopar.cli.parity import PlanRun, plan_job, run_job
from autopar.config import ConfigError, JobConfig
from autopar.data.chat import CHATML_TOKENIZER
from autopar.data.pair_batches import PairLoader, chosen_targets, pack_groups, pack_pairs
from autopar.data.preference import PREFERENCE_EXAMPLE
from autopar.models import Qwen
from autopar.training.metrics.logger import read_metrics
from autopar.training.objectives.dpo.loss import (
    LOSS_TYPES,
    METRICS,
    PairLosses,
    sequence_logps,
    sequence_sums,
)
from autopar.training.objectives.dpo.objective import losses_of, with_targets
from autopar.training.objectives.dpo.reference_table import TABLE_FILE
from autopar.training.preflight import check_job
from autopar.training.resolve import parse_job

from jobs import (
    CHAT_VOCAB,
    MOE_FLAGS,
    ac_flags,
    assert_fp32_parity,
    assert_same_training,
    data_flags,
    one_process_trainer,
    parity_runs,
    tiny_args,
    tiny_job,
)


@dataclass(frozen=True)
class Ids:
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def random_pairs(count: int, seed: int = 0, vocab: int = 64) -> list[Ids]:
    rng = np.random.default_rng(seed)
    return [
        Ids(*(rng.integers(0, vocab, size=int(rng.integers(1, 9))) for _ in range(3))) for _ in range(count)
    ]


def tiny_model(seed: int = 0) -> Qwen:
    args = tiny_args(
        vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=64
    )
    model = Qwen(args)
    model.init_weights(seed=seed)
    return model


def alone_logps(model: Qwen, pair: Ids) -> tuple[float, float]:
    """TRL's logps of one pair: each sequence by itself, summed over its completion's tokens."""
    out = []
    for completion in (pair.chosen, pair.rejected):
        tokens = torch.from_numpy(np.concatenate([pair.prompt, completion]))[None]
        logp = model(tokens)[0, :-1].log_softmax(-1).gather(1, tokens[0, 1:, None])[:, 0]
        out.append(logp[len(pair.prompt) - 1 :].sum().item())
    return out[0], out[1]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "one_per_row"])
def test_packed_pairs_get_the_log_probabilities_they_have_alone(packing):
    model = tiny_model()
    pairs = random_pairs(5)
    batch = pack_pairs(pairs, seq_len=40, pad_id=0, packing=packing)
    assert batch.inputs.shape[0] == (3 if packing else 10)
    with torch.no_grad():
        logits = model(batch.inputs, documents=batch.documents)
        logps = sequence_logps(logits, batch.labels, batch.documents, len(pairs))
    expected = torch.tensor([alone_logps(model, p) for p in pairs]).flatten()
    # fp32, one forward each way: the order of sums only
    torch.testing.assert_close(logps.logps, expected, rtol=1e-5, atol=1e-5)
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=torch.float32).flatten()
    assert torch.equal(logps.tokens, lengths)


def test_chosen_targets_are_the_chosen_completions_tokens():
    pairs = random_pairs(3)
    batch = pack_pairs(pairs, seq_len=40, pad_id=0)
    assert chosen_targets(batch).sum().item() == sum(len(p.chosen) for p in pairs)


def test_a_pair_never_splits_across_rows():
    pairs = random_pairs(12, seed=3)
    batch = pack_pairs(pairs, seq_len=40, pad_id=0)
    for j in range(len(pairs)):
        rows = {int(r) for r in torch.nonzero(batch.documents == 2 * j)[:, 0]}
        rows |= {int(r) for r in torch.nonzero(batch.documents == 2 * j + 1)[:, 0]}
        assert len(rows) == 1


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "one_per_row"])
def test_a_pipeline_layout_gives_each_chunk_of_rows_whole_pairs_numbered_from_zero(packing):
    """What a schedule cuts into equal row chunks: chunk g holds pairs g*k .. g*k + k - 1 of
    the micro-batch, whole, as ids 2j / 2j + 1, and the same rows every step."""
    pairs, groups = random_pairs(6, seed=4), 3
    batch = pack_groups(pairs, groups, seq_len=40, pad_id=0, packing=packing)
    assert batch.inputs.shape[0] == (6 if packing else 12)
    for g, chunk in enumerate(batch.documents.tensor_split(groups)):
        alone = pack_pairs(pairs[2 * g : 2 * g + 2], seq_len=40, pad_id=0, packing=packing)
        rows = alone.documents.shape[0]
        assert torch.equal(chunk[:rows], alone.documents)
        assert (chunk[rows:] == -1).all()


def test_reference_values_ride_the_pipeline_target_at_each_sequences_first_token():
    pairs = random_pairs(4, seed=5)
    batch = pack_groups(pairs, 2, seq_len=40, pad_id=0)
    reference = torch.arange(1.0, 9.0)  # (2P,) in the micro-batch's pair order
    target = with_targets(batch, reference, pairs_per_group=2).labels
    assert torch.equal(target[..., 0].long(), batch.labels) and torch.equal(
        target[..., 1].long(), batch.documents
    )
    for g, chunk in enumerate(target.tensor_split(2)):
        sums = sequence_sums(chunk[..., 2], chunk[..., 1].long(), 4)
        assert torch.equal(sums, reference[4 * g : 4 * g + 4])


def trl_loss(name: str, chosen, rejected, ref_chosen, ref_rejected, lengths, beta, smoothing) -> torch.Tensor:
    """TRL 1.16's ``_compute_loss`` per pair for ``name``, written out from its source."""
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    if name == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if name == "hinge":
        return torch.relu(1 - beta * delta)
    if name == "ipo":
        d = (chosen - ref_chosen) / lengths[:, 0] - (rejected - ref_rejected) / lengths[:, 1]
        return (d - 1 / (2 * beta)) ** 2
    if name == "robust":
        return (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / (
            1 - 2 * smoothing
        )
    raise KeyError(name)


@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo", "robust"])
def test_pair_losses_are_trls_formulas(name):
    model = tiny_model()
    reference = tiny_model(seed=1)
    pairs = random_pairs(6, seed=2)
    batch = pack_pairs(pairs, seq_len=48, pad_id=0)
    with torch.no_grad():
        policy = sequence_logps(
            model(batch.inputs, documents=batch.documents), batch.labels, batch.documents, 6
        )
        ref = sequence_logps(
            reference(batch.inputs, documents=batch.documents), batch.labels, batch.documents, 6
        )
    objective = PairLosses((name,), (1.0,), beta=0.3, label_smoothing=0.1)
    loss = objective.loss(policy, ref.logps, 6.0, torch.tensor(1.0))
    lengths = policy.tokens.view(-1, 2)
    expected = trl_loss(
        name, policy.chosen, policy.rejected, ref.chosen, ref.rejected, lengths, 0.3, 0.1
    ).mean()
    torch.testing.assert_close(loss, expected)


def test_the_sft_term_is_the_mean_over_chosen_tokens():
    model = tiny_model()
    pairs = random_pairs(4, seed=5)
    batch = pack_pairs(pairs, seq_len=48, pad_id=0)
    with torch.no_grad():
        logits = model(batch.inputs, documents=batch.documents)
    policy = sequence_logps(logits, batch.labels, batch.documents, 4)
    tokens = chosen_targets(batch).sum().float()
    loss = PairLosses(("sft",), (1.0,), 0.1, 0.0).loss(policy, policy.logps, 4.0, tokens)
    targets = torch.where(chosen_targets(batch), batch.labels, -100)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_every_loss_type_is_known():
    assert set(LOSS_TYPES) >= {"sigmoid", "ipo", "hinge", "robust", "sft"}


def test_the_loader_gives_each_rank_its_own_pairs_of_the_step():
    pairs = random_pairs(16)
    ranks = [
        PairLoader(8, 2, r, 2, torch.device("cpu"), pairs=pairs, seq_len=40, pad_id=0, seed=0)
        for r in range(2)
    ]
    one = PairLoader(8, 2, 0, 1, torch.device("cpu"), pairs=pairs, seq_len=40, pad_id=0, seed=0)
    seen = sorted(int(i) for loader in ranks for b in loader.next_step() for i in b.pairs)
    assert seen == sorted(int(i) for b in one.next_step() for i in b.pairs)
    assert len(set(seen)) == 8


FIXTURES = Path(__file__).parent / "dpo_fixtures"
TRL_CASES = ["sigmoid", "sigmoid_beta0.5", "ipo", "hinge", "robust", "sigmoid_sft"]


def trl_fixture(records: str) -> dict:
    return json.loads((FIXTURES / f"{records}_losses.json").read_text())


def fixture_job(folder: Path, records: str, case: dict) -> JobConfig:
    """The fixture's policy trained on its records against its reference, one step of every pair."""
    cfg = case["dpo_config"]
    return parse_job(
        [
            "--job.config",
            "debug_model",
            "--model.hf_assets_path",
            str(FIXTURES / "policy"),
            "--model.tokenizer_path",
            str(CHATML_TOKENIZER),
            "--checkpoint.initial_load_path",
            str(FIXTURES / "policy"),
            "--checkpoint.initial_load_in_hf",
            "true",
            "--dpo.reference_path",
            str(FIXTURES / "reference"),
            "--training.dataset_format",
            "preference",
            "--training.dataset_path",
            str(FIXTURES / f"{records}.jsonl"),
            "--training.local_batch_size",
            str(len(case["rows"])),
            "--training.seq_len",
            "2048",  # pairs of up to TRL's max_length 1024 each
            "--model.max_position_embeddings",
            "2048",
            "--training.mixed_precision_param",
            "float32",
            "--dpo.beta",
            str(cfg["beta"]),
            "--dpo.loss_type",
            ",".join(cfg["loss_type"]),
            "--dpo.label_smoothing",
            str(cfg["label_smoothing"]),
            *(["--dpo.loss_weights", ",".join(map(str, cfg["loss_weights"]))] if cfg["loss_weights"] else []),
            "--job.dump_folder",
            str(folder),
        ]
    )


@pytest.mark.parametrize("records", ["plain", "conversational"])
def test_the_first_step_loss_and_metrics_are_trls(tmp_path, records):
    fixture = trl_fixture(records)
    cases = {c["name"]: c for c in fixture["losses"]}
    trainer = one_process_trainer(fixture_job(tmp_path, records, cases["sigmoid"]))
    for name in TRL_CASES:
        case = cases[name]
        enable_objective(trainer, fixture_job(tmp_path, records, case))
        trainer.loader.consumed_samples = 0
        outcome = trainer.train_step.forward_backward(trainer.loader.next_step())
        trainer.train_step.discard()
        # fp32: TRL pads and runs one sequence per row, we pack rows; the order of sums only.
        # A reward is beta times a difference of log-probs of up to 200 in size, so its error
        # is absolute: measured 1.3e-6 at beta 0.1, 6.5e-6 at 0.5 (on Intel AVX-512)
        assert outcome.loss.item() == pytest.approx(case["loss"], rel=1e-5), name
        metrics = dict(zip(METRICS, outcome.metrics.tolist()))
        for key, value in metrics.items():
            assert value == pytest.approx(case["metrics"][key], rel=1e-5, abs=5e-5), (name, key)


def enable_objective(trainer, job: JobConfig) -> None:
    trainer.train_step.objective.losses = losses_of(job.dpo)


def preference_job(folder, *flags: str) -> JobConfig:
    """``tiny_job`` preference-tuning on the shipped pairs against a frozen copy of its start."""
    return tiny_job(
        folder,
        *data_flags("preference", PREFERENCE_EXAMPLE),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "64",
        *flags,
        vocab_size=CHAT_VOCAB,
    )


PLANS = [
    "dp_shard=2",
    "tp=2",
    "cp=2",
    "dp_shard=2,compile.enable=true",
    f"dp_shard=2,{ac_flags('full', 'op')}",
    f"tp=2,{ac_flags('selective', 'op')}",
    "pp=2",
]
"""Every parallelism a dense DPO job composes, with compile and each AC mode (a pair's two
sequences on one rank, a sequence's log-probability summed over CP ranks, the pair losses on
the last pipeline stage with the reference's values carried in the schedule's targets)."""


@pytest.fixture(scope="module")
def dpo_parity(tmp_path_factory):
    return parity_runs(preference_job(tmp_path_factory.mktemp("dpo")), PLANS, steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_dpo_under_a_plan_matches_one_device(dpo_parity, plan):
    reference, run = dpo_parity[plan]
    if "compile" in plan:  # inductor fuses and reorders fp32 reductions (measured 1.6e-6 here)
        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)


HEAVY_PLANS = [
    "dp_replicate=2",
    "tp=2,sp=false,loss_parallel=false",
    "pp=2,schedule=Interleaved1F1B",
    "pp=2,tp=2",
    "pp=2,dp_shard=2",
    "dp_replicate=2,dp_shard=2",
]
"""DDP, TP without SP or loss parallel, an interleaved schedule, and on 4 ranks pipelined DPO
composed with TP (loss parallel on the last stage) and with FSDP, and HSDP: each mechanism
runs for DPO above or for LM training in its own parity file; python -m pytest -m heavy."""


@pytest.fixture(scope="module")
def dpo_heavy(tmp_path_factory):
    return parity_runs(preference_job(tmp_path_factory.mktemp("dpo_heavy")), HEAVY_PLANS, steps=3)


@pytest.mark.heavy  # ~1.5 min, a 4-rank group among them
@pytest.mark.parametrize("plan", HEAVY_PLANS)
def test_dpo_under_more_plans_matches_one_device(dpo_heavy, plan):
    reference, run = dpo_heavy[plan]
    assert_fp32_parity(run, reference)


FAMILY_PLANS = {
    "qwen3.5": ["dp_shard=2", "cp=2", "tp=2"],
    "qwen3_moe": ["dp_shard=2,ep=2", "tp=2", "pp=2"],
    "lora_adapters_off": ["dp_shard=2", "tp=2", "pp=2"],
    "precomputed": ["pp=2"],
    "chunked": ["tp=2", "pp=2"],
}
"""Qwen3.5 (its Gated DeltaNets pass states across CP ranks, pairs crossing them), the MoE with
experts split by EP, LoRA whose reference is its own base, and a table computed by a
pipelined reference, and log-probabilities a chunk at a time (``training.loss_chunk_tokens``:
under TP each rank's chunks hold half the vocabulary)."""


def family_job(folder: Path, family: str) -> JobConfig:
    if family == "qwen3.5":
        return hybrid_preference_job(folder, "--optimizer.lr", "0.001")
    if family == "qwen3_moe":  # per-row load balancing: rows as one device's under PP too
        return preference_job(folder, *MOE_FLAGS, "--dpo.packing", "false")
    if family == "chunked":
        return preference_job(folder, "--training.loss_chunk_tokens", "24")
    if family == "precomputed":
        return preference_job(folder, "--dpo.reference", "precomputed")
    return preference_job(folder, "--lora.enable", "true", "--dpo.reference", "adapters_off")


FAMILY_STEPS = {"qwen3.5": 2}
"""Qwen3.5 for two steps: the first DPO gradients (policy = reference) are small, and Adam
turns fp32's order of sums in them into growing differences; TP measured 3e-7, 1.9e-5 and
1.8e-4 in grad norm over steps 1 to 3 (test_qwen3_5_plans sees the same family effect)."""


@pytest.fixture(scope="module")
def family_parity(tmp_path_factory):
    return {
        family: parity_runs(
            family_job(tmp_path_factory.mktemp(family), family), plans, steps=FAMILY_STEPS.get(family, 3)
        )
        for family, plans in FAMILY_PLANS.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "plan"), [(family, plan) for family, plans in FAMILY_PLANS.items() for plan in plans]
)
def test_dpo_of_every_family_under_a_plan_matches_one_device(family_parity, family, plan):
    reference, run = family_parity[family][plan]
    if family == "qwen3_moe":  # routing amplifies the order of sums in the norm (test_moe_training)
        assert_same_training(run, reference, loss_rtol=1e-5, norm_rtol=1e-4)
    elif family == "qwen3.5":
        # a DPO loss reads the difference of two log-prob sums of ~60, where fp32's order of
        # sums (~3e-6 of them) moves the loss by ~1e-5; Qwen3.5 amplifies it more than Qwen3
        # (test_qwen3_5_plans): measured 1.5e-5 in loss and 1.9e-5 in norm under TP (two
        # steps, ``FAMILY_STEPS``) on this Xeon, hence 1e-4
        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)


def hybrid_preference_job(folder, *flags: str) -> JobConfig:
    """``preference_job`` of the tiny Qwen3.5 (``hybrid_job``'s shape)."""
    return preference_job(folder, "--model.name", "qwen3.5", "--model.num_hidden_layers", "4", *flags)


def losses(job: JobConfig) -> list[float]:
    return [r.loss for r in one_process_trainer(job).train()]


def test_the_three_references_give_the_same_losses(tmp_path):
    lora = ("--lora.enable", "true", "--optimizer.lr", "0.05", "--training.steps", "3")
    runs = {
        mode: losses(preference_job(tmp_path / mode, *lora, "--dpo.reference", mode))
        for mode in ("copy", "adapters_off", "precomputed")
    }
    # fp32: the same forwards; precomputed packs the pairs in other rows (order of sums only)
    assert runs["adapters_off"] == pytest.approx(runs["copy"], rel=1e-6)
    assert runs["precomputed"] == pytest.approx(runs["copy"], rel=1e-5)
    # a reference that followed the policy would keep every loss at log 2: the check can tell
    assert abs(runs["adapters_off"][-1] - math.log(2)) > 1e-3


def test_a_reference_copy_keeps_bf16_weights_and_computes_what_the_policys_fp32_masters_do(tmp_path):
    job = preference_job(tmp_path, "--training.mixed_precision_param", "bfloat16")
    trainer = one_process_trainer(job)
    (policy,), (reference,) = trainer.parts, trainer.reference
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}  # half the memory
    tokens = torch.randint(0, CHAT_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same weights (the job's start) cast once or stored cast: the same logits
        assert torch.equal(reference(tokens), policy(tokens))


def test_a_precomputed_reference_is_read_back_and_refused_for_another_reference(tmp_path):
    flags = ("--dpo.reference", "precomputed", "--training.steps", "1")
    losses(preference_job(tmp_path, *flags))
    table = tmp_path / TABLE_FILE
    written = table.stat().st_mtime_ns
    losses(preference_job(tmp_path, *flags, "--training.steps", "2"))
    assert table.stat().st_mtime_ns == written
    other = preference_job(tmp_path, *flags, "--training.steps", "3", "--debug.seed", "1")
    with pytest.raises(ConfigError, match="reference log-probs of other pairs"):
        one_process_trainer(other)


def test_packing_gives_the_losses_of_one_sequence_per_row(tmp_path):
    packed = losses(preference_job(tmp_path / "packed", "--training.steps", "3"))
    alone = losses(preference_job(tmp_path / "alone", "--training.steps", "3", "--dpo.packing", "false"))
    # fp32: the same sequences in other rows (order of sums only)
    assert packed == pytest.approx(alone, rel=1e-5)


def test_a_resumed_dpo_run_continues_exactly(tmp_path):
    flags = ("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "4")
    straight = losses(preference_job(tmp_path / "straight", *flags))
    losses(preference_job(tmp_path / "resumed", *flags[:-1], "2"))
    resumed = losses(preference_job(tmp_path / "resumed", *flags))
    assert resumed == straight[2:]  # bit-exact: the same pairs, weights and optimizer state


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dpo.reference", "adapters_off"), "dpo.reference='adapters_off' is the LoRA model"),
        (("--dpo.loss_type", "sigmoid,dpop"), "dpo.loss_type=\\['sigmoid', 'dpop'\\] must name"),
        (("--dpo.loss_type", "sigmoid,sft", "--dpo.loss_weights", "1"), "one weight per dpo.loss_type"),
        (("--dpo.max_length", "40"), "dpo.max_length=40: a pair"),
        (("--dpo.label_smoothing", "0.5"), "dpo.label_smoothing=0.5 must be in"),
        (("--dpo.loss_type", "sigmoid,sft,sigmoid"), "dpo.loss_type names sigmoid twice"),
        (
            ("--dpo.loss_type", "sigmoid,sft", "--dpo.loss_weights", "1,-0.5"),
            "dpo.loss_weights\\[1\\]=-0.5 \\(sft\\) must be >= 0",
        ),
        (("--dpo.loss_weights", "0"), "dpo.loss_weights=\\[0.0\\] trains nothing"),
        (
            ("--dpo.label_smoothing", "0.1"),
            "dpo.label_smoothing=0.1 is read by dpo.loss_type robust and exo_pair only",
        ),
        (("--dpo.max_length", "0"), "dpo.max_length=0 must be at least 2"),
        (
            (
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ),
            "training.dataset_format='preference' under parallelism.pipeline_parallel_schedule='ZBVZeroBubble'",
        ),
        (
            ("--parallelism.pipeline_parallel_degree", "2", *MOE_FLAGS),
            "use --dpo.packing false",
        ),
        (
            ("--validation.enable", "true", "--validation.dataset_path", "x", "--validation.seq_len", "32"),
            "leave validation.seq_len at -1",
        ),
    ],
)
def test_a_preference_job_that_cannot_run_is_one_line_before_any_work(tmp_path, flags, message):
    job = preference_job(tmp_path, *flags)
    with pytest.raises(ConfigError, match=message):
        check_job(job, 2)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flags",
    [
        ("--dpo.reference", "precomputed"),
        ("--dpo.beta", "0.5"),
        ("--dpo.loss_type", "ipo"),
        ("--dpo.max_length", "16"),
    ],
)
def test_dpo_settings_without_preference_data_are_refused(tmp_path, flags):
    with pytest.raises(ConfigError, match=f"{flags[0][2:]}=.* without preference data"):
        check_job(tiny_job(tmp_path, *flags), 1)


def test_a_conversational_record_fits_the_shipped_dpo_preset(tmp_path):
    """The preset's rows hold a chat record (the template's default system turn alone is ~70
    tokens of the chatml tokenizer) beside the shipped plain pairs."""
    from autopar.data.chat import ChatFormat
    from autopar.data.preference import load_pairs
    from autopar.training.objectives.dpo.job import max_sequence_length
    from autopar.training.resolve import tokenizer_path

    job = parse_job(["--job.config", "dpo_debug"])
    record = {
        "prompt": [{"role": "user", "content": "Count on from three: three four"}],
        "chosen": [{"role": "assistant", "content": "five six seven eight"}],
        "rejected": [{"role": "assistant", "content": "two one zero"}],
    }
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    tokenizer = str(tokenizer_path(job))
    chat = ChatFormat(tokenizer, job.training.chat_template)
    loaded = load_pairs(tmp_path / "chat.jsonl", chat, tokenizer, max_sequence_length(job))
    assert loaded.truncated == 0


def lora_checkpoint(folder: Path, job: JobConfig) -> None:
    """A LoRA run's DCP save: the adapters only (its base is frozen, not saved)."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from autopar.parallel.lora import apply_lora
    from autopar.training.checkpointing.dcp_state import ModelState
    from autopar.training.resolve import model_args

    model = Qwen(model_args(job))
    apply_lora(model, dataclasses.replace(job.lora, enable=True), torch.float32)
    dcp.save({"model": ModelState([model], "trained")}, checkpoint_id=str(folder), no_dist=True)


def damaged_dcp(folder: Path, job: JobConfig, manifest: bool) -> Path:
    """The job's model saved as DCP (with a run's manifest, or none), its data file cut in half."""
    import torch.distributed.checkpoint as dcp

    from autopar.training.checkpointing.manifest import write_manifest
    from autopar.training.resolve import model_args

    dcp.save({"model": Qwen(model_args(job)).state_dict()}, checkpoint_id=str(folder), no_dist=True)
    if manifest:
        write_manifest(folder)
    data = sorted(folder.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return data


REFERENCE_PATHS = {
    "missing": "no such folder",
    "neither": "is neither an HF model folder \\(no config.json\\) nor a DCP checkpoint",
    "damaged_metadata": "/.metadata is damaged",
    "peft_adapters": "is a LoRA adapter folder",
    "lora_checkpoint": "is a LoRA run's checkpoint, which holds its adapters only",
    "other_family": "but .*config.json has",
}


@pytest.mark.parametrize("kind", REFERENCE_PATHS)
def test_a_reference_path_that_cannot_load_is_one_line_before_any_work(tmp_path, kind):
    """Each kind a user might name: refused by the job's checks, before a process group."""
    from autopar.models import build_model, get_flavor, save_hf

    folder = tmp_path / "reference"
    job = preference_job(tmp_path / "run")
    if kind == "neither":
        folder.mkdir()
        (folder / "notes.txt").write_text("weights elsewhere")
    elif kind == "damaged_metadata":
        damaged_dcp(folder, job, manifest=False)
        (folder / ".metadata").write_bytes(b"not a pickle")
    elif kind == "peft_adapters":
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    elif kind == "lora_checkpoint":
        lora_checkpoint(folder, job)
    elif kind == "other_family":
        other = build_model(get_flavor("qwen3.5", "debug"))
        save_hf(other.state_dict(), other.args, folder)
    job = preference_job(tmp_path / "run", "--dpo.reference_path", str(folder))
    with pytest.raises(ConfigError, match=f"dpo.reference_path.*{REFERENCE_PATHS[kind]}"):
        check_job(job, 1)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("manifest", [True, False])
def test_a_reference_checkpoint_with_a_damaged_file_is_one_line_naming_it(tmp_path, manifest):
    """Verified as it is read (its files are checksummed there, shared by the ranks): by a
    run's manifest, naming the file; without one, the read that fails names the folder."""
    folder = tmp_path / "reference"
    data = damaged_dcp(folder, preference_job(tmp_path / "run"), manifest)
    job = preference_job(tmp_path / "run", "--dpo.reference_path", str(folder))
    says = f" is damaged: {data} has" if manifest else ": a file of it is damaged"
    with pytest.raises(ConfigError, match=f"dpo.reference_path='{folder}'{says}"):
        one_process_trainer(job)


BF16_PLANS = ["dp_shard=2", "tp=2", "cp=2"]
"""DPO in bf16: FSDP computes what one device does; TP and CP split sums, held as
``test_bf16_parity`` holds them (a multiple of one device's bf16-to-fp32 distance)."""


@pytest.fixture(scope="module")
def bf16_dpo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_bf16")
    flags = ("--training.steps", str(BF16_STEPS), "--optimizer.lr", "0.003")
    bf16 = preference_job(tmp / "bf16", *flags, "--training.mixed_precision_param", "bfloat16")
    runs = parity_runs(bf16, BF16_PLANS, steps=BF16_STEPS)
    fp32 = PlanRun(
        "fp32", 1, *run_job(plan_job(preference_job(tmp / "fp32", *flags), "", BF16_STEPS, str(tmp / "r")))
    )
    gap = bf16_gaps(fp32, runs[BF16_PLANS[0]][0])
    return runs, tuple(MULTIPLE_OF_BF16_GAP * g for g in gap)


@pytest.mark.slow
@pytest.mark.parametrize("plan", BF16_PLANS)
def test_dpo_in_bf16_under_a_plan_stays_within_bf16_rounding_of_one_device(bf16_dpo, plan):
    runs, (loss_tol, norm_tol) = bf16_dpo
    reference, run = runs[plan]
    d_loss, d_norm = bf16_gaps(run, reference)
    if plan.startswith("dp_shard"):  # data parallel: the same computation as one device
        assert max(d_loss, d_norm) <= DATA_PARALLEL_RTOL
    else:
        assert d_loss <= loss_tol and d_norm <= norm_tol, (d_loss, loss_tol, d_norm, norm_tol)
    assert loss_tol > 1e-4  # bf16 is measurably apart from fp32, else the bound would be fp32's


def test_a_dpo_run_exports_its_model_as_sft_does(tmp_path):
    from autopar.models import from_hf

    trainer = one_process_trainer(
        preference_job(tmp_path, "--training.steps", "2", "--checkpoint.last_save_in_hf", "true")
    )
    trainer.train()
    exported = from_hf(tmp_path / "hf" / "step-2")
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, trainer.parts[0].state_dict()[name], rtol=0, atol=0)


def test_too_few_held_out_pairs_are_refused_before_the_model_is_built(tmp_path, model_never_built):
    from autopar.data.errors import DataError

    flags = ("--validation.enable", "true", "--validation.dataset_path", str(PREFERENCE_EXAMPLE))
    job = preference_job(tmp_path, *flags, "--validation.local_batch_size", "4096")
    with pytest.raises(DataError, match=r"holds \d+ pairs, fewer than one batch .* = 4096;"):
        one_process_trainer(job)


def test_validation_reports_trls_metrics_on_held_out_pairs(tmp_path):
    flags = ("--validation.enable", "true", "--validation.dataset_path", str(PREFERENCE_EXAMPLE))
    job = preference_job(
        tmp_path, *flags, "--validation.freq", "2", "--validation.steps", "2", "--training.steps", "2"
    )
    one_process_trainer(job).train()
    (record,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val_loss" in r]
    assert record["val_tokens"] == 16  # pairs: 2 steps of validation.local_batch_size 8
    assert {f"val_{name}" for name in METRICS} <= set(record)
    assert 0 <= record["val_rewards/accuracies"] <= 1 and record["val_loss"] != pytest.approx(math.log(2))
