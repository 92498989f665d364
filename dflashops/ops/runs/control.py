"""stop, status and log following: plain functions over an Invocation (no printing here).

`run_status`, `target_status`, `read_log`, `wait_for` and `ended_badly` only read: they change nothing, not even the
lineage. `stop_run` acts, and hands what it read afterwards to the observer (ops/runs/observer.py); `wait_for`
does so too when its caller acts (`observe=True`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from dflashops.agent.answers import Answer, StatusAnswer, StopAnswer, TailAnswer, answer_json
from dflashops.agent.protocol import Request, StatusRequest, StopRequest, TailRequest
from dflashops.core.errors import Conflict, DflashopsError, RunFailed, TransportError, UsageError, WaitTimeout
from dflashops.core.shell import validate_name
from dflashops.ops.agent_client import Agent, Busy, checked
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.job_state import overall
from dflashops.ops.runs.nodes import Stopped, nodes_of, read_nodes, status_nodes, stop_nodes
from dflashops.ops.runs.observer import observe_and_tell

DEFAULT_FAIL_ON = r"Traceback \(most recent call last\)"


class NotRunning(DflashopsError):
    """`stop` of a run that is not running: nothing was signalled."""

    exit_code = 9


def stop_run(
    invocation: Invocation,
    name: str,
    *,
    target: str | None = None,
    grace: float = 60.0,
    save_grace: float = 600.0,
    now: bool = False,
) -> Stopped:
    """TERM -> grace -> KILL the run's own processes, wait until they (and their GPU memory) are gone; a run
    still writing its checkpoint after `grace` gets up to `save_grace` seconds more before the KILL. A stop that
    meets another stop or restart of the run waits for it and answers with its outcome (`joined`) instead of
    signalling again; `now` kills the run at once (no final checkpoint), whatever else is going on.
    Raises NotRunning (nothing signalled) when the run is not running, NotFound when it does not exist.
    A run on several targets is stopped on every node at once (ops/runs/nodes.py). Returns the agent's answer
    (Stopped.answer, agent/answers.py StopAnswer; None when a dry run only planned the stop) and, for a run on
    several targets, each node's (Stopped.nodes).
    May change: the run (signals), and through the observer its lineage record, notifications and supervisor."""
    validate_name(name, what="run name")
    if not invocation.dry_run and (nodes := nodes_of(invocation, name, target)):
        stopped = stop_nodes(
            invocation, name, nodes, grace=grace, save_grace=save_grace, not_running=NotRunning, now=now
        )
        observe_and_tell(invocation, status_nodes(invocation, name, nodes))
        return stopped
    tgt = invocation.target_for_run(name, target)
    agent = invocation.agent(tgt)
    if invocation.dry_run:  # read-only check, so the plan shows what a real stop would do
        known = agent.ask("status", StatusRequest(workspace=tgt.workspace, name=name), StatusAnswer)
        state = known.runs[0].state if known is not None else None  # None: the read was only planned
        if state not in (None, "running", "stopping"):
            raise NotRunning(
                f"{tgt.name}: run {name!r} is not running ({state})",
                hint=f"`dflashops status {name}` shows how it ended",
            )
    request = StopRequest(workspace=tgt.workspace, name=name, grace=grace, save_grace=save_grace, now=now)
    try:
        answer = agent.ask("stop", request, StopAnswer)
    except Busy as exc:
        raise Conflict(
            exc.message, hint=f"wait for it (`dflashops status {name}`), or end it at once: dflashops stop {name} --now"
        ) from None
    except DflashopsError as exc:
        if "is not running" in exc.message:
            raise NotRunning(exc.message, hint=f"`dflashops status {name}` shows how it ended") from None
        raise
    if not invocation.dry_run:
        after = agent.ask("status", StatusRequest(workspace=tgt.workspace, name=name), StatusAnswer)
        observe_and_tell(invocation, [answer_json(entry) for entry in after.runs] if after is not None else [])
    return Stopped(answer)


def run_status(
    invocation: Invocation, name: str | None = None, *, target: str | None = None, unreachable_ok: bool = False
) -> list[dict[str, Any]]:
    """Agent status entries (one run, or every run of the target), each with its `target`: facts only, nothing is
    changed (the observer, ops/runs/observer.py, acts on them for the verbs that should). A run on several targets
    gives one entry per node (`node`, `target`), node 0 first; `overall` makes them one. With `unreachable_ok`, a
    node that cannot be reached is an entry of state "unreachable" (status_nodes)."""
    if name is None:
        return target_status(invocation, target)[0]
    validate_name(name, what="run name")
    if nodes := nodes_of(invocation, name, target):
        return status_nodes(invocation, name, nodes, unreachable_ok=unreachable_ok)
    tgt = invocation.target_for_run(name, target)
    return _read(invocation, tgt, StatusRequest(workspace=tgt.workspace, name=name))[0]


def target_status(
    invocation: Invocation, target: str | None, *, ended_within_s: float | None = None
) -> tuple[list[dict[str, Any]], int]:
    """(the agent's status entries of every run on `target`, how many were left out): with `ended_within_s`,
    runs that ended longer ago are left out (the agent counts them instead of reading them; an agent from
    before the option answers every run, and recent_runs filters here)."""
    tgt = invocation.inventory.target(target)
    runs, older = _read(invocation, tgt, StatusRequest(workspace=tgt.workspace, ended_within_s=ended_within_s))
    if ended_within_s is None:
        return runs, 0
    shown = recent_runs(runs, ended_within_s)
    return shown, (older or 0) + len(runs) - len(shown)


def _read(invocation: Invocation, tgt: Any, request: StatusRequest) -> tuple[list[dict[str, Any]], int | None]:
    """The agent's status answer for `tgt` (checked: agent/answers.py StatusAnswer): its run entries as their
    JSON objects, each marked with the target, which observe, lineage and `status --json` take as they always
    did; and its `older_runs`. A read only planned (a dry run before the agent is there) has no runs."""
    answer = invocation.agent(tgt).ask("status", request, StatusAnswer)
    if answer is None:
        return [], None
    return [{**answer_json(entry), "target": tgt.name} for entry in answer.runs], answer.older_runs


def recent_runs(runs: list[dict[str, Any]], ended_within_s: float) -> list[dict[str, Any]]:
    """The runs that have not ended, or ended (agent `ended_at`) within the last `ended_within_s` seconds."""
    cutoff = time.time() - ended_within_s
    return [
        entry for entry in runs if not isinstance(entry.get("ended_at"), (int, float)) or entry["ended_at"] >= cutoff
    ]


@dataclass
class LogCursor:
    """Where a log reader stands: resume from here after a dropped connection (no lost/repeated line)."""

    offset: int = 0
    inode: int | None = None
    check: str | None = None  # the agent's digest of the bytes before `offset` (detects a rewritten log)
    # Where the first read starts, for the agent (start_of_reading); both are dropped once an answer came:
    last_lines: int | None = None  # the last N lines of the log (`logs -n N`)
    to_line_start: bool = False  # `offset` typed by a person: move it forward to a line start
    run_ended: bool = False  # the last answer said the run had ended (its exit code is written)


RECONNECT_ATTEMPTS = 6
A = TypeVar("A", bound=Answer)


def ask_resuming(agent: Agent, verb: str, args: Request, kind: type[A]) -> A | None:
    """A read-only agent call (`Agent.ask`: its answer dataclass) retried after a dropped connection (the ssh
    transport reconnects on the next command). Safe for `tail`: it reads from the cursor's byte offset, which
    only advances after an answer arrived, so a retry neither loses nor repeats a line. Backoff 0.2 s doubling,
    ~6 s in all."""
    for attempt in range(RECONNECT_ATTEMPTS):
        try:
            return agent.ask(verb, args, kind)
        except TransportError:
            if attempt == RECONNECT_ATTEMPTS - 1:
                raise
            time.sleep(min(0.2 * 2**attempt, 2.0))
    raise AssertionError("unreachable")


def read_log(
    invocation: Invocation,
    name: str,
    cursor: LogCursor,
    *,
    target: str | None = None,
    follow: bool = False,
    poll_s: float = 0.5,
    timeout: float | None = None,
    on_notice: Callable[[str], None] = lambda notice: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Iterator[str]:
    """Yield complete chunks of train.log from `cursor` (updated as it goes). With `follow`, keep reading
    until the run has finished and the log is drained, or `timeout` passes (WaitTimeout). A log truncated,
    rewritten or replaced under the reader is read again from its start, and `on_notice` is told why."""
    validate_name(name, what="run name")
    if nodes := nodes_of(invocation, name, target):
        if cursor.offset:
            raise UsageError(
                f"run {name!r} runs on {len(nodes)} targets: a byte offset means one node's log",
                hint="add --node K (0 is the one with the metrics)",
            )
        yield from read_nodes(
            invocation,
            name,
            nodes,
            lambda node, follow_node, stop: read_log(
                invocation,
                name,
                LogCursor(last_lines=cursor.last_lines),
                target=node.target.name,
                follow=follow_node,
                poll_s=poll_s,
                timeout=timeout,
                on_notice=on_notice,
                should_stop=stop,
            ),
            follow=follow,
        )
        return
    tgt = invocation.target_for_run(name, target)
    agent = invocation.agent(tgt)
    deadline = None if timeout is None else time.monotonic() + timeout
    reader = LogReader(name, cursor, on_notice)
    if not follow:
        while True:  # what is there when asked (a long log comes in 1 MiB pieces)
            answer = ask_resuming(agent, "tail", reader.request(tgt.workspace), TailAnswer)
            if answer is None:  # only planned (a dry run before the agent is there): nothing to read
                return
            if data := reader.take(answer):
                yield data
            if not answer.more:
                return
    while True:
        # One long-lived `follow` stream (the agent pushes each new line ~20 ms after it is written, plus a
        # heartbeat a second): a line reaches the user half a round trip after the agent sees it, instead of
        # a new `pct exec` per answer. When the stream breaks (a cut, a restarted container) one `tail` call
        # through ask_resuming reconnects and says what happened; the next stream starts at the cursor, so
        # nothing is lost or repeated.
        try:
            for line in agent.stream("follow", reader.request(tgt.workspace)):
                if data := reader.take(checked(tgt.name, "follow", TailAnswer, line)):
                    yield data
                if reader.done or should_stop():
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"{name}: no match within {timeout:g}s", hint="raise --timeout")
        except TransportError:
            pass
        answer = ask_resuming(agent, "tail", reader.request(tgt.workspace), TailAnswer)
        if answer is None:
            return
        if data := reader.take(answer):
            yield data
        if reader.done:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"{name}: no match within {timeout:g}s", hint="raise --timeout")
        time.sleep(min(poll_s, 0.5))


@dataclass
class LogReader:
    """The cursor bookkeeping shared by `tail` answers and `follow` stream answers."""

    name: str
    cursor: LogCursor
    on_notice: Callable[[str], None]
    done: bool = False  # the run has ended and everything up to the end of its log was delivered

    def request(self, workspace: str) -> TailRequest:
        """The `tail`/`follow` request that reads on from the cursor (and where a first read starts)."""
        return TailRequest(
            workspace=workspace,
            name=self.name,
            offset=self.cursor.offset,
            inode=self.cursor.inode,
            check=self.cursor.check,
            lines=self.cursor.last_lines,
            align=self.cursor.to_line_start,
        )

    def take(self, answer: TailAnswer) -> str:
        """Advance the cursor past `answer`; its data ("" when none)."""
        moved = answer.offset != self.cursor.offset or answer.inode != self.cursor.inode or bool(answer.notice)
        self.cursor.offset, self.cursor.inode, self.cursor.check = answer.offset, answer.inode, answer.check
        self.cursor.last_lines, self.cursor.to_line_start = None, False
        self.cursor.run_ended = answer.finished
        if answer.notice:
            self.on_notice(f"{self.name}: {answer.notice}")
        self.done = answer.finished and not moved and not answer.more
        return answer.data


def wait_for(
    invocation: Invocation,
    name: str,
    *,
    until: str | None,
    fail_on: str | None = DEFAULT_FAIL_ON,
    target: str | None = None,
    timeout: float | None = None,
    cursor: LogCursor | None = None,
    on_text: Callable[[str], object] = lambda text: None,
    poll_s: float = 0.5,
    on_notice: Callable[[str], None] = lambda notice: None,
    observe: bool = False,
) -> str:
    """Follow the log until `until` matches a line (returns it), `fail_on` matches (RunFailed), the run
    ends first (RunFailed with its state; or returns "" when no `until` was given and it finished or was
    stopped), or
    `timeout` passes (WaitTimeout). Every line read is passed to `on_text` before it is matched.
    May change: nothing; with `observe` (a verb that acts: deploy --wait, a playbook's wait), the status read at
    the run's end goes to the observer (ops/runs/observer.py), which may change what it lists."""
    until_re = re.compile(until) if until else None
    fail_re = re.compile(fail_on) if fail_on else None
    recent: list[str] = []
    pending = ""

    def restarted(notice: str) -> None:  # the log is read again from its start: a held partial line is stale
        nonlocal pending
        pending = ""
        on_notice(notice)

    for chunk in read_log(
        invocation,
        name,
        cursor or LogCursor(),
        target=target,
        follow=True,
        poll_s=poll_s,
        timeout=timeout,
        on_notice=restarted,
    ):
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            on_text(line + "\n")  # line by line, so the output stops exactly at the matching line
            recent = (recent + [line])[-10:]
            if fail_re and fail_re.search(line):
                raise RunFailed(
                    f"{name}: failure pattern {fail_on!r} in the log: {line.strip()}",
                    hint=f"`dflashops logs {name}` shows the whole log",
                )
            if until_re and until_re.search(line):
                return line
    if pending:
        on_text(pending)
        if until_re and until_re.search(pending):
            return pending
    entries = run_status(invocation, name, target=target)
    if observe:
        observe_and_tell(invocation, entries)
    final = overall(entries)
    if until_re is None and final["state"] in ("finished", "stopped"):
        return ""  # only watching for failures: a run that finished or was stopped cleanly did not fail
    last = "\n".join("  | " + line for line in recent[-5:])
    raise RunFailed(
        f"{name} ended ({how_it_ended(final)}) before {until!r} appeared" + (f"\n{last}" if last else ""),
        hint=f"`dflashops logs {name}` shows the whole log",
    )


def how_it_ended(entry: dict[str, Any], *, exit_code: bool = True) -> str:
    """`crashed at step 8, exit code 1: error: ...`: a run's end in one phrase (step and error when known)."""
    detail = f" at step {entry['step']}" if entry.get("step") is not None else ""
    code = f", exit code {entry['exit_code']}" if exit_code else ""
    error = f": {entry['error_line']}" if entry.get("error_line") else ""
    return f"{entry['state']}{detail}{code}{error}"


def ended_badly(invocation: Invocation, name: str, *, target: str | None = None) -> RunFailed | None:
    """RunFailed when the run ended crashed or lost (for `logs -f`, whose exit status scripts check)."""
    final = overall(run_status(invocation, name, target=target))
    if final["state"] not in ("crashed", "lost"):
        return None
    return RunFailed(f"{name} {how_it_ended(final)}", hint=f"`dflashops status {name}` shows its last state")
