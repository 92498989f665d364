"""`stop`: a run's process group stopped, with the checkpoint hand-over, the grace and the records."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any

from .answers import StopAnswer
from .common import (
    LAUNCH_SETTLE_S,
    AgentFailure,
    alive,
    read_int,
    read_json,
    read_text,
    run_dir,
    run_processes,
    session_name,
    signal_run,
    tmux_socket,
)
from .protocol import StopRequest
from .run_lock import control_wait_s, joined_answer, release_control, take_control, try_control
from .status import cancel_supervisor, trainer_exit_code
from .wrap import launch_in_flight, record_exit_code, stop_requested, write_record


def gpu_apps() -> dict[int, int] | None:
    """pid -> used MiB of compute processes, or None when nvidia-smi is absent."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    apps: dict[int, int] = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else 0
    return apps


def wait_gone(pgid: int | None, marker: str | None, directory: str, timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = run_processes(pgid, marker, directory)[1]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


SAVE_HEARTBEAT_S = 45.0  # the trainer's status heartbeat beats every 15 s, also while it writes a checkpoint
EXIT_AFTER_SAVE_S = 30.0  # after the checkpoint: the process still closes its files and loggers


def saving_checkpoint(directory: str) -> bool:
    """True while the run's status.json says it is writing a checkpoint and its heartbeat is fresh."""
    status = read_json(os.path.join(directory, "status.json")) or {}
    try:
        fresh = time.time() - float(status.get("heartbeat", 0.0)) < SAVE_HEARTBEAT_S
    except (TypeError, ValueError):
        return False
    return status.get("phase") == "saving" and fresh


def verb_stop(req: StopRequest) -> StopAnswer:
    """Stop the run; its checkpoint first, then its processes. Refuses a run that is not running.

    Serialised per run (`take_control`): a stop that meets another stop or a restart of the same run waits for
    it and answers with its outcome (`joined`) instead of signalling again: a second SIGTERM tells the trainer
    to exit at once, without the checkpoint the first one asked for. With `now` (`stop --now`, the deliberate
    second signal) it neither waits nor checkpoints: SIGKILL to the whole run at once (`stop_now`).

    1. A launch still in flight (no job pid yet): record the stop request, which the wrapper reads before it
       starts the job, and wait for the launch to settle; the stop wins either way (verb_wrap).
    2. SIGTERM to the job's own process only (the recorded `pid`, or the trainer status.json names when a
       launcher such as torchrun stands between: first_to_stop), not yet its group: the trainer's children
       (the W&B service, data workers) must keep running until it has written its checkpoint and closed its
       W&B run, or the stop leaves a ConnectionResetError traceback in the log and W&B sockets behind.
    3. Once the job has exited (or `grace` passed), SIGTERM to the rest of the group and the marked
       processes (setsid children), and wait for them too.
    4. SIGKILL what is left after `grace`; a run still writing the checkpoint the TERM asked for (status.json
       phase "saving", live heartbeat) gets up to `save_grace` seconds more first.
    5. Wait until none is left and (with nvidia-smi) none of its pids holds GPU memory.
    Signals come first, bookkeeping after, and bookkeeping is best effort: a full disk must not stop a stop.
    With `handover` (restart --resume): once the trainer says in status.json that its final checkpoint is in
    host memory and its devices are free (`handover`, trainer/state/handover.py), answer at once with that offer;
    steps 2-5 then finish in a background process of the agent, exactly as they would have here, holding
    the run's control lock until they are done."""
    directory = run_dir(req.workspace, req.name)
    if not os.path.isdir(directory):
        raise AgentFailure(f"run {req.name!r} does not exist on this target", "not_found")
    if req.now:
        return stop_now(req, directory)
    started = time.monotonic()
    supervisor_cancelled = cancel_supervisor(directory)  # first: it must not restart what is being stopped
    by = "restart" if req.by == "restart" else "stop"  # a restart of a run on several targets stops here
    lock, met = take_control(directory, by, control_wait_s(req))
    answer: StopAnswer | None = None
    try:
        if met is not None and by == "restart" and met.get("op") == "restart":
            raise AgentFailure(
                f"run {req.name!r} was restarted meanwhile by another command; nothing was done", "superseded"
            )
        if met is not None and not run_processes_of(directory)[1]:
            answer = joined_answer(directory, met, started)
        else:
            answer = stop_held(req, directory, started, lock, supervisor_cancelled=supervisor_cancelled)
        return answer
    finally:
        outcome = {"exit_code": answer.exit_code if answer else None, "handover": bool(answer and answer.handover)}
        release_control(directory, lock, outcome)


def stop_held(
    req: StopRequest, directory: str, started: float, lock: int, *, supervisor_cancelled: bool = False
) -> StopAnswer:
    """verb_stop's work, for a caller that holds the run's control lock (`lock`: its descriptor, which the
    background part of a hand-over keeps open until it is done). `supervisor_cancelled`: the caller stopped the
    run's supervisor, so a run that had ended already is answered as a cancelled automatic restart."""
    if launch_in_flight(directory):
        record_stop(directory, {"requested_at": time.time()})
        wait_for_any(directory, ("pid", "exit_code"), LAUNCH_SETTLE_S)
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    pgid, pids = run_processes(read_int(os.path.join(directory, "pgid")), marker, directory)
    if (
        not pids
        and stop_requested(directory)
        and read_int(os.path.join(directory, "pid")) is None
        and read_int(os.path.join(directory, "exit_code")) is not None
    ):
        return finish_stop(req, directory, started, escalated=False, seen=set(), waited=0.0, before_start=True)
    if not pids and supervisor_cancelled:  # it had ended; its pending automatic restart is what was stopped
        return StopAnswer(
            escalated=False,
            signalled=[],
            gpu_released=None,
            waited_for_checkpoint_s=0.0,
            before_start=False,
            exit_code=read_int(os.path.join(directory, "exit_code")),
            seconds=round(time.monotonic() - started, 3),
            recorded=True,
            supervisor_cancelled=True,
        )
    if not pids:
        raise AgentFailure(f"run {req.name!r} is not running", "not_running")
    grace = float(req.grace)
    first = first_to_stop(directory, pids)
    job = first if first in pids else None  # goes first when it is one of the run's processes
    job_first = job is not None
    signal_run(None if job_first else pgid, {job} if job is not None else pids, signal.SIGTERM)
    recorded = record_stop(directory, {"requested_at": time.time()})
    grace_deadline = time.monotonic() + grace
    save_deadline = grace_deadline + float(req.save_grace)
    stopping = (req, directory, started, pgid, marker, pids, job, job_first, grace_deadline, save_deadline, recorded)
    if req.handover and job_first:
        offer = wait_for_handover(directory, job, grace_deadline, save_deadline)
        if offer is not None:

            def finish() -> None:
                try:
                    complete_stop(*stopping)
                except Exception as exc:  # noqa: BLE001 - nobody is listening: stop.json says what went wrong
                    record_stop(directory, {"error": f"{type(exc).__name__}: {exc}", "finished_at": time.time()})

            in_background(finish, keep_fd=lock)
            return StopAnswer(
                handover=offer,
                escalated=False,
                signalled=[job] if job is not None else [],  # job_first: never None here
                gpu_released=True,
                waited_for_checkpoint_s=0.0,
                before_start=False,
                exit_code=None,
                seconds=round(time.monotonic() - started, 3),
                recorded=recorded,
                supervisor_cancelled=supervisor_cancelled,
            )
    answer = complete_stop(*stopping)
    answer.supervisor_cancelled = supervisor_cancelled
    return answer


def stop_now(req: StopRequest, directory: str) -> StopAnswer:
    """`stop --now`: SIGKILL to every process of the run at once, whatever else is going on (a stop or restart
    in progress keeps its lock and finds the processes gone); no final checkpoint, the last periodic one stays.
    The bookkeeping (exit code, stop.json) is done here only when no other command holds the run."""
    started = time.monotonic()
    cancel_supervisor(directory)
    if launch_in_flight(directory):
        record_stop(directory, {"requested_at": time.time(), "now": True})
        wait_for_any(directory, ("pid", "exit_code"), LAUNCH_SETTLE_S)
    pgid, pids = run_processes_of(directory)
    if not pids and read_int(os.path.join(directory, "exit_code")) is None and not stop_requested(directory):
        raise AgentFailure(f"run {req.name!r} is not running", "not_running")
    signal_run(pgid, pids, signal.SIGKILL)
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    left = wait_gone(pgid, marker, directory, req.kill_s())
    if left:
        raise AgentFailure(f"processes {sorted(left)} of run {req.name!r} survived SIGKILL", "stuck")
    lock = try_control(directory, "stop --now")
    if lock is None:  # a stop or restart holds the run: it sees the processes gone and records the end itself
        return StopAnswer(now=True, escalated=True, signalled=sorted(pids), exit_code=128 + signal.SIGKILL,
                          seconds=round(time.monotonic() - started, 3), recorded=None, gpu_released=None,
                          waited_for_checkpoint_s=0.0, before_start=False)  # fmt: skip
    try:
        record_stop(directory, {"requested_at": time.time(), "now": True})
        answer = finish_stop(req, directory, started, escalated=True, seen=set(pids), waited=0.0,
                             gpu_timeout=req.gpu_s())  # fmt: skip
        answer.now = True
        return answer
    finally:
        release_control(directory, lock, {"exit_code": 128 + signal.SIGKILL, "now": True})


def run_processes_of(directory: str) -> tuple[int | None, set[int]]:
    """run_processes with the run directory's own pgid and marker."""
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    return run_processes(read_int(os.path.join(directory, "pgid")), marker, directory)


def complete_stop(
    req: StopRequest,
    directory: str,
    started: float,
    pgid: int | None,
    marker: str | None,
    pids: set[int],
    job: int | None,
    job_first: bool,
    grace_deadline: float,
    save_deadline: float,
    recorded: bool,
) -> StopAnswer:
    """verb_stop after its first SIGTERM: wait for the job, TERM the rest of the group, KILL what is left
    after the grace (a checkpoint being written gets its save grace), then the bookkeeping (finish_stop)."""
    grace = float(req.grace)
    seen, waited = set(pids), 0.0
    if job is not None:
        _, waited = wait_out(lambda: {job} if alive(job) else set(), grace_deadline, save_deadline, directory)

    def rest() -> set[int]:
        return run_processes(pgid, marker, directory)[1]

    left = rest()
    if left and job_first:
        seen |= left
        signal_run(pgid, left, signal.SIGTERM)
        # The rest of the group (the W&B service, data workers) gets what is left of the grace, and at least
        # REST_GRACE_S to close once the job has exited; a job that outlived the grace leaves it none.
        deadline = grace_deadline if job in left else max(grace_deadline, time.monotonic() + min(grace, REST_GRACE_S))
        left, more = wait_out(rest, deadline, save_deadline, directory)
        waited += more
    elif left:
        left, waited = wait_out(rest, grace_deadline, save_deadline, directory)
    escalated = bool(left)
    if left:
        seen |= left
        signal_run(pgid, left, signal.SIGKILL)
        left = wait_gone(pgid, marker, directory, req.kill_s())
    if left:
        raise AgentFailure(f"processes {sorted(left)} of run {req.name!r} survived SIGKILL", "stuck")
    return finish_stop(
        req,
        directory,
        started,
        escalated=escalated,
        seen=seen,
        waited=waited,
        recorded=recorded,
        gpu_timeout=req.gpu_s(),
    )


def handover_offer(directory: str) -> dict | None:
    """The trainer's hand-over offer in status.json (trainer/state/handover.py): its final checkpoint is in host
    memory, being written to `checkpoint` (inside the run's checkpoints/), and its devices are free."""
    offer = (read_json(os.path.join(directory, "status.json")) or {}).get("handover")
    if not isinstance(offer, dict) or offer.get("devices_released") is not True:
        return None
    checkpoint = offer.get("checkpoint")
    root = os.path.realpath(os.path.join(directory, "checkpoints"))
    if (
        not isinstance(checkpoint, str)
        or os.path.dirname(os.path.realpath(checkpoint)) != root
        or not re.match(r"^step_\d{6,}$", os.path.basename(checkpoint))
    ):
        return None
    return {
        "checkpoint": os.path.join(directory, "checkpoints", os.path.basename(checkpoint)),
        "step": offer.get("step"),
    }


def wait_for_handover(directory: str, job: int | None, grace_deadline: float, save_deadline: float) -> dict | None:
    """After the SIGTERM: the trainer's hand-over offer, or None once the job has exited (or the grace ran
    out while it was not writing a checkpoint, or the save grace ran out): the ordinary stop goes on."""
    while job is not None and alive(job):
        offer = handover_offer(directory)
        if offer is not None:
            return offer
        now = time.monotonic()
        if now >= save_deadline or (now >= grace_deadline and not saving_checkpoint(directory)):
            return None
        time.sleep(0.05)
    return None


def in_background(work, keep_fd: int) -> None:
    """Run `work()` in a detached process (double fork, own session, stdio on /dev/null, so the caller's pipe
    to the controller closes when the caller exits); return once it is on its way. `keep_fd` (the run's
    control lock) stays open in it, so the lock is held until `work` is done."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, keep_fd)
        os.closerange(keep_fd + 1, 1 << 16)
        try:
            work()
        except BaseException:  # noqa: BLE001 - nobody is listening; stop.json says how far it got
            pass
    finally:
        os._exit(0)


REST_GRACE_S = 1.0  # the rest of the group gets at least this long (within --grace) after the job exited


def first_to_stop(directory: str, pids: set[int]) -> int | None:
    """The process the stop's first SIGTERM goes to: the trainer that status.json names, when it is one of the
    run's processes, else the job the wrapper started. They differ under a launcher such as torchrun, which
    forwards a SIGTERM to its worker but SIGKILLs that worker 30 s later (its shutdown timeout): an 8B
    drafter's final checkpoint takes ~20 s, so the worker is told first, writes its checkpoint and exits,
    and torchrun, seeing its worker gone, ends on its own (or with the rest of the group after it)."""
    trainer = (read_json(os.path.join(directory, "status.json")) or {}).get("pid")
    if isinstance(trainer, int) and trainer in pids:
        return trainer
    return read_int(os.path.join(directory, "pid"))


def wait_for_any(directory: str, names: tuple[str, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(os.path.exists(os.path.join(directory, n)) for n in names):
        time.sleep(0.02)


def record_stop(directory: str, fields: dict) -> bool:
    """Merge `fields` into stop.json; False when it could not be written (a full disk, no reserve left)."""
    info = read_json(os.path.join(directory, "stop.json")) or {}
    info.update(fields)
    try:
        write_record(directory, "stop.json", json.dumps(info) + "\n")
        return True
    except OSError:
        return False


def wait_out(live, deadline: float, save_deadline: float, directory: str) -> tuple[set[int], float]:
    """Poll `live()` (the pids still to wait for) until it is empty or `deadline`; past the deadline keep
    waiting, up to `save_deadline`, while the run is writing its checkpoint, then give the process
    EXIT_AFTER_SAVE_S to close its files. Returns (still live, seconds waited for the checkpoint)."""
    left = live()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = live()
    waited = 0.0
    while left and saving_checkpoint(directory) and time.monotonic() < save_deadline:
        began = time.monotonic()
        time.sleep(min(0.05, max(0.0, save_deadline - began)))
        left = live()
        waited += time.monotonic() - began
    if left and waited:  # checkpoint written; the process is on its way out (closing files, wandb)
        exit_deadline = min(time.monotonic() + EXIT_AFTER_SAVE_S, save_deadline)
        while left and time.monotonic() < exit_deadline:
            began = time.monotonic()
            time.sleep(0.05)
            left = live()
            waited += time.monotonic() - began
    return left, waited


def finish_stop(
    req: StopRequest,
    directory: str,
    started: float,
    *,
    escalated: bool,
    seen: set[int],
    waited: float,
    recorded: bool = True,
    before_start: bool = False,
    gpu_timeout: float = 0.0,
) -> StopAnswer:
    """Bookkeeping after the processes are gone: GPU release, a missing exit code, the tmux session, stop.json.
    Best effort on a full disk; the answer says whether stop.json was written."""
    gpu_released = wait_gpu_release(seen, gpu_timeout) if seen else None
    if read_int(os.path.join(directory, "exit_code")) is None:
        # The wrapper itself was SIGKILLed before it could write the status; record what happened to it.
        try:
            record_exit_code(directory, 128 + signal.SIGKILL)
        except OSError:
            pass
    if shutil.which("tmux"):
        subprocess.run(
            ["tmux", "-L", tmux_socket(req.workspace), "kill-session", "-t", "=" + session_name(req.name)],
            capture_output=True,
            timeout=10,
        )
    exit_code = read_int(os.path.join(directory, "exit_code"))
    trainer_exit = trainer_exit_code(directory, read_json(os.path.join(directory, "status.json")))
    result: dict[str, Any] = {
        "escalated": escalated,
        "signalled": sorted(seen),
        "gpu_released": gpu_released,
        "waited_for_checkpoint_s": round(waited, 1),
        "before_start": before_start,
        "exit_code": trainer_exit if exit_code is not None and trainer_exit is not None else exit_code,
        "launcher_exit_code": exit_code if trainer_exit is not None else None,
        "seconds": round(time.monotonic() - started, 3),
    }
    result["recorded"] = record_stop(directory, {**result, "finished_at": time.time()}) and recorded
    answer = StopAnswer(**result)
    answer.nulls = NULL_LAUNCHER  # its key is there, null too, as stop.json records it
    return answer


NULL_LAUNCHER = frozenset({"launcher_exit_code"})


def wait_gpu_release(pids: set[int], timeout: float) -> bool | None:
    """None without nvidia-smi; else True once no pid of the run is listed as a GPU compute app."""
    apps = gpu_apps()
    if apps is None:
        return None
    deadline = time.monotonic() + timeout
    while pids & set(apps):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
        apps = gpu_apps() or {}
    return True
