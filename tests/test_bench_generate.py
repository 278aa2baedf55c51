"""``python -m autopar.cli.bench_generate``: the sampler's speed table beside transformers',
with the correctness columns (greedy = transformers' argmax, compiled = eager) and the commit."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from autopar.cli.bench_generate import main

pytest.importorskip("transformers")


def test_the_table_records_speeds_agreement_and_the_commit(tmp_path, monkeypatch, capsys):
    """Qwen3.5's debug model, a short run; the step traced by aot_eager (seconds, not 20)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    out = tmp_path / "bench.json"
    flags = ["--models", "qwen3.5:debug", "--batch", "2", "--prompt", "8", "--new", "4", "--repeat", "1"]
    assert main([*flags, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["commit"] and record["threads"] == 1
    (row,) = record["rows"]
    assert row["model"] == "qwen3.5:debug" and row["batch"] == 2
    assert row["greedy_agreement"] == 1.0 and row["compiled_tokens_equal_eager"]
    for field in ("eager_decode_tps", "compiled_decode_tps", "hf_decode_tps", "hf_prefill_tps"):
        assert row[field] > 0
    assert "qwen3.5:debug" in capsys.readouterr().out


@pytest.mark.heavy  # 7 s; test_speculative holds the drafts' tokens to plain greedy's
def test_speculative_rows_record_acceptance_against_plain_greedy(tmp_path):
    """k=1 for the random head and a head trained 2 steps; their tokens equal plain greedy's."""
    out = tmp_path / "bench.json"
    flags = [
        "--models",
        "--prompt",
        "8",
        "--new",
        "4",
        "--repeat",
        "1",
        "--speculative",
        "1",
        "--train-steps",
        "2",
    ]
    assert main([*flags, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["speculative_rows"]
    assert [(r["head"], r["draft_tokens"]) for r in rows] == [("random", 1), ("trained 2 steps", 1)]
    for row in rows:
        assert row["tokens_equal_plain"] and 1.0 <= row["tokens_per_forward"] <= 2.0
        assert row["plain_tps"] > 0 and row["speculative_tps"] > 0
