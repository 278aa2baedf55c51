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
