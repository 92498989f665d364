"""`restart`: stop + install + launch in one call (checks, build release, pre-flight, stop, flip, launch)."""

from __future__ import annotations

import io
import os
import time

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
from .gc import verb_clear_cache
from .launch import check_launch, verb_launch
from .preflight import (
    argv_for_check,
    held_preflight,
    refuse_unchecked,
    resume_probe,
    started_from,
    trained_a_step,
)
from .releases import build_release, flip_current, prune_releases
from .run_lock import control_wait_s, release_control, take_control
from .standby import STANDBY_PRELOAD, retire_unclaimed, standby_eligible, standby_fingerprint, start_standby
from .status import cancel_supervisor, run_status
from .stop import run_processes_of, stop_held


def substitute(value: object, placeholder: str, text: str) -> object:
    """`value` with every occurrence of `placeholder` in its strings replaced by `text` (lists/dicts deep)."""
    if isinstance(value, str):
        return value.replace(placeholder, text)
    if isinstance(value, list):
        return [substitute(item, placeholder, text) for item in value]
    if isinstance(value, dict):
        return {key: substitute(item, placeholder, text) for key, item in value.items()}
    return value


def verb_restart(req: dict, stdin: bytes | io.BufferedIOBase) -> dict:
    """The kill-copy-relaunch cycle in ONE call (one ssh round trip instead of six): `old` is stopped,
    the release `install` describes is made current, and the new run `name` is launched from it.

    Order, so that a refusal or a cut connection never leaves anything half-done:
    1. every check that can refuse, with nothing changed yet: names, the old run exists, the new run
       directory is free, the launch request is valid, and the
       release manifest rebuilt against `install.base` matches its hash (code `stale_release` when the
       base is gone: the controller's cached idea of the target is out of date; it then asks `manifest`
       and calls again);
    2. the release is built complete under releases/<hash>/, not yet current, from the upload as it arrives:
       one cut short or running long (against `tar_bytes`) is refused here (code `incomplete`);
    2b. with the pre-flight on, a job it could only compile (not the trainer, no profile `check:`) whose old run
       is alive is refused (code `unchecked`) unless `unchecked` is set: nothing is stopped;
    3. the old run is stopped exactly like `stop` (its group + marker, TERM, grace, KILL, GPU wait);
       a run that already ended is fine;
    4. with `resume_placeholder`: the old run's latest checkpoint replaces it in argv and run.json; with
       `handover` too, the stop may answer as soon as the old trainer has its final checkpoint in host memory
       and its devices free: that checkpoint (still being written) is the one resumed, and the new run's
       environment names the old run directory (DFLASHOPS_RESUME_WRITER), so the trainer waits for the
       checkpoint to be complete before it reads it (trainer/state/handover.py) while it builds meanwhile;
    5. `current` is flipped, old releases pruned, this code's compile cache cleared when asked;
    6. launch, as `launch`.
    The request (with the run's secrets in `env`) comes on stdin as one JSON line, then the tar."""
    workspace = workspace_of(req)
    old = check_name(req.get("old"), "old run name")
    old_dir = run_dir({"workspace": workspace, "name": old})
    if not os.path.isdir(old_dir):
        raise AgentFailure(f"run {old!r} does not exist on this target", "not_found")
    new_dir, _, _, launcher = check_launch(req)
    if os.path.exists(new_dir):
        raise AgentFailure(f"run directory {new_dir} already exists", "conflict")
    if launcher == "tmux" and tmux_has_session(workspace, session_name(req["name"])):
        raise AgentFailure(
            f"a tmux session named {session_name(req['name'])!r} already exists on this workspace's tmux server "
            f"(socket {tmux_socket(workspace)}); nothing was stopped",
            "conflict",
        )
    install = req.get("install")
    if not isinstance(install, dict):
        raise AgentFailure("restart needs an install request", "bad_request")
    # The upload is read as it arrives, while the release is built (step 2, before anything is stopped): one that
    # was cut short is refused there (`incomplete`), its partial release removed.
    install = {**install, "workspace": workspace, "tar_bytes": req.get("tar_bytes", install.get("tar_bytes"))}
    placeholder = req.get("resume_placeholder")
    chosen = req.get("resume_checkpoint")  # restart --checkpoint: this one, not the run's newest
    if chosen is not None and (not isinstance(chosen, str) or not complete_checkpoint(chosen)):
        raise AgentFailure(f"checkpoint {chosen} is not a complete checkpoint on this target", "not_found")
    once = one_shot_standby(req)  # importing while the release is built, the checkpoint probed, the check waits
    try:
        code_hash, release = build_release(install, stdin, stale_code="stale_release")  # not current yet
        probe, hold = resume_probe(
            old_dir, placeholder, chosen, req["argv"]
        )  # a damaged one is refused here, nothing stopped
        try:
            checked_in = {**req, "standby": True, "standby_once": True} if once else req
            return stop_and_launch(
                checked_in, workspace, old, old_dir, install, code_hash, release, chosen, probe, hold
            )
        finally:
            release_hold(hold)  # the child was launched with the checkpoint in place (restore_held), or none was
    finally:
        if once:  # refused, failed, or not ready in time for the launch: no interpreter is left waiting
            retire_unclaimed(once)


ONE_SHOT_IDLE_S = 900.0  # a one-shot standby whose restart never came back (its agent killed) exits after this
# The compiler's modules (torch._dynamo, inductor: 1.8 s of the 3.7 s preload on the CPU test machine) are left
# out for a run given no GPU: a CPU run compiles nothing unless asked, and the pre-flight waits for the preload,
# so they cost every such restart ~1 s (tiny profile: 6.1 s typed -> first step with them, 5.2 s without;
# bench/results/restart.md, "2026-12-05 — restart with one torch import").
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")


def one_shot_standby(req: dict) -> str | None:
    """Step 1b, with `standby_once` (the controller asks it on the local target) where the target keeps no
    standby: for a trainer job, a standby interpreter started for this restart alone (agent/standby.py), before
    anything slow. It imports torch while the old run still trains; the pre-flight runs in a fork of it
    (check_in_standby) and the launch adopts it (adopt_standby), so typed -> first step pays one import of
    torch, not two in series (the check's new interpreter, then the child's: issue 46 item 2). Returns its
    folder, or None (not asked, not the trainer, or it could not start: the check and the child then start
    new interpreters, as without it). verb_restart retires it unless a launch took it: none is left waiting."""
    argv = req["argv"]
    if not req.get("standby_once") or req.get("standby") or not standby_eligible(argv):
        return None
    env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
    launcher = str(req.get("launcher", "nohup"))
    fingerprint = standby_fingerprint(argv[0], env, launcher, list(req.get("secret_keys") or []))
    preload = list(req.get("standby_preload") or STANDBY_PRELOAD)
    if not (req.get("run_json") or {}).get("gpus"):
        preload = [name for name in preload if name not in COMPILER_MODULES]
    once = {**req, "standby_idle_s": ONE_SHOT_IDLE_S, "standby_preload": preload}
    return start_standby(once, argv, env, launcher, "", fingerprint)


def stop_and_launch(
    req: dict,
    workspace: str,
    old: str,
    old_dir: str,
    install: dict,
    code_hash: str,
    release: str,
    chosen: str | None,
    probe: str | None,
    hold: str | None,
) -> dict:
    """Steps 3-6 of verb_restart, once the release is built and the resume checkpoint `probe` is held (`hold`)."""
    placeholder = req.get("resume_placeholder")
    verdict = None
    if req.get("preflight"):  # the new code and flags prove they can start before the old run is signalled
        check_argv = argv_for_check(req["argv"], placeholder, hold or probe)
        verdict = held_preflight(req, release, check_argv, req.get("env") or {}, hold, probe)
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
        fallback = resume_fallback(old_dir, old) if placeholder and chosen is None else None
        stop = None
        handing_over = bool(placeholder and chosen is None and req.get("handover"))
        report_progress(req, "stopping", run=old, handover=handing_over)
        try:
            stop = stop_held(
                {
                    "workspace": workspace,
                    "name": old,
                    "grace": req.get("grace", 60.0),
                    "handover": handing_over,
                    **{k: req[k] for k in ("kill_timeout", "gpu_timeout") if k in req},
                },
                old_dir,
                time.monotonic(),
                lock,
                supervisor_cancelled=cancel_supervisor(old_dir),
            )
        except AgentFailure as exc:
            if exc.code != "not_running":
                raise
        old_status = run_status(old_dir)
        launch = {**req, "preflight": False, "clear_cache": False}  # both done above
        checkpoint = None
        handover = (stop or {}).get("handover")
        report_progress(
            req,
            "stopped",
            run=old,
            was_running=stop is not None,
            exit_code=(stop or {}).get("exit_code"),
            handover=(handover or {}).get("checkpoint"),
        )
        if placeholder:
            if chosen is not None:
                checkpoint = chosen
                restore_held(hold, chosen)  # put back if the run's rotation deleted it during the pre-flight
            elif handover:
                checkpoint = handover["checkpoint"]
                launch["env"] = {**(req.get("env") or {}), RESUME_WRITER_KEY: old_dir}
            else:
                checkpoint = latest_checkpoint(old_dir) or fallback
            if checkpoint is None:
                how = "was stopped" if stop else "had ended"
                raise AgentFailure(f"run {old!r} {how} but left no checkpoint to resume from", "not_found")
            launch["resuming"] = checkpoint  # for its `launching` progress line, whatever the job's flag
            launch["argv"] = substitute(req["argv"], str(placeholder), checkpoint)
            launch["run_json"] = substitute(req.get("run_json") or {}, str(placeholder), checkpoint)
        flip_current(workspace, code_hash)
        removed = prune_releases(workspace, int(install.get("keep", 5)))
        cleared = verb_clear_cache({**req, "workspace": workspace}) if req.get("clear_cache") else None
        launched = verb_launch(launch)
        outcome = {"name": req["name"], "checkpoint": checkpoint}
        return {
            "stop": stop,
            "old_status": old_status,
            "release": code_hash,
            "path": release,
            "removed": removed,
            "checkpoint": checkpoint,
            **launched,
            "cleared": cleared,
            "preflight": verdict,
        }
    finally:
        release_control(old_dir, lock, outcome)


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
