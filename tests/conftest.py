"""Session-wide hygiene for tests that share one pytest process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# torch writes its default cache folders into os.environ the first time anything in a process compiles
# (TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_<user>). A trainer test that compiles in-process would then hand
# that variable to every later local-target job as if a user had set it by hand, and the job would skip the
# compile cache dflashops chose for it (trainer.CACHE_DIR_SET_BY_HAND). Only what the session started with
# counts as set by hand.
TORCH_SETS_ITSELF = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
STARTED_WITH = {name: os.environ.get(name) for name in TORCH_SETS_ITSELF}

# The CLI's tables and trees use COLUMNS when stdout is not a terminal (else their wide default): a width left by
# the shell or by pytest-xdist's workers (80) would wrap them differently from run to run. Tests that care about a
# width set their own.
os.environ.pop("COLUMNS", None)


@pytest.fixture(autouse=True)
def no_cache_dir_set_by_torch() -> Iterator[None]:
    for name, value in STARTED_WITH.items():
        if value is None:
            os.environ.pop(name, None)
    yield
