"""``[profiling]``: torch.profiler traces of one step in every profile_freq, on CPU too."""

from __future__ import annotations

import json

import pytest

from autopar.config import ConfigError
from autopar.training.metrics.profiling import check_profiling

from jobs import one_process_trainer, tiny_job


def test_traces_are_written_for_one_step_in_every_profile_freq(tmp_path):
    job = tiny_job(
        tmp_path,
        "--training.steps",
        "6",
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        "3",
    )
    one_process_trainer(job).train()
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_3", "iteration_6"]
    events = json.loads((traces / "iteration_6" / "rank0_trace.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::mm" in names or "aten::addmm" in names  # the step's matmuls were recorded
    assert "Optimizer.step#AdamW.step" in names  # the whole step, optimizer included


def test_memory_snapshots_need_a_gpu():
    with pytest.raises(ConfigError, match=r"profiling.enable_memory_snapshot=true .* needs a GPU"):
        check_profiling(tiny_job("unused", "--profiling.enable_memory_snapshot", "true").profiling, "cpu")
