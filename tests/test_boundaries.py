"""The import boundaries of docs/architecture.md#boundaries, checked on the source (AST), so a violation fails
before it ships.

- `trainer` never imports `dflashops`; `dflashops` never imports `trainer` or `torch`.
- Inside dflashops the layers run cli -> playbook -> ops -> transport: each imports only its own layer or
  lower ones, and cli/playbook reach targets through ops only (never transport or the agent's code).
  `python -m dflashops` (dflashops/__main__.py) sits on top with cli. The library packages (core/: errors,
  shell, inventory*, yaml_files; lineage/; agent/) import no layer above transport.
- Only dflashops/transport/ touches subprocess, fabric, paramiko or libtmux (the agent's package
  `dflashops/agent/` is the exception: it runs inside the target); it imports the standard library and itself
  only, and the program of it that is sent alone (doctor_probe.py, the doctor's probe) the standard library only.
Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are skipped by these layer checks.
- No import circle in dflashops or trainer (the agent's package included): here every import counts (module
  level, inside a function, under `if TYPE_CHECKING:`), because a reader who follows one must not come back where
  they started.
- The folders of trainer and of dflashops are their layers: no two packages of either import each other (nor
  any circle of packages), and the pictures of docs/architecture.md#the-trainer-top-to-bottom and
  docs/architecture.md#the-controller-top-to-bottom list every module of each (a package's __init__.py aside),
  each importing only modules on its own line or a later one.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"transport": 0, "ops": 1, "playbook": 2, "cli": 3}
PROCESS_MODULES = {"subprocess", "fabric", "paramiko", "invoke", "libtmux"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _parsed(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def parse(path: Path) -> ast.Module:
    """The file's AST, parsed once per content: six checks read the same ~1.8 MB of sources (each parse of all of
    them ~0.8 CPU-s; bench/results/tests-speed.md, 2026-12-06 "The suite on a shared machine: duplicated work
    removed"). Keyed by the text read now, so an edited file (or the synthetic trees) is parsed afresh; nothing
    changes a tree."""
    return _parsed(path.read_text(encoding="utf-8"), str(path))


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every runtime import in the file; relative imports resolved."""
    tree = parse(path)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


ENTRY_POINTS = {"dflashops.__main__"}  # the program `python -m dflashops` runs: it sits on top like cli


def runs_in_target(module: str) -> bool:
    """The agent's package (its zipapp, and the doctor probe sent alone): stdlib only, may spawn."""
    return module == "dflashops.agent" or module.startswith("dflashops.agent.")


SENT_ALONE = {"dflashops.agent.doctor_probe"}  # piped to the target's python3 alone, as one file


def agent_may_import(module: str, name: str) -> bool:
    """The standard library, and (except for a program sent alone) the agent's own package."""
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return True
    return module not in SENT_ALONE and (name == "dflashops.agent" or name.startswith("dflashops.agent."))


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "dflashops" or len(parts) < 2:
        return None
    if module in ENTRY_POINTS:
        return LAYERS["cli"]
    return LAYERS.get(parts[1])


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def violations() -> list[str]:
    found = []
    for path in sources("trainer"):
        for name, line in imports_of(path):
            if name.split(".")[0] == "dflashops":
                found.append(f"{path.relative_to(REPO)}:{line} trainer imports {name}")
    for path in sources("dflashops"):
        me = module_name(path)
        my_layer = layer_of(me)
        for name, line in imports_of(path):
            top = name.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line}"
            if top in ("torch", "trainer"):
                found.append(f"{where} dflashops imports {name}")
            if top in PROCESS_MODULES and my_layer != 0 and not runs_in_target(me):
                found.append(f"{where} only dflashops.transport may import {top}")
            if runs_in_target(me) and not agent_may_import(me, name):
                found.append(f"{where} the agent must be stdlib-only, imports {name}")
            if (
                my_layer is not None
                and my_layer >= LAYERS["playbook"]
                and (
                    name.startswith("dflashops.transport")
                    or name == "dflashops.agent"
                    or name.startswith("dflashops.agent.")
                    or name == "dflashops.agent_client"
                )
            ):
                found.append(f"{where} {me} reaches past ops into {name}")  # cli/playbook go through ops
            their_layer = layer_of(name)
            if their_layer is None:
                continue
            ceiling = my_layer if my_layer is not None else 0  # library modules sit beside transport
            if their_layer > ceiling:
                found.append(f"{where} {me} imports the higher layer {name}")
    return found


def test_import_boundaries_hold() -> None:
    assert violations() == []


def test_the_checker_catches_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself must be able to fail: plant each kind of violation in a copy of the tree."""
    fake = tmp_path / "repo"
    (fake / "dflashops" / "transport").mkdir(parents=True)
    (fake / "dflashops" / "ops").mkdir()
    (fake / "trainer").mkdir()
    (fake / "dflashops" / "transport" / "x.py").write_text("from dflashops.ops import deploy\n")
    (fake / "dflashops" / "ops" / "y.py").write_text("import torch\nimport subprocess\nfrom ..cli import main\n")
    (fake / "dflashops" / "agent").mkdir()
    (fake / "dflashops" / "agent" / "core.py").write_text("import yaml\nfrom dflashops.agent import stop\n")
    (fake / "dflashops" / "agent" / "probe.py").write_text("import subprocess\nimport rich\n")
    (fake / "dflashops" / "agent" / "stop.py").write_text(
        "from dflashops.core.inventory import Target\nfrom . import core\n"
    )
    (fake / "dflashops" / "agent" / "doctor_probe.py").write_text("import os\nfrom dflashops.agent import core\n")
    (fake / "trainer" / "z.py").write_text("from dflashops.core import shell\n")
    (fake / "dflashops" / "cli").mkdir()
    (fake / "dflashops" / "cli" / "w.py").write_text(
        "from dflashops.transport.local import LocalTransport\nfrom dflashops.agent import verb_status\n"
    )
    (fake / "dflashops" / "ops" / "ok.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflashops.cli import main\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    found = "\n".join(violations())
    for expected in (
        "x.py:1 dflashops.transport.x imports the higher layer dflashops.ops",
        "y.py:1 dflashops imports torch",
        "y.py:2 only dflashops.transport may import subprocess",
        "y.py:3 dflashops.ops.y imports the higher layer dflashops.cli",
        "core.py:1 the agent must be stdlib-only",
        "stop.py:1 the agent must be stdlib-only, imports dflashops.core.inventory",
        "doctor_probe.py:2 the agent must be stdlib-only, imports dflashops.agent",
        "z.py:1 trainer imports dflashops",
        "probe.py:2 the agent must be stdlib-only",
        "w.py:1 dflashops.cli.w reaches past ops into dflashops.transport.local",
        "w.py:2 dflashops.cli.w reaches past ops into dflashops.agent",
    ):
        assert expected in found
    assert "ok.py" not in found and "probe.py:1" not in found  # shipped programs may spawn
    assert "core.py:2" not in found and "stop.py:2" not in found  # the package may import itself


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in ("dflashops", "trainer") for path in sources(package)}


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}, for every import: module level, inside a function,
    under `if TYPE_CHECKING:` (an annotation import is still a circle for a reader). `from pkg import name`
    counts pkg.name when that is a module, else pkg (its __init__); a submodule's implicit import of its
    package's __init__ (Python runs it first) is not an edge, or every package would be a circle."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for me, path in modules.items():
        tree = parse(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            names: list[str] = []
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for name in names:
                if name in modules and name != me:
                    edges.setdefault(name, node.lineno)
        graph[me] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import circle, each named once as `a -> b -> ... -> a` (started at its smallest module): for each
    edge a -> b, the shortest way back from b to a (breadth first), if there is one."""
    found: set[tuple[str, ...]] = set()
    for start, edges in graph.items():
        for first in edges:
            came_from = {first: start}  # module -> the one it was reached from
            frontier = [first]
            while frontier and start not in came_from:
                reached = []
                for module in frontier:
                    for nxt in graph.get(module, {}):
                        if nxt not in came_from:
                            came_from[nxt] = module
                            reached.append(nxt)
                frontier = reached
            if start not in came_from:
                continue
            loop = [start]
            while loop[-1] != first:
                loop.append(came_from[loop[-1]])
            loop = [start, *reversed(loop[1:])]  # start -> first -> ... -> the module that imports start
            turn = loop.index(min(loop))
            found.add(tuple(loop[turn:] + loop[:turn]))
    return sorted(" -> ".join([*loop, loop[0]]) for loop in found)


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(found)


def test_the_circle_check_finds_circles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The circle check must be able to fail: a synthetic tree with a lazy circle, an annotation-only circle
    and a three-module one; a package __init__ and its submodule (the implicit import) are not one."""
    fake = tmp_path / "repo"
    (fake / "dflashops" / "ops").mkdir(parents=True)
    (fake / "trainer").mkdir()
    (fake / "dflashops" / "__init__.py").write_text("")
    (fake / "dflashops" / "ops" / "__init__.py").write_text("from dflashops.ops.c import VALUE\n")
    (fake / "dflashops" / "ops" / "a.py").write_text("def f():\n    from dflashops.ops import b\n")
    (fake / "dflashops" / "ops" / "b.py").write_text("from . import a\n")
    (fake / "dflashops" / "ops" / "c.py").write_text("VALUE = 1\n")
    (fake / "trainer" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.y import Y\n"
    )
    (fake / "trainer" / "y.py").write_text("import trainer.x\n")
    (fake / "trainer" / "p.py").write_text("from trainer import q\n")
    (fake / "trainer" / "q.py").write_text("from trainer.r import thing\n")
    (fake / "trainer" / "r.py").write_text("import trainer.p\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    assert circles(import_graph()) == [
        "dflashops.ops.a -> dflashops.ops.b -> dflashops.ops.a",
        "trainer.p -> trainer.q -> trainer.r -> trainer.p",
        "trainer.x -> trainer.y -> trainer.x",
    ]


def ops_picture() -> list[list[str]]:
    """The ops modules of docs/architecture.md#the-ops-layer-top-to-bottom, one list per line of its block."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## The ops layer, top to bottom", 1)[1].split("```", 2)[1]
    return [
        ["dflashops.ops." + word[:-3].replace("/", ".") for word in line.split() if word.endswith(".py")]
        for line in block.splitlines()
        if line.strip()
    ]


def picture_violations(
    picture: list[list[str]], graph: dict[str, dict[str, int]], where: str = "dflashops/ops"
) -> list[str]:
    """Each module of the picture imports only modules listed on a later line (or on its own line, for the
    row of leaves); a module of the picture that does not exist is named too."""
    found = []
    for row, line in enumerate(picture):
        below = {module for later in picture[row:] for module in later}
        listed = {module for every in picture for module in every}
        for module in line:
            if module not in graph:
                found.append(f"{module} is in the picture but not in {where}")
                continue
            for imported in graph[module]:
                if imported in listed and imported not in below:
                    found.append(f"{module} imports {imported}, drawn above it")
    return found


def test_the_ops_picture_of_architecture_md_holds() -> None:
    picture = ops_picture()
    assert len(picture) >= 5 and all(picture)
    assert picture_violations(picture, import_graph()) == []


def test_the_ops_picture_check_can_fail() -> None:
    graph = {"dflashops.ops.a": {"dflashops.ops.b": 1}, "dflashops.ops.b": {}}
    assert picture_violations([["dflashops.ops.b"], ["dflashops.ops.a"]], graph) == [
        "dflashops.ops.a imports dflashops.ops.b, drawn above it"
    ]
    assert picture_violations([["dflashops.ops.c"]], graph) == [
        "dflashops.ops.c is in the picture but not in dflashops/ops"
    ]


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package's __init__, else its folder."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def package_graph(graph: dict[str, dict[str, int]], root: str) -> dict[str, dict[str, str]]:
    """package -> {package it imports: the first module edge that makes it}, for the packages under `root`."""
    modules = project_modules()  # once: a walk of both trees per edge was most of this file's CPU (2.6 of ~7 s)
    packages: dict[str, dict[str, str]] = {}
    for module, edges in graph.items():
        if not module.startswith(root):
            continue
        mine = package_of(module, modules)
        packages.setdefault(mine, {})
        for imported in edges:
            theirs = package_of(imported, modules)
            if imported.startswith(root) and theirs != mine:
                packages[mine].setdefault(theirs, f"{module} -> {imported}")
    return packages


def two_way_edges(packages: dict[str, dict[str, str]]) -> list[str]:
    """Each pair of packages that import each other, once, with one module edge each way."""
    return sorted(
        f"{a} <-> {b} ({edges[b]}; {packages[b][a]})"
        for a, edges in packages.items()
        for b in edges
        if a < b and a in packages.get(b, {})
    )


@pytest.mark.parametrize("root", ["trainer", "dflashops"])
def test_packages_are_layers(root: str) -> None:
    packages = package_graph(import_graph(), root)
    assert len(packages) >= 10, sorted(packages)  # the scan reads the packages
    assert two_way_edges(packages) == []
    found = circles({package: dict.fromkeys(edges, 1) for package, edges in packages.items()})
    assert found == [], "package circles:\n" + "\n".join(found)


@pytest.mark.parametrize("root", ["trainer", "dflashops"])
def test_the_package_check_can_fail(root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted two-way edge (a function-level import back up) and a three-package circle are found; a
    package's __init__ importing its own modules is no edge."""
    fake = tmp_path / "repo"
    for folder in ("low", "high", "a", "b", "c"):
        (fake / root / folder).mkdir(parents=True)
        (fake / root / folder / "__init__.py").write_text("")
    (fake / root / "__init__.py").write_text("")
    (fake / root / "low" / "__init__.py").write_text(f"from {root}.low import base\n")
    (fake / root / "low" / "base.py").write_text(f"def f():\n    from {root}.high import top\n")
    (fake / root / "high" / "top.py").write_text(f"from {root}.low import base\n")
    (fake / root / "a" / "x.py").write_text(f"import {root}.b.y\n")
    (fake / root / "b" / "y.py").write_text(f"from {root}.c import z\n")
    (fake / root / "c" / "z.py").write_text(f"from {root}.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    packages = package_graph(import_graph(), root)
    assert two_way_edges(packages) == [
        f"{root}.high <-> {root}.low ({root}.high.top -> {root}.low.base; {root}.low.base -> {root}.high.top)"
    ]
    assert circles({package: dict.fromkeys(edges, 1) for package, edges in packages.items()}) == [
        f"{root}.a -> {root}.b -> {root}.c -> {root}.a",
        f"{root}.high -> {root}.low -> {root}.high",
    ]


def test_the_package_check_finds_a_program_beside_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape dflashops once had: `python -m dflashops` (dflashops/__main__.py) imports the CLI, and the CLI
    imports errors.py from the same folder, so that folder is both the top and the bottom."""
    fake = tmp_path / "repo"
    (fake / "dflashops" / "cli").mkdir(parents=True)
    (fake / "dflashops" / "__init__.py").write_text("")
    (fake / "dflashops" / "__main__.py").write_text("from dflashops.cli.main import main\n")
    (fake / "dflashops" / "errors.py").write_text("class DflashopsError(Exception): ...\n")
    (fake / "dflashops" / "cli" / "__init__.py").write_text("")
    (fake / "dflashops" / "cli" / "main.py").write_text("from dflashops.errors import DflashopsError\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    assert two_way_edges(package_graph(import_graph(), "dflashops")) == [
        "dflashops <-> dflashops.cli (dflashops.__main__ -> dflashops.cli.main; dflashops.cli.main -> dflashops.errors)"
    ]


def package_picture(heading: str) -> list[list[str]]:
    """The modules of the block under `heading` in docs/architecture.md, one list per line of it (a line is a
    folder, then its modules)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split(f"## {heading}", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        if not line.strip():
            continue
        folder, *files = line.split()
        package = folder.strip("/").replace("/", ".")
        rows.append([f"{package}.{name[:-3]}" for name in files if name.endswith(".py")])
    return rows


def missing_from_picture(picture: list[list[str]], root: str) -> list[str]:
    """The modules under `root` (a package's __init__ aside) that the picture does not list."""
    listed = {module for row in picture for module in row}
    modules = [m for m, path in project_modules().items() if m.split(".")[0] == root and path.name != "__init__.py"]
    return sorted(set(modules) - listed)


PICTURES = {"trainer": "The trainer, top to bottom", "dflashops": "The controller, top to bottom"}


@pytest.mark.parametrize("root", sorted(PICTURES))
def test_the_package_picture_of_architecture_md_holds(root: str) -> None:
    picture = package_picture(PICTURES[root])
    graph = import_graph()
    assert len(picture) >= 10 and all(picture)
    listed = [module for row in picture for module in row]
    assert missing_from_picture(picture, root) == [], f"{root} modules missing from the picture"
    assert len(listed) == len(set(listed)), "a module drawn twice"
    assert picture_violations(picture, graph, root) == []


def test_the_package_picture_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module left off the picture is named, and so is one drawn above a module it imports."""
    fake = tmp_path / "repo"
    (fake / "dflashops" / "cli").mkdir(parents=True)
    (fake / "dflashops" / "__init__.py").write_text("")
    (fake / "dflashops" / "__main__.py").write_text("from dflashops.cli import main\n")
    (fake / "dflashops" / "cli" / "__init__.py").write_text("")
    (fake / "dflashops" / "cli" / "main.py").write_text("")
    (fake / "dflashops" / "cli" / "demo.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    picture = [["dflashops.cli.main"], ["dflashops.__main__"]]
    assert missing_from_picture(picture, "dflashops") == ["dflashops.cli.demo"]
    assert picture_violations(picture, import_graph(), "dflashops") == [
        "dflashops.__main__ imports dflashops.cli.main, drawn above it"
    ]
