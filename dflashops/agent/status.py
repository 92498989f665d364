"""`status` and `gpus`: a run's state derived from its files, and what its supervisor left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from .answers import GpuEntry, GpusAnswer, RunEntry, StatusAnswer
from .common import (
    ERROR_LINE_RE,
    NAME_RE,
    SUPERVISOR_ARGV,
    ProcessTable,
    alive,
    missing_run,
    read_int,
    read_json,
    read_proc,
    read_text,
    run_dir,
    run_processes,
    session_name,
    tmux_socket,
    workspace_of,
)
from .protocol import GpusRequest, StatusRequest
from .wrap import launch_in_flight


def last_lines(path: str, max_bytes: int = 65536) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - max_bytes))
            return handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []


def last_log_line(log_tail: list[str]) -> str | None:
    """The log's last line that says something about the run: wandb's housekeeping at exit (`wandb: Find logs
    at ...`, `wandb: Synced ...`) and blank lines are skipped."""
    return next((ln for ln in reversed(log_tail) if ln.strip() and not ln.startswith("wandb:")), None)


def trainer_exit_code(directory: str, trainer_status: dict | None) -> int | None:
    """The exit code the trainer recorded in status.json when a launcher (torchrun) ran it: torchrun exits 1
    whenever its worker exits non-zero, so its own code would call a clean stop (143) a failure of 1. None
    when the trainer is the job itself (its code is the exit_code file's) or recorded none."""
    status = trainer_status or {}
    code, pid = status.get("exit_code"), status.get("pid")
    if not isinstance(code, int) or not isinstance(pid, int) or pid == read_int(os.path.join(directory, "pid")):
        return None
    return code


def run_status(directory: str, table: ProcessTable | None = None) -> RunEntry:
    """The run's state and what its files say. `table`: a /proc walk shared by every run of one `status`
    call, taken before any run's files are read (a run with no process in it has written its exit code, if it
    ever will, before this reads it); None walks /proc for this run alone, after its exit code is read."""
    name = os.path.basename(directory)
    run_json = read_json(os.path.join(directory, "run.json")) or {}
    exit_code = read_int(os.path.join(directory, "exit_code"))
    pgid = read_int(os.path.join(directory, "pgid"))
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    live = sorted(run_processes(pgid, marker, directory, table)[1]) if exit_code is None or pgid else []
    if exit_code is None and not live and table is not None and table.predates(os.path.join(directory, "pgid")):
        # launched after the shared walk: its processes are not in it (this run alone walks /proc again)
        live = sorted(run_processes(pgid, marker, directory, ProcessTable())[1])
    if exit_code is None and not live:
        # The wrapper writes exit_code, then exits: between the read above and the scan it may have done both, and
        # the run would read as lost (seen under load: deploy reported a crash in its start as "lost, exit code
        # None"). With no process of the run left, this second read is final.
        exit_code = read_int(os.path.join(directory, "exit_code"))
    trainer_status = read_json(os.path.join(directory, "status.json"))
    launcher_exit_code = None
    trainer_exit = trainer_exit_code(directory, trainer_status)
    if exit_code is not None and trainer_exit is not None and trainer_exit != exit_code:
        launcher_exit_code, exit_code = exit_code, trainer_exit
    metrics_lines = last_lines(os.path.join(directory, "metrics.jsonl"), 16384)
    last_metrics = None
    for line in reversed(metrics_lines):
        try:
            last_metrics = json.loads(line)
            break
        except ValueError:
            continue
    # status.json names the step in progress (the one that crashed); metrics.jsonl the last one logged.
    steps = [v for v in ((last_metrics or {}).get("step"), (trainer_status or {}).get("step")) if isinstance(v, int)]
    step = max(steps) if steps else None
    # Stopped = by `dflashops stop` (stop.json), or the trainer itself recorded a graceful stop after a signal
    # from elsewhere (status.json phase "stopped": it checkpointed and exited), which is no crash.
    stopped = os.path.exists(os.path.join(directory, "stop.json")) or (trainer_status or {}).get("phase") == "stopped"
    if launcher_exit_code is not None and exit_code == 0 and (trainer_status or {}).get("phase") == "done":
        stopped = False  # the trainer had finished; the stop only met its launcher on the way out
    stall = read_json(os.path.join(directory, "stall.json"))  # written by supervisor.py
    if live:
        state = "stopping" if stopped else "running"
    elif exit_code is None:
        state = "launching" if not pgid and launch_in_flight(directory) else "lost"
    elif stall:
        state = "crashed"  # the supervisor stopped it for a stall: a failure, whatever the trainer wrote
    elif stopped:
        state = "stopped"
    elif exit_code == 0:
        state = "finished"
    else:
        state = "crashed"
    # The log's error line is reported for a crashed or lost run only, so only those pay the search through
    # 64 KB of log (1 s of the call's 1.5 s for 300 finished runs, 2,000 lines each); the others read the
    # last 8 KB for the last log line.
    log_path = os.path.join(directory, "train.log")
    error_line = None
    if state in ("crashed", "lost"):
        log_tail = last_lines(log_path)
        error_line = next((ln for ln in reversed(log_tail) if ERROR_LINE_RE.search(ln) and "Traceback" not in ln), None)
        if error_line is None and trainer_status and trainer_status.get("error"):
            error_line = str(trainer_status["error"])
    else:
        log_tail = last_lines(log_path, 8192)
        if last_log_line(log_tail) is None:
            log_tail = last_lines(log_path)  # 8 KB of blank or wandb lines: look further back, as before
    if stall and stall.get("reason"):
        error_line = f"stalled: {stall['reason']}"
    checkpoints = (
        sorted(d for d in os.listdir(os.path.join(directory, "checkpoints")) if d.startswith("step_"))
        if os.path.isdir(os.path.join(directory, "checkpoints"))
        else []
    )
    workspace = os.path.dirname(os.path.dirname(os.path.abspath(directory)))
    return RunEntry(
        name=name,
        state=state,
        exit_code=exit_code,
        launcher_exit_code=launcher_exit_code,
        tmux={"socket": tmux_socket(workspace), "session": run_json.get("session") or session_name(name)},
        pids=live,
        pgid=pgid,
        step=step,
        error_line=error_line if state in ("crashed", "lost") else None,
        ended_at=ended_at(directory) if state in ("finished", "crashed", "stopped") else None,
        trainer_status=trainer_status,
        last_metrics=last_metrics,
        last_log_line=last_log_line(log_tail),
        checkpoints=checkpoints,
        run_dir=directory,
        run_json=run_json,
        **supervision(directory),
    )


def ended_at(directory: str) -> float | None:
    """When the run ended (epoch seconds): its exit_code file's time (the wrapper writes it as the job exits).
    The controller's `status` shows ended runs from the last day only (ops/runs/control.py recent_runs)."""
    try:
        return os.stat(os.path.join(directory, "exit_code")).st_mtime
    except OSError:
        return None


def supervision(directory: str) -> dict:
    """What supervisor.py left in the run directory: the run that replaced this one, the events it
    recorded (events.jsonl) and its own state (supervisor.json); empty for an unsupervised run."""
    found: dict = {}
    child = (read_text(os.path.join(directory, "restarted_as")) or "").strip()
    if child:
        found["restarted_as"] = child
    events: list[dict] = []
    for line in last_lines(os.path.join(directory, "events.jsonl"), 65536):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if "delivery" in entry:  # the supervisor's courier: how the webhook POST of an earlier event went
            for event in events:
                if event.get("id") == entry["delivery"]:
                    event["webhook"] = entry.get("webhook")
            continue
        events.append(entry)
    if events:
        found["events"] = events
    state = read_json(os.path.join(directory, "supervisor.json"))
    if state:
        if state.get("state") in ("watching", "backoff"):
            state["alive"] = supervisor_alive(state.get("pid"))
        found["supervisor"] = state
    return found


def supervisor_alive(pid: object) -> bool:
    """`pid` is a live supervisor process (its command line is the agent's `supervise` verb: a reused pid is not).
    A supervisor started before the agent became one zipapp ran as `.dflashops/supervisor-<sha12>.py`: it is
    still known, so a stop after an upgrade cancels its pending restart too."""
    if not (isinstance(pid, int) and alive(pid)):
        return False
    cmdline = read_proc(pid, "cmdline")
    return SUPERVISOR_ARGV in cmdline or b"/.dflashops/supervisor-" in cmdline


def cancel_supervisor(directory: str) -> bool:
    """SIGTERM the supervisor watching this run (its supervisor.json pid, checked against its command line):
    a stop means no automatic restart. True when one was running."""
    state = read_json(os.path.join(directory, "supervisor.json")) or {}
    pid = state.get("pid")
    if state.get("state") not in ("watching", "backoff") or not supervisor_alive(pid):
        return False
    assert isinstance(pid, int)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    # Until it has exited or said `cancelled` (it may still be finishing a webhook delivery: that is no restart).
    deadline = time.monotonic() + 5.0
    while alive(pid) and time.monotonic() < deadline:
        now = read_json(os.path.join(directory, "supervisor.json")) or {}
        if now.get("pid") == pid and now.get("state") not in ("watching", "backoff"):
            break
        time.sleep(0.02)
    return True


def verb_status(req: StatusRequest) -> StatusAnswer:
    """One run's state (`name`), or every run's of the workspace (those that ended more than `ended_within_s`
    ago counted in `older_runs`, not read)."""
    if req.name:
        directory = run_dir(req.workspace, req.name)
        if not os.path.isdir(directory):
            raise missing_run(req.workspace, req.name, "does not exist on this target")
        return StatusAnswer(runs=[run_status(directory)])
    runs_root = os.path.join(workspace_of(req.workspace), "runs")
    names = sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []
    table = ProcessTable()  # one walk of /proc for every run (O(runs + processes)), before any run is read
    directories = [os.path.join(runs_root, n) for n in names if NAME_RE.match(n)]
    within = req.ended_within_s
    if not isinstance(within, (int, float)) or isinstance(within, bool):
        return StatusAnswer(runs=[run_status(directory, table) for directory in directories])
    # The controller's default view: runs that ended more than `within` seconds ago (and have no process left)
    # are counted, not read: a workspace of 1,000 finished runs costs a stat and two small reads each.
    cutoff = time.time() - within
    shown = [directory for directory in directories if not ended_before(directory, cutoff, table)]
    return StatusAnswer(
        runs=[run_status(directory, table) for directory in shown], older_runs=len(directories) - len(shown)
    )


def ended_before(directory: str, cutoff: float, table: ProcessTable) -> bool:
    """The run ended (its exit_code was written) before `cutoff` and none of its processes is alive."""
    written = ended_at(directory)
    if written is None or written >= cutoff:
        return False
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    return not run_processes(read_int(os.path.join(directory, "pgid")), marker, directory, table)[1]


def verb_gpus(req: GpusRequest) -> GpusAnswer:
    """nvidia-smi's GPUs: index, name, memory used and total (MiB), utilization (%)."""
    if not shutil.which("nvidia-smi"):
        return GpusAnswer(available=False, gpus=[])
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.used,memory.total,utilization.gpu",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5:
            gpus.append(
                GpuEntry(
                    index=int(parts[0]),
                    name=parts[1],
                    memory_used_mib=int(parts[2]),
                    memory_total_mib=int(parts[3]),
                    utilization_pct=int(parts[4]),
                )
            )
    return GpusAnswer(available=True, gpus=gpus)
