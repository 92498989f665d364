"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.trainer.full_disk import mount_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """`small_disk(size_kb)` -> the mount point of a fresh tmpfs of that size; unmounted at teardown."""
    mounted: list[Path] = []

    def make(size_kb: int) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        mount_tmpfs(path, size_kb)
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)
