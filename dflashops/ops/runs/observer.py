"""The observer: the one step that acts on what a status read found. Reads (ops/runs/control.py `run_status`,
`target_status`) return facts only; a verb that should act hands the entries it read to `observe_runs`, which

1. records a run the lineage does not know whose run.json says the in-target supervisor made it (an auto-restart),
   so `runs tree` shows it (ops/runs/observe.py `adopt`);
2. starts again a supervisor that died (ops/runs/supervise.py `revive`): recovery must not stay off because the
   controller was away; the entry's `supervisor.revived` then says what was done, for the table;
3. queues the notifications of the supervisor's events and of a run seen ended against its lineage record (once
   each: the notifier's ledger remembers them; ops/runs/observe.py `deliver`);
4. mirrors the run's state, exit code and last step into its lineage record.

It returns what it did (`Observed`); it prints nothing. The verbs that call it, and so may change these four
things: `status` (the CLI prints each line of `Observed.lines` on stderr), `stop`, `restart`, the start wait of
`deploy`/`restart`, `deploy --wait` and the waits and checks of a playbook. `logs` and `watch` never call it.
Cost: nothing beyond a lineage lookup per entry when nothing changed; a revival is one agent call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflashops.lineage import LineageDBError
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE, other_node
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.job_state import overall
from dflashops.ops.runs.observe import adopt, deliver
from dflashops.ops.runs.supervise import revive


@dataclass
class Observed:
    """What one `observe_runs` call did."""

    adopted: list[str] = field(default_factory=list)  # runs recorded into the lineage
    revivals: list[str] = field(default_factory=list)  # one line per dead supervisor: started again, or why not
    events: list[str] = field(default_factory=list)  # ids of the notifications queued
    recorded: list[str] = field(default_factory=list)  # runs whose lineage record changed

    @property
    def lines(self) -> list[str]:
        """What the user is told on stderr: the revivals (the notifier says what it queued itself; an adoption is
        shown by `runs tree`)."""
        return list(self.revivals)


def observe_runs(invocation: Invocation, entries: list[dict[str, Any]]) -> Observed:
    """Steps 1-4 of the module docstring for each run of `entries` (as run_status/target_status answer them: the
    node entries of a run on several targets count as one run, `overall`; a run directory of node 1, 2, ... is
    skipped, its row is node 0's; a run whose state is not known, a node being unreachable, is not observed).
    Best effort: a lineage that cannot be read or written becomes a warning (Invocation.warn), not a failure.
    Nothing in a dry run."""
    observed = Observed()
    if invocation.dry_run:
        return observed
    for entry in whole_runs(entries):
        if other_node(entry) is not None or entry.get("state") == "unreachable":
            continue
        try:
            observe_one(invocation, entry, observed)
        except LineageDBError as exc:
            invocation.warn(f"the lineage was not updated: {exc.message}")
    return observed


def whole_runs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per run: the per-node entries of a run on several targets (they carry `node`) made one."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    whole: list[dict[str, Any]] = []
    for entry in entries:
        if "node" not in entry:
            whole.append(entry)
        elif str(entry.get("name")) not in nodes:
            nodes[str(entry.get("name"))] = [entry]
            whole.append(entry)  # replaced below by the job's entry, in the same place
        else:
            nodes[str(entry.get("name"))].append(entry)
    return [overall(nodes[str(e.get("name"))]) if "node" in e else e for e in whole]


def observe_one(invocation: Invocation, status: dict[str, Any], observed: Observed) -> None:
    name = str(status.get("name"))
    record = invocation.record_of(name)
    if record is None and adopt(invocation, status):
        observed.adopted.append(name)
        record = invocation.record_of(name)
    if (status.get("supervisor") or {}).get("alive") is False and (line := revive(invocation, status)):
        observed.revivals.append(line)
    observed.events += deliver(invocation, status, record)
    if record is None:
        return
    state = AGENT_STATE_TO_LINEAGE.get(str(status.get("state")), "crashed")
    fields: dict[str, Any] = {"exit_code": status.get("exit_code")}
    if isinstance(status.get("step"), int):
        fields["last_step"] = status["step"]
    if state != record.state or any(getattr(record, k) != v for k, v in fields.items()):
        invocation.db.set_state(record.name, state, **fields)
        observed.recorded.append(record.name)


def observe_and_tell(invocation: Invocation, entries: list[dict[str, Any]]) -> Observed:
    """`observe_runs` for a verb whose CLI prints nothing of its own about it (stop, restart, the waits): its lines
    go where the CLI prints them when the invocation closes (Invocation.notices, on stderr)."""
    observed = observe_runs(invocation, entries)
    invocation.notices.extend(observed.lines)
    return observed
