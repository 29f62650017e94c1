"""The structure docs/architecture.md promises: one-way imports, no cycles, one owner per concept.

Read from the source with ``ast`` (nothing is imported), so a lazy import
inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "potluck"
SCHEDULE_NAMES = {"gpipe", "1f1b", "interleaved", "zb"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(_modules()[name].read_text())


def _resolve(name: str) -> str | None:
    """The potluck module an imported name lives in (``a.b.c`` -> ``a.b`` if c is a name)."""
    while name and name not in _modules():
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> set[str]:
    """Every potluck module ``name`` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in map(_resolve, targets) if t and t != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None (depth-first search with colours)."""
    colour: dict[str, int] = defaultdict(int)  # 0 new, 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == 0 and (found := visit(nxt)):
                return found
        colour[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    graph = {name: _imports(name) for name in _modules()}
    assert _cycle(graph) is None


def _folder(name: str) -> str:
    path = _modules()[name]
    return _module_name(path.parent / "__init__.py") if path.name != "__init__.py" else name


def test_no_two_folders_import_each_other():
    """Between sub-packages imports go one way (modules at a package's top, which hold what
    its folders share or what puts them together, are not counted as a folder)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name in _modules():
        for target in _imports(name):
            a, b = _folder(name), _folder(target)
            nested = a.startswith(f"{b}.") or b.startswith(f"{a}.") or a == "potluck" or b == "potluck"
            if a != b and not nested:
                graph[a].add(b)
    assert _cycle(graph) is None


def test_the_cli_reaches_the_runtime_and_the_planner_only_through_the_api():
    """The CLI parses and prints: it builds the options through :mod:`potluck.api`, which
    plans and trains; of the planner it names only the options' vocabulary."""
    reached = {module for module in _imports("potluck.cli")
               if module.startswith(("potluck.runtime", "potluck.planner"))}
    assert reached <= {"potluck.planner.options"}


def test_every_module_says_what_it_is_for():
    undocumented = [name for name in _modules()
                    if name != "potluck.__main__" and not ast.get_docstring(_tree(name))]
    assert undocumented == []


@pytest.mark.parametrize("name", sorted(SCHEDULE_NAMES))
def test_schedule_names_are_spelled_only_in_the_schedules_package(name):
    """Everything else asks potluck.schedules (schedule_for, the Schedule enum)."""
    spelled = [
        module for module in _modules()
        if not module.startswith("potluck.schedules")
        and any(isinstance(node, ast.Constant) and node.value == name
                for node in ast.walk(_tree(module)))
    ]
    assert spelled == []


def test_the_checks_see_imports_inside_functions():
    """The module graph includes lazy imports: one that exists today is found."""
    assert "potluck.planner.evaluate" in _imports("potluck.runtime.timing.targets")
