"""One CLI invocation's state: the inventory, the lineage database, and one agent per target used.

Connections are opened lazily and reused (one per target per invocation); `close()` releases them. Nothing here
acts on what a verb reads: the verbs that act on a run's observed state call the observer
(ops/runs/observer.py) themselves. A `read_only` invocation (logs, watch, attach) opens the lineage for reading only: it
never creates, migrates or writes the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops.agent.answers import StatusAnswer
from dflashops.agent.protocol import StatusRequest
from dflashops.core.errors import DflashopsError, NotFound
from dflashops.core.inventory import Inventory, Target
from dflashops.lineage import LineageDB, LineageDBError, RunRecord
from dflashops.lineage.naming import close_names
from dflashops.ops.agent_client import Agent
from dflashops.ops.notify import Notifier
from dflashops.transport import open_transport


@dataclass
class Invocation:
    inventory: Inventory
    dry_run: bool = False
    # The verb only reads (logs, watch, attach): the lineage file is opened read-only, so a write to it anywhere
    # below fails loudly instead of changing it; a missing or old-schema file reads as holding no runs.
    read_only: bool = False
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
        """Run notifications (ops/notify.py); `notices` lists what it did, for the CLI to print."""
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
            if self.read_only:
                self._db = self._reading_db(path)
            else:
                # A dry run must not create the database file: an empty in-memory one answers its lookups.
                self._db = LineageDB(":memory:" if self.dry_run and not path.exists() else path)
        return self._db

    @staticmethod
    def _reading_db(path: Path) -> LineageDB:
        """The lineage for a read-only verb: the file opened read-only, or an empty in-memory database where there
        is no file yet or its schema is older (migrating it would be a write)."""
        try:
            db = LineageDB(path, read_only=True)
        except NotFound:
            return LineageDB(":memory:")
        if db.needs_migration:
            db.close()
            return LineageDB(":memory:")
        return db

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
            answer = self.agent(target).ask("status", StatusRequest(workspace=target.workspace), StatusAnswer)
            names |= {run.name for run in (answer.runs if answer is not None else [])}
        except DflashopsError:
            pass
        names.discard(name)
        return close_names(name, names)

    def close(self) -> None:
        if self._notifier is not None:
            if not self.dry_run:
                self._notifier.flush()  # a detached courier delivers what this call queued
            self._notifier.close()
        for agent in self._agents.values():
            agent.transport.close()
        if self._db is not None:
            self._db.close()
