"""The new release proves it can start before a deploy launches or a restart stops (`preflight`).

Before a deploy launches and before a restart stops the old run, the new release proves it can start: every
Python file of it compiles (here, with the target's python), and for a trainer job `python -m trainer check
<its train flags>` (trainer/check.py: the package compiles, the flags validate, the training stack imports,
train's own pre-flight passes); any other job runs its profile's `check:` command when it has one
(profile_check), else nothing beyond the compile is checked. In a ready standby that check is a fork of an interpreter with torch imported
already; else a fresh interpreter pays the imports. A refusal (code `preflight`) changes nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time

from .answers import PreflightAnswer
from .checkpoints import (
    HOLD_NAME,
    checkpoint_damage,
    complete_checkpoint,
    damaged,
    hold_checkpoint,
    last_good_checkpoint,
    latest_checkpoint,
    release_hold,
)
from .common import (
    HASH_RE,
    AgentFailure,
    read_int,
    read_json,
    remove_quietly,
    report_progress,
    run_dir,
    workspace_of,
    write_atomic,
)
from .protocol import LaunchRequest, PreflightRequest, ResumeRequest
from .standby import (
    CHECK_ANSWER,
    CHECK_CLAIM,
    CHECK_REQUEST,
    SECRET_KEY_RE,
    STANDBY_POLL_S,
    carries_marker,
    ready_standbys,
    standby_alive,
    standby_eligible,
    standby_fingerprint,
    standbys,
    take_file,
)

PREFLIGHT_TIMEOUT_S = 600.0  # train's pre-flight reads the target's config and opens the data: bounded, never hung


def trainer_flags(argv: list[str]) -> list[str] | None:
    """The flags of a job that runs `python -m trainer train ...`, directly or behind a launcher (torchrun's
    `... -m trainer train ...`); None for any other job."""
    for index in range(len(argv) - 2):
        if argv[index : index + 3] == ["-m", "trainer", "train"]:
            return argv[index + 3 :]
    return None


def compile_release(release: str) -> None:
    """Every .py file of the release compiles with this (the target's) python; in memory, nothing written."""
    for root, _, names in os.walk(release):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as handle:
                    compile(handle.read(), path, "exec", dont_inherit=True)
            except SyntaxError as exc:
                where = os.path.relpath(path, release) + (f":{exc.lineno}" if exc.lineno else "")
                raise AgentFailure(
                    f"error: {where}: SyntaxError: {exc.msg}\nhint: fix it and try again", "preflight"
                ) from None


def preflight_release(req: LaunchRequest, release: str, argv: list[str], env: dict) -> dict:
    """The pre-flight of `argv` (run from `release`, with `env`): what it checked, or AgentFailure `preflight`
    whose message is the check's own `error:`/`hint:` lines. Secrets stay out of it: a check needs none."""
    started = time.monotonic()
    flags = trainer_flags(argv)
    own = req.check if flags is None else None  # the profile's `check:` (a job other than the trainer)
    checks = "trainer" if flags is not None else "check" if own else "compile"
    command = shlex.join(own["argv"]) if own else None
    report_progress(req.progress, "preflight", checks=checks, resume=resume_of(argv), command=command)
    compile_release(release)
    secret_keys = list(req.secret_keys)
    check_env = {k: v for k, v in {**os.environ, **env}.items() if k not in secret_keys and not SECRET_KEY_RE.search(k)}
    if own:
        return profile_check(req, own, release, check_env, started)
    if flags is None:
        return {"checked": "compile", "seconds": round(time.monotonic() - started, 3)}
    check = {"argv": [argv[0], "-m", "trainer", "check", *flags], "env": check_env, "cwd": req.workspace}
    answer, where, standby_pid = None, "a new interpreter", None
    if req.standby and standby_eligible(argv):
        fingerprint = standby_fingerprint(argv[0], env, str(req.launcher), secret_keys)
        await_starting_standby(req.workspace, fingerprint, time.monotonic() + PREFLIGHT_TIMEOUT_S)
        answer = check_in_standby(req.workspace, fingerprint, check)
        where = "a standby interpreter" if answer is not None else where
        standby_pid = (answer or {}).pop("standby_pid", None)
    if answer is None:
        answer = check_fresh(check)
    seconds = round(time.monotonic() - started, 3)
    output = str(answer.get("output") or "").strip()
    if answer.get("exit_code") != 0:
        lines = [ln for ln in output.splitlines() if ln.startswith(("error: ", "hint: "))]
        if not lines:  # not a refusal the trainer explained: its last lines (a traceback's end)
            tail = "; ".join(output.splitlines()[-2:]) or f"exit code {answer.get('exit_code')}"
            lines = [f"error: the trainer's pre-flight failed: {tail}"]
        raise AgentFailure("\n".join(lines[:2]), "preflight")
    summary = HOLD_NAME.sub(r"/\1", output.splitlines()[-1]) if output else ""
    report_progress(req.progress, "preflight_done", summary=summary, seconds=seconds, where=where)
    verdict = {"checked": "trainer", "summary": summary, "in": where, "seconds": seconds}
    return {**verdict, "standby_pid": standby_pid} if standby_pid else verdict


CHECK_TAIL_LINES = 3  # the last lines of a failed check's stderr that its refusal quotes


def profile_check(req: LaunchRequest, own: dict, release: str, env: dict, started: float) -> dict:
    """The profile's `check:` command (`own`: argv with the run's `--` extra arguments, timeout, profile), run in
    the new release with the job's environment (secrets left out, as for the trainer's check): its verdict, or
    AgentFailure `preflight` naming the profile, the exit code and the last lines of its stderr."""
    argv = [str(word) for word in own.get("argv") or []]
    timeout = float(own.get("timeout") or 120)
    command, profile = shlex.join(argv), own.get("profile") or "?"
    hint = f"hint: the check ran `{command}` in the new release; fix the code or the arguments and try again"
    try:
        done = subprocess.run(
            argv, cwd=release, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise AgentFailure(
            f"error: the check of profile {profile} gave no verdict within {timeout:.0f} s\n{hint}", "preflight"
        ) from None
    except OSError as exc:
        raise AgentFailure(
            f"error: the check of profile {profile} cannot start {argv[0]}: {exc.strerror}\n{hint}", "preflight"
        ) from None
    seconds = round(time.monotonic() - started, 3)
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-CHECK_TAIL_LINES:]
        tail = ": " + " | ".join(line.strip() for line in said) if said else ""
        raise AgentFailure(
            f"error: the check of profile {profile} exited with code {done.returncode}{tail}\n{hint}", "preflight"
        )
    summary = f"ok: the check `{command}` exited 0"
    report_progress(req.progress, "preflight_done", summary=summary, seconds=seconds, where=None)
    return {"checked": "check", "summary": summary, "seconds": seconds}


def resume_of(argv: list[str]) -> str | None:
    """The checkpoint `--resume` names in argv (the pre-flight's: a hold folder, named as its original), or None."""
    for index, flag in enumerate(argv[:-1]):
        if flag == "--resume":
            return HOLD_NAME.sub(r"/\1", argv[index + 1])
    return None


def verb_preflight(req: PreflightRequest) -> PreflightAnswer:
    """The pre-flight alone, read-only (a dry run's verdict): release `release` (a hash) must be on the target
    already; with `old`, the resume placeholder stands for that run's newest checkpoint (or the one it started
    from). Answers `{"preflight": verdict}`, `{"preflight": None, "skipped": why}`, or refuses as a launch
    would (code `preflight`)."""
    workspace = workspace_of(req.workspace)
    code_hash = str(req.release or "")
    release = os.path.join(workspace, "releases", code_hash)
    if not HASH_RE.match(code_hash) or not os.path.isdir(release):
        return PreflightAnswer(
            preflight=None, skipped="the new code is not on the target yet: it is checked after its upload"
        )
    argv = req.argv
    if not all(isinstance(a, str) for a in argv):
        raise AgentFailure("argv must be a list of strings", "bad_request")
    hold = probe = None
    try:
        if req.old:
            old_dir = run_dir(workspace, req.old)
            placeholder, chosen = req.resume_placeholder, req.resume_checkpoint
            probe, hold = resume_probe(old_dir, placeholder, chosen, argv) if os.path.isdir(old_dir) else (None, None)
            argv = argv_for_check(argv, placeholder, hold or probe)
        verdict = held_preflight(req, release, argv, dict(req.env), hold, probe)
        if req.old:
            refuse_unchecked(req, verdict, str(req.old), run_dir(workspace, req.old))
        return PreflightAnswer(preflight=verdict)
    finally:
        release_hold(hold)


def held_preflight(
    req: LaunchRequest, release: str, argv: list[str], env: dict, hold: str | None, probe: str | None
) -> dict:
    """preflight_release of an argv that names the hold folder of checkpoint `probe` (resume_probe): what it
    says names `probe`, the checkpoint the user knows."""

    def named(text: str) -> str:
        return text.replace(hold, str(probe)) if hold else text

    try:
        verdict = preflight_release(req, release, argv, env)
    except AgentFailure as exc:
        raise AgentFailure(named(str(exc)), exc.code) from None
    return {**verdict, "summary": named(str(verdict.get("summary") or ""))} if "summary" in verdict else verdict


def refuse_unchecked(req: ResumeRequest, verdict: dict | None, old: str, old_dir: str) -> None:
    """A restart's refusal (code `unchecked`) when the pre-flight could only compile the new job (not the trainer,
    no profile `check:`), the old run is alive and the request does not say `unchecked`: the old run is not
    stopped for a job that may not start. A run that has ended, or a pre-flight that was skipped, passes."""
    from .stop import run_processes_of  # stop imports the launch side, which imports this module

    if (verdict or {}).get("checked") != "compile" or req.unchecked or not run_processes_of(old_dir)[1]:
        return
    profile = req.run_json.get("profile")
    raise AgentFailure(
        f"{old}'s job (profile {profile}) cannot be checked before the old run is stopped; nothing was stopped",
        "unchecked",
    )


def trained_a_step(status: dict) -> bool:
    """The job has finished an optimizer step in this process, so a stop makes it checkpoint: the trainer's
    timeline says `first_step`; a job that keeps no timeline counts when status.json names a step past 0."""
    timeline = status.get("timeline")
    if isinstance(timeline, dict):
        return "first_step" in timeline
    return isinstance(status.get("step"), int) and status["step"] > 0


def writes_final(directory: str) -> bool:
    """The run is alive and has trained a step in this process: its stop writes a final checkpoint."""
    from .stop import run_processes_of  # stop imports the launch side, which imports this module

    return bool(run_processes_of(directory)[1]) and trained_a_step(
        read_json(os.path.join(directory, "status.json")) or {}
    )


def resume_probe(
    old_dir: str, placeholder: object, chosen: str | None, argv: list[str]
) -> tuple[str | None, str | None]:
    """(the checkpoint a restart's pre-flight checks, its hold folder or None), before anything is stopped.

    - `chosen` (restart --checkpoint): the child resumes exactly it, so it must be whole (checkpoint_damage),
      else AgentFailure `preflight` naming the damaged file and the last good checkpoint; it is held (hard
      links, checkpoints.hold_checkpoint) until the child is launched, and put back if the run's rotation
      deletes it meanwhile (checkpoints.restore_held).
    - else the run's newest checkpoint. When the run will write a final one on its stop (writes_final: the
      child resumes that, a hand-over's or after the exit), the newest whole one stands in for its shape and
      number of nodes; else the newest is what the child resumes, and a damaged one is refused here. Held while
      the pre-flight reads it: the running trainer keeps its newest N and deletes older ones meanwhile (a
      restart failed 1 time in 5 at --save-interval 10 with "not a complete checkpoint (no state.json)").
    - none of its own: the checkpoint the run started from (run.json's `resumed_from`), held likewise.
    Wholeness is judged for a trainer job (`python -m trainer train`, whose checkpoint files are known) only."""
    if not placeholder:
        return None, None
    whole = checkpoint_damage if trainer_flags(argv) is not None else (lambda path: None)
    if chosen is not None:
        damage = whole(chosen)
        if damage is not None:
            raise AgentFailure(damaged(chosen, damage), "preflight")
        return chosen, hold_checkpoint(chosen)
    probe = None
    for _ in range(5):  # the pick and its hold race the trainer's rotation: pick again when it won
        newest = latest_checkpoint(old_dir)
        if newest is None:
            origin = started_from(old_dir)
            return origin, hold_checkpoint(origin) if origin else None
        damage = whole(newest)
        if damage is not None and not writes_final(old_dir):
            raise AgentFailure(damaged(newest, damage), "preflight")
        probe = newest if damage is None else last_good_checkpoint(newest)
        if probe is None:  # the final checkpoint alone will be whole: nothing of this shape to check now
            return None, None
        hold = hold_checkpoint(probe)
        if hold is not None or os.path.isdir(probe):  # held, or a filesystem without hard links: unheld
            return probe, hold
    return probe, None


def check_fresh(check: dict) -> dict:
    """The check in a new interpreter: exit code and output."""
    try:
        done = subprocess.run(
            check["argv"], cwd=check["cwd"], env=check["env"], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=PREFLIGHT_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "output": f"no verdict within {PREFLIGHT_TIMEOUT_S:.0f} s"}
    except OSError as exc:
        return {"exit_code": None, "output": f"cannot start {check['argv'][0]}: {exc.strerror}"}
    return {"exit_code": done.returncode, "output": done.stdout + done.stderr}


def await_starting_standby(workspace: str, fingerprint: str, deadline: float) -> None:
    """Wait while a standby of `fingerprint` started for this very launch (no run to follow: `after` empty) is
    still importing and none is ready: a new interpreter for the check would pay the same imports, and the run
    then a third time. Returns at once when one is ready or none is starting; a standby that dies ends the wait."""
    while time.monotonic() < deadline and not any(ready_standbys(workspace, fingerprint)):
        starting = (
            spec.get("fingerprint") == fingerprint and not spec.get("after") and standby_alive(folder, spec)
            for folder, spec in standbys(workspace)
            if not os.path.exists(os.path.join(folder, "claimed"))
        )
        if not any(starting):
            return
        time.sleep(STANDBY_POLL_S * 5)


def check_in_standby(workspace: str, fingerprint: str, check: dict) -> dict | None:
    """The check in a ready standby of `fingerprint` (check_in_child) with that standby's pid (`standby_pid`), or
    None when none is free (none ready, one busy with another check, or it left meanwhile): the caller checks
    in a new interpreter."""
    for folder, spec in ready_standbys(workspace, fingerprint):
        ready = read_int(os.path.join(folder, "ready"))
        try:
            os.mkdir(os.path.join(folder, CHECK_CLAIM))  # one check at a time per standby
        except OSError:
            continue
        try:
            remove_quietly(os.path.join(folder, CHECK_ANSWER))
            write_atomic(os.path.join(folder, CHECK_REQUEST), json.dumps(check), mode=0o600)
            deadline = time.monotonic() + PREFLIGHT_TIMEOUT_S
            while time.monotonic() < deadline:
                answer = take_file(os.path.join(folder, CHECK_ANSWER))
                if answer is not None:  # with the interpreter that checked: the one a launch may adopt next
                    return {**answer, "standby_pid": ready}
                if not carries_marker(ready, spec["marker"]):  # it exited (idle, retired): nobody will answer
                    break
                time.sleep(0.02)
            if take_file(os.path.join(folder, CHECK_REQUEST)) is None:  # taken, never answered: it is broken
                write_atomic(os.path.join(folder, "retired"), "\n")
            return None
        finally:
            try:
                os.rmdir(os.path.join(folder, CHECK_CLAIM))
            except OSError:
                pass
    return None


def started_from(directory: str) -> str | None:
    """The complete checkpoint the run was started from (run.json's `resumed_from`), or None."""
    origin = ((read_json(os.path.join(directory, "run.json")) or {}).get("extra") or {}).get("resumed_from")
    return origin if isinstance(origin, str) and complete_checkpoint(origin) else None


def argv_for_check(argv: list[str], placeholder: object, checkpoint: str | None) -> list[str]:
    """A restart's argv for its pre-flight: the resume placeholder replaced by `checkpoint` (the one it will
    resume, or one of the same run and shape), or, with none yet, dropped with the flag before it."""
    if not placeholder or str(placeholder) not in argv:
        return argv
    if checkpoint is not None:
        return [checkpoint if arg == placeholder else arg for arg in argv]
    index = argv.index(str(placeholder))
    return argv[: max(index - 1, 0)] + argv[index + 1 :]
