"""LoRA: peft's numbers on one device, only adapters train, the adapter folder loads in peft
and the merged export in transformers. Parity under every plan: tests/test_parallel_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_models import hf_model_for, parity_args
from test_moe import hf_moe_for, moe_args

from autopar.config.errors import ConfigError
from autopar.config.sections import ActivationCheckpoint, LoRA
from autopar.data.chat import CHAT_EXAMPLE, encode
from autopar.models import Qwen, from_hf
from autopar.models.qwen import canonical_name
from autopar.parallel.activation_checkpoint import apply_ac
from autopar.parallel.expert_parallel import apply_expert_kernel
from autopar.parallel.lora import LoRALinear, apply_lora
from autopar.parallel.materialize import materialize, seeded_values
from autopar.training.checkpointing.adapters import (
    adapter_config,
    from_peft_layout,
    load_adapter,
    low_rank_update,
    our_name,
    save_adapter,
)
from autopar.training.checkpointing.dcp_state import saved_keys
from autopar.training.faults import TrainingStopped
from autopar.training.preflight import check_job
from autopar.training.resolve import model_args

from jobs import CHAT_VOCAB, chat_hf_base, chat_job, debug_job, moe_job, one_process_trainer, tiny_job

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = LoRA(enable=True, rank=4, alpha=8.0)


def peft_pair(tmp_path, family: str, tied: bool):
    """An HF model with peft adapters (B random, not zero, so every gradient flows) and our
    model from the same HF folder carrying the same adapters."""
    args = parity_args(family, 2, tied)
    hf = hf_model_for(args)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path, dtype=torch.float32)
    config = peft.LoraConfig(
        r=LORA.rank, lora_alpha=LORA.alpha, target_modules=LORA.target_modules, init_lora_weights=False
    )
    theirs = peft.get_peft_model(hf, config)
    apply_lora(ours, LORA, torch.float32)
    adapters = {our_name(k): v for k, v in peft.get_peft_model_state_dict(theirs).items()}
    missing, unexpected = ours.load_state_dict(adapters, strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing)
    return ours, theirs, args


@pytest.mark.parametrize(("family", "tied"), [("qwen3", False), ("qwen2", True)])
def test_logits_and_adapter_grads_match_peft(tmp_path, family, tied):
    ours, theirs, args = peft_pair(tmp_path, family, tied)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    their_logits, our_logits = theirs(tokens).logits, ours(tokens)
    assert (our_logits - their_logits).abs().max().item() <= 1e-5
    for logits in (their_logits, our_logits):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hf_layers = theirs.base_model.model.model.layers
    for adapter in ("lora_A", "lora_B"):
        theirs_q = getattr(hf_layers[0].self_attn.q_proj, adapter)["default"].weight.grad
        theirs_down = getattr(hf_layers[1].mlp.down_proj, adapter)["default"].weight.grad
        ours_q = getattr(ours.layers["0"].self_attn.q_proj, adapter).weight.grad
        ours_down = getattr(ours.layers["1"].mlp.down_proj, adapter).weight.grad
        torch.testing.assert_close(ours_q, theirs_q, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours_down, theirs_down, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for n, p in ours.named_parameters() if ".lora_" not in n)  # base frozen


def test_adapter_folder_loads_in_peft_with_our_logits(tmp_path):
    ours, _, args = peft_pair(tmp_path / "base", "qwen3", False)
    with torch.no_grad():  # our own adapters, not the ones peft drew
        for module in ours.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.weight.normal_(0, 0.02)
    adapters = {n: p for n, p in ours.named_parameters() if ".lora_" in n}
    save_adapter(adapters, LORA, tmp_path / "adapter", args)
    assert load_adapter(tmp_path / "adapter").keys() == adapters.keys()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def lora_chat_run(tmp_path, *flags: str):
    """A LoRA SFT run of the tiny model on the shipped conversations, from an HF base."""
    base, source = chat_hf_base(tmp_path)
    job = chat_job(
        tmp_path / "run",
        *("--model.hf_assets_path", str(source), "--model.tokenizer_path", str(source)),
        *("--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf", "true"),
        *("--lora.enable", "true", "--lora.rank", "4", "--optimizer.lr", "0.01"),
        *flags,
    )
    trainer = one_process_trainer(job)
    return base, trainer, trainer.train(), source


LEARNED = 0.03
"""Nats by which a few LoRA steps lower the assistant-token loss of the shipped conversations
(measured 0.064 in 16 steps; a single step's loss is too noisy to compare)."""


def assistant_loss(model, source) -> float:
    """Mean loss on the assistant tokens of the first shipped conversations."""
    losses = []
    with torch.no_grad():
        for line in CHAT_EXAMPLE.read_text().splitlines()[:8]:
            ids, learned = encode(json.loads(line)["messages"], str(source))
            tokens, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
            mask = torch.tensor(learned[1:])
            losses.append(F.cross_entropy(model(tokens)[0][mask], targets[mask]).item())
    return sum(losses) / len(losses)


def test_lora_sft_trains_adapters_only_and_exports_what_peft_and_transformers_load(tmp_path):
    base, trainer, _, source = lora_chat_run(
        tmp_path,
        *("--training.steps", "16", "--training.document_masking", "true"),
        *("--checkpoint.last_save_in_hf", "true", "--lora.merge_on_export", "true"),
    )
    model = trainer.parts[0]
    assert assistant_loss(model, source) < assistant_loss(base, source) - LEARNED
    base_params = dict(base.named_parameters())
    for name, param in model.named_parameters():
        if ".lora_" in name:
            assert param.requires_grad
        else:  # the frozen base is never written by a step
            assert not param.requires_grad and torch.equal(param, base_params[name]), name
    assert all(m.lora_B.weight.abs().max() > 0 for m in model.modules() if isinstance(m, LoRALinear))

    tokens = torch.randint(0, CHAT_VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "run" / "hf"
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        ours = model(tokens)
        adapted = peft.PeftModel.from_pretrained(hf_base, out / "step-16").eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            out / "step-16-merged", dtype=torch.float32
        )
        torch.testing.assert_close(adapted, ours, rtol=0, atol=1e-4)
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=0, atol=1e-4)
        assert not torch.allclose(ours, base(tokens), atol=1e-3)  # it trained


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora.rank", "0"], "lora.rank = 0"),
        (["--lora.target_modules", "q_proj,qkv"], "entry 'qkv' matches no linear"),
        (["--lora.base_dtype", "bfloat16"], "lora.base_dtype = bfloat16 below"),
        (["--lora.dropout", "0.1", "--parallelism.tensor_parallel_degree", "2"], "different dropout masks"),
        (
            ["--lora.dropout", "0.1", "--compile.enable", "true", "--activation_checkpoint.mode", "full"],
            "replay the forward's dropout masks",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ],
            "pipeline stage 3 holds ['norm', 'lm_head'], where LoRA trains nothing",
        ),
    ],
    ids=["rank", "target", "base-dtype", "dropout-tp", "dropout-compiled-ac", "pipeline-stage"],
)
def test_bad_lora_settings_are_refused_with_the_field_and_the_fix(flags, message):
    job = debug_job("--lora.enable", "true", "--training.mixed_precision_param", "float32", *flags)
    with pytest.raises(ConfigError) as err:
        check_job(job, 2, "cpu")
    assert message in str(err.value)


def test_lora_over_transformer_engine_fp8_is_refused_with_the_backend_that_works():
    job = debug_job("--lora.enable", "true", "--float8.enable", "true")  # auto: TE on CUDA
    with pytest.raises(ConfigError, match=r"set --float8\.backend torchao"):  # before TE's own checks
        check_job(job, 1, "cuda")


def lora_job(folder, steps: int, *flags: str):
    return tiny_job(
        folder,
        *LORA_FLAGS,
        *("--training.steps", str(steps), "--checkpoint.enable", "true", "--checkpoint.interval", "2"),
        *flags,
    )


LORA_FLAGS = ("--lora.enable", "true", "--lora.rank", "4")


def test_lora_resume_saves_adapters_only_and_continues_exactly(tmp_path):
    straight = one_process_trainer(lora_job(tmp_path / "straight", 4)).train()
    one_process_trainer(lora_job(tmp_path / "resumed", 2)).train()
    saved = saved_keys(tmp_path / "resumed" / "checkpoint" / "step-2")
    assert {k for k in saved if k.startswith("model.")} == {
        f"model.{n}" for n, _ in targeted_adapters(model_args(lora_job(tmp_path, 2)))
    }
    resumed = one_process_trainer(lora_job(tmp_path / "resumed", 4)).train()
    assert [r.loss for r in resumed] == [r.loss for r in straight[2:]]


def test_resuming_lora_adapters_on_another_base_is_refused(tmp_path):
    one_process_trainer(lora_job(tmp_path, 2)).train()
    with pytest.raises(TrainingStopped, match="trained on seeded initialization"):
        one_process_trainer(lora_job(tmp_path, 4, "--debug.seed", "1"))


def targeted_adapters(args):
    with torch.device("meta"):
        model = Qwen(args)
    apply_lora(model, LORA, torch.float32)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def test_lora_from_a_dcp_base_exports_the_merged_model_it_trained(tmp_path):
    one_process_trainer(
        tiny_job(tmp_path / "full", "--training.steps", "2", "--checkpoint.enable", "true")
    ).train()
    base = tmp_path / "full" / "checkpoint" / "step-2"
    job = tiny_job(
        tmp_path / "lora",
        *LORA_FLAGS,
        *("--training.steps", "3", "--checkpoint.initial_load_path", str(base)),
        *("--checkpoint.last_save_in_hf", "true", "--lora.merge_on_export", "true"),
    )
    trainer = one_process_trainer(job)
    trainer.train()
    merged = from_hf(tmp_path / "lora" / "hf" / "step-3-merged", dtype=torch.float32)
    tokens = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), trainer.parts[0](tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("option", ["1", "op"])
def test_lora_dropout_is_replayed_by_activation_checkpointing(option):
    """A checkpointed block recomputed in backward draws the forward's dropout masks."""
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        args = parity_args("qwen3", 2, False)
        model = Qwen(args)
        materialize(model, torch.device("cpu"), seeded_values(args, 0, torch.device("cpu")))
        apply_lora(model, LoRA(enable=True, rank=4, alpha=8.0, dropout=0.5), torch.float32)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_()  # B starts at zero: make A's gradient depend on the masks
        if checkpointed:
            apply_ac(
                model, ActivationCheckpoint(mode="selective", selective_ac_option=option), False, random=True
            )
        torch.manual_seed(1)
        model(torch.arange(12).reshape(2, 6)).float().square().mean().backward()
        grads.append({canonical_name(n): p.grad for n, p in model.named_parameters() if p.requires_grad})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=0, msg=name)


def test_adapters_split_with_their_base_under_tensor_parallelism(tmp_path):
    """Under TP 2 each rank keeps half of an adapter's larger factor: a column-parallel base
    (q/k/v/gate/up, its output split) keeps A whole and splits B's rows; a row-parallel one
    (o/down, its input split) splits A's columns and keeps B whole, so the adapter's partial
    sum joins the base's in one reduction. (Parity cannot see a wrong placement: DTensor
    redistributes a replicated adapter for free, at full size on every rank.)"""
    import torch.distributed as dist

    from autopar.parallel.mesh import ParallelDims, build_meshes
    from autopar.parallel.parallelize import build_parts
    from autopar.parallel.torch_internals import fake_store, forget_sharding_caches

    tp2 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
    job = tiny_job(tmp_path, *tp2, "--lora.enable", "true")
    args, cpu, rank = model_args(job), torch.device("cpu"), job.lora.rank
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        meshes = build_meshes(ParallelDims.resolve(job.parallelism, 2), "cpu")
        (model,) = build_parts(args, job, meshes, cpu, seeded_values(args, 0, cpu)).parts
        local = {
            canonical_name(n): tuple(p.to_local().shape) for n, p in model.named_parameters() if "lora_" in n
        }
    finally:
        dist.destroy_process_group()
        forget_sharding_caches()
    hidden, q_out, ffn = args.hidden_size, args.num_attention_heads * args.head_dim, args.intermediate_size
    block = "layers.1"
    assert local[f"{block}.self_attn.q_proj.lora_A.weight"] == (rank, hidden)
    assert local[f"{block}.self_attn.q_proj.lora_B.weight"] == (q_out // 2, rank)
    assert local[f"{block}.mlp.up_proj.lora_B.weight"] == (ffn // 2, rank)
    assert local[f"{block}.self_attn.o_proj.lora_A.weight"] == (rank, q_out // 2)
    assert local[f"{block}.self_attn.o_proj.lora_B.weight"] == (hidden, rank)
    assert local[f"{block}.mlp.down_proj.lora_A.weight"] == (rank, ffn // 2)
    assert local[f"{block}.mlp.down_proj.lora_B.weight"] == (hidden, rank)


EXPERT_LORA = LoRA(enable=True, rank=4, alpha=8.0, target_modules=["q_proj", "experts"])


def expert_peft_pair(tmp_path):
    """A transformers Qwen3-MoE with peft adapters on q_proj and on its fused experts
    (``target_parameters``, as our adapter_config names them; B random), and ours from the
    same folder carrying the same adapters."""
    args = moe_args()
    hf = hf_moe_for(args)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path, dtype=torch.float32)
    spelled = adapter_config(EXPERT_LORA, None)
    fields = ("r", "lora_alpha", "target_modules", "target_parameters")
    config = peft.LoraConfig(**{k: spelled[k] for k in fields}, init_lora_weights=False)
    theirs = peft.get_peft_model(hf, config)
    apply_lora(ours, EXPERT_LORA, torch.float32)
    adapters = {our_name(k): v for k, v in peft.get_peft_model_state_dict(theirs).items()}
    adapters = {k: from_peft_layout(k, v, EXPERT_LORA.rank) for k, v in adapters.items()}
    missing, unexpected = ours.load_state_dict(adapters, strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing)
    return ours, theirs, args


@pytest.mark.parametrize("kernel", ["grouped", "loop"])
def test_expert_adapters_match_peft_on_transformers_fused_experts(tmp_path, kernel):
    ours, theirs, args = expert_peft_pair(tmp_path)
    apply_expert_kernel(ours, kernel)
    tokens = torch.randint(0, args.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    their_logits, (our_logits, _) = theirs(tokens).logits, ours(tokens)
    assert (our_logits - their_logits).abs().max().item() <= 1e-5
    for logits in (their_logits, our_logits):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    down = theirs.base_model.model.model.layers[1].mlp.experts  # peft nests gate_up's wrapper inside
    theirs_by_name = {
        "lora_gate_up_A": down.base_layer.lora_A["default"],
        "lora_gate_up_B": down.base_layer.lora_B["default"],
        "lora_down_A": down.lora_A["default"],
        "lora_down_B": down.lora_B["default"],
    }
    experts = ours.layers["1"].mlp.experts
    for name, linear in theirs_by_name.items():
        expected = from_peft_layout(f"experts.{name}", linear.weight.grad, EXPERT_LORA.rank)
        torch.testing.assert_close(getattr(experts, name).grad, expected, rtol=1e-5, atol=1e-8, msg=name)
    assert all(p.grad is None for n, p in ours.named_parameters() if ".lora_" not in n)  # base frozen


def test_expert_adapter_folder_loads_in_peft_with_our_logits(tmp_path):
    ours, _, args = expert_peft_pair(tmp_path / "base")
    with torch.no_grad():  # our own adapters, not the ones peft drew
        for name, param in ours.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.05)
    adapters = {n: p.detach() for n, p in ours.named_parameters() if ".lora_" in n}
    save_adapter(adapters, EXPERT_LORA, tmp_path / "adapter", args)
    loaded = load_adapter(tmp_path / "adapter")
    assert loaded.keys() == adapters.keys() and all(torch.equal(loaded[n], t) for n, t in adapters.items())
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens)[0], rtol=0, atol=1e-5)


def test_merged_expert_adapters_give_the_adapted_model():
    args = moe_args()
    adapted = Qwen(args)
    materialize(adapted, torch.device("cpu"), seeded_values(args, 0, torch.device("cpu")))
    plain = Qwen(args)
    plain.load_state_dict(adapted.state_dict())
    apply_lora(adapted, EXPERT_LORA, torch.float32)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.05)
        adapters = {canonical_name(n): p for n, p in adapted.named_parameters() if ".lora_" in n}
        for name, param in plain.named_parameters():
            update = low_rank_update(canonical_name(name), adapters)
            if update is not None:
                param += EXPERT_LORA.alpha / EXPERT_LORA.rank * update
        tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(plain(tokens)[0], adapted(tokens)[0], rtol=0, atol=1e-5)


def test_expert_adapters_with_dropout_are_refused():
    job = debug_job(
        *("--model.flavor", "debug-moe", "--training.mixed_precision_param", "float32"),
        *("--lora.enable", "true", "--lora.target_modules", "q_proj,experts", "--lora.dropout", "0.1"),
    )
    with pytest.raises(ConfigError, match=r"lora.dropout = 0.1 with experts in lora.target_modules"):
        check_job(job, 1, "cpu")


def test_lora_on_experts_exports_the_merged_model_it_trained(tmp_path):
    job = moe_job(
        tmp_path,
        *("--training.steps", "3", "--lora.enable", "true", "--lora.rank", "4"),
        *("--lora.target_modules", "q_proj,experts", "--checkpoint.last_save_in_hf", "true"),
        *("--lora.merge_on_export", "true"),
    )
    trainer = one_process_trainer(job)
    trainer.train()
    adapters = load_adapter(tmp_path / "hf" / "step-3")
    assert adapters["layers.0.mlp.experts.lora_down_B"].abs().max() > 0  # the experts' adapters trained
    merged = from_hf(tmp_path / "hf" / "step-3-merged", dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens)[0], trainer.parts[0](tokens)[0], rtol=0, atol=1e-5)
