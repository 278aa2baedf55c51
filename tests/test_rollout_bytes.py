"""The planner counts an RL job's rollout: the sampler's decoding state exactly as it is
allocated, and the moment a rank samples at where it holds more than the training step."""

from __future__ import annotations

import pytest
import torch

from autopar.models import build_model, get_flavor
from autopar.models.generation import Decoder
from autopar.planner.memory import predict
from autopar.planner.rollout_bytes import decode_state_bytes
from autopar.training.resolve import model_args, parse_job

from jobs import tiny_args

PRESET = "train_configs/qwen3_8b_rl_lora.toml"


def allocated_state_bytes(decoder: Decoder) -> int:
    tensors = [t for cache in decoder.attention.values() for t in (cache.k, cache.v)]
    for sequence in decoder.sequences.values():
        tensors += [*sequence.conv, sequence.recurrent]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_the_decoding_state_counted_is_what_the_sampler_allocates(family, dtype):
    args = get_flavor("qwen3.5", "debug") if family == "qwen3.5" else tiny_args(family)
    model = build_model(args)
    model.init_weights(seed=3)
    rows, length = 3, 40
    decoder = Decoder(model.to(dtype).eval(), rows, length)
    decoder.forward(torch.ones(rows, 5, dtype=torch.long), slice(None), torch.zeros(rows, dtype=torch.long))
    assert allocated_state_bytes(decoder) == decode_state_bytes(args, 1, rows, length, dtype.itemsize)


def rl_8b(*flags: str):
    job = parse_job(["--job.config", PRESET, *flags])
    return predict(model_args(job), job, 8)[0].parts


def test_an_rl_job_whose_rollout_holds_more_than_its_step_peaks_at_the_rollout():
    training = rl_8b()
    assert "decode_state" not in training  # 64 completions a rank: the step's activations lead
    sampling = rl_8b("--training.global_batch_size", "2048")  # 256 a rank
    assert {"decode_state", "decode_logits"} <= set(sampling) and "activations" not in sampling
    assert sampling["params"] == training["params"]


def test_a_replayed_rl_job_samples_nothing_and_peaks_at_its_step():
    parts = rl_8b("--training.global_batch_size", "2048", "--rl.replay", "rollouts")
    assert "decode_state" not in parts and "activations" in parts


def test_an_rl_reference_copy_is_held_beside_the_policy():
    parts = rl_8b("--lora.enable", "false", "--rl.beta", "0.04", "--rl.reference", "copy")
    assert parts["reference"] == pytest.approx(2 * 8.19e9 / 8, rel=0.01)  # bf16 Qwen3-8B over 8 ranks
