"""What must not happen under a run, and `provision TARGET --destroy`.

`active_runs` asks the container's agent which runs are active (running, stopping, launching): a driver repair and
a destroy refuse while one is, naming it. `destroy` removes a container dflashops made (or one it is told to
adopt) only when the container's name is typed back; it stops it first, and prints the same commands on --dry-run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from dflashops.agent.answers import StatusAnswer
from dflashops.agent.protocol import StatusRequest
from dflashops.core.errors import Conflict, NotFound, UsageError
from dflashops.core.inventory import Target
from dflashops.core.shell import join_argv
from dflashops.ops.agent_client import Agent
from dflashops.ops.provision import config as cfg
from dflashops.ops.provision.lock import provision_lock
from dflashops.transport import open_transport
from dflashops.transport.pct import PctTransport

ACTIVE = ("running", "stopping", "launching")


def active_runs(target: Target, ct: PctTransport) -> list[str]:
    """Names of the runs active in the container's workspace (the stdlib agent, run by the container's python3:
    the target's venv may be what is being repaired)."""
    try:
        agent = Agent(replace(target, python="python3"), ct)
        answer = agent.ask("status", StatusRequest(workspace=target.workspace), StatusAnswer)
    except NotFound:
        return []  # no workspace yet: no run
    return [run.name for run in answer.runs if run.state in ACTIVE] if answer is not None else []


def refuse_under_runs(target: Target, ct: PctTransport, doing: str) -> None:
    runs = active_runs(target, ct)
    if runs:
        raise Conflict(
            f"run {runs[0]} is active in container {target.ctid}"
            + (f" (and {len(runs) - 1} more)" if len(runs) > 1 else "")
            + f": not {doing} under it",
            hint=f"wait for it to end or stop it (`dflashops stop {runs[0]}`), then run this again",
        )


def destroy(
    target: Target, *, typed_name: str | None, adopt: bool, dry_run: bool, progress: Callable[[str], None]
) -> tuple[str, list[str]]:
    """Destroy the target's container; returns its name and the commands (run, or only planned on dry_run, which
    needs no name typed back)."""
    transport = open_transport(target)
    try:
        assert isinstance(transport, PctTransport) and transport.host is not None
        host, vmid = transport.host, str(target.ctid)
        shown = host.run(transport.pct_argv("config", vmid), check=False)
        if not shown.ok:
            raise NotFound(
                f"container {vmid} does not exist on {host.name}",
                hint="nothing to destroy (`pct list` on the host shows the containers)",
            )
        config = cfg.parse_config(shown.stdout)
        name = cfg.value(config, "hostname") or f"CT{vmid}"
        if not {cfg.OWNER_TAG, cfg.UNFINISHED_TAG} & set(cfg.tags(config)) and not adopt:
            raise Conflict(
                f"container {vmid} ({name}) on {host.name} was not created by dflashops: not destroying it",
                hint="destroy it by hand on the host, or pass --adopt if dflashops is to own it",
            )
        if typed_name != name and not dry_run:
            raise UsageError(
                f"destroying container {vmid} needs its name typed back"
                + (f" ({typed_name!r} is not {name!r})" if typed_name is not None else ""),
                hint=f"pass --yes-destroy {name}",
            )
        running = "status: running" in host.run(transport.pct_argv("status", vmid), check=False).stdout
        if running:
            refuse_under_runs(target, transport, "destroying the container")
        commands = [*([transport.pct_argv("stop", vmid)] if running else []), transport.pct_argv("destroy", vmid)]
        if not dry_run:
            with provision_lock(host, int(vmid), progress):
                for number, argv in enumerate(commands, 1):
                    progress(f"[{number}/{len(commands)}] {' '.join(argv[argv.index('pct') :])}")
                    host.run(argv, timeout=600)
        return name, [join_argv(argv) for argv in commands]
    finally:
        transport.close()
