"""A run on several targets (torchrun, one node per target): one job, one run name, one lineage row.

`deploy GROUP` (or `deploy ct200,ct201`) launches the profile on every target with that node's torchrun values
({nnodes} {node_rank} {master_addr} {master_port} {rdzv_id}); each node has its own `runs/<name>/` on its own
target (train.log, status.json; node 0 also metrics and checkpoints: the trainer's contract). The lineage row is
node 0's, with `extra.nodes` = [{rank, target, run_dir, pgid}]: every verb that gets the run's name reads it and
acts on every node (`--target` narrows to one node, `logs --node K` too). A launch that fails on one node stops
the nodes already launched and releases the name, so a half-started job never runs on. Stop signals every node
at once (the trainer makes them all checkpoint the same step), and a node that cannot be reached does not keep
the others from being stopped.
"""

from __future__ import annotations

import copy
import queue
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dflashops.agent.answers import StatusAnswer, StopAnswer, answer_json
from dflashops.agent.protocol import StatusRequest, StopRequest
from dflashops.core.errors import DflashopsError, NotFound, TransportError, UsageError
from dflashops.core.inventory import Group, Profile, Target
from dflashops.lineage import LineageDBError
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.launch import (
    DeployOutcome,
    DeployRequest,
    NodePlace,
    check_free_on_target,
    check_request,
    claim_name,
    launch_on,
)
from dflashops.ops.runs.observe import started
from dflashops.ops.runs.observer import observe_and_tell

NODE_PLACEHOLDERS = re.compile(r"\{(node_rank|nnodes|master_addr|master_port|rdzv_id)\}")


@dataclass(frozen=True)
class RunNode:
    rank: int
    target: Target


def master_address(group: Group, targets: tuple[Target, ...]) -> str:
    """Where every node reaches node 0: the group's master_addr, node 0's `address`, or loopback when every
    node is a local target (one machine)."""
    if group.master_addr:
        return group.master_addr
    if targets[0].address:
        return targets[0].address
    if all(target.kind == "local" for target in targets):
        return "127.0.0.1"
    raise UsageError(
        f"no address for node 0 ({targets[0].name}) that the other nodes can reach",
        hint=f"add `address:` to target {targets[0].name} in the inventory (its own network "
        "address), or define a group with master_addr",
    )


def deploy_nodes(
    invocation: Invocation, request: DeployRequest, targets: tuple[Target, ...], group: Group, profile: Profile
) -> DeployOutcome:
    """Launch `profile` as one job on `targets` (node 0 first); returns node 0's outcome with `nodes` filled."""
    if not any(NODE_PLACEHOLDERS.search(arg) for arg in profile.argv):
        raise UsageError(
            f"profile {profile.name!r} does not use {{node_rank}} or {{nnodes}}: on {len(targets)} "
            "targets it would start that many separate runs under one name",
            hint="use a torchrun profile: torchrun --nnodes {nnodes} --node-rank {node_rank} "
            "--master-addr {master_addr} --master-port {master_port} -m trainer train ...",
        )
    if profile.on_failure or profile.stall:
        raise UsageError(
            f"profile {profile.name!r} has on_failure/stall: the in-target supervisor watches a run "
            "on one target, not a job on several",
            hint="deploy it on one target, or remove them",
        )
    address = master_address(group, targets)
    name = check_request(invocation, request, targets[0], profile)
    if request.name != "+":
        for target in targets[1:]:
            check_free_on_target(invocation, target, name)
    name = claim_name(invocation, request, targets[0], profile, name)
    names = tuple(target.name for target in targets)
    launched: list[tuple[Target, DeployOutcome, Any]] = []
    try:
        if request.name == "+":
            for target in targets:
                check_free_on_target(invocation, target, name)
        for rank, target in enumerate(targets):
            place = NodePlace(
                rank=rank, nnodes=len(targets), master_addr=address, master_port=group.master_port, targets=names
            )
            outcome, spec = launch_on(invocation, replace(request, node=place), target, profile, name)
            launched.append((target, outcome, spec))
    except BaseException:
        if not invocation.dry_run:
            for target, _, _ in launched:  # a job without all its nodes must not run on: stop what started
                try:
                    invocation.agent(target).ask(
                        "stop", StopRequest(workspace=target.workspace, name=name, grace=10), StopAnswer
                    )
                except DflashopsError:
                    pass
            invocation.db.release(name)
        raise
    first = launched[0][1]
    first.nodes = [outcome for _, outcome, _ in launched]
    if not invocation.dry_run:
        record = launched[0][2].record
        record.extra["nodes"] = [
            {"rank": rank, "target": target.name, "run_dir": outcome.run_dir, "pgid": outcome.pgid}
            for rank, (target, outcome, _) in enumerate(launched)
        ]
        record.extra["group"] = group.name
        invocation.db.fill(record)
        started(invocation, targets[0].name, name, request.note, request.parent)
    return first


def nodes_of(invocation: Invocation, name: str, explicit_target: str | None = None) -> list[RunNode] | None:
    """The nodes of a run on several targets (from its lineage row), or None: a run on one target, a run the
    lineage does not know, or `--target` naming the one node to act on."""
    if explicit_target:
        return None
    try:
        record = invocation.record_of(name)
    except LineageDBError:
        return None
    entries = (record.extra.get("nodes") if record else None) or []
    if len(entries) < 2:
        return None
    nodes: list[RunNode] = []
    for entry in entries:
        target = str(entry.get("target"))
        if target not in invocation.inventory.targets:
            raise NotFound(
                f"node {entry.get('rank')} of run {name!r} was on target {target!r}, which is not in "
                f"{invocation.inventory.path}",
                hint="add the target back, or pass --target for one node",
            )
        nodes.append(RunNode(int(entry.get("rank", len(nodes))), invocation.inventory.targets[target]))
    return nodes


def node_target(invocation: Invocation, name: str, node: int | None) -> str | None:
    """`--node K` -> that node's target name (None without --node); UsageError for a run on one target."""
    if node is None:
        return None
    nodes = nodes_of(invocation, name)
    if nodes is None:
        if node == 0:
            return None
        raise UsageError(f"run {name!r} runs on one target: it has only node 0", hint="leave out --node")
    for entry in nodes:
        if entry.rank == node:
            return entry.target.name
    raise UsageError(f"run {name!r} has nodes 0-{len(nodes) - 1}, not {node}")


def on_every_node(
    invocation: Invocation, nodes: list[RunNode], work: Callable[[RunNode], Any]
) -> list[tuple[RunNode, Any]]:
    """`work(node)` on every node at once (one thread each; the agents are made here first, on this thread).
    Returns (node, result or the DflashopsError it raised), in rank order."""
    for node in nodes:
        invocation.agent(node.target)

    def attempt(node: RunNode) -> tuple[RunNode, Any]:
        try:
            return node, work(node)
        except DflashopsError as exc:
            return node, exc

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(attempt, nodes))


@dataclass
class Stopped:
    """What a stop did (ops/runs/control.py stop_run, stop_nodes): the agent's answer (agent/answers.py
    StopAnswer), None when a dry run only planned the call; for a run on several targets node 0's, with
    `escalated`, `seconds` and `recorded` over every node, and `nodes`: each node's `node` and `target` with its
    answer's keys, or `not_running`."""

    answer: StopAnswer | None
    nodes: list[dict[str, Any]] = field(default_factory=list)


def stop_nodes(
    invocation: Invocation,
    name: str,
    nodes: list[RunNode],
    *,
    grace: float,
    save_grace: float,
    not_running: type[DflashopsError],
    now: bool = False,
    by: str = "stop",
) -> Stopped:
    """Stop every node at once (Stopped: node 0's answer, and each node's answer or error). Raises
    `not_running` when no node was running, the first node's error when one could not be stopped (after every
    other node was)."""
    results = on_every_node(
        invocation,
        nodes,
        lambda node: invocation.agent(node.target).ask(
            "stop",
            StopRequest(workspace=node.target.workspace, name=name, grace=grace, save_grace=save_grace, by=by, now=now),
            StopAnswer,
        ),
    )
    stopped = [(node, answer) for node, answer in results if not isinstance(answer, DflashopsError)]
    failures = [
        (node, error)
        for node, error in results
        if isinstance(error, DflashopsError) and "is not running" not in error.message
    ]
    if failures:
        node, error = failures[0]
        raise type(error)(
            f"node {node.rank} ({node.target.name}): {error.message}"
            + (f"; nodes {', '.join(str(n.rank) for n, _ in stopped)} were stopped" if stopped else ""),
            hint=error.hint,
        )
    if not stopped:
        raise not_running(
            f"run {name!r} is not running on any of its {len(nodes)} nodes",
            hint=f"`dflashops status {name}` shows how it ended",
        )
    answer = copy.copy(stopped[0][1])  # node 0's (None: a dry run only planned the calls)
    every: list[StopAnswer] = [a for _, a in stopped if a is not None]
    if answer is not None:
        answer.escalated = any(a.escalated for a in every)
        answer.seconds = max(a.seconds for a in every)
        answer.recorded = all(a.recorded for a in every)  # None (another command records it) counts as not
    per_node = [
        {
            "node": node.rank,
            "target": node.target.name,
            **(
                {"not_running": True}
                if isinstance(answer_, DflashopsError)
                else answer_json(answer_)
                if answer_ is not None
                else {}
            ),
        }
        for node, answer_ in results
    ]
    return Stopped(answer, per_node)


def node_runs(invocation: Invocation, node: RunNode, name: str) -> list[dict[str, Any]]:
    """The node's status entry of run `name` (checked: agent/answers.py StatusAnswer) as its JSON object."""
    answer = invocation.agent(node.target).ask(
        "status", StatusRequest(workspace=node.target.workspace, name=name), StatusAnswer
    )
    return [answer_json(entry) for entry in answer.runs] if answer is not None else []


def status_nodes(
    invocation: Invocation, name: str, nodes: list[RunNode], *, unreachable_ok: bool = False
) -> list[dict[str, Any]]:
    """Every node's status entry (with `node` and `target`), rank order; NotFound when no node has the run.
    A node that cannot be reached (TransportError) raises, or with `unreachable_ok` (`status`, which shows
    every node) gives an entry of state "unreachable" with the reason in `error` and `hint`."""
    results = on_every_node(
        invocation,
        nodes,
        lambda node: node_runs(invocation, node, name),
    )
    entries: list[dict[str, Any]] = []
    for node, runs in results:
        if isinstance(runs, (NotFound, TransportError)):
            unreachable = isinstance(runs, TransportError)
            if unreachable and not unreachable_ok:
                raise type(runs)(f"node {node.rank} ({node.target.name}): {runs.message}", hint=runs.hint)
            entries.append(
                {
                    "name": name,
                    "node": node.rank,
                    "target": node.target.name,
                    "state": "unreachable" if unreachable else "missing",
                    "exit_code": None,
                    "step": None,
                    "error_line": None if unreachable else runs.message,
                    "run_json": {},
                    **({"error": runs.message.splitlines()[0], "hint": runs.hint} if unreachable else {}),
                }
            )
            continue
        if isinstance(runs, DflashopsError):
            raise type(runs)(f"node {node.rank} ({node.target.name}): {runs.message}", hint=runs.hint)
        for entry in runs:
            entries.append({**entry, "node": node.rank, "target": node.target.name})
    if all(entry["state"] == "missing" for entry in entries):
        raise NotFound(f"run {name!r} exists on none of its nodes ({', '.join(n.target.name for n in nodes)})")
    return entries


def unreachable_error(name: str, entries: list[dict[str, Any]]) -> TransportError | None:
    """The error of the first node `status_nodes(unreachable_ok=True)` could not reach (None when it reached
    them all): what the CLI ends with after showing every node, as a one-target status would."""
    for entry in entries:
        if entry.get("state") == "unreachable":
            return TransportError(
                f"node {entry['node']} ({entry['target']}) of run {name!r} is unreachable: {entry['error']}",
                hint=entry.get("hint"),
            )
    return None


def read_nodes(
    invocation: Invocation, name: str, nodes: list[RunNode], read_one: Callable[..., Iterator[str]], *, follow: bool
) -> Iterator[str]:
    """Every node's log as complete lines prefixed `[node K] `: node after node, or with `follow`, merged as
    they arrive (one follower thread per node; `read_one(node, follow, should_stop)` reads one node's log and
    ends soon after should_stop() turns true, which it does when this generator is closed)."""
    if not follow:
        for node in nodes:
            yield from prefixed(read_one(node, False, lambda: False), node.rank)
        return
    for node in nodes:
        invocation.agent(node.target)
    events: queue.Queue[tuple[str, int, Any]] = queue.Queue()
    closing = threading.Event()

    def follow_node(node: RunNode) -> None:
        try:
            for line in prefixed(read_one(node, True, closing.is_set), node.rank):
                if closing.is_set():
                    return
                events.put(("line", node.rank, line))
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread, which raises it
            events.put(("error", node.rank, exc))
        finally:
            events.put(("done", node.rank, None))

    threads = [
        threading.Thread(target=follow_node, args=(node,), daemon=True, name=f"logs-node-{node.rank}") for node in nodes
    ]
    for thread in threads:
        thread.start()
    done, error = 0, None
    try:
        while done < len(nodes):
            kind, rank, value = events.get()
            if kind == "line":
                yield value
            elif kind == "error":
                error = error or value
            else:
                done += 1
        if error is not None:
            raise error
    finally:
        closing.set()


def prefixed(chunks: Iterator[str], rank: int) -> Iterator[str]:
    pending = ""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            yield f"[node {rank}] {line}\n"
    if pending:
        yield f"[node {rank}] {pending}"


def relaunch_nodes(
    invocation: Invocation,
    old: Any,
    profile: Profile,
    request: DeployRequest,
    *,
    resume: bool,
    grace: float,
    not_running: type[DflashopsError],
) -> tuple[Stopped | None, str | None, DeployOutcome]:
    """`restart` of a run on several targets: stop every node (a node already ended is fine), pick node 0's
    latest checkpoint when resuming (only node 0 reads it; every node gets the same --resume), and deploy the
    child on the same targets. Returns (what the stop did, None when no node was running; checkpoint; the
    child's outcome)."""
    nodes = nodes_of(invocation, old.name)
    assert nodes is not None
    try:
        stop = stop_nodes(
            invocation, old.name, nodes, grace=grace, save_grace=600.0, not_running=not_running, by="restart"
        )
    except not_running:
        stop = None
    entries = status_nodes(invocation, old.name, nodes)
    observe_and_tell(invocation, entries)
    checkpoint = None
    if resume:
        first = next(entry for entry in entries if entry["node"] == 0)
        if not first.get("checkpoints"):
            raise NotFound(
                f"run {old.name!r} has no checkpoint on node 0 ({nodes[0].target.name}) to resume from",
                hint="use --fresh to start from scratch",
            )
        checkpoint = f"{first['run_dir']}/checkpoints/{first['checkpoints'][-1]}"
    targets = tuple(node.target for node in nodes)
    group = invocation.inventory.groups.get(str(old.extra.get("group"))) or Group(
        name=",".join(target.name for target in targets), targets=tuple(target.name for target in targets)
    )
    deployed = deploy_nodes(invocation, replace(request, checkpoint=checkpoint), targets, group, profile)
    return stop, checkpoint, deployed
