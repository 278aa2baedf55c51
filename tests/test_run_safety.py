"""Nothing a user has on disk is overwritten without being asked, and a resume says what
changed since its checkpoint and applies or refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from autopar.training.trainer import Trainer

from jobs import one_process_trainer, tiny_job

CHECKPOINTS = ("--checkpoint.enable", "true", "--checkpoint.interval", "1")
EXPORT = ("--checkpoint.last_save_in_hf", "true")


def trainer(folder, *flags: str) -> Trainer:
    return one_process_trainer(tiny_job(folder, *flags))


class Killed(BaseException):
    """A kill -9 at this point of the code: nothing after it runs, no handler catches it."""


def kill_at_rename_of(monkeypatch, name: str) -> None:
    """Stop the process when it renames a folder called ``name`` into place."""
    rename = Path.rename

    def killed_there(self, target):
        if self.name == name:
            raise Killed
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_there)


def whole_exports(hf: Path) -> dict[str, bytes]:
    """The complete HF folders under ``hf`` (not a ``.partial`` one) and their weights' bytes."""
    return {
        folder.name: (folder / "model.safetensors").read_bytes()
        for folder in hf.iterdir()
        if not folder.name.endswith(".partial") and (folder / "config.json").is_file()
    }


def test_a_reexport_killed_between_its_renames_keeps_the_previous_export(tmp_path, monkeypatch):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, *EXPORT).train()
    exported = (tmp_path / "hf" / "step-2" / "model.safetensors").read_bytes()
    kill_at_rename_of(monkeypatch, "step-2.partial")
    with pytest.raises(Killed):  # the finished job run again exports again
        trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, *EXPORT).train()
    assert exported in whole_exports(tmp_path / "hf").values()
    monkeypatch.undo()
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, *EXPORT).train()
    assert whole_exports(tmp_path / "hf") == {"step-2": exported}
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-2"]


def test_a_checkpoint_resave_killed_between_its_renames_is_put_back_on_resume(tmp_path, monkeypatch):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    kill_at_rename_of(monkeypatch, ".step-2.partial")
    with pytest.raises(Killed):  # step 2 saved again, after a rewind to step 1
        trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS, "--checkpoint.load_step", "1").train()
    monkeypatch.undo()
    run = trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS)
    run.restore()
    assert run.step == 2


def test_the_summary_names_no_checkpoint_an_earlier_run_left(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    caplog.set_level("INFO", logger="autopar")
    trainer(tmp_path, "--training.steps", "2", "--optimizer.lr", "1e-4").train()
    last = caplog.records[-1].getMessage()
    assert last.startswith("finished at step 2 of 2") and "checkpoint" not in last


def test_an_hf_export_holds_this_runs_weights_not_an_earlier_runs_checkpoint(tmp_path):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    run = trainer(tmp_path, "--training.steps", "2", "--optimizer.lr", "1e-4", *EXPORT)
    run.train()
    exported = load_file(tmp_path / "hf" / "step-2" / "model.safetensors")
    trained = run.parts[0].state_dict()
    assert exported["model.norm.weight"].equal(trained["norm.weight"])
    assert exported["lm_head.weight"].equal(trained["lm_head.weight"])
