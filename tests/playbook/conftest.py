"""Fixtures for playbook tests: C1's throwaway local-target inventory (tests/controller/helpers.py) and a
helper that writes playbook files into tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.controller.conftest import env  # noqa: F401 - the same throwaway local target as the controller tests

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, str], Path]:
    """write(name, yaml_text) -> path of a playbook file in tmp_path."""

    def make(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return make
