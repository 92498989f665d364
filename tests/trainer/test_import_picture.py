"""The trainer's import picture, read from the source (AST): one loop, engines below it, no circle.

- No import circle (module-level or lazy) passes through the entry point, the loop, the pre-flight or any
  engine (trainer.train, loop, engine, preflight, single_engine, pipeline.*, dist.*).
- The loop imports no engine; the engines and the pre-flight never import trainer.train (the entry point).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINING = (
    "trainer.train",
    "trainer.training.loop",
    "trainer.training.engine",
    "trainer.training.preflight",
    "trainer.training.single_engine",
    "trainer.pipeline",
    "trainer.dist",
)
ENGINES = ("trainer.training.single_engine", "trainer.pipeline", "trainer.dist")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / "trainer").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
                deps |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_import_circle_passes_through_the_loop_or_an_engine() -> None:
    graph = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(path: list[str]) -> None:  # depth first; path[-1] is being visited, path the way to it
        state[path[-1]] = 1
        for dep in sorted(graph[path[-1]]):
            if state.get(dep) == 1:  # back to a module on the path: a circle
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit([*path, dep])
        state[path[-1]] = 2

    for module in sorted(graph):
        if module not in state:
            visit([module])
    assert [c for c in circles if any(_in(m, TRAINING) for m in c)] == []


def test_the_loop_imports_no_engine_and_no_engine_imports_the_entry_point() -> None:
    graph = _graph()
    assert not [d for d in graph["trainer.training.loop"] | graph["trainer.training.engine"] if _in(d, ENGINES)]
    offenders = [
        m
        for m, deps in graph.items()
        if (_in(m, ENGINES) or m == "trainer.training.preflight") and "trainer.train" in deps
    ]
    assert offenders == []
