"""Fixtures for playbook tests: C1's throwaway local-target inventory (tests/controller/helpers.py) and a
helper that writes playbook files into tmp_path."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import INVENTORY, WORKLOAD, Env, cleanup

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    shutil.copy(WORKLOAD, tmp_path / "workload.py")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY.format(python=sys.executable))
    setup = Env(root=tmp_path, inventory=inventory, workspace=tmp_path / "ws")
    yield setup
    cleanup(setup.workspace)


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, str], Path]:
    """write(name, yaml_text) -> path of a playbook file in tmp_path."""

    def make(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return make
