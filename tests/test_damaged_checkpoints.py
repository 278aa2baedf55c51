"""A damaged checkpoint, as the train command meets it: whichever file of the latest step folder
is cut short, has flipped bytes or is gone, the same command resumes from the newest intact
checkpoint and says which file is broken (docs/checkpoints_and_faults.md); when nothing intact
is left, or the damage is in a checkpoint without a manifest, it stops with one line."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from autopar.cli.train import main as train_main

from jobs import TINY_FLAGS

STEPS = ("--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")


def train(capsys, folder: Path, *flags: str) -> tuple[int, list[str]]:
    """train.py's exit code on the tiny job in ``folder``, and the lines it wrote to stderr."""
    argv = ["--job.config", "debug_model", *TINY_FLAGS, *STEPS, "--job.dump_folder", str(folder)]
    code = train_main([*argv, *flags])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory) -> Path:
    """A finished 3-step run with a checkpoint of each step."""
    folder = tmp_path_factory.mktemp("three_steps")
    argv = ["--job.config", "debug_model", *TINY_FLAGS, *STEPS, "--job.dump_folder", str(folder)]
    assert train_main([*argv, "--training.steps", "3"]) == 0
    return folder


@pytest.fixture
def run(three_steps, tmp_path) -> Path:
    """A copy of ``three_steps`` this test may damage."""
    shutil.copytree(three_steps, tmp_path / "run")
    return tmp_path / "run"


def emptied(path: Path) -> None:
    path.write_bytes(b"")


def cut_to_1000_bytes(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def first_64_bytes_flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = bytes(b ^ 0xFF for b in data[:64])
    path.write_bytes(bytes(data))


def middle_byte_flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def removed(path: Path) -> None:
    path.unlink()


DAMAGE: list[tuple[str, Callable[[Path], None]]] = [
    *((shard, d) for shard in ["__0_0.distcp"] for d in (emptied, cut_to_1000_bytes, cut_in_half)),
    ("__0_0.distcp", first_64_bytes_flipped),
    ("__0_0.distcp", middle_byte_flipped),
    ("__0_0.distcp", removed),
    *((".metadata", d) for d in (removed, emptied, cut_in_half, first_64_bytes_flipped)),
    *(("rng-rank0.pt", d) for d in (removed, emptied, first_64_bytes_flipped)),
    *(("manifest.json", d) for d in (emptied, cut_in_half, first_64_bytes_flipped)),
]


@pytest.mark.parametrize("name, damage", DAMAGE, ids=[f"{name}-{damage.__name__}" for name, damage in DAMAGE])
def test_a_damaged_file_of_the_latest_checkpoint_resumes_from_the_one_before_saying_so(
    run, capsys, name, damage
):
    damage(run / "checkpoint" / "step-3" / name)
    code, lines = train(capsys, run, "--training.steps", "4")
    broken = [line for line in lines if "checkpoint step-3 is broken" in line]
    assert code == 0 and len(broken) == 1, lines
    assert str(run / "checkpoint" / "step-3") in broken[0] and "trying the one before" in broken[0]
    assert any(line.endswith(f"resumed from {run / 'checkpoint' / 'step-2'}") for line in lines), lines
    assert not any("Traceback" in line for line in lines)


def test_a_step_folder_emptied_is_broken_and_the_one_before_resumed(run, capsys):
    for file in (run / "checkpoint" / "step-3").iterdir():
        file.unlink()
    code, lines = train(capsys, run, "--training.steps", "4")
    assert code == 0 and any("checkpoint step-3 is broken (" in line for line in lines), lines
    assert any(line.endswith("step-2") and "resumed from" in line for line in lines), lines


def test_every_checkpoint_damaged_stops_with_one_line_naming_them(run, capsys):
    for step in (1, 2, 3):
        cut_to_1000_bytes(run / "checkpoint" / f"step-{step}" / "__0_0.distcp")
    code, lines = train(capsys, run, "--training.steps", "4")
    assert code == 1 and lines[-1].endswith(
        f"training stopped: every checkpoint in {run / 'checkpoint'} is broken (steps [1, 2, 3]); "
        "move the folder away to start afresh"
    ), lines


def test_a_broken_load_step_is_refused_offering_only_intact_steps(run, capsys):
    for step in (2, 3):
        middle_byte_flipped(run / "checkpoint" / f"step-{step}" / "__0_0.distcp")
    rewind = ("--checkpoint.load_step", "2", "--checkpoint.allow_rewind", "true")
    code, lines = train(capsys, run, "--training.steps", "4", *rewind)
    assert code == 1 and "checkpoint.load_step=2 is broken: " in lines[-1], lines
    assert lines[-1].endswith("pick another of [1], or leave load_step unset to use the newest intact one")


@pytest.mark.parametrize(
    "name, damage",
    [("__0_0.distcp", cut_to_1000_bytes), ("__0_0.distcp", first_64_bytes_flipped), (".metadata", emptied)],
)
def test_a_damaged_checkpoint_without_manifest_whose_train_state_fails_is_skipped(run, capsys, name, damage):
    (run / "checkpoint" / "step-3" / "manifest.json").unlink()  # as an older autopar saved it
    damage(run / "checkpoint" / "step-3" / name)
    code, lines = train(capsys, run, "--training.steps", "4")
    broken = [line for line in lines if "checkpoint step-3 is broken (its files cannot be read" in line]
    assert code == 0 and len(broken) == 1, lines
    assert any(line.endswith(f"resumed from {run / 'checkpoint' / 'step-2'}") for line in lines), lines


def test_damage_in_the_weights_of_a_checkpoint_without_manifest_stops_with_one_line(run, capsys):
    (run / "checkpoint" / "step-3" / "manifest.json").unlink()
    cut_in_half(run / "checkpoint" / "step-3" / "__0_0.distcp")  # the train entries come first
    code, lines = train(capsys, run, "--training.steps", "4")
    assert code == 1 and "could not read checkpoint" in lines[-1], lines
    assert str(run / "checkpoint" / "step-3") in lines[-1]
    assert lines[-1].endswith(
        "a file of it is damaged; resume from another with --checkpoint.load_step (one of [1, 2]), or move it away"
    )
    assert not any("Traceback" in line for line in lines)


@pytest.mark.parametrize(
    "damage, manifest, said",
    [
        (cut_to_1000_bytes, True, " is damaged: {file} has 1000 bytes, "),
        (middle_byte_flipped, True, " is damaged: {file} does not match the checksum written with it"),
        (cut_to_1000_bytes, False, ": rank 0 could not read it ("),
    ],
    ids=["cut", "flipped", "cut-without-manifest"],
)
def test_a_damaged_initial_load_path_is_refused_before_step_1(
    three_steps, tmp_path, capsys, damage, manifest, said
):
    source = tmp_path / "weights"
    shutil.copytree(three_steps / "checkpoint" / "step-3", source)
    if not manifest:
        (source / "manifest.json").unlink()
    damage(source / "__0_0.distcp")
    code, lines = train(
        capsys, tmp_path / "run", "--training.steps", "1", "--checkpoint.initial_load_path", str(source)
    )
    field = f"config error: checkpoint.initial_load_path={str(source)!r}"
    assert code == 2 and lines[-1].startswith(field + said.format(file=source / "__0_0.distcp")), lines
    assert lines[-1].endswith("copy or save it again, or start from other weights")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
