"""Per-run control: the flock that serialises the commands that change a run (stop, restart, a stall stop)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time

from .answers import StopAnswer
from .common import LAUNCH_SETTLE_S, AgentFailure, read_json, write_atomic
from .protocol import StopTimes
from .status import run_status

# The commands that change a run (stop, restart, the supervisor's stop of a stalled run) are serialised per run:
# each holds an exclusive flock on the run's directory while it acts, including the part of a hand-over stop
# that finishes in the background. Two that meet act once: the second waits for the first, then reports what
# the first did instead of acting again. Without this, two stops each sent SIGTERM, and the trainer reads a
# second SIGTERM as "exit now, without the checkpoint the first one asked for". flock needs no new disk blocks
# (a full disk cannot keep a stop from taking it), and the kernel drops it when its holder dies, so a command
# killed mid-way never leaves a stale lock behind.
CONTROL = ".control.json"  # the last holder of the run's lock: op, pid, since; its outcome once it let go


def control_wait_s(times: StopTimes) -> float:
    """How long a command waits for another one on the same run: as long as that one's stop may take with the
    same settings (grace, save grace, the SIGKILL and GPU waits), plus a launch's settle time."""
    return float(times.grace) + float(times.save_grace) + times.kill_s() + times.gpu_s() + LAUNCH_SETTLE_S


def try_control(directory: str, op: str) -> int | None:
    """Take the run's control lock if it is free: its descriptor (close it with release_control), else None."""
    fd = lock_run(directory)
    if fd is not None:
        note_control(directory, {"op": op, "pid": os.getpid(), "since": time.time()})
    return fd


def lock_run(directory: str) -> int | None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def take_control(directory: str, op: str, wait_s: float) -> tuple[int, dict | None]:
    """The run's control lock: (descriptor, None) when it was free; (descriptor, the previous holder's record
    with its outcome) when another command held it and this one waited for it to finish. AgentFailure `busy`
    when it is still held after `wait_s`. The wait is a blocking flock (the kernel lists it in /proc/locks as a
    waiter), bounded by an interval timer."""
    fd = try_control(directory, op)
    if fd is not None:
        return fd, None
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    previous = signal.signal(signal.SIGALRM, _wait_expired)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(wait_s, 0.001))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _WaitExpired:  # during the wait, or just after it ended: holding the lock is what counts
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = read_json(os.path.join(directory, CONTROL)) or {}
                since = holder.get("since")
                age = f", for {time.time() - float(since):.0f} s" if isinstance(since, (int, float)) else ""
                raise AgentFailure(
                    f"a {holder.get('op', 'stop or restart')} of run {os.path.basename(directory)!r} is already in "
                    f"progress (pid {holder.get('pid', '?')}{age}); nothing was done",
                    "busy",
                ) from None
    finally:
        signal.signal(signal.SIGALRM, previous)
    holder = read_json(os.path.join(directory, CONTROL)) or {}  # read before this holder's record replaces it
    note_control(directory, {"op": op, "pid": os.getpid(), "since": time.time()})
    return fd, holder


class _WaitExpired(Exception):
    pass


def _wait_expired(signum: int, frame: object) -> None:
    raise _WaitExpired


def note_control(directory: str, fields: dict, *, replace: bool = True) -> None:
    """Write the lock holder's record (best effort: the lock itself is what serialises; this only tells)."""
    record = fields if replace else {**(read_json(os.path.join(directory, CONTROL)) or {}), **fields}
    try:
        write_atomic(os.path.join(directory, CONTROL), json.dumps(record) + "\n")
    except OSError:
        pass


def release_control(directory: str, fd: int, outcome: dict) -> None:
    """Record this holder's outcome for a command that waited, then let go (a background part of a hand-over
    stop that inherited `fd` keeps the lock until it exits)."""
    if (read_json(os.path.join(directory, CONTROL)) or {}).get("pid") == os.getpid():
        note_control(directory, {"outcome": outcome, "finished_at": time.time()}, replace=False)
    os.close(fd)


def joined_answer(directory: str, holder: dict, started: float) -> StopAnswer:
    """A stop's answer when another command had the run and stopped it meanwhile: what that one did."""
    status = run_status(directory)
    stop = read_json(os.path.join(directory, "stop.json")) or {}
    return StopAnswer(
        joined={k: holder.get(k) for k in ("op", "pid", "since", "outcome", "finished_at")},
        state=status.state,
        escalated=bool(stop.get("escalated")),
        signalled=[],
        gpu_released=stop.get("gpu_released"),
        waited_for_checkpoint_s=0.0,
        before_start=bool(stop.get("before_start")),
        exit_code=status.exit_code,
        checkpoints=status.checkpoints[-1:],
        seconds=round(time.monotonic() - started, 3),
        recorded=True,
    )
