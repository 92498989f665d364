"""Starting the in-target supervisor (agent_supervisor.py) beside a run whose profile sets `on_failure`/`stall`.

Recovery must not depend on the controller staying awake, so everything the supervisor needs travels in
its start request: the policy, and a launch TEMPLATE for the runs it may have to start (the profile's argv,
environment and run.json built by deploy's own `launch_spec`, with sentinels where the child's name, parent,
note and checkpoint go). The request holds the run's secrets (and the webhook URL when `notify.from_target`
is set): it goes on stdin, the supervisor keeps it in memory only, and the dry-run plan shows it redacted.

The supervisor file is content-addressed beside the agent (`<workspace>/.dflashops/supervisor-<sha12>.py`),
like the agent, so a running supervisor's file is never replaced under it. Cost: one upload when the
supervisor changed, one `start` call (~one agent round trip).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflashops.errors import AgentError, DflashopsError
from dflashops.inventory import Profile, Target
from dflashops.inventory_policy import shown_url
from dflashops.lineage.record import REDACTED
from dflashops.ops.agent_client import _UPLOAD, Agent, _parse
from dflashops.ops.invocation import Invocation

SOURCE = Path(__file__).resolve().parent.parent / "agent_supervisor.py"
SENTINELS = {
    "name": "@dflashops-run-name@",
    "parent": "@dflashops-parent@",
    "note": "@dflashops-note@",
    "checkpoint": "@dflashops-checkpoint@",
}  # the same strings as agent_supervisor.SENTINELS
POLL_S = 2.0  # a status poll is one read of a few small files: cheap; stall windows shorter than 8 s poll faster


def wanted(profile: Profile) -> bool:
    return profile.on_failure is not None or profile.stall is not None


def template(
    invocation: Invocation, request: Any, target: Target, profile: Profile, code_hash: str, release_path: str, root: str
) -> dict[str, Any]:
    """The launch of a child run, with sentinels (see the module docstring)."""
    from dflashops.ops.deploy import launch_spec  # deploy imports this module: imported when used

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
    run_json = dict(fresh.args["run_json"])
    run_json["env"] = {
        **fresh.record.env,
        "WANDB_RUN_GROUP": root,
        "DFLASHOPS_RUN_PARENT": SENTINELS["parent"],
        "WANDB_NOTES": SENTINELS["note"],
        "DFLASHOPS_RUN_NOTE": SENTINELS["note"],
    }
    return {
        "argv": fresh.args["argv"],
        "argv_resume": resumed.args["argv"] if resumed else None,
        "shown_argv": fresh.record.argv,
        "shown_argv_resume": resumed.record.argv if resumed else None,
        "env": env,
        "shown_env": run_json["env"],
        "cwd": fresh.args["cwd"],
        "launcher": fresh.args["launcher"],
        "standby": fresh.args.get("standby", False),  # an auto-restart takes the target's standby interpreter too
        "standby_idle_s": fresh.args.get("standby_idle_s"),
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


def supervisor_path(target: Target, source: bytes) -> str:
    return f"{target.workspace}/.dflashops/supervisor-{hashlib.sha256(source).hexdigest()[:12]}.py"


def start(
    invocation: Invocation,
    request: Any,
    target: Target,
    profile: Profile,
    name: str,
    code_hash: str,
    release_path: str,
    restarts: int = 0,
) -> dict[str, Any] | None:
    """Start the supervisor for the run `name` just launched (None when the profile asks for none). Its
    failure to start is reported (AgentError) after the run is already running: the run stays up."""
    if not wanted(profile):
        return None
    agent: Agent = invocation.agent(target)
    root = invocation.db.root(name) if invocation.record_of(name) else name
    source = SOURCE.read_bytes()
    path = supervisor_path(target, source)
    notify = invocation.inventory.notify
    webhook = None
    if notify is not None and notify.from_target:
        webhook = notify.webhook or (os.environ.get(notify.webhook_env) if notify.webhook_env else None)
    on_failure, stall = profile.on_failure, profile.stall
    launch_template = template(invocation, request, target, profile, code_hash, release_path, root)
    req = {
        "workspace": target.workspace,
        "agent": agent.path,
        "root": name,
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
        "template": launch_template,
    }
    argv = [target.python, path, "start", "--json-stdin"]
    if invocation.dry_run:
        shown = {
            **req,
            "webhook": shown_url(webhook) if webhook else None,
            "template": {
                **launch_template,
                "env": {k: launch_template["shown_env"].get(k, REDACTED) for k in launch_template["env"]},
            },
        }
        agent.record([target.python, "-c", "<upload>", path], "agent_supervisor.py")
        agent.record(argv, "request JSON: " + json.dumps(shown, sort_keys=True))
        return {"dry_run": True}
    agent.transport.run([target.python, "-c", _UPLOAD, path], stdin=source)  # a few KB; idempotent
    result = agent.transport.run(argv, stdin=json.dumps(req).encode(), check=False, timeout=60)
    answer = _parse(result.stdout, result.stderr, "supervisor start", target.name)
    if not answer.get("ok"):
        raise AgentError(
            f"{target.name}: the supervisor of {name} did not start: {answer.get('error')}",
            hint=f"{name} runs unsupervised; see {target.workspace}/supervisors/{name}.log",
        )
    return answer


def after_launch(
    invocation: Invocation, request: Any, target: Target, profile: Profile, name: str, code_hash: str, release_path: str
) -> dict[str, Any] | None:
    """What follows every launch by deploy/restart: the `started` notification, then `start`, with a failure
    of the supervisor turned into {"ok": False, "error", "hint"}: the run is launched already and stays up,
    so the caller reports a warning instead of failing the deploy."""
    from dflashops.ops.observe import started

    started(invocation, target.name, name, request.note, request.parent)
    try:
        return start(invocation, request, target, profile, name, code_hash, release_path)
    except DflashopsError as exc:
        return {"ok": False, "error": exc.message, "hint": exc.hint}
