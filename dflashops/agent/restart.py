"""`restart`: stop + install + launch in one call (checks, build release, pre-flight, stop, flip, launch)."""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, replace
from typing import TypeVar

from .answers import ClearCacheAnswer, RestartAnswer, StopAnswer
from .checkpoints import complete_checkpoint, latest_checkpoint, release_hold, restore_held
from .common import (
    RESUME_WRITER_KEY,
    AgentFailure,
    check_name,
    read_json,
    report_progress,
    run_dir,
    session_name,
    tmux_has_session,
    tmux_socket,
    workspace_of,
)
from .gc import clear_cache
from .launch import check_launch, verb_launch
from .preflight import (
    argv_for_check,
    held_preflight,
    refuse_unchecked,
    resume_probe,
    started_from,
    trained_a_step,
)
from .protocol import InstallRequest, RestartRequest, StopRequest
from .releases import build_release, flip_current, prune_releases
from .run_lock import control_wait_s, release_control, take_control
from .standby import STANDBY_PRELOAD, retire_unclaimed, standby_eligible, standby_fingerprint, start_standby
from .status import cancel_supervisor, run_status
from .stop import run_processes_of, stop_held

T = TypeVar("T")


def substitute(value: T, placeholder: str, text: str) -> T:
    """`value` with every occurrence of `placeholder` in its strings replaced by `text` (lists/dicts deep)."""
    if isinstance(value, str):
        return value.replace(placeholder, text)  # type: ignore[return-value]  # a str is a T here
    if isinstance(value, list):
        return [substitute(item, placeholder, text) for item in value]  # type: ignore[return-value]
    if isinstance(value, dict):
        return {key: substitute(item, placeholder, text) for key, item in value.items()}  # type: ignore[return-value]
    return value


def verb_restart(req: RestartRequest, stdin: bytes | io.BufferedIOBase) -> RestartAnswer:
    """The kill-copy-relaunch cycle in ONE call (one ssh round trip instead of six): `old` is stopped,
    the release `install` describes is made current, and the new run `name` is launched from it.

    Order, so that a refusal or a cut connection never leaves anything half-done (one function each):
    1. `check`: every check that can refuse, with nothing changed yet: names, the old run exists, the new run
       directory is free, the launch request is valid, and (in step 2) the
       release manifest rebuilt against `install.base` matches its hash (code `stale_release` when the
       base is gone: the controller's cached idea of the target is out of date; it then asks `manifest`
       and calls again);
    1b. `one_shot_standby`: with `standby_once`, an interpreter that imports while the rest goes on;
    2. `build`: the release is built complete under releases/<hash>/, not yet current, from the upload as it
       arrives: one cut short or running long (against `tar_bytes`) is refused here (code `incomplete`); the
       checkpoint to resume is probed and held;
    2b. `preflight`: with the pre-flight on, the new code and flags checked; a job it could only compile (not
       the trainer, no profile `check:`) whose old run is alive is refused (code `unchecked`) unless
       `unchecked` is set: nothing is stopped;
    3. `stop_old`: the old run is stopped exactly like `stop` (its group + marker, TERM, grace, KILL, GPU
       wait), under its control lock; a run that already ended is fine;
    4. `resumed_launch`: with `resume_placeholder`, the old run's latest checkpoint replaces it in argv and
       run.json; with `handover` too, the stop may answer as soon as the old trainer has its final checkpoint
       in host memory and its devices free: that checkpoint (still being written) is the one resumed, and the
       new run's environment names the old run directory (DFLASHOPS_RESUME_WRITER), so the trainer waits for
       the checkpoint to be complete before it reads it (trainer/state/handover.py) while it builds meanwhile;
    5. `make_current`: `current` is flipped, old releases pruned, the compile cache cleared when asked;
    6. launch, as `launch`.
    The request (with the run's secrets in `env`) comes on stdin as one JSON line, then the tar."""
    old_dir, install = check(req)
    once = one_shot_standby(req)  # importing while the release is built, the checkpoint probed, the check waits
    try:
        built = build(req, install, stdin, old_dir)
        try:
            return stop_and_launch(replace(req, standby=True, standby_once=True) if once else req, built)
        finally:
            release_hold(built.hold)  # the child was launched with the checkpoint in place (restore_held), or none was
    finally:
        if once:  # refused, failed, or not ready in time for the launch: no interpreter is left waiting
            retire_unclaimed(once)


@dataclass
class Built:
    """What steps 1-2 leave for the rest: the old run's directory, the release (built, not current yet) and the
    checkpoint to resume: `probe`, held as `hold` (checkpoints.resume_probe) so a rotation cannot delete it."""

    old_dir: str
    install: InstallRequest
    code_hash: str
    path: str
    probe: str | None
    hold: str | None


def check(req: RestartRequest) -> tuple[str, InstallRequest]:
    """Step 1: (the old run's directory, the install request) or AgentFailure, with nothing changed."""
    workspace = workspace_of(req.workspace)
    old = check_name(req.old, "old run name")
    old_dir = run_dir(workspace, old)
    if not os.path.isdir(old_dir):
        raise AgentFailure(f"run {old!r} does not exist on this target", "not_found")
    new_dir, _, _, launcher = check_launch(req)
    if os.path.exists(new_dir):
        raise AgentFailure(f"run directory {new_dir} already exists", "conflict")
    if launcher == "tmux" and tmux_has_session(workspace, session_name(req.name)):
        raise AgentFailure(
            f"a tmux session named {session_name(req.name)!r} already exists on this workspace's tmux server "
            f"(socket {tmux_socket(workspace)}); nothing was stopped",
            "conflict",
        )
    if req.install is None:
        raise AgentFailure("restart needs an install request", "bad_request")
    chosen = req.resume_checkpoint  # restart --checkpoint: this one, not the run's newest
    if chosen is not None and not complete_checkpoint(chosen):
        raise AgentFailure(f"checkpoint {chosen} is not a complete checkpoint on this target", "not_found")
    # The upload is read as it arrives, while the release is built (step 2, before anything is stopped): one that
    # was cut short is refused there (`incomplete`), its partial release removed.
    tar_bytes = req.tar_bytes if req.tar_bytes is not None else req.install.tar_bytes
    return old_dir, replace(req.install, workspace=workspace, tar_bytes=tar_bytes)


def build(req: RestartRequest, install: InstallRequest, stdin: bytes | io.BufferedIOBase, old_dir: str) -> Built:
    """Step 2: the release built complete (not current yet), and the checkpoint to resume probed and held; a
    damaged one is refused here, with nothing stopped."""
    code_hash, path = build_release(install, stdin, stale_code="stale_release")
    probe, hold = resume_probe(old_dir, req.resume_placeholder, req.resume_checkpoint, req.argv)
    return Built(old_dir, install, code_hash, path, probe, hold)


ONE_SHOT_IDLE_S = 900.0  # a one-shot standby whose restart never came back (its agent killed) exits after this
# The compiler's modules (torch._dynamo, inductor: 1.8 s of the 3.7 s preload on the CPU test machine) are left
# out for a run given no GPU: a CPU run compiles nothing unless asked, and the pre-flight waits for the preload,
# so they cost every such restart ~1 s (tiny profile: 6.1 s typed -> first step with them, 5.2 s without;
# bench/results/restart.md, "2026-12-05 — restart with one torch import").
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")


def one_shot_standby(req: RestartRequest) -> str | None:
    """Step 1b, with `standby_once` (the controller asks it on the local target) where the target keeps no
    standby: for a trainer job, a standby interpreter started for this restart alone (agent/standby.py), before
    anything slow. It imports torch while the old run still trains; the pre-flight runs in a fork of it
    (check_in_standby) and the launch adopts it (adopt_standby), so typed -> first step pays one import of
    torch, not two in series (the check's new interpreter, then the child's: issue 46 item 2). Returns its
    folder, or None (not asked, not the trainer, or it could not start: the check and the child then start
    new interpreters, as without it). verb_restart retires it unless a launch took it: none is left waiting."""
    argv = req.argv
    if not req.standby_once or req.standby or not standby_eligible(argv):
        return None
    env = {str(k): str(v) for k, v in req.env.items()}
    launcher = str(req.launcher)
    fingerprint = standby_fingerprint(argv[0], env, launcher, list(req.secret_keys))
    preload = list(req.standby_preload or STANDBY_PRELOAD)
    if not req.run_json.get("gpus"):
        preload = [name for name in preload if name not in COMPILER_MODULES]
    once = replace(req, standby_idle_s=ONE_SHOT_IDLE_S, standby_preload=preload)
    return start_standby(once, argv, env, launcher, "", fingerprint)


def stop_and_launch(req: RestartRequest, built: Built) -> RestartAnswer:
    """Steps 2b-6, once the release is built and the resume checkpoint held: the pre-flight, then under the old
    run's control lock the stop, the resumed launch request, the flip and the launch. The answer: the stop's,
    the old run's status, the release's and the launch's."""
    old, old_dir = str(req.old), built.old_dir
    verdict = preflight(req, built)
    lock, met = take_control(old_dir, "restart", control_wait_s(req))
    outcome: dict = {}
    try:
        child = ((met or {}).get("outcome") or {}).get("name") if (met or {}).get("op") == "restart" else None
        if child:  # two restarts met: the first one's child is the answer, not a second child
            raise AgentFailure(
                f"run {old!r} was restarted meanwhile by another command, as {child!r}; nothing was done", "superseded"
            )
        refuse_unchecked(req, verdict, old, old_dir)  # a live old run of a job nothing checked stays running
        # Refused before anything is stopped when the run has no checkpoint and will write none.
        resuming = bool(req.resume_placeholder) and req.resume_checkpoint is None
        fallback = resume_fallback(old_dir, old) if resuming else None
        stop = stop_old(req, old_dir, lock, handing_over=resuming and req.handover)
        old_status = run_status(old_dir)
        launch, checkpoint = resumed_launch(req, built, stop, fallback)
        removed, cleared = make_current(req, built)
        launched = verb_launch(launch)
        outcome = {"name": req.name, "checkpoint": checkpoint}
        return RestartAnswer(
            stop=stop,
            old_status=old_status,
            release=built.code_hash,
            path=built.path,
            removed=removed,
            checkpoint=checkpoint,
            run_dir=launched.run_dir,
            pgid=launched.pgid,
            marker=launched.marker,
            launcher=launched.launcher,
            session=launched.session,
            standby=launched.standby,
            preflight=verdict,
            cleared=cleared,
        )
    finally:
        release_control(old_dir, lock, outcome)


def preflight(req: RestartRequest, built: Built) -> dict | None:
    """Step 2b: the new code and flags prove they can start before the old run is signalled (its verdict), or
    None when the request asks no pre-flight. Its refusal (code `preflight`) stops nothing."""
    if not req.preflight:
        return None
    check_argv = argv_for_check(req.argv, req.resume_placeholder, built.hold or built.probe)
    return held_preflight(req, built.path, check_argv, req.env, built.hold, built.probe)


def stop_old(req: RestartRequest, old_dir: str, lock: int, *, handing_over: bool) -> StopAnswer | None:
    """Step 3: the old run stopped exactly like `stop`, under the control lock the caller holds (`lock`); its
    stop answer, or None when it had ended already. With `handing_over`, the stop answers at the trainer's
    hand-over offer and finishes in the background (stop.stop_held)."""
    report_progress(req.progress, "stopping", run=req.old, handover=handing_over)
    stop = StopRequest(
        workspace=req.workspace,
        name=str(req.old),
        grace=req.grace,
        save_grace=req.save_grace,
        kill_timeout=req.kill_timeout,
        gpu_timeout=req.gpu_timeout,
        handover=handing_over,
    )
    answer = None
    try:
        answer = stop_held(stop, old_dir, time.monotonic(), lock, supervisor_cancelled=cancel_supervisor(old_dir))
    except AgentFailure as exc:
        if exc.code != "not_running":
            raise
    handover = answer.handover if answer is not None else None
    report_progress(
        req.progress,
        "stopped",
        run=req.old,
        was_running=answer is not None,
        exit_code=answer.exit_code if answer is not None else None,
        handover=(handover or {}).get("checkpoint"),
    )
    return answer


def resumed_launch(
    req: RestartRequest, built: Built, stop: StopAnswer | None, fallback: str | None
) -> tuple[RestartRequest, str | None]:
    """Step 4: (the launch request of the new run, the checkpoint it resumes). With `resume_placeholder`: the
    chosen checkpoint (put back if rotation took it), else the one a hand-over offers (the new run's environment
    names the old run directory as its writer), else the old run's newest or the one it started from
    (`fallback`), put into argv and run.json; NotFound when there is none. The pre-flight and the cache
    clearing are done already, so the launch does neither again."""
    launch = replace(req, preflight=False, clear_cache=False)
    placeholder, chosen = req.resume_placeholder, req.resume_checkpoint
    if not placeholder:
        return launch, None
    handover = stop.handover if stop is not None else None
    if chosen is not None:
        checkpoint: str | None = chosen
        restore_held(built.hold, chosen)  # put back if the run's rotation deleted it during the pre-flight
    elif handover:
        checkpoint = handover["checkpoint"]
        launch = replace(launch, env={**req.env, RESUME_WRITER_KEY: built.old_dir})
    else:
        checkpoint = latest_checkpoint(built.old_dir) or fallback
    if checkpoint is None:
        how = "was stopped" if stop else "had ended"
        raise AgentFailure(f"run {req.old!r} {how} but left no checkpoint to resume from", "not_found")
    launch = replace(
        launch,
        resuming=checkpoint,  # for its `launching` progress line, whatever the job's flag
        argv=substitute(req.argv, str(placeholder), checkpoint),
        run_json=substitute(req.run_json, str(placeholder), checkpoint),
    )
    return launch, checkpoint


def make_current(req: RestartRequest, built: Built) -> tuple[list, ClearCacheAnswer | None]:
    """Step 5: `current` flipped to the new release, old releases pruned, the compile cache cleared when asked:
    (the pruned releases, what the clearing removed or None)."""
    workspace = workspace_of(req.workspace)
    flip_current(workspace, built.code_hash)
    removed = prune_releases(workspace, int(built.install.keep))
    cleared = clear_cache(workspace, req.compile_cache) if req.clear_cache else None
    return removed, cleared


def resume_fallback(directory: str, name: str) -> str | None:
    """Before a `restart --resume` stops anything: None when the run has a checkpoint of its own or its stop will
    write one (it has taken a step in this process); else the checkpoint the run itself started from (run.json's
    `resumed_from`, committed if its writer left it unfinished); else AgentFailure, with nothing changed yet."""
    if latest_checkpoint(directory) is not None:
        return None
    if run_processes_of(directory)[1] and trained_a_step(read_json(os.path.join(directory, "status.json")) or {}):
        return None  # its stop writes the final checkpoint of the steps it took
    origin = ((read_json(os.path.join(directory, "run.json")) or {}).get("extra") or {}).get("resumed_from")
    if started_from(directory):
        return origin
    raise AgentFailure(
        f"run {name!r} has no checkpoint to resume from: it has not finished a step"
        + (f", and the checkpoint it started from ({origin}) is gone" if origin else " and started fresh")
        + "; nothing was stopped",
        "not_found",
    )
