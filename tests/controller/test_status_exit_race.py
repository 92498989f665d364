"""The agent's run status against its wrapper ending mid-read: a run that crashed must never read as "lost".

run_status reads `exit_code`, then scans /proc for the run's processes. The wrapper writes `exit_code` and then
exits, so both can happen between those two reads; under load that made `deploy` report a crash in its start as
"lost, exit code None". The interleaving is made here, not waited for: the scan is the real one, run just after
a real wrapper-like process has recorded its exit code and gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashops.agent import status as agent_status

RECORD_PGID_AND_SLEEP = """
import os, sys, time
path = sys.argv[2]
with open(path + ".tmp", "w") as handle:
    handle.write(f"{os.getpgrp()}\\n")
os.replace(path + ".tmp", path)  # whole or absent, as write_atomic
time.sleep(60)
"""


def test_a_wrapper_that_records_its_exit_and_ends_mid_read_reads_as_crashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    # A stand-in for the launch wrapper: the leader of its own group, its command line naming the run directory
    # as verb_launch's wrapper argv does, so the scan counts its group as the run's. Like the real one it records
    # `pgid` itself, from its own code: Popen returns once exec has begun, and the kernel closes the exec pipe
    # before it sets the new argv, so a scan made right after Popen can read an empty /proc/PID/cmdline (it did,
    # under load) and not count the group.
    wrapper = subprocess.Popen(
        [sys.executable, "-c", RECORD_PGID_AND_SLEEP, json.dumps({"dir": str(run)}), str(run / "pgid")],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (run / "pgid").exists():
            assert wrapper.poll() is None and time.monotonic() < deadline, "the stand-in did not record its pgid"
            time.sleep(0.02)
        assert agent_status.run_status(str(run))["state"] == "running"  # the scan sees it while it lives

        real_scan = agent_status.run_processes

        def wrapper_ends_before_the_scan(*args: object) -> tuple[int | None, set[int]]:
            (run / "exit_code").write_text("2\n")  # record_exit_code, then the wrapper exits
            wrapper.kill()
            wrapper.wait()
            return real_scan(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(agent_status, "run_processes", wrapper_ends_before_the_scan)
        status = agent_status.run_status(str(run))
    finally:
        wrapper.kill()
        wrapper.wait()
    assert (status["state"], status["exit_code"], status["pids"]) == ("crashed", 2, [])


def test_a_run_with_no_process_and_no_exit_code_is_still_lost(tmp_path: Path) -> None:
    """The second read changes nothing for a wrapper that died without recording (SIGKILL, a reboot)."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    (run / "pgid").write_text(f"{gone.pid}\n")
    status = agent_status.run_status(str(run))
    assert (status["state"], status["exit_code"]) == ("lost", None)
