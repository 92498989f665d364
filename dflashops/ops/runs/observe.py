"""The parts of observing a run status that need nothing of the launch layer (the observer itself, which also
starts a dead supervisor again, is ops/runs/observer.py):

- `adopt`: a run the lineage does not know, whose run.json says the in-target supervisor made it
  (`extra.auto_restart`), is recorded (the same import `runs sync` does);
- `deliver`: events the supervisor recorded in the run's events.jsonl, and a state change against the lineage
  record (running -> crashed/finished/stopped), are handed to the notifier (ops/notify.py; once each);
- `started`: the event of a launch by deploy/restart.
Cost: nothing when `notify` is not configured and no run is new; else one ledger lookup per event.
"""

from __future__ import annotations

import time
from typing import Any

from dflashops.core.errors import DflashopsError
from dflashops.lineage import RunRecord
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE, import_dict_from_status
from dflashops.ops.session import Session

ENDINGS = {"crashed": "crashed", "finished": "finished", "stopped": "stopped"}


def adopt(invocation: Session, status: dict[str, Any]) -> bool:
    """Record a supervisor-made run (its parent chain is what the lineage needs); True when added."""
    run_json = status.get("run_json") or {}
    if not (run_json.get("extra") or {}).get("auto_restart") or not status.get("target"):
        return False
    data = import_dict_from_status(status, str(status["target"]))
    if data is None:
        return False
    try:
        return invocation.db.import_run_json(data) == "added"
    except DflashopsError as exc:
        invocation.notices.append(f"warning: could not record {status.get('name')}: {exc.message}")
        return False


def ending_event(status: dict[str, Any], previous: str | None) -> dict[str, Any] | None:
    """The event for a run seen ended while its record still says launched/running, else None."""
    state = AGENT_STATE_TO_LINEAGE.get(str(status.get("state")), "crashed")
    if previous not in ("launched", "running") or state not in ENDINGS:
        return None
    name, line = str(status["name"]), status.get("error_line")
    kind = "stalled" if state == "crashed" and str(line or "").startswith("stalled:") else ENDINGS[state]
    step = status.get("step")
    message = f"{name} {kind}" + (f" at step {step}" if step is not None else "")
    if kind in ("crashed", "stalled"):
        message += f", exit code {status.get('exit_code')}" + (f": {line}" if line else "")
    if status.get("restarted_as"):
        message += f" (restarted as {status['restarted_as']})"
    return {
        "id": f"{name}:{kind}",
        "event": kind,
        "run": name,
        "target": status.get("target"),
        "time": time.time(),
        "message": message,
        "exit_code": status.get("exit_code"),
        "step": step,
        "log_line": line,
        "source": "controller",
    }


def deliver(invocation: Session, status: dict[str, Any], record: RunRecord | None) -> list[str]:
    """Hand the notifier the events of one status entry (the supervisor's, then the run's end against `record`'s
    state); the ids of those it had not seen before. Nothing when `notify` is not configured."""
    notifier = invocation.notifier
    if notifier.config is None:
        return []
    notifier.look()
    wanted = [event for event in status.get("events") or [] if isinstance(event, dict) and event.get("id")]
    if record is not None and (ending := ending_event(status, record.state)) is not None:
        wanted.append(ending)
    sent = []
    for event in wanted:
        if notifier.send(event, delivered_by_target=event.get("webhook") == "sent"):
            sent.append(str(event["id"]))
    return sent


def started(invocation: Session, target: str, name: str, note: str, parent: str | None) -> None:
    """The controller launched `name` (deploy, restart)."""
    if invocation.dry_run or invocation.notifier.config is None:
        return
    message = f"{name} started on {target}" + (f" (parent {parent})" if parent else "") + (f": {note}" if note else "")
    invocation.notifier.send(
        {
            "id": f"{name}:started",
            "event": "started",
            "run": name,
            "target": target,
            "time": time.time(),
            "message": message,
            "parent": parent,
            "source": "controller",
        }
    )
