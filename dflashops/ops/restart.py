"""restart: the kill-copy-relaunch cycle as one operation.

stop the old run cleanly (SIGTERM first, so the trainer checkpoints), sync, optionally clear this code's
compile cache, relaunch as a NEW run whose parent is the old one. `resume` starts from the old run's
latest checkpoint; nothing of the old run is deleted. A decoy process of the same program outside the
run is never touched (stop works by process group and run marker, never by name).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflashops.errors import Conflict, NotFound, UsageError
from dflashops.ops.control import NotRunning, run_status, stop_run
from dflashops.ops.deploy import DeployOutcome, DeployRequest, deploy
from dflashops.ops.session import Session
from dflashops.shell import validate_name


@dataclass
class RestartRequest:
    run: str
    name: str | None = "+"
    note: str = ""
    resume: bool = False
    clear_cache: bool = False
    launcher: str | None = None
    extra_args: list[str] | None = None  # None: the parent's extra args
    grace: float = 60.0


@dataclass
class RestartOutcome:
    stopped: bool
    old_exit_code: int | None
    checkpoint: str | None
    deployed: DeployOutcome


def restart(session: Session, request: RestartRequest) -> RestartOutcome:
    validate_name(request.run, what="run name")
    old = session.db.get(request.run)  # NotFound with close names
    if old.profile is None or old.profile not in session.inventory.profiles:
        raise UsageError(f"run {old.name!r} was not started from a profile in this inventory",
                         hint="deploy a new run with --profile and --parent instead")
    profile = session.inventory.profile(old.profile)
    if request.resume and not profile.resume_args:
        raise UsageError(f"profile {profile.name!r} has no resume_args, so --resume cannot work",
                         hint="use --fresh, or add resume_args to the profile")
    if request.name not in (None, "+"):
        validate_name(request.name, what="run name")
        if session.record_of(request.name) is not None:
            raise Conflict(f"run name {request.name!r} is already used", hint="use --name + for the next free name")
    stopped, exit_code = False, None
    try:
        answer = stop_run(session, old.name, target=old.target, grace=request.grace)
        stopped, exit_code = True, answer.get("exit_code")
    except NotRunning:
        pass  # already ended: relaunching is still what was asked
    checkpoint = None
    if request.resume and not session.dry_run:
        status = run_status(session, old.name, target=old.target)[0]
        if not status["checkpoints"]:
            raise NotFound(f"run {old.name!r} has no checkpoint to resume from",
                           hint="use --fresh to start from scratch")
        checkpoint = f"{status['run_dir']}/checkpoints/{status['checkpoints'][-1]}"
    elif request.resume:
        checkpoint = f"<latest checkpoint of {old.name}>"
    extra = request.extra_args if request.extra_args is not None else list(old.extra.get("extra_args") or [])
    outcome = deploy(session, DeployRequest(
        target=old.target, profile=profile.name, name=request.name or "+", parent=old.name, note=request.note,
        launcher=request.launcher or old.launcher, clear_cache=request.clear_cache, extra_args=extra,
        checkpoint=checkpoint))
    return RestartOutcome(stopped=stopped, old_exit_code=exit_code, checkpoint=checkpoint, deployed=outcome)
