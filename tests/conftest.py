"""Session-wide hygiene for tests that share one pytest process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch writes its default cache folders into os.environ the first time anything in a process compiles
# (TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_<user>). A trainer test that compiles in-process would then hand
# that variable to every later local-target job as if a user had set it by hand, and the job would skip the
# compile cache dflashops chose for it (trainer.core.process_start.CACHE_DIR_SET_BY_HAND). Only what the session started with
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

# Inductor compiles in the process that asked, not in a pool of its own: with one core per worker its default (one
# compile process per core, each a new interpreter importing torch) started two more torch imports per compiling
# process, four workers at once, on a fresh clone's empty cache (issue 45 item 6). The kernels are the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# And its C++ at -O0 (with -g) instead of -O3: the tests' tensors are tiny, the g++ runs are what a cold cache pays.
# test_compile_scope.py's Inductor test with an empty cache: 65.3 s at -O3 (load ~5), 43.8 s at -O0 (load ~3.5);
# 220 s at -O3 beside another worker at load 7-17 (bench/results/tests-speed.md, 2026-12-06 "The suite's cold compiles on a busy 2-core machine"). The losses still match eager.
os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")


@pytest.fixture(autouse=True)
def no_cache_dir_set_by_torch() -> Iterator[None]:
    for name, value in STARTED_WITH.items():
        if value is None:
            os.environ.pop(name, None)
    yield


# The files that kept a worker busiest (the sum of their tests' wall seconds, `make test`'s arguments with three
# workers and `--durations=0`, bench/results/tests-speed.md 2026-12-05 "make test's CPU with four workers", the machine shared: load average 7.4 at the start, ~3 at
# the end), longest first. With `--dist loadfile` a worker takes the next file when its own run dry, and xdist's
# default order (most tests first) started these late: the suite ended on a 50-80 s file while the other workers
# had finished. Running the longest first (LPT scheduling) leaves the short files for the end. A stale entry costs
# nothing but balance: a missing file is skipped, a new slow file runs in the default order.
LONGEST_FIRST = (
    "tests/trainer/test_real_world.py",  # the real model: conversion, regeneration, train, eval (~150 s idle)
    "tests/trainer/test_distributed.py",  # 165 s
    "tests/controller/test_ctl_concurrency.py",  # 160
    "tests/trainer/test_bench.py",  # 131
    "tests/controller/test_ctl_handover.py",  # 59
    "tests/controller/test_ctl_compile_cache.py",  # 54
    "tests/controller/test_supervisor_local.py",  # 49
    "tests/trainer/test_loss_triton.py",  # 49
    "tests/controller/test_ctl_preflight.py",  # 42
    "tests/remote/test_fanout.py",  # 41
    "tests/trainer/test_demo.py",  # 40
    "tests/remote/test_multinode_remote.py",  # 39
    "tests/trainer/test_compile_cache_artifacts.py",  # 34
    "tests/controller/test_ctl_reliability.py",  # 31
    "tests/remote/test_restart_remote.py",  # 27
    "tests/controller/test_ctl_lifecycle.py",  # 27
    "tests/controller/test_notify_local.py",  # 23
    "tests/remote/test_mux.py",  # 22
    "tests/controller/test_ctl_standby.py",  # 21
    "tests/trainer/test_checkpoint.py",  # 21
    "tests/trainer/test_compile_scope.py",  # 20
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in LONGEST_FIRST order, then the others by their number of tests (xdist's own default, which the
    Makefile turns off with --no-loadscope-reorder so this order reaches the workers); a file's tests keep their
    order. The same order in every worker: xdist checks that all collected the same list."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    files = sorted(by_file, key=lambda path: (rank.get(path, len(rank)), -len(by_file[path])))
    items[:] = [item for path in files for item in by_file[path]]


# No process of the suite may outlive it. The runs, standbys and multiplexers the tests start live in sessions of
# their own (setsid, as every dflashops run), so a test that dies early (a timeout's SIGKILL) leaves them running,
# reparented to PID 1: four restart-cycle bench runs were found training 36 min after a `make test` (issue 45 item
# 6). At the end of the whole session (xdist's controller, after every worker), any orphan started during the
# session by this checkout's interpreter is named, and fails the session, after a grace for those that exit by
# themselves (a retired standby, an idle multiplexer asked to stop).
ORPHAN_GRACE_S = 30.0
SESSION_STARTED = time.time()


def suite_orphans() -> list[str]:
    """`PID: command line` of every process whose parent is PID 1, started since SESSION_STARTED, running this
    checkout's interpreter (its path on the command line)."""
    boot = next(
        float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
    )
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        started = boot + int(stat[19]) / ticks  # field 22 of stat; the fields after ")" start at field 3
        if stat[1] == "1" and started >= SESSION_STARTED and argv[0].decode(errors="replace") == sys.executable:
            found.append(f"{entry}: {b' '.join(argv).decode(errors='replace')[:300]}")
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or sys.platform != "linux":  # a worker: its controller checks
        return
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (left := suite_orphans()) and time.monotonic() < deadline:
        time.sleep(1.0)
    if left:
        print(f"\nerror: {len(left)} process(es) of the suite outlived it (parent PID 1):", file=sys.stderr)
        for line in left:
            print(f"  {line}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
