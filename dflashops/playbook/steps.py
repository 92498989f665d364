"""What each playbook step does: a thin call into dflashops.ops (never the CLI, never a shell).

Every step function takes the run context and its rendered arguments and returns a StepOutcome
(changed or not, a one-line detail, a dict that `register:` stores), or raises a DflashopsError. In check
mode the Invocation is a dry-run one: mutating agent calls are recorded as the exact commands they would
run, read-only calls (status, manifest) still run, and steps that only observe (wait, assert, collect)
describe what they would poll instead of polling.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflashops.core.errors import CommandFailed, NotFound, RunFailed, UsageError, WaitTimeout
from dflashops.core.shell import join_argv
from dflashops.ops.agent_client import ClearCacheAnswer, StatusAnswer
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import sync
from dflashops.ops.runs.control import DEFAULT_FAIL_ON, LogCursor, NotRunning, read_log, run_status, stop_run, wait_for
from dflashops.ops.runs.deploy import deploy
from dflashops.ops.runs.launch import DeployRequest
from dflashops.ops.runs.observer import observe_and_tell
from dflashops.ops.runs.restart import RestartRequest, restart
from dflashops.playbook.expr import MissingMetric, lookup, parse

DEFAULT_FIELDS = ["step", "loss", "tau_sim", "block_tok_s"]


@dataclass
class Context:
    invocation: Invocation
    target: str | None  # `play --target`: the default for steps that name none
    check: bool
    scope: dict[str, Any]
    say: Callable[[str], None] = lambda text: None
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    planned_runs: set[str] = field(default_factory=set)  # check mode: runs earlier steps would have launched

    def target_arg(self, args: dict[str, Any]) -> str | None:
        return str(args["target"]) if args.get("target") else self.target


@dataclass
class StepOutcome:
    changed: bool
    detail: str
    result: dict[str, Any] = field(default_factory=dict)


def _number(args: dict[str, Any], key: str, default: float | None = None) -> float:
    value = args.get(key, default)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UsageError(f"{key} must be a number, got {value!r}") from None
    if number < 0 or (key == "timeout" and number == 0):
        raise UsageError(f"{key} must be > 0, got {value!r}")
    return number


def _profile_and_target(ctx: Context, args: dict[str, Any]) -> tuple[Any, Any]:
    """(Profile or None, Target) for sync/clear-cache: from `profile`/`target`, else from `run`'s record."""
    inventory, record = ctx.invocation.inventory, None
    if args.get("run"):
        record = ctx.invocation.db.get(str(args["run"]))
    profile_name = args.get("profile") or (record.profile if record else None)
    profile = inventory.profile(str(profile_name)) if profile_name else None
    target = inventory.target(ctx.target_arg(args) or (record.target if record else None))
    return profile, target


def do_stop(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    run, grace = str(args["run"]), _number(args, "grace", 60.0)
    if ctx.check and run in ctx.planned_runs:
        # The run only exists in this plan, so the agent cannot be asked about it: show the stop call itself.
        target = ctx.invocation.target_for_run(run, ctx.target_arg(args))
        argv = ctx.invocation.agent(target).argv("stop", {"grace": grace, "name": run, "workspace": target.workspace})
        return StepOutcome(True, f"would stop {run}", {"commands": [f"[{target.name}] {join_argv(argv)}"]})
    try:
        answer = stop_run(ctx.invocation, run, target=ctx.target_arg(args), grace=grace).answer
    except NotRunning:
        return StepOutcome(False, f"{run} was not running", {"stopped": False, "exit_code": None})
    if ctx.check or answer is None:  # None: the stop was only planned
        return StepOutcome(True, f"would stop {run}", {"stopped": True, "exit_code": None})
    how = "SIGKILL after the grace period" if answer.escalated else "SIGTERM"
    return StepOutcome(
        True,
        f"stopped {run} by {how}, exit code {answer.exit_code}",
        {"stopped": True, "exit_code": answer.exit_code, "escalated": answer.escalated},
    )


def do_sync(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    profile, target = _profile_and_target(ctx, args)
    outcome = sync(
        ctx.invocation.agent(target),
        extra_files=profile.files if profile else (),
        extra_root=ctx.invocation.inventory.root,
    )
    detail = f"release {outcome.code_hash}: {len(outcome.uploaded)} files uploaded, {len(outcome.linked)} unchanged"
    return StepOutcome(
        bool(outcome.uploaded),
        detail,
        {"code_hash": outcome.code_hash, "release": outcome.release_path, "uploaded": list(outcome.uploaded)},
    )


def do_clear_cache(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    """Remove the target's compile caches (shared by every code version: the next run compiles cold)."""
    _, target = _profile_and_target(ctx, args)
    answer = ctx.invocation.agent(target).ask(
        "clear-cache", {"workspace": target.workspace, "compile_cache": target.compile_cache_root}, ClearCacheAnswer
    )
    removed = answer.removed if answer is not None else []  # None: a check only planned it
    freed = answer.bytes if answer is not None else None
    detail = (
        f"would remove the compile caches of {target.name}"
        if ctx.check
        else f"removed {', '.join(removed)} ({freed or 0} bytes)"
        if removed
        else f"no compile cache on {target.name}"
    )
    return StepOutcome(bool(removed) or ctx.check, detail, {"removed": removed, "bytes": freed})


def do_deploy(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    """Launch a run. With `parent`, profile/launcher/extra args/target default to the parent's, name to `+`."""
    parent = str(args["parent"]) if args.get("parent") else None
    record = ctx.invocation.db.get(parent) if parent else None
    profile = args.get("profile") or (record.profile if record else None)
    if not profile:
        raise UsageError("deploy needs a profile (or a parent started from one)", hint="add profile: NAME")
    extra = args.get("extra_args", (record.extra.get("extra_args") if record else None) or [])
    if not isinstance(extra, list):
        raise UsageError(f"deploy extra_args must be a list, got {extra!r}")
    outcome = deploy(
        ctx.invocation,
        DeployRequest(
            target=ctx.target_arg(args) or (record.target if record else None),
            profile=str(profile),
            name=str(args["name"]) if args.get("name") else ("+" if parent else None),
            parent=parent,
            note=str(args.get("note") or ""),
            launcher=str(args.get("launcher") or (record.launcher if record else "tmux")),
            clear_cache=bool(args.get("clear_cache", False)),
            extra_args=[str(a) for a in extra],
        ),
    )
    if ctx.check:
        ctx.planned_runs.add(outcome.name)
    verb = "would launch" if ctx.check else "launched"
    return StepOutcome(
        True,
        f"{verb} {outcome.name} on {outcome.target}" + (f" (parent {parent})" if parent else ""),
        {
            "name": outcome.name,
            "target": outcome.target,
            "run_dir": outcome.run_dir,
            "code_hash": outcome.code_hash,
            "pgid": outcome.pgid,
        },
    )


def do_restart(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    extra = args.get("extra_args")
    outcome = restart(
        ctx.invocation,
        RestartRequest(
            run=str(args["run"]),
            name=str(args.get("name") or "+"),
            note=str(args.get("note") or ""),
            resume=bool(args.get("resume", False)),
            clear_cache=bool(args.get("clear_cache", False)),
            launcher=args.get("launcher"),
            extra_args=[str(a) for a in extra] if isinstance(extra, list) else None,
            grace=_number(args, "grace", 60.0),
            unchecked=bool(args.get("unchecked", False)),
        ),
    )
    new = outcome.deployed.name
    if ctx.check:
        ctx.planned_runs.add(new)
    how = f" from {outcome.checkpoint}" if outcome.checkpoint else ""
    return StepOutcome(
        True,
        f"relaunched {args['run']} as {new}{how}",
        {
            "name": new,
            "parent": str(args["run"]),
            "checkpoint": outcome.checkpoint,
            "stopped": outcome.stopped,
            "old_exit_code": outcome.old_exit_code,
        },
    )


def _poll_command(ctx: Context, run: str, args: dict[str, Any]) -> str:
    """The read-only agent call a wait repeats (shown by --check instead of running it)."""
    target = ctx.invocation.target_for_run(run, ctx.target_arg(args))
    agent = ctx.invocation.agent(target)
    verb_args = {"workspace": target.workspace, "name": run, "offset": 0, "inode": None}
    return f"[{target.name}] {join_argv(agent.argv('tail', verb_args))}"


def do_wait(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    run, timeout = str(args["run"]), _number(args, "timeout")
    fail_on = DEFAULT_FAIL_ON if args.get("fail_on") is None else (str(args["fail_on"]) or None)
    what = f"log /{args['log']}/" if "log" in args else f"metric {args['metric']}"
    if ctx.check:
        condition = f"until {what}" + (f", failing on /{fail_on}/" if fail_on else "") + f", at most {timeout:g}s"
        return StepOutcome(
            False,
            f"would poll {run} {condition}",
            {"commands": [f"{_poll_command(ctx, run, args)}  # repeated {condition}"]},
        )
    if "log" in args:
        line = wait_for(
            ctx.invocation,
            run,
            until=str(args["log"]),
            fail_on=fail_on,
            target=ctx.target_arg(args),
            timeout=timeout,
            poll_s=_number(args, "poll", 0.5),
            observe=True,
        )
        return StepOutcome(False, f"{run}: matched {line.strip()[:120]!r}", {"line": line.strip()})
    return _wait_metric(ctx, run, str(args["metric"]), fail_on, timeout, args)


def _wait_metric(
    ctx: Context, run: str, text: str, fail_on: str | None, timeout: float, args: dict[str, Any]
) -> StepOutcome:
    """Poll the run's last metrics until `text` holds; fail early on `fail_on` in the log or when it ends."""
    condition, fail_re = parse(text), re.compile(fail_on) if fail_on else None
    cursor, pending, poll = LogCursor(), "", _number(args, "poll", 0.5)
    deadline = time.monotonic() + timeout
    while True:
        for chunk in read_log(ctx.invocation, run, cursor, target=ctx.target_arg(args)) if fail_re else ():
            assert fail_re is not None  # the log is read only when there is a pattern
            pending += chunk
            *lines, pending = pending.split("\n")
            bad = next((line for line in lines if fail_re.search(line)), None)
            if bad is not None:
                raise RunFailed(
                    f"{run}: failure pattern {fail_on!r} in the log: {bad.strip()}",
                    hint=f"`dflashops logs {run}` shows the whole log",
                )
        entry = _observed_status(ctx, run, args)[0]
        values = {**(entry.get("last_metrics") or {}), "state": entry["state"]}
        try:
            if condition.evaluate(values):
                return StepOutcome(False, f"{run}: {text} (step {values.get('step')})", {"metrics": values})
        except MissingMetric:
            pass  # not logged yet
        if entry["state"] not in ("running", "launching", "stopping"):
            error = f": {entry['error_line']}" if entry.get("error_line") else ""
            raise RunFailed(
                f"{run} ended ({entry['state']} at step {entry.get('step')}, exit code "
                f"{entry.get('exit_code')}) before {text}{error}",
                hint=f"`dflashops logs {run}` shows the whole log",
            )
        if time.monotonic() >= deadline:
            raise WaitTimeout(
                f"{run}: {text} not reached within {timeout:g}s (last step {entry.get('step')})",
                hint="raise the step's timeout",
            )
        time.sleep(poll)


def _observed_status(ctx: Context, run: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's status entries, handed to the observer: a playbook acts on runs, so its reads do what `status`
    does (ops/runs/observer.py: a dead supervisor started again, an end notified once, the lineage following)."""
    entries = run_status(ctx.invocation, run, target=ctx.target_arg(args))
    observe_and_tell(ctx.invocation, entries)
    return entries


def _run_values(ctx: Context, run: str, args: dict[str, Any]) -> dict[str, Any]:
    entry = _observed_status(ctx, run, args)[0]
    return {
        **(entry.get("last_metrics") or {}),
        "state": entry["state"],
        "exit_code": entry.get("exit_code"),
        "step": entry.get("step"),
        "name": run,
    }


def do_assert(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    """`that` over the run's last metrics (+ state, exit_code, step), or over the playbook's variables."""
    text = str(args["that"])
    condition = parse(text)
    run = str(args["run"]) if args.get("run") else None
    if ctx.check:
        return StepOutcome(False, f"would check {text}" + (f" on {run}" if run else ""))
    values = _run_values(ctx, run, args) if run else ctx.scope
    try:
        held = condition.evaluate(values)
    except MissingMetric as exc:
        raise RunFailed(f"assert {text}: {exc.name} has no value" + (f" for {run}" if run else "")) from None
    if not held:
        shown = ", ".join(f"{name}={_safe_lookup(values, name)!r}" for name in condition.names())
        raise RunFailed(str(args.get("message") or f"assert failed: {text} ({shown})"))
    return StepOutcome(False, f"{text} holds", {"values": {n: _safe_lookup(values, n) for n in condition.names()}})


def _safe_lookup(values: dict[str, Any], name: str) -> Any:
    try:
        return lookup(values, name)
    except MissingMetric:
        return None


def do_exec(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    argv = args["argv"]
    if not isinstance(argv, list) or not argv:
        raise UsageError(f"exec argv must be a non-empty list, got {argv!r}")
    argv = [str(word) for word in argv]
    agent = ctx.invocation.agent(ctx.invocation.inventory.target(ctx.target_arg(args)))
    if ctx.check:
        agent.record(argv)
        return StepOutcome(True, f"would run {join_argv(argv)}")
    result = agent.transport.run(argv, check=False)
    if result.exit_code != 0 and args.get("check", True):
        raise CommandFailed(result)
    last = (result.stdout.strip().splitlines() or [""])[-1]
    return StepOutcome(
        True,
        f"exit code {result.exit_code}" + (f": {last[:100]}" if last else ""),
        {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr},
    )


def do_collect(ctx: Context, args: dict[str, Any]) -> StepOutcome:
    """Append the run's last metrics (the named fields) as one row of the report table `into`."""
    run, into = str(args["run"]), str(args["into"])
    fields = args.get("fields") or DEFAULT_FIELDS
    if not isinstance(fields, list):
        raise UsageError(f"collect fields must be a list of metric names, got {fields!r}")
    if ctx.check:
        ctx.tables.setdefault(into, [])
        return StepOutcome(False, f"would add {run}'s {', '.join(map(str, fields))} to table {into!r}")
    values = _run_values(ctx, run, args)
    row = {"run": run, "state": values["state"], **{str(name): _safe_lookup(values, str(name)) for name in fields}}
    ctx.tables.setdefault(into, []).append(row)
    return StepOutcome(False, f"{into}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "run"), row)


def latest_running_run(invocation: Invocation, target: str | None) -> str:
    """The most recently started run that is running now on `target` (for the `{{latest_run}}` default)."""
    tgt = invocation.inventory.target(target)
    # The agent's status verb directly (read-only): in --check mode on a target that has no agent yet,
    # the call is only planned and answers without "runs", which here simply means "none running".
    answer = invocation.agent(tgt).ask("status", {"workspace": tgt.workspace}, StatusAnswer)
    running = [e for e in (answer.runs if answer is not None else []) if e.state == "running"]
    if not running:
        raise NotFound(f"no run is running on target {tgt.name}", hint="name the run: --set run=NAME")
    return max(running, key=lambda e: str(e.run_json.get("started_at") or "")).name


STEP_FUNCTIONS: dict[str, Callable[[Context, dict[str, Any]], StepOutcome]] = {
    "stop": do_stop,
    "sync": do_sync,
    "clear-cache": do_clear_cache,
    "deploy": do_deploy,
    "restart": do_restart,
    "wait": do_wait,
    "assert": do_assert,
    "exec": do_exec,
    "collect": do_collect,
}
