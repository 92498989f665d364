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

# One compute thread per torch process, in the workers and every process they start (trainers, pre-flights,
# standbys, torchrun nodes: the environment reaches them all on the local target). The tests' tensors are tiny,
# and two xdist workers plus their children already share the machine's cores: torch's default of one OpenMP
# thread per core made each process spin on its own thread pool while the others held the cores. Measured on 2
# loaded cores: a 60-step tiny `trainer train` took 5-20 CPU-s with the default and 4.4-5.9 with one thread, in
# the same or less wall time (issue 29 item 11). A test that sets its own value keeps it.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")


@pytest.fixture(autouse=True)
def no_cache_dir_set_by_torch() -> Iterator[None]:
    for name, value in STARTED_WITH.items():
        if value is None:
            os.environ.pop(name, None)
    yield
