"""The import graph of ``agent/`` keeps the house's shape (docs/architecture.md).

Six rules, each checked over the real tree and, with a small synthetic tree that breaks it, shown
to fail:

(a) no two packages import each other (a package is the first level under ``agent/``; a top-level
    module such as ``agent/store.py`` is its own package), and no circle runs through several
    packages: the imports between packages go one way;
(a') the same inside the operator side: its rooms (the sub-packages of ``agent/fleet/``, listed in
    :data:`FLEET_ROOMS`) import each other one way only, every module of it lives in a room, and
    each room's ``__init__.py`` says its purpose; and inside the device's runtime (:data:`RUNTIME_ROOMS`);
(b) no circle between files;
(c) ``agent/config*`` imports only the ground floor, and the ground floor imports only itself;
(d) only the paho core imports ``paho``;
(e) only the operator side (``agent/fleet/``) imports its web and metrics libraries
    (``prometheus_client``, ``starlette``, ``uvicorn``: the ``fleet`` extra a Jetson never installs),
    except the device's opt-in ``/metrics`` (:data:`DEVICE_METRICS`), which imports
    ``prometheus_client`` lazily: inside functions (or for type checking) only.

Every import counts: at module level, under ``if TYPE_CHECKING:``, and inside functions. A lazy or
type-only import is still a dependency of the code that writes it; moving an import into a function
is how a circle is usually hidden, not how it is removed. There are no exceptions: any violation
fails the test.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

AGENT_DIR = Path(__file__).resolve().parents[1] / "agent"

#: Modules at the ground floor: they import nothing of the agent but each other. ``agent.config``
#: and everything below it belong here too (matched by prefix in :func:`is_ground_floor`).
GROUND_FLOOR = frozenset(
    {
        "agent.names",
        "agent.errors",
        "agent.fsutil",
        "agent.model_base",
        "agent.secret_file",
        # each package's own small settings model / spec module
        "agent.camera.source_spec",
        "agent.delivery.settings",
        "agent.engines.settings",
        "agent.enrollment.settings",
        "agent.mqtt.settings",
        "agent.spool.settings",
        # what a slot's configuration and a manifest share
        "agent.specs.build",
        "agent.specs.postprocess",
        "agent.specs.preprocess",
    }
)

#: Packages only the device runs; the operator side shares the wire contract (``agent.protocol``),
#: the model contract (``agent.model_contract``) and the ground floor with them, never their code.
DEVICE_ONLY = frozenset(
    {
        "agent.backends",
        "agent.camera",
        "agent.delivery",
        "agent.engines",
        "agent.postprocess",
        "agent.runtime",
    }
)

#: The only module that may import paho: the MQTT core (the device link and the service client are
#: built on it).
PAHO_CORE = frozenset({"agent/mqtt/core.py"})

#: Libraries of the ``fleet`` extra: the controller's /metrics and console.
OPERATOR_LIBRARIES = ("prometheus_client", "starlette", "uvicorn")
#: The operator side, where they may be imported anywhere.
OPERATOR_SIDE = "agent/fleet/"
#: The device's opt-in /metrics: prometheus_client (the ``metrics`` extra) inside functions only.
DEVICE_METRICS = frozenset({"agent/telemetry/prometheus.py"})

#: The operator side, whose sub-packages (its rooms) follow the rules of the top-level packages.
FLEET = "agent.fleet"
#: The rooms of the operator side, lowest first: each imports only rooms before it in this list
#: (docs/architecture.md draws them). The test checks the real imports against the one-way rule, not
#: against this order; the list is here so that a new room is a deliberate change.
FLEET_ROOMS = (
    "base",
    "statedb",
    "ca",
    "view",
    "devices",
    "chunks",
    "deploy",
    "rollout",
    "samples",
    "engines",
    "enrollment",
    "metrics",
    "trust",
    "bundle",
    "console",
    "controller",
    "cli",
)

#: The device's runtime, whose rooms follow the same rules, lowest first: the frame path runs the
#: slots' models, so ``frames`` imports ``slots`` and never the other way.
RUNTIME = "agent.runtime"
RUNTIME_ROOMS = ("slots", "frames")


#: The whole agent as rooms, lowest first: every top-level package and module of ``agent/`` is one,
#: and a room imports only rooms listed before it or a ground-floor module (:data:`GROUND_FLOOR`,
#: ``agent.config``), which any room may use. docs/architecture.md draws the same layers.
AGENT_ROOMS = (
    # ground floor: names, errors, configuration and the settings models every package shares
    "names",
    "errors",
    "fsutil",
    "model_base",
    "secret_file",
    "config",
    "specs",
    "backoff",
    "transitions",
    "flag_aliases",
    # services: the machine, files kept on disk, the wire contract, the broker
    "machine",
    "watchdog",
    "signing",
    "store",
    "state",
    "telemetry",
    "datasets",
    "protocol",
    "spool",
    "logs",
    "mqtt",
    # the fleet root of trust: which keys may sign what (TUF metadata), checked by the device
    "trust",
    # what a deployable model must be: checked by the operator before signing and by the device
    "model_contract",
    # frames and models
    "backends",
    "camera",
    "postprocess",
    # device services
    "enrollment",
    "delivery",
    "engines",
    "measure",
    "runtime",
    # the device's own configuration and agent release as desired state (beside the model slots)
    "lifecycle",
    # the operator side (its own rooms: FLEET_ROOMS)
    "fleet",
    # composition roots: build everything, start, stop; prove it
    "app",
    "demo",
    "schemas",
    "selftest",
    "fleetsim",
    "cli",
    "__main__",
)

#: Modules a package may hold directly (``__init__.py`` aside): a room that grows gets sub-rooms
#: by concept, never a file split only to be shorter.
MAX_MODULES_PER_PACKAGE = 16


@dataclass(frozen=True)
class Import:
    """One import statement's target inside the tree, as seen from the importing module."""

    importer: str  # dotted module name, e.g. "agent.delivery.jobs"
    target: str  # dotted module name, resolved to a module file when one exists
    line: int
    where: str  # "module", "type-checking" or "function"

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target} ({self.where} level)"


def module_files(root: Path) -> dict[str, Path]:
    """Map the dotted name of every module under ``root`` (a package directory) to its file."""
    base = root.parent
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Yield every import below ``node`` with where it stands."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, "function")
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and where == "module":
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), where)
        else:
            yield from _walk(child, where)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int, str]]:
    """Yield ``(imported name, line, where)`` for every import in ``path``, names made absolute.

    ``from a.b import c`` yields ``a.b.c`` when that is a module of the tree, else ``a.b``.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node, where in _walk(tree, "module"):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, where
            continue
        base = _absolute(module, is_package, node)
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            yield (candidate if candidate in modules else base), node.lineno, where


def internal_imports(root: Path) -> list[Import]:
    """Every import from one module of the tree under ``root`` of another module of it."""
    modules = module_files(root)
    found: dict[Import, None] = {}  # ordered and without repeats (two names from one module)
    for module, path in modules.items():
        for name, line, where in imports_of(module, path, modules):
            target = _enclosing_module(name, modules)
            if target is not None and target != module:
                found[Import(module, target, line, where)] = None
    return list(found)


def _enclosing_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def package_of(module: str, root: str = "agent") -> str:
    """The first level under ``root``: ``agent.delivery.jobs`` -> ``agent.delivery``; with ``root``
    ``agent.fleet``, ``agent.fleet.rollout.store`` -> ``agent.fleet.rollout``."""
    return ".".join(module.split(".")[: root.count(".") + 2])


def _within(imports: Iterable[Import], root: str) -> Iterator[tuple[str, str, Import]]:
    """``(importer's package, target's package, import)`` for imports between two packages under
    ``root`` (both ends inside it; ``root``'s own ``__init__`` is not a package of it)."""
    prefix = root + "."
    for imp in imports:
        if imp.importer.startswith(prefix) and imp.target.startswith(prefix):
            a, b = package_of(imp.importer, root), package_of(imp.target, root)
            if a != b:
                yield a, b, imp


# --- the rules ------------------------------------------------------------------------------


def package_cycles(imports: Iterable[Import], root: str = "agent") -> dict[tuple[str, str], list[Import]]:
    """Pairs of packages under ``root`` that import each other, each with the imports that make the pair."""
    between: dict[tuple[str, str], list[Import]] = {}
    for a, b, imp in _within(imports, root):
        between.setdefault((a, b), []).append(imp)
    return {
        (a, b): between[(a, b)] + between[(b, a)] for (a, b) in sorted(between) if a < b and (b, a) in between
    }


def file_cycles(imports: Iterable[Import]) -> list[frozenset[str]]:
    """Sets of modules that reach each other through imports (strongly connected, 2 or more)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    # Tarjan's algorithm, iterative so a deep graph cannot hit the recursion limit.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(frozenset(component))
    return sorted(components, key=sorted)


def package_circles(imports: Iterable[Import], root: str = "agent") -> list[frozenset[str]]:
    """Sets of packages under ``root`` that reach each other through imports: a pair (also found by
    :func:`package_cycles`) or a longer circle, such as three packages each importing the next."""
    return file_cycles(Import(a, b, imp.line, imp.where) for a, b, imp in _within(imports, root))


def loose_modules(modules: dict[str, Path], root: str = FLEET) -> list[str]:
    """Module files directly under ``root`` (not packages): each module belongs in a room."""
    return sorted(
        m
        for m, path in modules.items()
        if m.startswith(root + ".") and m.count(".") == root.count(".") + 1 and path.name != "__init__.py"
    )


def rooms_without_purpose(root_dir: Path) -> list[str]:
    """Sub-packages of ``root_dir`` whose ``__init__.py`` has no docstring saying what the room is for."""
    inits = sorted(root_dir.glob("*/__init__.py"))
    return [p.parent.name for p in inits if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]


def is_ground_floor(module: str, ground_floor: frozenset[str] = GROUND_FLOOR) -> bool:
    """Whether ``module`` is at the ground floor (the listed modules and ``agent.config*``)."""
    return module in ground_floor or module == "agent.config" or module.startswith("agent.config.")


def ground_floor_violations(
    imports: Iterable[Import], modules: Iterable[str], ground_floor: frozenset[str] = GROUND_FLOOR
) -> list[str]:
    """Imports from the ground floor of anything above it.

    Importing ``agent.engines.settings`` runs ``agent/engines/__init__.py`` first, so the package files
    above a ground-floor module must import nothing of the agent either.
    """
    modules = set(modules)
    floor = {m for m in modules if is_ground_floor(m, ground_floor)}
    parents = {".".join(m.split(".")[:i]) for m in floor for i in range(2, m.count(".") + 1)} & modules
    problems = [
        f"{imp} (above the ground floor)"
        for imp in imports
        if imp.importer in floor and not is_ground_floor(imp.target, ground_floor)
    ]
    problems += [
        f"{imp} (a ground-floor package file imports)" for imp in imports if imp.importer in parents - floor
    ]
    return sorted(set(problems))


def device_imports_of_the_operator_side(
    imports: Iterable[Import],
    device_only: frozenset[str] = DEVICE_ONLY,
) -> list[str]:
    """Imports of a device-only package by a module of the operator side, at any level."""
    return sorted(
        str(imp)
        for imp in imports
        if imp.importer.startswith(FLEET + ".") and package_of(imp.target) in device_only
    )


def rooms_out_of_order(
    imports: Iterable[Import],
    rooms: tuple[str, ...] = AGENT_ROOMS,
    ground_floor: frozenset[str] = GROUND_FLOOR,
) -> list[str]:
    """Imports of a room listed later in ``rooms`` (a ground-floor target is allowed from anywhere)."""
    rank = {f"agent.{room}": n for n, room in enumerate(rooms)}
    return sorted(
        str(imp)
        for a, b, imp in _within(imports, "agent")
        if not is_ground_floor(imp.target, ground_floor) and a in rank and b in rank and rank[b] > rank[a]
    )


def unlisted_rooms(root: Path, rooms: tuple[str, ...] = AGENT_ROOMS) -> list[str]:
    """Top-level packages and modules of ``root`` missing from ``rooms``, and listed ones that are gone."""
    present = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    present |= {p.parent.name for p in root.glob("*/__init__.py")}
    return sorted(present.symmetric_difference(rooms))


def packages_too_full(root: Path, limit: int = MAX_MODULES_PER_PACKAGE) -> list[str]:
    """Packages under ``root`` (itself included) holding more than ``limit`` modules directly."""
    full = []
    for init in sorted([root / "__init__.py", *root.rglob("*/__init__.py")]):
        count = sum(1 for p in init.parent.glob("*.py") if p.name != "__init__.py")
        if count > limit:
            full.append(f"{init.parent.relative_to(root.parent).as_posix()}/ holds {count} modules")
    return full


def packages_without_purpose(root: Path) -> list[str]:
    """Packages under ``root`` whose ``__init__.py`` has no docstring saying what the room is for."""
    return [
        init.parent.relative_to(root.parent).as_posix()
        for init in sorted(root.rglob("*/__init__.py"))
        if not ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    ]


def rooms_importing_each_other(imports: list[Import], modules: Iterable[str]) -> list[str]:
    """At every level of the tree: two sub-packages of one package that import each other, or a
    circle through several of them."""
    problems = []
    for package in sorted({m for m in modules if m == "agent" or m.startswith("agent.")}):
        for (a, b), imps in package_cycles(imports, package).items():
            problems.append(f"{a} <-> {b}: " + "; ".join(map(str, imps)))
        problems.extend("circle: " + ", ".join(sorted(c)) for c in package_circles(imports, package))
    return sorted(set(problems))


def paho_importers(root: Path, allowed: frozenset[str] = PAHO_CORE) -> list[str]:
    """Imports of ``paho`` outside the allowed files (paths relative to ``root``'s parent)."""
    modules = module_files(root)
    problems = []
    for module, path in modules.items():
        relative = path.relative_to(root.parent).as_posix()
        for name, line, where in imports_of(module, path, modules):
            if (name == "paho" or name.startswith("paho.")) and relative not in allowed:
                problems.append(f"{relative}:{line} imports {name} ({where} level)")
    return problems


def operator_library_importers(root: Path, device_metrics: frozenset[str] = DEVICE_METRICS) -> list[str]:
    """Imports of the ``fleet`` extra's libraries outside ``agent/fleet/`` (the device's opt-in
    /metrics may import ``prometheus_client`` inside a function or for type checking)."""
    modules = module_files(root)
    problems = []
    for module, path in modules.items():
        relative = path.relative_to(root.parent).as_posix()
        if relative.startswith(OPERATOR_SIDE):
            continue
        for name, line, where in imports_of(module, path, modules):
            top = name.split(".")[0]
            if top not in OPERATOR_LIBRARIES:
                continue
            lazy = where in {"function", "type-checking"}
            if relative in device_metrics and top == "prometheus_client" and lazy:
                continue
            problems.append(f"{relative}:{line} imports {name} ({where} level)")
    return problems


# --- the real tree --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_imports() -> list[Import]:
    return internal_imports(AGENT_DIR)


def test_no_two_packages_import_each_other(agent_imports: list[Import]) -> None:
    cycles = package_cycles(agent_imports)
    assert not cycles, "packages that import each other:\n" + "\n".join(
        f"{a} <-> {b}:\n" + "\n".join(f"    {imp}" for imp in imps) for (a, b), imps in cycles.items()
    )


def test_no_circle_through_packages(agent_imports: list[Import]) -> None:
    circles = package_circles(agent_imports)
    assert not circles, "packages in a circle:\n" + "\n".join("    " + ", ".join(sorted(c)) for c in circles)


def test_no_two_rooms_of_the_operator_side_import_each_other(agent_imports: list[Import]) -> None:
    cycles = package_cycles(agent_imports, FLEET)
    assert not cycles, "rooms of agent/fleet/ that import each other:\n" + "\n".join(
        f"{a} <-> {b}:\n" + "\n".join(f"    {imp}" for imp in imps) for (a, b), imps in cycles.items()
    )


def test_no_circle_through_rooms_of_the_operator_side(agent_imports: list[Import]) -> None:
    circles = package_circles(agent_imports, FLEET)
    assert not circles, "rooms of agent/fleet/ in a circle:\n" + "\n".join(
        "    " + ", ".join(sorted(c)) for c in circles
    )


def test_the_runtime_is_rooms_importing_one_way_each_with_its_purpose(agent_imports: list[Import]) -> None:
    runtime_dir = AGENT_DIR / "runtime"
    assert package_cycles(agent_imports, RUNTIME) == {}
    assert package_circles(agent_imports, RUNTIME) == []
    assert loose_modules(module_files(AGENT_DIR), RUNTIME) == [], "modules of agent/runtime/ outside a room"
    assert sorted(p.parent.name for p in runtime_dir.glob("*/__init__.py")) == sorted(RUNTIME_ROOMS)
    assert rooms_without_purpose(runtime_dir) == []
    assert rooms_without_purpose(runtime_dir / "slots") == []
    order = {f"{RUNTIME}.{room}": i for i, room in enumerate(RUNTIME_ROOMS)}
    upward = [imp for a, b, imp in _within(agent_imports, RUNTIME) if order[b] > order[a]]
    assert upward == [], "runtime rooms importing a room listed after them:\n" + "\n".join(map(str, upward))
    # Inside slots, what every slot runs (slots.models) builds on the slot, never the other way.
    inward = [
        imp
        for imp in agent_imports
        if imp.importer.count(".") == 3
        and imp.importer.startswith(f"{RUNTIME}.slots.")
        and imp.target.startswith(f"{RUNTIME}.slots.models")
    ]
    assert inward == [], "\n".join(map(str, inward))


def test_the_operator_side_is_all_rooms_each_with_its_purpose(agent_imports: list[Import]) -> None:
    fleet_dir = AGENT_DIR / "fleet"
    assert loose_modules(module_files(AGENT_DIR)) == [], "modules of agent/fleet/ outside a room"
    assert sorted(p.parent.name for p in fleet_dir.glob("*/__init__.py")) == sorted(FLEET_ROOMS)
    assert rooms_without_purpose(fleet_dir) == []
    # The listed order is one the real imports keep: a room imports only rooms listed before it.
    rank = {f"{FLEET}.{room}": n for n, room in enumerate(FLEET_ROOMS)}
    upward = [str(imp) for a, b, imp in _within(agent_imports, FLEET) if rank[b] > rank[a]]
    assert not upward, "imports of a room listed later in FLEET_ROOMS:\n" + "\n".join(upward)


def test_the_agent_is_rooms_listed_lowest_first_each_importing_only_rooms_below(
    agent_imports: list[Import],
) -> None:
    assert unlisted_rooms(AGENT_DIR) == [], (
        "top-level packages and modules missing from AGENT_ROOMS (or gone)"
    )
    upward = rooms_out_of_order(agent_imports)
    assert not upward, "imports of a room listed later in AGENT_ROOMS:\n" + "\n".join(upward)


def test_every_package_at_every_level_imports_one_way_and_says_its_purpose(
    agent_imports: list[Import],
) -> None:
    problems = rooms_importing_each_other(agent_imports, module_files(AGENT_DIR))
    assert not problems, "rooms that import each other:\n" + "\n".join(problems)
    assert packages_without_purpose(AGENT_DIR) == []


def test_no_package_holds_more_than_sixteen_modules() -> None:
    assert packages_too_full(AGENT_DIR) == []


def _drawn_rooms(doc: str) -> dict[str, str]:
    """The operator side's drawing in docs/architecture.md: each room's entry (its lines) by name."""
    drawing = doc.split("## The operator side", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    room = None
    for line in drawing.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if line.startswith(" ") and head.endswith("/") and not line.startswith("  "):
            room = head.rstrip("/")
            entries[room] = line
        elif room is not None and line.startswith("   ") and not line.strip().startswith("-"):
            entries[room] += " " + line.strip()
    return entries


def test_the_drawing_of_the_operator_side_names_every_room_and_module() -> None:
    doc = (AGENT_DIR.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    entries = _drawn_rooms(doc)
    assert sorted(entries) == sorted(FLEET_ROOMS)
    for room, text in entries.items():
        words = set(re.split(r"[\s(),;:]+", text))
        modules = {p.stem for p in (AGENT_DIR / "fleet" / room).glob("*.py") if p.stem != "__init__"}
        missing = sorted(modules - words)
        assert not missing, f"{room}/: modules missing from docs/architecture.md's drawing: {missing}"


def test_no_circle_between_files(agent_imports: list[Import]) -> None:
    cycles = file_cycles(agent_imports)
    assert not cycles, "circles between files:\n" + "\n".join("    " + ", ".join(sorted(c)) for c in cycles)


def test_configuration_imports_only_the_ground_floor(agent_imports: list[Import]) -> None:
    problems = ground_floor_violations(agent_imports, module_files(AGENT_DIR))
    assert not problems, "\n".join(problems)


def test_ground_floor_list_names_real_modules() -> None:
    assert set(module_files(AGENT_DIR)) >= GROUND_FLOOR
    assert {"agent.config"} <= set(module_files(AGENT_DIR))


def test_the_operator_side_imports_no_device_only_package(agent_imports: list[Import]) -> None:
    problems = device_imports_of_the_operator_side(agent_imports)
    assert not problems, "\n".join(problems)
    modules = set(module_files(AGENT_DIR))
    assert all(package in modules for package in DEVICE_ONLY)


def test_only_the_paho_core_imports_paho() -> None:
    problems = paho_importers(AGENT_DIR)
    assert not problems, "\n".join(problems)
    assert all((AGENT_DIR.parent / path).is_file() for path in PAHO_CORE)


def test_only_the_operator_side_imports_its_web_and_metrics_libraries() -> None:
    problems = operator_library_importers(AGENT_DIR)
    assert not problems, "\n".join(problems)
    assert all((AGENT_DIR.parent / path).is_file() for path in DEVICE_METRICS)


# --- each rule fails on a tree that breaks it -------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "agent"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text, encoding="utf-8")
    return root


def test_two_packages_importing_each_other_are_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "delivery/verify.py": "from agent.runtime.compat import check\n",
            "runtime/compat.py": "def check():\n    from agent.delivery import verify\n",
            "store.py": "import agent.delivery.verify\n",
        },
    )
    cycles = package_cycles(internal_imports(root))
    assert list(cycles) == [("agent.delivery", "agent.runtime")]
    assert {imp.where for imp in cycles[("agent.delivery", "agent.runtime")]} == {"module", "function"}


def test_a_top_level_module_is_its_own_package(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {"store.py": "from agent.delivery.errors import Bad\n", "delivery/errors.py": "import agent.store\n"},
    )
    assert list(package_cycles(internal_imports(root))) == [("agent.delivery", "agent.store")]


def test_a_circle_through_three_packages_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "delivery/jobs.py": "from agent.runtime.models import Models\n",
            "runtime/models.py": "from agent.engines.plan import Plan\n",
            "engines/plan.py": "def f():\n    from agent.delivery import jobs\n",
            "engines/spec.py": "",
        },
    )
    imports = internal_imports(root)
    assert package_cycles(imports) == {}  # no pair: only the circle rule sees it
    assert package_circles(imports) == [frozenset({"agent.delivery", "agent.runtime", "agent.engines"})]


def test_two_rooms_of_the_operator_side_importing_each_other_are_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "fleet/rollout/store.py": "from agent.fleet.controller.config import Config\n",
            "fleet/rollout/runner.py": "from agent.fleet.rollout.store import Store\n",
            "fleet/controller/config.py": "",
            "fleet/controller/process.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agent.fleet.rollout import runner\n"
            ),
            "fleet/cli/main.py": "from agent.fleet.controller.process import run\nimport agent.store\n",
            "store.py": "",
        },
    )
    imports = internal_imports(root)
    # The files make no circle and the top-level packages none either: only the rooms' rule fails.
    assert file_cycles(imports) == []
    assert package_cycles(imports) == {}
    cycles = package_cycles(imports, FLEET)
    assert list(cycles) == [("agent.fleet.controller", "agent.fleet.rollout")]
    assert {imp.where for imp in cycles[("agent.fleet.controller", "agent.fleet.rollout")]} == {
        "module",
        "type-checking",
    }
    assert package_circles(imports, FLEET) == [frozenset({"agent.fleet.controller", "agent.fleet.rollout"})]


def test_a_circle_through_three_rooms_and_a_loose_module_are_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "fleet/deploy/run.py": "from agent.fleet.devices.command import ask\n",
            "fleet/devices/command.py": "from agent.fleet.view.status import Row\n",
            "fleet/view/status.py": "def f():\n    from agent.fleet.deploy.run import Deploy\n",
            "fleet/helpers.py": "",
            "fleet/base/__init__.py": '"""What every room shares."""\n',
        },
    )
    imports = internal_imports(root)
    assert package_cycles(imports, FLEET) == {}
    assert package_circles(imports, FLEET) == [
        frozenset({"agent.fleet.deploy", "agent.fleet.devices", "agent.fleet.view"})
    ]
    assert loose_modules(module_files(root)) == ["agent.fleet.helpers"]
    assert rooms_without_purpose(root / "fleet") == ["deploy", "devices", "view"]


def test_a_circle_between_files_is_found_through_type_checking_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engines/worker.py": "from agent.engines import ort_builder\n",
            "engines/ort_builder.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agent.engines.plan import Plan\n"
            ),
            "engines/plan.py": "from . import worker\n",
            "engines/spec.py": "from .plan import Plan\n",
        },
    )
    imports = internal_imports(root)
    assert {imp.where for imp in imports if imp.importer == "agent.engines.ort_builder"} == {"type-checking"}
    assert file_cycles(imports) == [
        frozenset({"agent.engines.worker", "agent.engines.ort_builder", "agent.engines.plan"})
    ]


def test_configuration_importing_above_the_ground_floor_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "config/models.py": "from agent.engines.spec import BuildSpec\nfrom agent.errors import E\n",
            "config/loading.py": "def load():\n    from agent.mqtt.link import Link\n",
            "engines/spec.py": "from agent.engines.plan import Plan\n",
            "engines/plan.py": "",
            "mqtt/__init__.py": "from agent.mqtt.link import Link\n",
            "mqtt/settings.py": "",
            "mqtt/link.py": "",
            "errors.py": "",
        },
    )
    floor = frozenset({"agent.errors", "agent.engines.spec", "agent.mqtt.settings"})
    problems = ground_floor_violations(internal_imports(root), module_files(root), floor)
    assert problems == [
        "agent.config.loading:2 imports agent.mqtt.link (function level) (above the ground floor)",
        "agent.engines.spec:1 imports agent.engines.plan (module level) (above the ground floor)",
        "agent.mqtt:1 imports agent.mqtt.link (module level) (a ground-floor package file imports)",
    ]


def test_paho_outside_the_core_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "mqtt/link.py": "import paho.mqtt.client as mqtt\n",
            "fleet/watch.py": "def run():\n    from paho.mqtt.properties import Properties\n",
        },
    )
    assert paho_importers(root, frozenset({"agent/mqtt/link.py"})) == [
        "agent/fleet/watch.py:2 imports paho.mqtt.properties (function level)"
    ]


def test_operator_libraries_outside_the_operator_side_are_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "fleet/console.py": "import starlette\nimport prometheus_client\n",
            "telemetry/prometheus.py": "import prometheus_client\ndef f():\n  import prometheus_client.core",
            "telemetry/loop.py": "def f():\n    import uvicorn\n",
        },
    )
    assert operator_library_importers(root, frozenset({"agent/telemetry/prometheus.py"})) == [
        "agent/telemetry/loop.py:2 imports uvicorn (function level)",
        "agent/telemetry/prometheus.py:1 imports prometheus_client (module level)",
    ]


def test_an_operator_module_importing_a_device_package_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "fleet/deploy/plan.py": "import agent.protocol.manifest\nfrom agent.delivery.guard import G\n",
            "fleet/deploy/check.py": "def f():\n    from agent.engines import spec\n",
            "fleet/cli/deploy.py": "from agent.camera.fit import fits\n",
            "protocol/manifest.py": "",
            "delivery/guard.py": "",
            "engines/spec.py": "",
            "camera/fit.py": "",
            "runtime/slot.py": "from agent.engines.spec import S\n",
        },
    )
    imports = internal_imports(root)
    assert device_imports_of_the_operator_side(imports) == [
        "agent.fleet.cli.deploy:1 imports agent.camera.fit (module level)",
        "agent.fleet.deploy.check:2 imports agent.engines.spec (function level)",
        "agent.fleet.deploy.plan:2 imports agent.delivery.guard (module level)",
    ]


def test_a_room_importing_a_room_listed_above_it_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "camera/source.py": "from agent.runtime.slot import Slot\n",
            "runtime/slot.py": "from agent.errors import E\nfrom agent.camera.source import S\n",
            "errors.py": "",
        },
    )
    imports = internal_imports(root)
    rooms = ("errors", "camera", "runtime")
    assert rooms_out_of_order(imports, rooms, frozenset({"agent.errors"})) == [
        "agent.camera.source:1 imports agent.runtime.slot (module level)"
    ]
    assert unlisted_rooms(root, rooms) == []
    assert unlisted_rooms(root, ("errors", "camera")) == ["runtime"]


def test_a_full_package_a_room_without_purpose_and_sub_rooms_in_a_circle_are_found(tmp_path: Path) -> None:
    files = {f"engines/m{n}.py": "" for n in range(MAX_MODULES_PER_PACKAGE + 1)}
    files["runtime/slots/a.py"] = "from agent.runtime.frames.b import B\n"
    files["runtime/frames/b.py"] = "from agent.runtime.slots.a import A\n"
    root = _tree(tmp_path, files)
    (root / "engines" / "__init__.py").write_text('"""Engines."""\n', encoding="utf-8")
    assert packages_too_full(root) == [f"agent/engines/ holds {MAX_MODULES_PER_PACKAGE + 1} modules"]
    assert packages_without_purpose(root) == ["agent/runtime", "agent/runtime/frames", "agent/runtime/slots"]
    problems = rooms_importing_each_other(internal_imports(root), module_files(root))
    assert any(p.startswith("agent.runtime.frames <-> agent.runtime.slots") for p in problems), problems
