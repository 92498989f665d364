"""A REAL full disk for trainer tests: a small tmpfs per test, and a filler that writes until ENOSPC.

Mounting needs root: `needs_root` skips a module's tests with that reason otherwise. The `small_disk` fixture
(conftest.py) mounts one per call. Shared by
test_disk_full.py (checkpoint writes, issue 15 item 7) and test_disk_full_records.py (status, metrics and
train_config writes, issue 27 item 8).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tiny trainer on CPU, small enough that a step takes milliseconds, one metrics line per step.
SMALL = [
    "--preset",
    "tiny",
    "--synthetic-samples",
    "48",
    "--max-seq-len",
    "32",
    "--token-budget",
    "128",
    "--wandb",
    "off",
    "--log-interval",
    "1",
]
TRAINER_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full disk) needs root")


def mount_tmpfs(path: Path, size_kb: int) -> None:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def fill(disk: Path, name: str = "filler") -> Path:
    """Write a filler file until the filesystem is really full (ENOSPC); return it."""
    filler = disk / name
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # unbuffered: nothing left to flush at close
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler
