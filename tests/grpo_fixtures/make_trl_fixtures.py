"""Write TRL 1.16's GRPO losses and metrics for fixed completions, and those completions as
an autopar rollouts file (``step-1.jsonl``) to replay them.

Run with the interpreter that has trl (``/work/venv-trl/bin/python
tests/grpo_fixtures/make_trl_fixtures.py``); the tests read what it writes and never import
trl. Deterministic: the tiny policy and reference are the DPO fixtures' (seeded, fp32),
the completions, rewards and the sampler's log-probabilities are drawn from a fixed seed, and
``GRPOTrainer._compute_loss`` runs once per configuration in train mode (one micro-batch:
``current_gradient_accumulation_steps = 1``, ``steps_per_generation = 1``).

Prompts are all of one length, so TRL's batch has no left padding (HF positions count
padding); completions vary in length (right padding) and some end without an end of text
(truncated).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TOKENIZER = ROOT / "autopar" / "data" / "tokenizers" / "chatml"
POLICY, REFERENCE = ROOT / "tests" / "dpo_fixtures" / "policy", ROOT / "tests" / "dpo_fixtures" / "reference"
EOS = 0  # <|endoftext|> in the chatml tokenizer
GROUP, PROMPTS, PROMPT_LENGTH, MAX_COMPLETION = 4, 2, 6, 10
TEMPERATURE = 0.7
REWARDS = [
    [1.0, 0.0],
    [0.5, None],
    [0.0, 1.0],
    [1.0, 1.0],
    [0.25, 0.0],
    [0.0, None],
    [None, None],
    [0.75, 0.5],
]
"""Two reward functions' values per completion (None: does not apply; the seventh no function
scores: its advantage is 0)."""
WEIGHTS = [1.0, 0.5]

CONFIGS = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "dapo_beta": {"beta": 0.04},
    "dapo_asymmetric_delta": {"epsilon": 0.1, "epsilon_high": 0.28, "delta": 1.5},
    "dapo_masked_truncated": {"mask_truncated_completions": True},
    "grpo_batch_scale": {"loss_type": "grpo", "scale_rewards": "batch"},
    "bnpo_no_scale": {"loss_type": "bnpo", "scale_rewards": "none"},
    "dapo_beta_uncorrected_kl": {"beta": 0.04, "use_bias_correction_kl": False},
    "dapo_trainer_old_logps": {"old_logps": "trainer"},
    "dapo_is_token_truncate": {
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 1.2,
    },
    "dapo_is_token_mask": {
        "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_max": 1.3,
        "vllm_importance_sampling_clip_min": 0.8,
    },
    "grpo_is_sequence_truncate": {
        "loss_type": "grpo",
        "vllm_importance_sampling_mode": "sequence_truncate",
        "vllm_importance_sampling_clip_max": 2.0,
    },
    "dapo_is_sequence_mask": {
        "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_clip_max": 2.0,
        "vllm_importance_sampling_clip_min": 0.5,
    },
}
"""Each configuration's settings (TRL's GRPOConfig names) over the defaults. ``old_logps =
"trainer"`` (autopar's name) stands for TRL recomputing pi_old with the policy; a
``vllm_importance_sampling_mode`` turns TRL's importance-sampling correction on (as with vLLM:
pi_old the policy's, each token's loss times the ratio ``importance_ratio`` makes)."""
AUTOPAR_NAMES = {
    "vllm_importance_sampling_mode": "importance_correction",
    "vllm_importance_sampling_clip_max": "importance_cap_max",
    "vllm_importance_sampling_clip_min": "importance_cap_min",
}
"""autopar's ``[rl]`` names of TRL's settings that differ."""


def completions() -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of the 8 completions: 2 prompts x 4."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(PROMPTS)]
    out_prompts, out = [], []
    for i in range(PROMPTS * GROUP):
        length = int(torch.randint(2, MAX_COMPLETION + 1, (1,), generator=g))
        ids = torch.randint(3, 500, (length,), generator=g).tolist()
        if i % 3 != 2:  # every third runs to the end without an end of text: truncated
            ids = [*ids[: min(length, MAX_COMPLETION - 1)], EOS]
        elif len(ids) < MAX_COMPLETION:
            ids = ids + torch.randint(3, 500, (MAX_COMPLETION - len(ids),), generator=g).tolist()
        out_prompts.append(prompts[i // GROUP])
        out.append(ids)
    return out_prompts, out


def advantages(scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, advantages) by TRL's formulas (``_generate_and_score_completions``)."""
    per_function = torch.tensor([[math.nan if r is None else r for r in row] for row in REWARDS])
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * torch.tensor(WEIGHTS)[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return rewards, torch.nan_to_num(adv, nan=0.0)


def token_logps(model: Qwen3ForCausalLM, prompts: list[list[int]], ids: list[list[int]]) -> torch.Tensor:
    """(B, C) each completion token's log-probability at TEMPERATURE (0 past its end)."""
    out = torch.zeros(len(ids), MAX_COMPLETION)
    with torch.no_grad():
        for row, (p, c) in enumerate(zip(prompts, ids)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / TEMPERATURE
            out[row, : len(c)] = logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
    return out


def importance_ratio(
    config: dict, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The correction's factors as ``GRPOTrainer._generate_and_score_completions`` makes them
    (TRL 1.16, its lines under "Compute the importance sampling ratio when using vLLM"): (B, T)
    per token, (B, 1) per completion; truncated to the caps, or zero outside them."""
    mode = config["vllm_importance_sampling_mode"]
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = (
        config.get("vllm_importance_sampling_clip_min"),
        config.get("vllm_importance_sampling_clip_max", 3.0),
    )
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    low = low if low is not None else -math.inf
    high = high if high is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trainer_for(policy: Qwen3ForCausalLM, config: dict, tokenizer) -> GRPOTrainer:
    args = GRPOConfig(
        output_dir=str(HERE / "_trl_output"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        report_to=[],
        **{k: v for k, v in config.items() if k != "old_logps"},
    )
    data = Dataset.from_list([{"prompt": "x"}] * (PROMPTS * GROUP))
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    if "vllm_importance_sampling_mode" in config:  # the correction TRL applies to a vLLM's samples
        trainer.use_vllm = True
    return trainer


def main() -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    policy = Qwen3ForCausalLM.from_pretrained(POLICY, torch_dtype=torch.float32, attn_implementation="eager")
    reference = Qwen3ForCausalLM.from_pretrained(
        REFERENCE, torch_dtype=torch.float32, attn_implementation="eager"
    )
    prompts, ids = completions()
    policy_logps = token_logps(policy, prompts, ids)
    noise = torch.randn(policy_logps.shape, generator=torch.Generator().manual_seed(1)) * 0.3
    sampler = policy_logps + noise  # pi_old: the sampler's, off from the trainer's so ratios clip
    ref = token_logps(reference, prompts, ids)
    mask = torch.tensor([[1.0 if t < len(c) else 0.0 for t in range(MAX_COMPLETION)] for c in ids])
    truncated = [c[-1] != EOS for c in ids]
    entries = []
    for name, config in CONFIGS.items():
        trainer = trainer_for(policy, config, tokenizer)
        rewards, adv = advantages(config.get("scale_rewards", "group"))
        completion_mask = mask.clone()
        if config.get("mask_truncated_completions"):
            completion_mask *= torch.tensor([0.0 if t else 1.0 for t in truncated])[:, None]
        padded = torch.tensor([c + [EOS] * (MAX_COMPLETION - len(c)) for c in ids])
        recomputed = config.get("old_logps") == "trainer" or "vllm_importance_sampling_mode" in config
        inputs = {
            "prompt_ids": torch.tensor(prompts),
            "prompt_mask": torch.ones(len(prompts), PROMPT_LENGTH, dtype=torch.long),
            "completion_ids": padded,
            "completion_mask": completion_mask.long(),
            "advantages": adv,
            "old_per_token_logps": policy_logps if recomputed else sampler,
            "ref_per_token_logps": ref,
            "num_items_in_batch": completion_mask.sum(),
        }
        if "vllm_importance_sampling_mode" in config:
            inputs["importance_sampling_ratio"] = importance_ratio(
                config, policy_logps, sampler, completion_mask
            )
        policy.train()
        trainer._metrics["train"].clear()
        loss = trainer._compute_loss(policy, inputs)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        entries.append(
            {
                "name": name,
                "rl": {AUTOPAR_NAMES.get(k, k): v for k, v in config.items()},
                "loss": loss.item(),
                "metrics": metrics,
                "rewards": [None if math.isnan(r) else r for r in rewards.tolist()],
                "advantages": adv.tolist(),
            }
        )
        print(name, loss.item(), metrics)
    records = [
        {
            "step": 1,
            "group": i // GROUP,
            "prompt": "x",
            "prompt_ids": prompts[i],
            "completion_ids": ids[i],
            "completion": tokenizer.decode(ids[i], skip_special_tokens=True),
            "rewards": {"first": REWARDS[i][0], "second": REWARDS[i][1]},
            "reward": None,
            "advantage": 0.0,
            "logps": sampler[i, : len(ids[i])].tolist(),
            "truncated": truncated[i],
        }
        for i in range(len(ids))
    ]
    (HERE / "rollouts").mkdir(exist_ok=True)
    (HERE / "rollouts" / "step-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    (HERE / "losses.json").write_text(
        json.dumps(
            {
                **versions,
                "temperature": TEMPERATURE,
                "max_completion_length": MAX_COMPLETION,
                "num_generations": GROUP,
                "reward_weights": WEIGHTS,
                "entries": entries,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
