"""Parallel `--all`: one verb over every target of the inventory at once.

`fan_out(targets, work, timeout=...)` runs `work(target)` in one daemon thread per target and returns one
`FanoutResult` per target, in inventory order, after all finished or `timeout` seconds passed, whichever
comes first. A dead host fails within its own connect timeout; a host that hangs mid-command is reported
as timed out at the deadline and abandoned (its thread is a daemon, so the CLI still exits), so one bad
host never holds the others' answers beyond `timeout`.

Each worker opens its own Invocation (its own connection and its own SQLite handle: sqlite3 connections
must not cross threads) and closes it when done. Cost: wall time ~= the slowest target's, not the sum.

At most PER_HOST_LIMIT targets of one host are worked on at once; the others wait for a slot. Why: every
target of a Proxmox host goes through that host's one sshd, whose defaults are MaxStartups 10:30:100 (from the
11th connection being set up at once, sshd drops 30% of new ones, more as they grow) and MaxSessions 10 (the
11th channel on one multiplexed connection is refused). A host with a dozen containers would otherwise fail a
random few targets of every `--all`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dflashops.core.errors import DflashopsError
from dflashops.core.inventory import Inventory, Target
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import run_status, stop_run
from dflashops.ops.runs.observer import observe_runs

R = TypeVar("R")
DEFAULT_TIMEOUT_S = 60.0
PER_HOST_LIMIT = 8  # below OpenSSH's default MaxStartups and MaxSessions (10 each): see the module docstring


@dataclass
class FanoutResult(Generic[R]):
    target: str
    ok: bool
    value: R | None = None
    error: str | None = None
    hint: str | None = None
    duration_s: float = 0.0
    timed_out: bool = False


def fan_out(
    targets: Sequence[Target],
    work: Callable[[Target], R],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    per_host: int = PER_HOST_LIMIT,
) -> list[FanoutResult[R]]:
    """Run `work` on every target concurrently, at most `per_host` targets of one host at a time; never raises for
    one target's failure."""
    slots: dict[str, FanoutResult[R]] = {}
    done = threading.Semaphore(0)
    gates = {t.host.name: threading.Semaphore(per_host) for t in targets if t.host is not None}

    def worker(target: Target) -> None:
        started = time.monotonic()
        gate = gates[target.host.name] if target.host is not None else contextlib.nullcontext()
        try:
            with gate:
                value = work(target)
            slots[target.name] = FanoutResult(target.name, True, value=value, duration_s=time.monotonic() - started)
        except DflashopsError as exc:
            slots[target.name] = FanoutResult(
                target.name, False, error=exc.message, hint=exc.hint, duration_s=time.monotonic() - started
            )
        except Exception as exc:  # noqa: BLE001 - one target's bug must not hide the others' answers
            slots[target.name] = FanoutResult(
                target.name, False, error=f"{type(exc).__name__}: {exc}", duration_s=time.monotonic() - started
            )
        finally:
            done.release()

    for target in targets:
        threading.Thread(target=worker, args=(target,), name=f"fanout-{target.name}", daemon=True).start()
    deadline = time.monotonic() + timeout
    for _ in targets:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    return [
        slots.get(t.name)
        or FanoutResult(
            t.name,
            False,
            error=f"no answer within {timeout:g}s",
            hint="the host is slow or hung; try it alone",
            duration_s=timeout,
            timed_out=True,
        )
        for t in targets
    ]


def remote_targets(inventory: Inventory, include_local: bool = True) -> list[Target]:
    return [t for t in inventory.targets.values() if include_local or t.kind != "local"]


def _with_invocation(inventory: Inventory, dry_run: bool, body: Callable[[Invocation], R]) -> R:
    invocation = Invocation(inventory, dry_run=dry_run)
    try:
        return body(invocation)
    finally:
        invocation.close()


def status_all(
    inventory: Inventory, *, timeout: float = DEFAULT_TIMEOUT_S, told: list[str] | None = None
) -> list[FanoutResult[list[dict[str, Any]]]]:
    """Every run on every target (the agent's status entries per target), each target's handed to the observer
    as `status` does (ops/runs/observer.py). May change what the observer changes; the lines of what it did (and
    the notifications it queued) are appended to `told`, for the CLI to print."""

    def read_and_observe(invocation: Invocation, target: Target) -> list[dict[str, Any]]:
        entries = run_status(invocation, None, target=target.name)
        lines = observe_runs(invocation, entries).lines
        if told is not None:
            told.extend([*lines, *invocation.notices])  # list.extend holds the GIL: safe from the fan-out's threads
        return entries

    return fan_out(
        remote_targets(inventory),
        lambda t: _with_invocation(inventory, False, lambda inv: read_and_observe(inv, t)),
        timeout=timeout,
    )


def stop_all(
    inventory: Inventory,
    *,
    grace: float = 60.0,
    save_grace: float = 600.0,
    dry_run: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[FanoutResult[list[str]]]:
    """Stop every running run on every target; each result lists the runs it stopped."""

    def stop_target(invocation: Invocation, target: Target) -> list[str]:
        stopped = []
        for entry in run_status(invocation, None, target=target.name):
            pending = (entry.get("supervisor") or {}).get("state") == "backoff"  # a restart waiting to happen
            if entry.get("state") in ("running", "stopping", "launching") or pending:
                stop_run(invocation, str(entry["name"]), target=target.name, grace=grace, save_grace=save_grace)
                stopped.append(str(entry["name"]))
        return stopped

    return fan_out(
        remote_targets(inventory),
        lambda t: _with_invocation(inventory, dry_run, lambda inv: stop_target(inv, t)),
        timeout=timeout,
    )


def exec_all(
    inventory: Inventory, argv: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[FanoutResult[Any]]:
    """Run argv on every target; each value is the Result (exit code, stdout, stderr)."""
    return fan_out(
        remote_targets(inventory),
        lambda t: _with_invocation(
            inventory, False, lambda inv: inv.agent(t).transport.run(list(argv), check=False, timeout=timeout)
        ),
        timeout=timeout,
    )
