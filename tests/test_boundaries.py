"""The import boundaries of docs/architecture.md#boundaries, checked on the source (AST), so a violation fails
before it ships.

- `trainer` never imports `dflashops`; `dflashops` never imports `trainer` or `torch`.
- Inside dflashops the layers run cli -> playbook -> ops -> transport: each imports only its own layer or
  lower ones, and cli/playbook reach targets through ops only (never transport or the agent's code). Library modules (errors, shell, inventory, lineage*, agent) import no layer above transport.
- Only dflashops/transport/ touches subprocess, fabric, paramiko or libtmux (the agent's package
  `dflashops/agent/` is the exception: it runs inside the target); it imports the standard library and itself
  only, and the two programs of it that are sent alone (supervisor.py, doctor_probe.py) the standard library only.
Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are skipped.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"transport": 0, "ops": 1, "playbook": 2, "cli": 3}
PROCESS_MODULES = {"subprocess", "fabric", "paramiko", "invoke", "libtmux"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every runtime import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
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


ENTRY_POINTS = {"dflashops.__main__", "dflashops.demo"}  # programs, not libraries: they sit on top like cli


def runs_in_target(module: str) -> bool:
    """The agent's package (its zipapp, and the doctor probe and supervisor sent alone): stdlib only, may spawn."""
    return module == "dflashops.agent" or module.startswith("dflashops.agent.")


SENT_ALONE = {"dflashops.agent.supervisor", "dflashops.agent.doctor_probe"}  # uploaded or piped as one file


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
        "from dflashops.inventory import Target\nfrom . import core\n"
    )
    (fake / "dflashops" / "agent" / "supervisor.py").write_text("import os\nfrom dflashops.agent import core\n")
    (fake / "trainer" / "z.py").write_text("from dflashops import shell\n")
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
        "stop.py:1 the agent must be stdlib-only, imports dflashops.inventory",
        "supervisor.py:2 the agent must be stdlib-only, imports dflashops.agent",
        "z.py:1 trainer imports dflashops",
        "probe.py:2 the agent must be stdlib-only",
        "w.py:1 dflashops.cli.w reaches past ops into dflashops.transport.local",
        "w.py:2 dflashops.cli.w reaches past ops into dflashops.agent",
    ):
        assert expected in found
    assert "ok.py" not in found and "probe.py:1" not in found  # shipped programs may spawn
    assert "core.py:2" not in found and "stop.py:2" not in found  # the package may import itself


def agent_circles(root: Path) -> list[list[str]]:
    """Import circles among the agent's modules (module-level and function-level imports alike), each as the
    path of modules that closes it. The zipapp runs whatever the controller's tests ran, so a circle that works
    by import order here would work there too; it is refused for the reader's sake (the package reads bottom-up:
    common, then wrap, ..., restart, and __main__ on top)."""
    modules = {module_name(path): path for path in sorted((root / "dflashops" / "agent").glob("*.py"))}
    graph = {
        me: sorted({name for name, _ in imports_of(path) if name in modules and name != me})
        for me, path in modules.items()
    }
    circles, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            circles.append([*path[path.index(module) :], module])
            return
        if module in done:
            return
        for name in graph[module]:
            walk(name, [*path, module])
        done.add(module)

    for module in graph:
        walk(module, [])
    return circles


def test_the_agent_package_has_no_import_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert agent_circles(REPO) == []
    fake = tmp_path / "repo"
    (fake / "dflashops" / "agent").mkdir(parents=True)
    (fake / "dflashops" / "agent" / "stop.py").write_text("from .status import run_status\n")
    (fake / "dflashops" / "agent" / "status.py").write_text("def f():\n    from dflashops.agent import stop\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    assert agent_circles(fake) in (
        [["dflashops.agent.stop", "dflashops.agent.status", "dflashops.agent.stop"]],
        [["dflashops.agent.status", "dflashops.agent.stop", "dflashops.agent.status"]],
    )
