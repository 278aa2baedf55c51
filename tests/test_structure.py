"""The package's floors: every module imports on its own, and lower floors never import higher ones."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autopar"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def module_path(module: str) -> Path:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    return path if path.is_file() else PACKAGE.parent / module.replace(".", "/") / "__init__.py"


def autopar_imports(module: str) -> set[str]:
    """Every autopar module ``module`` imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(module_path(module).read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "autopar" or name.startswith("autopar.")}


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    # One interpreter (torch imports once); before each module every autopar module is
    # forgotten, so each import starts from nothing of autopar, as in a fresh process.
    def script(names: list[str]) -> str:
        return (
            "import importlib, sys, traceback\n"
            f"for name in {names!r}:\n"
            "    for loaded in [m for m in sys.modules if m == 'autopar' or m.startswith('autopar.')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception:\n"
            "        print(f'{name}: {traceback.format_exc().splitlines()[-1]}')\n"
        )

    # two interpreters at once, one per core, each taking every other module
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script(MODULES[i::2])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr[-3000:]
        assert stdout == "", f"modules that fail to import on their own:\n{stdout}"


FLOORS = {
    "autopar.config": ("autopar.config",),
    "autopar.rewards": ("autopar.rewards",),
    "autopar.models": ("autopar.models",),
    "autopar.data": ("autopar.config", "autopar.data"),
    "autopar.parallel": ("autopar.config", "autopar.models", "autopar.data", "autopar.parallel"),
    "autopar.training": (
        "autopar.config",
        "autopar.models",
        "autopar.data",
        "autopar.parallel",
        "autopar.training",
    ),
    "autopar.planner": (
        "autopar.config",
        "autopar.models",
        "autopar.data",
        "autopar.parallel",
        "autopar.training",
        "autopar.planner",
    ),
}
"""Each folder and the folders it may import: each floor stands only on those below it."""

COMMAND_MODULES = (
    "autopar.train",
    "autopar.plan",
    "autopar.probe",
    "autopar.bench",
    "autopar.parity",
    "autopar.plot",
    "autopar.generate",
)
"""``python -m autopar.<command>``: each only hands over to ``autopar.cli``."""


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_floor_imports_only_the_floors_below(floor):
    offenders = {
        module: sorted(
            name for name in autopar_imports(module) if not any(in_package(name, a) for a in FLOORS[floor])
        )
        for module in MODULES
        if in_package(module, floor)
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_every_module_lives_on_a_floor_or_is_a_command():
    homeless = [
        module
        for module in MODULES
        if module != "autopar"
        and not any(in_package(module, floor) for floor in (*FLOORS, "autopar.cli"))
        and module not in COMMAND_MODULES
    ]
    assert homeless == []


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_command_modules_only_hand_over_to_the_cli(module):
    assert autopar_imports(module) == {module.replace("autopar.", "autopar.cli.")}


def test_no_module_has_its_forward_replaced():
    # a plan that changes how a module computes swaps in a module or a class (shown by the
    # model's repr), never an instance's forward
    assigned = [
        f"{module}:{node.lineno}"
        for module in MODULES
        for node in ast.walk(ast.parse(module_path(module).read_text()))
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Attribute) and target.attr == "forward" for target in node.targets)
    ]
    assert assigned == []


def test_the_import_graph_has_no_cycles():
    graph = {module: {name for name in autopar_imports(module) if name in MODULES} for module in MODULES}
    visiting, done, cycles = set(), set(), []

    def visit(module: str, path: list[str]) -> None:
        if module in done:
            return
        if module in visiting:
            cycles.append([*path[path.index(module) :], module])
            return
        visiting.add(module)
        for child in sorted(graph[module]):
            visit(child, [*path, child])
        visiting.discard(module)
        done.add(module)

    for module in MODULES:
        visit(module, [module])
    assert cycles == []


LONGEST_FUNCTION = 60
"""Lines, signature and docstring included: a longer function is split into named steps."""


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines"
                    )
    assert not long, "\n".join(long)
