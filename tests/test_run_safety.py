"""Nothing a user has on disk is overwritten without being asked, and a resume says what
changed since its checkpoint and applies or refuses it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from autopar.cli.train import main as train_main
from autopar.training.checkpointing.dcp_state import complete_steps
from autopar.training.metrics.logger import read_metrics
from autopar.training.trainer import Trainer

from jobs import TINY_FLAGS, one_process_trainer, tiny_job

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


def test_a_checkpoint_a_resave_set_aside_and_was_killed_is_put_back_on_resume(tmp_path):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    folder = tmp_path / "checkpoint"
    (folder / "step-2").rename(folder / ".step-2.stale")  # step 2 saved again, killed before it was in
    run = trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS)
    run.restore()
    assert run.step == 2 and complete_steps(folder) == [1, 2]


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


def train(capsys, folder: Path, *flags: str) -> tuple[int, list[str]]:
    """``train.py`` on the tiny job in ``folder`` (checkpoints every step, all kept), in this
    process: its exit code and the lines it printed to stderr."""
    code = train_main(
        [
            "--job.config",
            "debug_model",
            *TINY_FLAGS,
            *("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"),
            *("--metrics.log_freq", "1", "--job.dump_folder", str(folder)),
            *flags,
        ]
    )
    return code, capsys.readouterr().err.strip().splitlines()


def outputs(folder: Path) -> dict[str, bytes]:
    """The files a run leaves in ``folder`` and their bytes (checkpoints by name)."""
    files = {name: (folder / name).read_bytes() for name in ("metrics.jsonl", "config.toml")}
    return {**files, "checkpoints": str(complete_steps(folder / "checkpoint")).encode()}


@pytest.mark.parametrize(
    "other, named",
    [
        (("--checkpoint.enable", "false", "--optimizer.lr", "1e-4"), "checkpoint.enable true -> false"),
        (("--checkpoint.folder", "elsewhere"), "checkpoint.folder checkpoint -> elsewhere"),
        (("--training.steps", "2", "--checkpoint.enable", "false"), "training.steps 3 -> 2"),
    ],
)
def test_a_run_of_other_settings_never_replaces_a_finished_runs_files(tmp_path, capsys, other, named):
    assert train(capsys, tmp_path, "--training.steps", "3")[0] == 0
    before = outputs(tmp_path)
    code, lines = train(capsys, tmp_path, "--training.steps", "3", *other)
    assert code == 2 and len(lines) == 1, lines
    assert "holds an earlier run's metrics.jsonl (steps 1-3) and config.toml" in lines[0]
    assert named in lines[0] and "--job.overwrite_dump_folder true" in lines[0]
    assert outputs(tmp_path) == before


def test_overwrite_dump_folder_replaces_an_earlier_run_when_asked(tmp_path, capsys):
    assert train(capsys, tmp_path, "--training.steps", "3")[0] == 0
    flags = ("--checkpoint.enable", "false", "--optimizer.lr", "1e-4", "--job.overwrite_dump_folder", "true")
    assert train(capsys, tmp_path, "--training.steps", "2", *flags)[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert "lr = 0.0001" in (tmp_path / "config.toml").read_text()
    assert "overwrite_dump_folder =" not in (tmp_path / "config.toml").read_text()  # asked once, not for good


def test_a_config_toml_of_the_users_own_in_the_dump_folder_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "config.toml").write_text("[training]\nsteps = 7\n")
    code, lines = train(capsys, tmp_path, "--training.steps", "1")
    assert code == 2 and "holds an earlier run's config.toml" in lines[0], lines
    assert (tmp_path / "config.toml").read_text() == "[training]\nsteps = 7\n"


def test_the_same_job_run_again_replaces_its_own_files_without_a_flag(tmp_path, capsys):
    flags = ("--training.steps", "2", "--checkpoint.enable", "false")
    assert train(capsys, tmp_path, *flags)[0] == 0
    assert train(capsys, tmp_path, *flags, "--job.description", "again")[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_rewinding_with_load_step_is_refused_naming_what_it_would_discard(tmp_path, capsys):
    assert train(capsys, tmp_path, "--training.steps", "4")[0] == 0
    before = outputs(tmp_path)
    code, lines = train(capsys, tmp_path, "--training.steps", "4", "--checkpoint.load_step", "2")
    assert code == 2 and len(lines) == 1, lines
    assert (
        "checkpoint.load_step=2 rewinds this run: its later checkpoints step-3, step-4 and the "
        "metrics.jsonl rows of steps 3-4 would be discarded; pass --checkpoint.allow_rewind true"
    ) in lines[0]
    assert outputs(tmp_path) == before


def test_an_allowed_rewind_discards_the_later_checkpoints_and_rows(tmp_path, capsys):
    assert train(capsys, tmp_path, "--training.steps", "4")[0] == 0
    rewind = ("--checkpoint.load_step", "2", "--checkpoint.allow_rewind", "true")
    assert train(capsys, tmp_path, "--training.steps", "3", *rewind)[0] == 0
    assert complete_steps(tmp_path / "checkpoint") == [1, 2, 3]  # no step-4 of the abandoned run
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


ADAM = ("--optimizer.beta1", "0.5", "--optimizer.beta2", "0.9", "--optimizer.eps", "1e-6")


def test_a_resume_applies_other_adam_hyperparameters_and_says_so(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    caplog.set_level("INFO", logger="autopar")
    run = trainer(tmp_path, "--training.steps", "3", *CHECKPOINTS, *ADAM, "--optimizer.weight_decay", "0.3")
    run.restore()
    groups = run.optimizers[0].param_groups
    assert {(g["betas"], g["eps"]) for g in groups} == {((0.5, 0.9), 1e-6)}
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.3]  # matrices only, as built
    line = next(r.getMessage() for r in caplog.records if "changed since its checkpoint" in r.getMessage())
    for said in (
        "optimizer.beta1 0.9 -> 0.5",
        "optimizer.eps 1e-08 -> 1e-06",
        "optimizer.weight_decay 0.1 -> 0.3",
    ):
        assert said in line


def test_a_resume_applies_another_learning_rate_schedule_and_says_so(tmp_path, caplog):
    trainer(tmp_path, "--training.steps", "2", *CHECKPOINTS).train()
    caplog.set_level("INFO", logger="autopar")
    flags = ("--optimizer.lr", "0.001", "--lr_scheduler.decay_type", "cosine")
    trainer(tmp_path, "--training.steps", "4", *CHECKPOINTS, *flags).train()
    # step 3 of 4 after 2 warmup steps: halfway down the cosine, from the new peak
    assert read_metrics(tmp_path / "metrics.jsonl")[2]["lr"] == pytest.approx(0.001 * 0.5)
    line = next(r.getMessage() for r in caplog.records if "changed since its checkpoint" in r.getMessage())
    assert "optimizer.lr 0.01 -> 0.001" in line and "lr_scheduler.decay_type linear -> cosine" in line


@pytest.mark.parametrize(
    "change, refused",
    [
        (("--lora.alpha", "1600"), "lora.alpha=1600.0: "),
        (("--model.rope_theta", "10000"), "model.rope_theta=10000.0: "),
    ],
)
def test_a_resume_that_would_change_what_the_weights_compute_is_refused(tmp_path, capsys, change, refused):
    lora = ("--lora.enable", "true", "--training.mixed_precision_param", "float32")
    assert train(capsys, tmp_path, "--training.steps", "2", *lora)[0] == 0
    before = outputs(tmp_path)
    code, lines = train(capsys, tmp_path, "--training.steps", "3", *lora, *change)
    assert code == 2 and len(lines) == 1, lines
    assert refused in lines[0] and "resume with --" in lines[0]
    assert outputs(tmp_path) == before


def test_a_resume_of_other_settings_keeps_the_config_that_trained_the_steps_before_it(tmp_path, capsys):
    assert train(capsys, tmp_path, "--training.steps", "2", "--optimizer.lr", "0.01")[0] == 0
    assert train(capsys, tmp_path, "--training.steps", "3", "--optimizer.lr", "0.001")[0] == 0
    assert "lr = 0.01\n" in (tmp_path / "config.until-step-2.toml").read_text()
    assert "lr = 0.001\n" in (tmp_path / "config.toml").read_text()


def test_a_finished_run_run_again_with_other_settings_keeps_its_config(tmp_path, capsys):
    assert train(capsys, tmp_path, "--training.steps", "2")[0] == 0
    before = (tmp_path / "config.toml").read_text()
    assert (
        train(capsys, tmp_path, "--training.steps", "2", "--optimizer.lr", "1e-4")[0] == 0
    )  # nothing to train
    assert (tmp_path / "config.toml").read_text() == before


@pytest.mark.parametrize(
    "lines",
    [
        "my notes: lr 0.01 looked fine\n",
        '{"note": "rerun with more steps"}\n',
        "[1, 2, 3]\n",
        '{"step": 3, "loss": 2.7\n{"step": 4, "loss": 2.6}\n',  # cut off, then more after it
        "my notes, not ended by a newline",
    ],
    ids=["text", "json-object", "json-list", "cut-in-the-middle", "last-text"],
)
@pytest.mark.parametrize("steps", ["3", "2"], ids=["resume", "same-job-again"])
def test_metrics_lines_that_are_not_autopars_records_are_refused_untouched(tmp_path, capsys, lines, steps):
    assert train(capsys, tmp_path, "--training.steps", "2", *CHECKPOINTS)[0] == 0
    if steps == "2":  # no checkpoint: the same job runs again from step 1
        shutil.rmtree(tmp_path / "checkpoint")
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write(lines)
    before = metrics.read_bytes()
    code, said = train(capsys, tmp_path, "--training.steps", steps, *CHECKPOINTS)
    assert code == 2 and len(said) == 1, said
    assert said[0].startswith(f"config error: {metrics} line 3 is not a record autopar wrote (")
    assert said[0].endswith("move it (or that line) elsewhere, then rerun")
    assert metrics.read_bytes() == before
