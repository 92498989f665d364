"""`attach`: the local argv that puts the user's terminal on a run's tmux session (the CLI execs it).

The socket and session names come from the agent's status answer (the agent owns tmux naming: one server per
workspace, injective session names), so the controller never re-derives them. Remote targets go through the
system `ssh -t` (transport/interactive.py): paramiko cannot hand over a real terminal."""

from __future__ import annotations

import os

from dflashops.core.errors import NotFound, UsageError
from dflashops.core.shell import validate_name
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import run_status
from dflashops.ops.runs.nodes import node_target, nodes_of
from dflashops.transport.interactive import interactive_argv
from dflashops.transport.tmux_local import local_session_exists


def attach_argv(invocation: Invocation, run: str, *, target: str | None = None, node: int | None = None) -> list[str]:
    """argv for `tmux attach` to `run` (node `node` of a run on several targets, default 0). UsageError for a
    nohup run, which has no session."""
    validate_name(run, what="run name")
    if not target and (node or nodes_of(invocation, run)):
        target = node_target(invocation, run, node or 0)
    tgt = invocation.target_for_run(run, target)
    entry = run_status(invocation, run, target=tgt.name)[0]
    if entry["run_json"].get("launcher") != "tmux":
        raise UsageError(
            f"run {run!r} was launched with nohup; there is no session to attach", hint=f"`dflashops logs {run} -f`"
        )
    names = entry["tmux"]
    if tgt.kind == "local" and not local_session_exists(names["socket"], names["session"]):
        raise NotFound(
            f"run {run!r} has no tmux session any more ({entry['state']})",
            hint=f"`dflashops logs {run}` shows what it printed",
        )
    tmux = ["tmux", "-L", names["socket"], "attach-session", "-t", "=" + names["session"]]
    # Remote: the terminal type travels (pct exec clears the environment); detach with the tmux prefix + d.
    term = {"TERM": os.environ.get("TERM", "xterm-256color")} if tgt.kind != "local" else None
    return interactive_argv(tgt, tmux, hosts=invocation.inventory.hosts, env=term)
