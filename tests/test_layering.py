"""The folders' dependency direction, read from the source: no cycle, no import upwards.

Every import of a hybridkv module counts, those under ``TYPE_CHECKING`` and those inside
functions too: a name imported only for a type is still a dependency a reader follows.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Folder -> the folders its modules may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "policies": {"errors"},
    "memory": {"errors", "policies"},
    "kernels": {"errors"},
    "scheduler": {"errors", "policies", "memory"},
    # Architectures read the layer specs they are described by (memory.layout,
    # memory.state_pages' step states) and the policies in them, never the engine.
    "models": {"errors", "policies", "memory", "kernels"},
    "executor": {"errors", "policies", "memory", "kernels", "models", "scheduler"},
    "parallel": {"errors", "policies", "memory", "kernels", "models", "executor", "scheduler"},
    "serving": {
        "errors", "policies", "memory", "kernels", "models", "executor", "parallel", "scheduler",
    },
    # The test helpers sit on top: fakes, the sampler, the server, the policy laws.
    "testing": {
        "errors", "policies", "memory", "kernels", "models", "executor", "parallel", "scheduler",
        "serving",
    },
}  # fmt: skip

#: The scheduler modules an executor may see: the protocol and the sampling params.
EXECUTOR_SEES = {
    "hybridkv.scheduler.batch",
    "hybridkv.scheduler.params",
    "hybridkv.scheduler.outputs",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder in ALLOWED:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("hybridkv", *parts))] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> Iterator[str]:
    """The hybridkv modules ``path`` imports (a name imported from a package that is a
    module of its own counts as that module)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridkv"):
            assert node.module is not None
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                yield name if name in MODULES else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("hybridkv"))


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        deps = set()
        for name in _imports(path):
            while name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


GRAPH = _graph()


def _folder(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folders_import_only_downwards(folder: str) -> None:
    """Each folder imports only the folders below it in the dependency direction."""
    wrong = sorted(
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        if _folder(module) == folder
        for dep in deps
        if _folder(dep) != folder and _folder(dep) not in ALLOWED[folder]
    )
    assert not wrong


def test_executor_and_parallel_see_only_the_scheduler_protocol() -> None:
    """The executor implements the scheduler's protocol and reads sampling params: no
    other scheduler module (the core, the engine, the planner) is visible to it."""
    wrong = sorted(
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        if _folder(module) in ("executor", "parallel")
        for dep in deps
        if _folder(dep) == "scheduler" and dep not in EXECUTOR_SEES
    )
    assert not wrong


def test_no_module_imports_itself_through_others() -> None:
    """No cycle of imports, also not inside a folder (Tarjan's strongly connected parts)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles


#: serving/'s rooms, each importing only those after it.
SERVING_ORDER = ("cli", "router", "http", "openai", "metrics")


def _serving_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["hybridkv", "serving"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SERVING_ORDER else None


def test_serving_rooms_import_only_downwards() -> None:
    """Inside serving/: cli -> router -> http -> openai -> metrics, so that the protocol
    never reaches for HTTP and the front end never reaches for the command line."""
    rank = {room: i for i, room in enumerate(SERVING_ORDER)}
    wrong = sorted(
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        if (room := _serving_room(module)) is not None
        for dep in deps
        if (other := _serving_room(dep)) is not None and rank[other] < rank[room]
    )
    assert not wrong


def test_every_serving_module_is_in_a_room() -> None:
    """No module sits loose in serving/ besides the package and its old-path finder."""
    loose = sorted(
        m
        for m in MODULES
        if m.startswith("hybridkv.serving.")
        and _serving_room(m) is None
        and m != "hybridkv.errors.moved"
    )
    assert not loose


def _top_level_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [(node.module or "").split(".")[0]]
    return []


@pytest.mark.parametrize("folder", ["memory", "policies"])
def test_the_allocator_imports_no_torch(folder: str) -> None:
    """memory/ and policies/ stay pure Python, so the allocator and its tests are fast."""
    users = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if "torch" in _top_level_names(node)
    )
    assert not users


def test_no_library_module_is_over_400_lines() -> None:
    """One concept per module: none grows past the ceiling of the style guide."""
    long = sorted(
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > 400
    )
    assert not long
