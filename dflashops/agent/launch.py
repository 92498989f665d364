"""`launch` and `wrap`: starting a run, with a new wrapper and job or by adopting a ready standby."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from .answers import LaunchAnswer
from .common import (
    DISK_FULL_ERRNOS,
    LAUNCHERS,
    MARKER_KEY,
    AgentFailure,
    append_log,
    free_space,
    no_space,
    program,
    remove_quietly,
    report_progress,
    run_dir,
    session_name,
    tmux_has_session,
    tmux_socket,
    write_atomic,
)
from .gc import clear_cache
from .preflight import preflight_release, resume_of
from .protocol import LaunchRequest, WrapRequest
from .standby import adopt_standby, retire_standbys, standby_eligible, standby_fingerprint, start_standby, wrap_standby
from .wrap import (
    CLEAN_ENV,
    LAUNCH_SPEC,
    become_group_leader,
    launch_answer,
    launch_failed,
    record_exit_code,
    reserve_records,
    stop_requested,
    wait_for_file,
    wait_job,
)

# What a launch writes before its job can say anything itself: run.json, marker, the launch spec (the job's whole
# environment), pgid, pid, the reserves for exit_code and stop.json (wrap.RESERVED_BYTES), train.log's first lines,
# the trainer's status.json and its reserve: about a dozen files of one or two 4 KiB blocks each. A 1 MiB floor
# leaves room for a large environment and the job's first writes; a run's checkpoints are the trainer's to check.
LAUNCH_NEEDS_BYTES = 1 << 20
LAUNCH_NEEDS = f"a launch needs about {LAUNCH_NEEDS_BYTES >> 20} MiB and a dozen files for the run's records"


def check_space(workspace: str) -> None:
    """AgentFailure `no_space` (naming the disk, what is free and what a launch needs) when the workspace's disk
    cannot take a run's records: refused before a pre-flight's seconds, a stop or a taken name. Blocks only: a
    disk out of inodes fails at the launch's first write, which gives the name back (`unclaim`)."""
    free = free_space(workspace)
    if free is not None and free[0] < LAUNCH_NEEDS_BYTES:
        raise no_space(workspace, LAUNCH_NEEDS)


def unclaim(directory: str, exc: OSError, workspace: str) -> Exception:
    """A write of the launch's own records failed before any job started (the disk filled since check_space):
    the run directory this call made a moment ago is removed, so no empty run shows as `launching`, later
    `lost`, and the name stays free. The error to raise: `no_space` for a full disk, else `exc` itself."""
    error = (
        no_space(workspace, LAUNCH_NEEDS) if exc.errno in DISK_FULL_ERRNOS else exc
    )  # what is free before the removal
    shutil.rmtree(directory, ignore_errors=True)
    return error


def check_launch(req: LaunchRequest) -> tuple[str, list[str], dict, str]:
    """(run dir, argv, env, launcher) of a launch request, or AgentFailure; changes nothing."""
    directory = run_dir(req.workspace, req.name)
    argv = req.argv
    if not argv or not all(isinstance(a, str) for a in argv):
        raise AgentFailure("argv must be a non-empty list of strings", "bad_request")
    env = req.env
    launcher = req.launcher
    if launcher not in LAUNCHERS:
        raise AgentFailure(f"unknown launcher {launcher!r}", "bad_request")
    if launcher == "tmux" and not shutil.which("tmux"):
        raise AgentFailure("tmux is not installed on the target", "missing_tool")
    check_space(req.workspace)
    return directory, argv, env, launcher


def verb_launch(req: LaunchRequest) -> LaunchAnswer:
    """Start a run: a new wrapper and job, or (`standby: true` and a `python -m trainer` argv) the waiting
    interpreter of a matching standby (see the standby section), which skips the job's imports. Either way the
    run directory gets the same records (run.json, marker, pgid, pid, exit_code) and `stop` treats both alike.
    In order, everything that can refuse before the name is taken (`check_launch`, `launch_preflight`, the
    tmux session), then `claim` (the run directory and run.json), then `adopt_standby` or `start_wrapper`."""
    directory, argv, env, launcher = check_launch(req)
    if os.path.exists(directory):  # the same refusal as the mkdir below, before a pre-flight's seconds
        raise AgentFailure(f"run directory {directory} already exists", "conflict")
    launch_env = {str(k): str(v) for k, v in env.items()}
    wants_standby = bool(req.standby) and standby_eligible(argv)
    fingerprint = standby_fingerprint(argv[0], launch_env, launcher, list(req.secret_keys)) if wants_standby else ""
    verdict = launch_preflight(req, argv, env, launch_env, launcher, fingerprint)
    cleared = clear_cache(req.workspace, req.compile_cache) if req.clear_cache else None
    session = session_name(req.name)
    if launcher == "tmux" and tmux_has_session(req.workspace, session):  # refused before the name is taken
        raise AgentFailure(
            f"a tmux session named {session!r} already exists on this workspace's tmux server "
            f"(socket {tmux_socket(req.workspace)})",
            "conflict",
        )
    report_progress(req.progress, "launching", name=req.name, resume=req.resuming or resume_of(argv))
    claim(req, directory, launcher, session)
    cwd = req.cwd or directory
    # `standby_once` (a restart's one-shot standby, agent/restart.py): adopt the one started for this launch,
    # start none for the next one.
    follow_up = wants_standby and not req.standby_once
    if wants_standby:
        adopted = adopt_standby(req, directory, argv, launch_env, cwd, launcher, session, fingerprint)
        if adopted is not None:
            if follow_up:
                start_standby(req, argv, launch_env, launcher, directory, fingerprint)
            adopted.preflight, adopted.cleared = verdict, cleared
            return adopted
    elif req.standby is False:
        retire_standbys(req.workspace, keep=None)
    marker = f"{req.name}.{os.urandom(6).hex()}"
    try:
        write_atomic(os.path.join(directory, "marker"), marker + "\n")
    except OSError as exc:
        raise unclaim(directory, exc, req.workspace) from None
    launch_env.update(DFLASHOPS_RUN=req.name, **{MARKER_KEY: marker})
    pgid = start_wrapper(req, directory, argv, launch_env, cwd, launcher, session)
    if follow_up:
        start_standby(req, argv, launch_env, launcher, directory, fingerprint)
    answer = launch_answer(directory, pgid, marker, launcher, session, standby=False)
    answer.preflight, answer.cleared = verdict, cleared
    return answer


def launch_preflight(
    req: LaunchRequest, argv: list[str], env: dict, launch_env: dict, launcher: str, fingerprint: str
) -> dict | None:
    """With `preflight`, the release's pre-flight (its verdict), before the name is taken: a refused launch
    leaves nothing behind. A launch that wants a standby (`fingerprint`) and finds none ready (a fresh workspace)
    starts one first: the check waits for it, the run adopts it, and the imports are paid once. None when not
    asked, or when the release is not a folder here."""
    if not req.preflight:
        return None
    release = str(req.run_json.get("release") or env.get("PYTHONPATH") or "")
    if not os.path.isdir(release):
        return None
    if fingerprint:
        start_standby(req, argv, launch_env, launcher, "", fingerprint)
    return preflight_release(req, release, argv, env)


def claim(req: LaunchRequest, directory: str, launcher: str, session: str) -> None:
    """Take the run's name: mkdir of its run directory (atomic: a second launch of the same name fails here,
    `conflict`), then run.json; a full disk is `no_space`, and a failed run.json gives the name back."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    try:
        os.mkdir(directory)
    except FileExistsError:
        raise AgentFailure(f"run directory {directory} already exists", "conflict") from None
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise no_space(req.workspace, LAUNCH_NEEDS) from None
        raise
    run_json = dict(req.run_json)
    run_json.update(name=req.name, launcher=launcher, session=session, run_dir=directory)
    try:
        write_atomic(os.path.join(directory, "run.json"), json.dumps(run_json, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise unclaim(directory, exc, req.workspace) from None


def start_wrapper(
    req: LaunchRequest, directory: str, argv: list[str], launch_env: dict, cwd: str, launcher: str, session: str
) -> int:
    """Start the launch wrapper (`wrap`) in a tmux session or with setsid + nohup, and wait up to 10 s for the
    `pgid` it records (else launch_failed). The job's environment reaches it through a 0600 spec file that
    never outlives this call."""
    # The job's whole environment: this agent's (what the controller gave this call) with the launch's on top.
    # Never the tmux server's: that server was started by an earlier call, with an earlier deploy's environment.
    spec = {"argv": argv, "env": {**os.environ, **launch_env}, "cwd": cwd}
    spec_path = os.path.join(directory, LAUNCH_SPEC)
    wrapper = [sys.executable, program(), "wrap", "--json-args", json.dumps({"dir": directory})]
    try:
        # Secrets reach the wrapper through this 0600 file; the wrapper deletes it as soon as it has read it.
        try:
            write_atomic(spec_path, json.dumps(spec), mode=0o600)
        except OSError as exc:
            raise unclaim(directory, exc, req.workspace) from None
        if launcher == "tmux":
            started = subprocess.run(
                [
                    "tmux",
                    "-L",
                    tmux_socket(req.workspace),
                    "new-session",
                    "-d",
                    "-s",
                    session,
                    "-x",
                    "200",
                    "-y",
                    "50",
                    "--",
                    *CLEAN_ENV,
                    *wrapper,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=20,
            )
            if started.returncode != 0:
                reason = started.stderr.decode(errors="replace").strip()
                launch_failed(directory, f"tmux new-session failed: {reason}")
        else:
            with open(os.devnull, "rb") as devnull, open(os.path.join(directory, "train.log"), "ab") as log:
                subprocess.Popen(wrapper, stdin=devnull, stdout=log, stderr=log, start_new_session=True, close_fds=True)
        pgid = wait_for_file(os.path.join(directory, "pgid"), 10.0)
        if pgid is None:
            launch_failed(directory, f"the launch wrapper did not start within 10 s (see {directory}/train.log)")
    finally:
        # The wrapper has read and deleted the spec before it writes `pgid`; if it has not (the launch failed or
        # timed out), the secrets must not stay on disk, and a wrapper that starts late then finds no spec and
        # does not start the job.
        remove_quietly(spec_path)
    return pgid


def verb_wrap(req: WrapRequest) -> dict:
    """Runs as the leader of the run's new process group/session (setsid or tmux pane). Records pgid, starts
    the job with output appended to train.log unless a stop was requested first, records its pid, waits, and
    writes `exit_code` (128+N for signal N). With `standby` (a standby's folder): the standby's wrapper."""
    if req.standby is not None:
        return wrap_standby(req.standby)
    if req.dir is None:
        raise AgentFailure("wrap: missing key 'dir' (or 'standby')", "bad_request")
    directory = req.dir
    spec_path = os.path.join(directory, LAUNCH_SPEC)
    try:
        with open(spec_path, encoding="utf-8") as handle:
            spec = json.load(handle)
    except FileNotFoundError:  # verb_launch gave up waiting for this wrapper and removed the spec
        append_log(directory, "the launch timed out before the wrapper started; the job was not started")
        record_exit_code(directory, 127)
        return {"exit_code": 127}
    finally:
        remove_quietly(spec_path)
    become_group_leader()
    reserve_records(directory)
    write_atomic(os.path.join(directory, "pgid"), f"{os.getpgrp()}\n")
    # A stop that raced the launch wrote its request before the job existed: it wins, the job never starts.
    # (A stop after this check finds the group and waits for `pid`: verb_stop.)
    if stop_requested(directory):
        append_log(directory, "stop requested before the job started; not starting it")
        status = 128 + signal.SIGTERM
        record_exit_code(directory, status)
        return {"exit_code": status}
    log_path = os.path.join(directory, "train.log")
    with open(log_path, "ab") as log:
        try:
            child = subprocess.Popen(
                spec["argv"], cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        except OSError as exc:
            log.write(f"dflashops: cannot start {spec['argv'][0]}: {exc}\n".encode())
            record_exit_code(directory, 127)
            return {"exit_code": 127}
    write_atomic(os.path.join(directory, "pid"), f"{child.pid}\n")
    status = wait_job(child, log_path)
    record_exit_code(directory, status)
    return {"exit_code": status}
