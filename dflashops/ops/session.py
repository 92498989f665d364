"""What the services below an Invocation use of it: the seam that keeps ops/invocation.py at the top.

`Invocation` (ops/invocation.py) owns one CLI call's state. The services that act with it (observation,
ops/runs/observe.py; notification, ops/notify.py; the in-target supervisor, ops/runs/supervise.py; the
one-target launch, ops/runs/launch.py) take a `Session`, this Protocol, instead of importing Invocation, so that
none of them depends on the top of ops/; an Invocation is a Session as it is (structural typing).
"""

from __future__ import annotations

from typing import Any, Protocol

from dflashops.core.inventory import Inventory, Target
from dflashops.lineage import LineageDB, RunRecord
from dflashops.ops.agent_client import Agent
from dflashops.ops.notify import Notifier


class Session(Protocol):
    """One CLI call's inventory, lineage, agents and notifier (read-only views: an Invocation holds them)."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def dry_run(self) -> bool: ...

    @property
    def db(self) -> LineageDB: ...

    @property
    def notifier(self) -> Notifier: ...

    @property
    def notices(self) -> list[str]: ...

    def agent(self, target: Target) -> Agent:
        """The agent of `target`, connected once per call and reused."""
        ...

    def record_of(self, name: str) -> RunRecord | None:
        """The lineage record of run `name`, None when the lineage does not know it."""
        ...

    def phase(self, phase: str, **fields: Any) -> None:
        """Tell the user that `phase` of a long verb starts (Invocation.phase)."""
        ...
