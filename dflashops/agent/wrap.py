"""The launch wrapper's records: the launch spec, the reserved blocks, pgid/pid/exit_code, the wrapper's own
process group and the job's wait (verb_wrap in launch.py uses these, and so does a standby's wrapper).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

from .answers import LaunchAnswer
from .common import LAUNCH_SETTLE_S, AgentFailure, append_log, read_int, remove_quietly, write_atomic

LAUNCH_SPEC = ".launch.json"  # argv + env (with every pass_env secret) for the wrapper; 0600, deleted on every path
# Run-directory records the wrapper sets aside blocks for at start (`.NAME.reserved`), so that they can be
# written on a full disk: the exit status, and a stop request with its outcome.
RESERVED_BYTES = {"exit_code": 16, "stop.json": 4096}
# A tmux pane's command starts with the environment of the tmux server, which the first launch of the workspace
# started with ITS environment (an earlier deploy's secrets included): wrappers started in tmux drop it all.
CLEAN_ENV = ("env", "-i")


def launch_answer(
    directory: str, pgid: int | None, marker: str, launcher: str, session: str, *, standby: bool
) -> LaunchAnswer:
    """What `launch` answers: where the run is, its group and marker, how it was started (`standby`: a standby
    interpreter took it); verb_launch adds its pre-flight verdict and cache clearing."""
    return LaunchAnswer(
        run_dir=directory,
        pgid=pgid,
        marker=marker,
        launcher=launcher,
        session=session,
        standby=standby,
        preflight=None,
        cleared=None,
    )


def launch_failed(directory: str, reason: str) -> NoReturn:
    """Record a launch that did not start (so status says crashed, not launching forever) and refuse."""
    append_log(directory, reason)
    record_exit_code(directory, 127)
    raise AgentFailure(reason, "launch_failed")


def wait_for_file(path: str, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read_int(path)
        if value is not None:
            return value
        time.sleep(0.02)
    return None


def reserve_records(directory: str) -> None:
    """Set aside, while the disk still has room, the blocks that `exit_code` and `stop.json` will need: a run
    that fills its disk must still end with its exit status and its stop recorded, or status could only
    call a stopped run `lost` or `crashed`."""
    for name, size in RESERVED_BYTES.items():
        try:
            write_atomic(os.path.join(directory, f".{name}.reserved"), " " * (size - 1) + "\n")
        except OSError:
            pass


def write_record(directory: str, name: str, text: str) -> None:
    """`write_atomic(directory/name, text)`; on a full disk, the text goes into the file `reserve_records` set
    aside (overwritten in place, which needs no new blocks, padded with whitespace that JSON and int readers
    ignore), which is then renamed over `name`."""
    path, reserve = os.path.join(directory, name), os.path.join(directory, f".{name}.reserved")
    try:
        write_atomic(path, text)
    except OSError:
        data = text.encode()
        # The reserve, or (once it was used) the record it became: both hold blocks this write can reuse.
        spare = reserve if os.path.exists(reserve) else path
        if not os.path.exists(spare) or len(data) > os.path.getsize(spare):
            raise
        with open(spare, "r+b") as handle:
            handle.write(data.ljust(os.path.getsize(spare)))
            handle.flush()
            os.fsync(handle.fileno())
        if spare == reserve:
            os.replace(reserve, path)
    else:
        remove_quietly(reserve)


def record_exit_code(directory: str, status: int) -> None:
    write_record(directory, "exit_code", f"{status}\n")


def stop_requested(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "stop.json"))


def become_group_leader() -> None:
    """The wrapper's start: leader of its own session and process group (the run's pgid), and alive through
    the group-wide SIGTERM of a stop: Python-level handlers (not SIG_IGN, which exec would pass on to the job),
    so it can record the job's real exit status."""
    if os.getpgrp() != os.getpid():
        os.setsid()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: None)


def wait_job(child: subprocess.Popen, log_path: str) -> int:
    """Wait for the job, mirroring `log_path` to a tmux pane meanwhile; its exit status (128+N for signal N)."""
    tee = sys.stdout.isatty()  # in a tmux pane: mirror the log for humans who attach
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if tee:
            offset = mirror(log_path, offset)
    if tee:
        mirror(log_path, offset)
    return code if code >= 0 else 128 - code


def mirror(path: str, offset: int) -> int:
    """Copy new log bytes to the tmux pane. A pane that went away (EIO) must not kill the wrapper, which
    still has to record the exit code, so write errors are swallowed."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:  # an adopted standby's job has not written its first line yet
        return offset
    if data:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except OSError:
            pass
    return offset + len(data)


def launch_in_flight(directory: str) -> bool:
    """The run directory exists but its job has not started yet (no pid, no exit code) and is young enough
    that its launch may still be running."""
    if any(os.path.exists(os.path.join(directory, f)) for f in ("pid", "exit_code")):
        return False
    try:
        return time.time() - os.stat(directory).st_ctime < LAUNCH_SETTLE_S
    except OSError:
        return False
