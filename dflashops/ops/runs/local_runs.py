"""Run directories on this machine read the way `dflashops status` reads a target's: by the agent, run as its
own process through the local transport (never imported and run inside the CLI), read-only.

Used by `runs sync --workspace DIR` and by the lineage views for runs whose directory is here. One agent
process per workspace folder answers for every run in it (~50 ms), and the answers are kept per invocation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dflashops.core.errors import AgentError, UsageError
from dflashops.ops.agent_client import AGENT_SOURCE
from dflashops.transport.local import LocalTransport


class LocalRuns:
    """Agent `status` answers for local workspace folders, cached per folder."""

    def __init__(self) -> None:
        self._transport = LocalTransport(name="this machine", default_env={})
        self._answers: dict[Path, dict[str, dict[str, Any]]] = {}

    def statuses(self, workspace: Path) -> list[dict[str, Any]]:
        """Every run of `workspace` (a folder holding runs/<name>/), as the agent's status verb answers."""
        return list(self._of(workspace.resolve()).values())

    def status(self, run_dir: Path) -> dict[str, Any] | None:
        """The status of the run in `run_dir` (<workspace>/runs/<name>), or None when the agent does not list it."""
        run_dir = run_dir.resolve()
        return self._of(run_dir.parent.parent).get(run_dir.name)

    def _of(self, workspace: Path) -> dict[str, dict[str, Any]]:
        if workspace not in self._answers:
            request = json.dumps({"workspace": str(workspace)})
            result = self._transport.run(
                [sys.executable, str(AGENT_SOURCE), "status", "--json-args", request], check=False
            )
            try:
                answer = json.loads(result.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise AgentError(f"the agent gave no answer for {workspace}: {result.stderr.strip()[-300:]}") from None
            if not answer.get("ok"):
                raise UsageError(f"cannot read workspace {workspace}: {answer.get('error')}")
            self._answers[workspace] = {entry["name"]: entry for entry in answer["runs"]}
        return self._answers[workspace]
