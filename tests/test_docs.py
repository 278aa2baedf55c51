"""The README and docs/ pages: every command they show names flags and files that exist, and
every page they link is there. A renamed field or preset fails here, not in a user's shell."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from autopar.config.parse import field_types, sections
from autopar.training.resolve import MODEL_FIELDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = {
    # how a command is spelt -> the module whose source holds its own (non-job) options
    "train.py": "autopar/cli/train.py",
    "autopar.train": "autopar/cli/train.py",
    "autopar-train": "autopar/cli/train.py",
    "autopar.plan": "autopar/cli/plan.py",
    "autopar.probe": "autopar/cli/probe.py",
    "autopar-probe": "autopar/cli/probe.py",
    "autopar.bench": "autopar/cli/bench.py",
    "autopar.parity": "autopar/cli/parity.py",
    "autopar.plot": "autopar/cli/plot.py",
    "autopar.generate": "autopar/cli/generate.py",
    "autopar-generate": "autopar/cli/generate.py",
    "autopar.data.prepare": "autopar/data/prepare.py",
}
OWN_FLAGS_ELSEWHERE = {"--help", "--print-config", "--dry-run", "--world-size"}
"""train.py's own flags, documented in ``autopar.config.parse.help_text``."""


def shown_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(command module, its words) of every autopar command in the page's code blocks."""
    found = []
    for block in page.read_text().split("```")[1::2]:
        text = re.sub(r"\\\n\s*", " ", block)  # continued lines
        for line in text.splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"&&|\|", line):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                start = next((i for i, w in enumerate(words) if w in COMMANDS), None)
                if start is not None:  # the command's own words, not torchrun's
                    found.append((COMMANDS[words[start]], words[start:]))
    return found


SHOWN = [(page, module, words) for page in PAGES for module, words in shown_commands(page)]


def job_field_exists(dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    if section == "model" and name in MODEL_FIELDS:
        return True
    return section in sections() and name in field_types(sections()[section])


def test_the_pages_show_commands_of_every_kind():
    assert {module for _, module, _ in SHOWN} == set(COMMANDS.values())


@pytest.mark.parametrize(
    "page, module, words", SHOWN, ids=[f"{p.name}: {' '.join(w)[:60]}" for p, _, w in SHOWN]
)
def test_a_shown_command_names_flags_and_files_that_exist(page, module, words):
    source = (ROOT / module).read_text()
    for i, word in enumerate(words):
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and "." in flag:
            assert job_field_exists(flag[2:]) or flag == "--job.config", f"{page.name}: {flag}"
        elif flag.startswith("--"):
            assert f'"{flag}"' in source or flag in OWN_FLAGS_ELSEWHERE, f"{page.name}: {flag} of {module}"
        if words[i - 1] == "--job.config" and "/" not in word and word != "...":
            assert (ROOT / "autopar" / "train_configs" / f"{word}.toml").is_file(), (
                f"{page.name}: preset {word}"
            )
        if word.startswith(("train_configs/", "autopar/")):
            assert (ROOT / word).exists(), f"{page.name}: {word}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_page_a_page_links_exists(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links {target}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
