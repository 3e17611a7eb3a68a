"""The engine package's import graph: no circle between its files, and nothing of the config above it.

Every import counts, the lazy ones inside functions too: a cycle hidden in a function still ties
two modules into one job.
"""

from __future__ import annotations

import ast
from pathlib import Path

import agent.engines

PACKAGE = Path(agent.engines.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every ``agent.*`` module ``path`` imports, wherever the import statement stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("agent.")}


def engine_graph() -> dict[str, set[str]]:
    """``agent.engines.X`` -> the modules of agent/engines it imports."""
    modules = {f"agent.engines.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: imported_modules(path) & set(modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_sees_a_circle_of_three() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_between_engine_modules() -> None:
    assert find_cycle(engine_graph()) is None


def test_no_engine_module_imports_the_agent_config() -> None:
    offenders = sorted(
        path.name
        for path in PACKAGE.glob("*.py")
        if any(name == "agent.config" or name.startswith("agent.config.") for name in imported_modules(path))
    )
    assert offenders == []
