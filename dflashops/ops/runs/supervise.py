"""Starting the in-target supervisor (agent/supervisor.py) beside a run whose profile sets `on_failure`/`stall`.

Recovery must not depend on the controller staying awake, so everything the supervisor needs travels in
its start request: the policy, and a launch TEMPLATE for the runs it may have to start (the profile's argv,
environment and run.json built by launch's own `launch_spec`, with sentinels where the child's name, parent,
note and checkpoint go). The request holds the run's secrets (and the webhook URL when `notify.from_target`
is set): it goes on stdin, the supervisor keeps it in memory only, and the dry-run plan shows it redacted.

The supervisor is part of the agent's package: it runs from the agent's one content-addressed zipapp
(`python3 agent-<sha12>.pyz supervise start --json-stdin`), so a running supervisor's code is never replaced
under it and nothing else is uploaded. Cost: one `start` call (~one agent round trip).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from dflashops.agent.template_sentinels import SENTINELS
from dflashops.core.errors import AgentError, Conflict, DflashopsError
from dflashops.core.inventory import Profile, Target
from dflashops.core.inventory_policy import shown_url
from dflashops.lineage.record import REDACTED
from dflashops.ops.agent_client import Agent, _parse, readable_json
from dflashops.ops.runs.launch import DeployRequest, launch_spec
from dflashops.ops.runs.observe import started
from dflashops.ops.session import Session

POLL_S = 2.0  # a status poll is one read of a few small files: cheap; stall windows shorter than 8 s poll faster


def wanted(profile: Profile) -> bool:
    return profile.on_failure is not None or profile.stall is not None


def template(
    invocation: Session, request: Any, target: Target, profile: Profile, code_hash: str, release_path: str, root: str
) -> dict[str, Any]:
    """The launch of a child run, with sentinels (see the module docstring)."""
    base = replace(request, parent=None, note="", checkpoint=None)
    fresh = launch_spec(invocation, base, target, profile, SENTINELS["name"], code_hash, release_path)
    resumed = None
    if profile.resume_args:
        resumed = launch_spec(
            invocation,
            replace(base, checkpoint=SENTINELS["checkpoint"]),
            target,
            profile,
            SENTINELS["name"],
            code_hash,
            release_path,
        )
    env = {
        **fresh.env,
        "WANDB_RUN_GROUP": root,
        "DFLASHOPS_RUN_PARENT": SENTINELS["parent"],
        "WANDB_NOTES": SENTINELS["note"],
        "DFLASHOPS_RUN_NOTE": SENTINELS["note"],
    }
    run_json = dict(fresh.args.run_json)
    run_json["env"] = {
        **fresh.record.env,
        "WANDB_RUN_GROUP": root,
        "DFLASHOPS_RUN_PARENT": SENTINELS["parent"],
        "WANDB_NOTES": SENTINELS["note"],
        "DFLASHOPS_RUN_NOTE": SENTINELS["note"],
    }
    return {
        "argv": fresh.args.argv,
        "argv_resume": resumed.args.argv if resumed else None,
        "shown_argv": fresh.record.argv,
        "shown_argv_resume": resumed.record.argv if resumed else None,
        "env": env,
        "shown_env": run_json["env"],
        "cwd": fresh.args.cwd,
        "launcher": fresh.args.launcher,
        "standby": bool(fresh.args.standby),  # an auto-restart takes the target's standby interpreter too
        "standby_idle_s": fresh.args.standby_idle_s,
        "run_json": run_json,
    }


def poll_interval(stall: Any) -> float:
    """POLL_S, or a quarter of the shortest stall window (so a stall is seen within window + window/4)."""
    windows = [
        w
        for w in ((stall.heartbeat_s, stall.for_s if stall.gpu_util_below is not None else None) if stall else ())
        if w
    ]
    return max(0.1, min([POLL_S, *(w / 4 for w in windows)]))


def start(
    invocation: Session,
    request: Any,
    target: Target,
    profile: Profile,
    name: str,
    code_hash: str,
    release_path: str,
    restarts: int = 0,
    root: str | None = None,
) -> dict[str, Any] | None:
    """Start the supervisor for the run `name` just launched (None when the profile asks for none). Its
    failure to start is reported (AgentError) after the run is already running: the run stays up. `restarts`
    and `root` (the name its restarts are named after) carry on a supervisor that died (`revive`)."""
    if not wanted(profile):
        return None
    agent: Agent = invocation.agent(target)
    root = invocation.db.root(name) if invocation.record_of(name) else name
    notify = invocation.inventory.notify
    webhook = None
    if notify is not None and notify.from_target:
        webhook = notify.webhook or (os.environ.get(notify.webhook_env) if notify.webhook_env else None)
    on_failure, stall = profile.on_failure, profile.stall
    launch_template = template(invocation, request, target, profile, code_hash, release_path, root)
    req = {
        "workspace": target.workspace,
        "root": root or name,
        "run": name,
        "restarts": restarts,
        "target": target.name,
        "gpus": list(target.gpus),
        "poll_s": poll_interval(stall),
        "on_failure": None
        if on_failure is None
        else {
            "resume": on_failure.resume,
            "max_restarts": on_failure.max_restarts,
            "backoff_s": on_failure.backoff_s,
            "exit_codes": list(on_failure.exit_codes),
        },
        "stall": None
        if stall is None
        else {
            "heartbeat_s": stall.heartbeat_s,
            "gpu_util_below": stall.gpu_util_below,
            "for_s": stall.for_s,
            "grace_s": stall.grace_s,
        },
        "events": list(notify.events) if notify else [],
        "webhook": webhook,
        "webhook_timeout_s": notify.timeout_s if notify else 10.0,
        "webhook_retry_s": list(notify.retry_s) if notify else [],
        "template": launch_template,
    }
    agent.ensure()  # the zipapp the supervisor runs from (uploaded by the launch already, unless in a dry run)
    argv = [target.python, agent.path, "supervise", "start", "--json-stdin"]
    if invocation.dry_run:
        shown = {
            **req,
            "webhook": shown_url(webhook) if webhook else None,
            "template": {
                **launch_template,
                "env": {k: launch_template["shown_env"].get(k, REDACTED) for k in launch_template["env"]},
            },
        }
        agent.record(argv, "request JSON: " + readable_json(shown))
        return {"dry_run": True}
    result = agent.transport.run(argv, stdin=json.dumps(req).encode(), check=False, timeout=60)
    answer = _parse(result.stdout, result.stderr, "supervisor start", target.name)
    if answer.get("code") == "conflict":
        raise Conflict(f"{target.name}: {answer.get('error')}")
    if not answer.get("ok"):
        raise AgentError(
            f"{target.name}: the supervisor of {name} did not start: {answer.get('error')}",
            hint=f"{name} runs unsupervised; see {target.workspace}/supervisors/{name}.log",
        )
    return answer


def after_launch(
    invocation: Session, request: Any, target: Target, profile: Profile, name: str, code_hash: str, release_path: str
) -> dict[str, Any] | None:
    """What follows every launch by deploy/restart: the `started` notification, then `start`, with a failure
    of the supervisor turned into {"ok": False, "error", "hint"}: the run is launched already and stays up,
    so the caller reports a warning instead of failing the deploy."""
    started(invocation, target.name, name, request.note, request.parent)
    try:
        return start(invocation, request, target, profile, name, code_hash, release_path)
    except DflashopsError as exc:
        return {"ok": False, "error": exc.message, "hint": exc.hint}


def revive(invocation: Session, status: dict[str, Any]) -> str | None:
    """A run's supervisor that died (the agent's status says its supervisor.json is watching or waiting out a
    backoff, and its pid is no supervisor): start a new one with the same root and restart count, from the
    run's lineage record and this shell's environment (its secrets), and return a line saying so (a warning
    when it cannot be done from here). A crash that happened meanwhile is then handled by `on_failure` as if
    it had been watching: the new supervisor finds the run ended and acts on it. Two commands that both revive
    it get one supervisor: the second start finds the root supervised already. None when nothing was dead.
    Called by the observer (ops/runs/observer.py) only; `status["supervisor"]["revived"]` records the outcome."""
    supervisor = status.get("supervisor") or {}
    if supervisor.get("alive") is not False or invocation.dry_run:
        return None
    supervisor["revived"] = None  # tried: the table says "NOT restarted" unless a start below succeeds
    name, dead = str(supervisor.get("run") or status.get("name")), supervisor.get("pid")
    record = invocation.record_of(name)
    target = invocation.inventory.targets.get(record.target) if record else None
    profile = invocation.inventory.profiles.get(record.profile or "") if record else None
    if record is None or target is None or profile is None or not wanted(profile):
        why = "no lineage record" if record is None else f"its profile {record.profile!r} asks for none here"
        return f"warning: {name}'s supervisor (pid {dead}) has died and cannot be started again from here ({why})"
    request = DeployRequest(
        target=target.name,
        profile=profile.name,
        name=name,
        parent=record.parent,
        note=record.note,
        launcher=record.launcher,
        extra_args=list(record.extra.get("extra_args") or []),
    )
    release = str(record.extra.get("release") or f"{target.workspace}/releases/{record.code_hash}")
    try:
        answer = start(
            invocation,
            request,
            target,
            profile,
            name,
            record.code_hash,
            release,
            restarts=int(supervisor.get("restarts") or 0),
            root=str(supervisor.get("root") or name),
        )
    except Conflict:
        supervisor["revived"] = "elsewhere"
        return None  # another command started it again a moment ago
    except DflashopsError as exc:
        return f"warning: {name}'s supervisor (pid {dead}) has died and could not be started again: {exc.message}"
    supervisor["revived"] = (answer or {}).get("pid")
    return f"{name}'s supervisor (pid {dead}) had died; started a new one (pid {supervisor['revived']})"


def supervision_note(entry: dict[str, Any]) -> str | None:
    """How a status entry's run is supervised, in words for `status` and `watch`: "supervised", "supervised,
    restart pending", "supervisor died, restarted (pid N)", "supervisor died, NOT restarted" (the observer tried),
    "supervisor died; `dflashops status` restarts it" (nobody acted on this read: `watch`); None when no supervisor watches it."""
    supervisor = entry.get("supervisor") or {}
    if supervisor.get("state") not in ("watching", "backoff"):
        return None
    if supervisor.get("alive") is False:
        if "revived" not in supervisor:
            return "supervisor died; `dflashops status` restarts it"
        revived = supervisor.get("revived")
        if revived == "elsewhere":
            return "supervisor died, restarted by another command"
        return f"supervisor died, restarted (pid {revived})" if revived else "supervisor died, NOT restarted"
    return "supervised, restart pending" if supervisor.get("state") == "backoff" else "supervised"
