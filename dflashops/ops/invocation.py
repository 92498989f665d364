"""One CLI invocation's state: the inventory, the lineage database, and one agent per target used.

Connections are opened lazily and reused (one per target per invocation); `close()` releases them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflashops.errors import DflashopsError, NotFound
from dflashops.inventory import Inventory, Target
from dflashops.lineage import LineageDB, LineageDBError, RunRecord
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE
from dflashops.lineage.naming import close_names
from dflashops.ops.agent_client import Agent
from dflashops.ops.observe.notify import Notifier
from dflashops.ops.observe.observe import observe
from dflashops.ops.runs.supervise import revive
from dflashops.transport import open_transport


@dataclass
class Invocation:
    inventory: Inventory
    dry_run: bool = False
    _db: LineageDB | None = None
    _agents: dict[str, Agent] = field(default_factory=dict)
    # Things that went wrong on the side of a verb that still did its job (the lineage could not follow
    # a stop); the CLI prints each as `warning: ...` on stderr when the invocation closes.
    warnings: list[str] = field(default_factory=list)
    _notifier: Notifier | None = None
    # Where a long verb's phases go as they start (deploy, restart: the CLI prints a line or a JSON event each);
    # None: nobody listens. An event is a dict with `phase` and the phase's facts.
    on_phase: Callable[[dict[str, Any]], None] | None = None

    def phase(self, phase: str, **fields: Any) -> None:
        """Tell the listener (on_phase), if any, that `phase` starts; the agent's own phases come the same way."""
        if self.on_phase is not None:
            self.on_phase({"phase": phase, **fields})

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    @property
    def notifier(self) -> Notifier:
        """Run notifications (ops/observe/notify.py); `notices` lists what it did, for the CLI to print."""
        if self._notifier is None:
            self._notifier = Notifier(self.inventory)
        return self._notifier

    @property
    def notices(self) -> list[str]:
        return self.notifier.notices

    @property
    def db(self) -> LineageDB:
        if self._db is None:
            path = self.inventory.lineage_path
            # A dry run must not create the database file: an empty in-memory one answers its lookups.
            self._db = LineageDB(":memory:" if self.dry_run and not path.exists() else path)
        return self._db

    def agent(self, target: Target) -> Agent:
        if target.name not in self._agents:
            self._agents[target.name] = Agent(target, open_transport(target), dry_run=self.dry_run)
        return self._agents[target.name]

    @property
    def plan(self) -> list[str]:
        """Commands recorded in dry-run mode, in order, across targets."""
        return [line for agent in self._agents.values() for line in agent.plan]

    def record_of(self, name: str) -> RunRecord | None:
        try:
            return self.db.get(name)
        except NotFound:
            return None

    def target_for_run(self, name: str, explicit: str | None = None) -> Target:
        """The target a run lives on: the one named, else the lineage record's, else the default."""
        if explicit:
            return self.inventory.target(explicit)
        try:
            record = self.record_of(name)
        except LineageDBError as exc:
            # A corrupt or unreadable database must not keep `stop`/`status`/`logs` from the run itself.
            fallback = self.inventory.target(None)
            self.warn(
                f"{exc.message}; looked for {name} on the default target {fallback.name} (pass --target to choose)"
            )
            return fallback
        if record is not None and record.target in self.inventory.targets:
            return self.inventory.targets[record.target]
        return self.inventory.target(None)

    def close_run_names(self, name: str, explicit_target: str | None = None) -> list[str]:
        """Names close to `name` (a mistyped run name) among the recorded runs and the runs on the target
        it would be looked up on, best first. Best effort: a source that cannot be read adds nothing."""
        names: set[str] = set()
        try:
            if self._db is not None or self.inventory.lineage_path.exists():  # never creates the database
                names |= self.db.names()
        except DflashopsError:
            pass
        try:
            target = self.target_for_run(name, explicit_target)
            names |= {
                str(run["name"]) for run in self.agent(target).call("status", {"workspace": target.workspace})["runs"]
            }
        except DflashopsError:
            pass
        names.discard(name)
        return close_names(name, names)

    def note_state(self, status: dict) -> None:
        """Mirror an agent status entry into the lineage record (when the run is recorded); first adopt a
        supervisor-made run and notify what changed (ops/observe/observe.py). Best effort: the verb that asked (stop,
        status) has done its job on the target already, so a database that cannot be read or written becomes
        a warning, not a failure."""
        if self.dry_run:
            return
        try:
            self._note_state(status)
        except LineageDBError as exc:
            self.warn(f"the lineage was not updated: {exc.message}")

    def _note_state(self, status: dict) -> None:
        record = self.record_of(str(status.get("name")))
        observe(self, status, record, revive)
        record = record or self.record_of(str(status.get("name")))
        if record is None:
            return
        state = AGENT_STATE_TO_LINEAGE.get(str(status.get("state")), "crashed")
        fields: dict = {"exit_code": status.get("exit_code")}
        if isinstance(status.get("step"), int):
            fields["last_step"] = status["step"]
        if state != record.state or any(getattr(record, k) != v for k, v in fields.items()):
            self.db.set_state(record.name, state, **fields)

    def close(self) -> None:
        if self._notifier is not None:
            if not self.dry_run:
                self._notifier.flush()  # a detached courier delivers what this call queued
            self._notifier.close()
        for agent in self._agents.values():
            agent.transport.close()
        if self._db is not None:
            self._db.close()
