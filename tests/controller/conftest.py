"""Fixtures for controller tests (see helpers.py): `env` is a fresh inventory + workspace on the local
target whose runs are all stopped at teardown."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import INVENTORY, WORKLOAD, Env, cleanup


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    shutil.copy(WORKLOAD, tmp_path / "workload.py")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY.format(python=sys.executable))
    setup = Env(root=tmp_path, inventory=inventory, workspace=tmp_path / "ws")
    yield setup
    cleanup(setup.workspace)


@pytest.fixture
def decoy() -> Iterator[subprocess.Popen]:
    """A python3 started outside dflashops on the same target: it must survive every stop/restart."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.terminate()  # our own child, by pid
    proc.wait()
