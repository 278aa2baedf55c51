"""The private torch names autopar leans on: all reached through
``autopar/parallel/torch_internals.py``, and each still there. A torch upgrade that moves or
drops one fails here by name, before it fails deep in a dry run or a pipeline step."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from autopar.parallel.torch_internals import (
    CHECKED_WITH,
    LEANED_ON,
    LEANED_ON_BEFORE,
    torch_version,
    untested_torch_warning,
)

PACKAGE = Path(__file__).resolve().parents[1] / "autopar"
INTERNALS_MODULE = PACKAGE / "parallel" / "torch_internals.py"
OPS = [
    "_c10d_functional.wait_tensor",
    "_c10d_functional.all_to_all_single",
    "_c10d_functional.all_reduce",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional_autograd.all_to_all_single",
]
"""Operators the dry run and per-op activation checkpointing recognise by name."""


def private_torch_imports(path: Path) -> list[str]:
    """``import``/``from`` statements of ``path`` that reach a private torch module or name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = [alias.name for alias in node.names]
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                name.startswith("_") for name in names
            ):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [
                f"import {alias.name}"
                for alias in node.names
                if alias.name.split(".")[0] == "torch"
                and any(p.startswith("_") for p in alias.name.split("."))
            ]
    return found


@pytest.mark.parametrize(("module", "name"), LEANED_ON, ids=[f"{m}.{n}" for m, n in LEANED_ON])
def test_a_private_torch_name_autopar_uses_is_still_there(module, name):
    value = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(value, part), (
            f"torch {torch.__version__}: {module}.{name} is gone ({LEANED_ON[module, name]})"
        )
        value = getattr(value, part)


@pytest.mark.parametrize(("module", "name"), LEANED_ON_BEFORE, ids=[f"{m}.{n}" for m, n in LEANED_ON_BEFORE])
def test_a_private_torch_name_autopar_uses_on_older_torch_is_there_on_it(module, name):
    until, why = LEANED_ON_BEFORE[module, name]
    if torch_version(torch.__version__) >= torch_version(until):
        pytest.skip(f"torch {torch.__version__} does without {name} ({why})")
    value = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(value, part), f"torch {torch.__version__}: {module}.{name} is gone ({why})"
        value = getattr(value, part)


def test_the_torch_running_the_tests_is_in_the_checked_range():
    assert torch_version(CHECKED_WITH[0]) <= torch_version(torch.__version__), torch.__version__
    assert untested_torch_warning() is None, untested_torch_warning()


def test_a_newer_torch_than_the_checked_range_gets_one_warning_line_naming_the_range():
    newest = CHECKED_WITH[-1]
    assert untested_torch_warning(f"{newest}.1+cu132") is None
    major, minor = torch_version(newest)
    warning = untested_torch_warning(f"{major}.{minor + 1}.0")
    assert warning is not None and "\n" not in warning
    assert f"({CHECKED_WITH[0]} to {newest})" in warning


@pytest.mark.parametrize("op", OPS)
def test_a_collective_operator_autopar_recognises_is_still_there(op):
    namespace, name = op.split(".")
    assert hasattr(getattr(torch.ops, namespace), name), f"torch {torch.__version__}: torch.ops.{op} is gone"


def test_only_the_internals_module_imports_private_torch_names():
    elsewhere = {
        str(path.relative_to(PACKAGE)): private_torch_imports(path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != INTERNALS_MODULE
    }
    assert {path: found for path, found in elsewhere.items() if found} == {}


def test_every_private_import_of_the_internals_module_is_listed():
    listed = {module for module, _ in LEANED_ON}
    imported = {
        line.split()[1] for line in private_torch_imports(INTERNALS_MODULE) if line.startswith("from ")
    }
    assert imported - listed - {"torch.distributed.tensor"} == set()
