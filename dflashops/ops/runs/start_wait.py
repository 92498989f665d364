"""Has a just-launched run passed its start? What `deploy` and `restart` wait for unless told `--detach`.

A run has passed its start when (the profile's `started_when`, core/inventory.py):
- `preflight_done` / `first_step`: that milestone is in its status.json `timeline` (the trainer's pre-flight, or
  its first optimizer step); a job whose status.json keeps no timeline counts a step >= 1 as both;
- `settle` (any other job): its status.json names a step >= 1, or it is still alive `settle_s` seconds after
  the wait began.
A run that ends inside the window has not "started": crashed or lost is RunFailed (with the last lines of its
log), finished or stopped is reported as such. No printing here; the caller says what happened.

Cost: one agent `status` call per poll (every 0.1 s at first, backing off to 0.5 s), plus one `tail` call when
the run crashed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflashops.core.errors import RunFailed, WaitTimeout
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import LogCursor, how_it_ended, read_log, run_status
from dflashops.ops.runs.job_state import overall
from dflashops.ops.runs.observer import observe_and_tell

SETTLE_S = 2.0
LIVE_STATES = ("launching", "running")
LOG_LINES = 10  # of a run that crashed in its start window, shown in the error


@dataclass
class Started:
    """How the run passed its start (`how`, one phrase; with `ended`: how it finished or was stopped inside
    the window, which is no failure), the status entry that said so, and the seconds waited."""

    name: str
    how: str
    entry: dict[str, Any]
    seconds: float
    ended: bool = False


def passed(entry: dict[str, Any], started_when: str, alive_s: float, settle_s: float) -> str | None:
    """The phrase for a run that has passed its start by `started_when`, else None (still starting)."""
    status = entry.get("trainer_status") or {}
    timeline = status.get("timeline")
    step = status.get("step") if isinstance(status.get("step"), int) else None
    if isinstance(timeline, dict) and started_when != "settle":
        if started_when in timeline or "first_step" in timeline:  # a first step is past the pre-flight too
            mark = started_when if started_when in timeline else "first_step"
            return f"status.json timeline `{mark}`" + (f", step {step}" if step else "")
        return None
    if step is not None and step >= 1:
        return f"its first step (status.json step {step})"
    if started_when == "settle" and alive_s >= settle_s:
        return f"still running {alive_s:.0f} s after its launch"
    return None


def wait_started(
    invocation: Invocation,
    name: str,
    *,
    started_when: str,
    timeout: float,
    settle_s: float = SETTLE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Started:
    """Poll the run's status until it passed its start (Started), ended cleanly (Started, `ended`), crashed
    (RunFailed: its end and last log lines, hint `dflashops logs RUN`) or `timeout` passed (WaitTimeout;
    the run goes on)."""
    began = clock()
    poll = 0.1
    while True:
        entries = run_status(invocation, name)
        observe_and_tell(invocation, entries)  # deploy/restart act: the run's end reaches its record and notify
        entry = overall(entries)
        state = entry["state"]
        if state not in LIVE_STATES:
            if state in ("finished", "stopped"):
                return Started(name, how_it_ended(entry), entry, clock() - began, ended=True)
            raise RunFailed(
                f"{name} did not pass its start: {how_it_ended(entry)}" + last_lines(invocation, name),
                hint=f"dflashops logs {name}",
            )
        if state == "running" and (how := passed(entry, started_when, clock() - began, settle_s)):
            return Started(name, how, entry, clock() - began)
        if clock() - began >= timeout:
            raise WaitTimeout(
                f"{name} has not passed its start ({started_when}) within {timeout:g}s; it goes on",
                hint=f"dflashops watch {name}   (or raise --timeout; --detach does not wait)",
            )
        sleep(poll)
        poll = min(poll * 1.5, 0.5)


def last_lines(invocation: Invocation, name: str) -> str:
    """The end of the run's log as `  | line` lines (after a newline), or "" when it has none."""
    text = "".join(read_log(invocation, name, LogCursor(last_lines=LOG_LINES)))
    lines = [line for line in text.splitlines() if line.strip()][-LOG_LINES:]
    return "".join("\n  | " + line for line in lines)
