"""TRL's recorded DPO losses and metrics follow from its recorded per-pair log-probs by the
formulas of ``DPOTrainer._compute_loss`` (TRL 1.16), written here in numpy: the fixtures are
self-consistent, and these lines are the definitions autopar's loss is held to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "dpo_fixtures"
RTOL = 1e-5  # fp32: TRL's loss forward and its log-prob forward differ in the last bits only


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def entries(group: str) -> list[dict]:
    return json.loads((FIXTURES / f"{group}_losses.json").read_text())["losses"]


def completion_lengths(group: str, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = json.loads((FIXTURES / f"{group}_ids.json").read_text())["ids"]
    chosen = np.array([len(ids[r]["chosen_ids"]) for r in rows], dtype=np.float64)
    rejected = np.array([len(ids[r]["rejected_ids"]) for r in rows], dtype=np.float64)
    return chosen, rejected


def trl_loss(entry: dict, group: str) -> float:
    """The loss TRL's formulas give from the entry's log-probs (summed over completions)."""
    config, logps = entry["dpo_config"], {k: np.array(v, dtype=np.float64) for k, v in entry["logps"].items()}
    beta, smoothing = config["beta"], config["label_smoothing"]
    chosen = logps["policy_chosen"] - logps["reference_chosen"]
    rejected = logps["policy_rejected"] - logps["reference_rejected"]
    delta = beta * (chosen - rejected)
    weights = config["loss_weights"] or [1.0] * len(config["loss_type"])
    total = 0.0
    for kind, weight in zip(config["loss_type"], weights):
        if kind == "sigmoid":
            per_pair = -log_sigmoid(delta)
        elif kind == "hinge":
            per_pair = np.maximum(0.0, 1 - delta)
        elif kind == "robust":
            per_pair = (-(1 - smoothing) * log_sigmoid(delta) + smoothing * log_sigmoid(-delta)) / (
                1 - 2 * smoothing
            )
        elif kind == "ipo":  # length-normalised: per completion token
            chosen_tokens, rejected_tokens = completion_lengths(group, entry["rows"])
            per_pair = (chosen / chosen_tokens - rejected / rejected_tokens - 1 / (2 * beta)) ** 2
        elif kind == "sft":  # the chosen tokens' mean negative log-likelihood, over the batch
            chosen_tokens, _ = completion_lengths(group, entry["rows"])
            per_pair = np.full(chosen.size, -logps["policy_chosen"].sum() / chosen_tokens.sum())
        total += weight * per_pair.mean()
    return total


CASES = [
    (g, e["name"])
    for g in ("plain", "conversational")
    for e in entries(g)
    if not e["name"].endswith("truncated")
]


@pytest.mark.parametrize("group, name", CASES)
def test_trls_loss_follows_from_its_log_probs(group, name):
    entry = next(e for e in entries(group) if e["name"] == name)
    assert trl_loss(entry, group) == pytest.approx(entry["loss"], rel=RTOL)


@pytest.mark.parametrize("group", ["plain", "conversational"])
def test_trls_metrics_follow_from_its_log_probs(group):
    for entry in entries(group):
        beta, logps = entry["dpo_config"]["beta"], {k: np.array(v) for k, v in entry["logps"].items()}
        chosen = beta * (logps["policy_chosen"] - logps["reference_chosen"])
        rejected = beta * (logps["policy_rejected"] - logps["reference_rejected"])
        expected = {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(),
            "rewards/accuracies": (chosen > rejected).mean(),  # strict: an identical pair counts 0
            "logps/chosen": logps["policy_chosen"].mean(),
            "logps/rejected": logps["policy_rejected"].mean(),
        }
        found = {k: entry["metrics"][k] for k in expected}
        assert found == pytest.approx(expected, rel=RTOL, abs=1e-6), entry["name"]
