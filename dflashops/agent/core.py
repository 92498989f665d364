"""dflashops agent: a stdlib-only program that runs inside the target with its own python3.

Contract: `python3 agent-<sha12>.pyz VERB [--json-args JSON | --json-stdin]` prints exactly ONE JSON line on stdout,
`{"ok": true, ...}` or `{"ok": false, "error": "...", "code": "..."}`, and exits 0 either way (exit 2 only
for a request that could not even be parsed, still with its JSON line). The controller trusts the JSON line,
never the exit status, because ssh (255) and pct/lxc-attach (1) make exit codes ambiguous. The one
exception is `follow`, which streams one such line per answer (see verb_follow).

With `--json-stdin` the request is read from stdin (launch uses this so that secrets in the environment of
the launched process never appear on a command line). `install` and `restart` read one JSON request line
from stdin, then the tar stream of the changed files.

Verbs: ping, launch, stop, status, tail, follow (tail, streamed), gpus, clear-cache, manifest, install, restart (stop + install +
launch in one call), gc, and the internal `wrap`
(the launch wrapper that records pid/pgid/exit code). It runs with whatever python3 the container has, so it
imports the standard library only; it travels as one zipapp built from the package (dflashops/agent/).

It never kills by name: only the recorded process group of a run and processes whose environment carries
the run's unique marker (DFLASHOPS_RUN_ID=<name>.<nonce>).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LAUNCHERS = ("tmux", "nohup")  # how a run is started: a tmux session, or setsid + nohup (the controller uses these)
HASH_RE = re.compile(r"^[0-9a-f]{8,64}$")
MARKER_KEY = "DFLASHOPS_RUN_ID"
RESUME_WRITER_KEY = "DFLASHOPS_RESUME_WRITER"  # trainer/handover.py: the run still writing the --resume checkpoint
# A crash's one-line reason in train.log: a Python exception line, or the `error: ...` line that the trainer
# (and dflashops' own wrapper) print for failures they explain themselves.
ERROR_LINE_RE = re.compile(r"(Traceback \(most recent call last\)|^\w*(Error|Exception)\b.*|^error: .+)")
# THE list of names in a run directory `<workspace>/runs/<name>/` (a folder ends in "/"), with who writes each:
# this agent, its supervisor (agent_supervisor.py), the trainer, the wandb library it starts, `trainer export`
# (run by `dflashops fetch --export`), or nobody here ("none": read when present). The trainer cannot import
# this file, so it keeps its own names (trainer/run_files.py); tests/test_run_directory_contract.py checks that
# they, the code here and the table of docs/run-directory.md all agree with this one.
RUN_FILES = {
    "run.json": "agent",
    "marker": "agent",
    ".launch.json": "agent",
    "pgid": "agent",
    "pid": "agent",
    "train.log": "agent",
    "exit_code": "agent",
    ".exit_code.reserved": "agent",
    ".stop.json.reserved": "agent",
    "stop.json": "agent",
    ".control.json": "agent",
    ".fetch-sha256.json": "agent",
    "supervisor.json": "supervisor",
    "events.jsonl": "supervisor",
    "stall.json": "supervisor",
    "restarted_as": "supervisor",
    "train_config.json": "trainer",
    "status.json": "trainer",
    ".status.json.reserved": "trainer",
    "metrics.jsonl": "trainer",
    "checkpoints/": "trainer",
    "wandb/": "wandb",
    "export/": "trainer export",
    "train.log.1": "none",
}


class AgentFailure(Exception):
    """A refusal the controller shows to the user; `code` is machine-readable (not_found, conflict, ...)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------- helpers
def is_safe_name(text: str) -> bool:
    """THE rule for names that reach command lines, file paths and tmux (runs, sessions, targets, hosts,
    profiles): 1-64 of A-Z a-z 0-9 . _ -, no `..`, no leading `-`. The controller imports it from here
    (dflashops/shell.py), so the agent and the controller can never disagree on a name."""
    return bool(NAME_RE.match(text)) and text != "." and ".." not in text and not text.startswith("-")


def check_name(value: object, what: str = "run name") -> str:
    text = str(value or "")
    if not is_safe_name(text):
        raise AgentFailure(f"invalid {what} {text!r}", "bad_request")
    return text


def run_dir(req: dict) -> str:
    workspace = req.get("workspace")
    if not isinstance(workspace, str) or not os.path.isabs(workspace):
        raise AgentFailure("workspace must be an absolute path", "bad_request")
    return os.path.join(workspace, "runs", check_name(req.get("name")))


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Write through a temporary file and rename(2); on any failure (a full disk) the temporary is removed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def append_log(directory: str, line: str) -> None:
    """One `dflashops: ...` line in the run's train.log; best effort (the disk may be full)."""
    try:
        with open(os.path.join(directory, "train.log"), "ab") as log:
            log.write(f"dflashops: {line}\n".encode())
    except OSError:
        pass


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def read_json(path: str) -> dict | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_int(path: str) -> int | None:
    text = read_text(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


# ------------------------------------------------------------------------------------ process discovery
def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, pgid) of a live process, or None when it is gone."""
    text = read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # comm may contain spaces and parentheses
    return fields[0], int(fields[2])


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def run_processes(pgid: int | None, marker: str | None, directory: str) -> tuple[int | None, set[int]]:
    """(the run's process group or None, its live processes), from one scan of /proc.

    Live processes: members of the recorded group, plus any process whose environment has the run's exact
    marker (children that called setsid left the group but kept the environment). A pgid outlives its run on
    disk: after a lost wrapper (SIGKILL, reboot) the number can be reused by an unrelated group. So the group
    counts, and is returned for killpg, only while a member carries the marker or is the run's own launch
    wrapper (its command line names this run directory); otherwise only marked processes are the run's."""
    needle = f"{MARKER_KEY}={marker}".encode() if marker else None
    wrapper_arg = json.dumps({"dir": directory}).encode()  # exactly as verb_launch builds the wrapper's argv
    members: set[int] = set()
    marked: set[int] = set()
    owned = False
    for pid in all_pids():
        if pid == os.getpid():
            continue
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        has_marker = needle is not None and needle in read_proc(pid, "environ").split(b"\0")
        if has_marker:
            marked.add(pid)
        if pgid and pgid > 1 and stat[1] == pgid:
            members.add(pid)
            owned = owned or has_marker or wrapper_arg in read_proc(pid, "cmdline")
    return (pgid, members | marked) if owned else (None, marked)


def read_proc(pid: int, name: str) -> bytes:
    """/proc/PID/NAME, or b"" when the process is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def signal_run(pgid: int | None, pids: set[int], signum: int) -> None:
    """Signal the run's group and each marked process; never anything else."""
    if pgid and pgid > 1:
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------- launch
LAUNCH_SPEC = ".launch.json"  # argv + env (with every pass_env secret) for the wrapper; 0600, deleted on every path
# Run-directory records the wrapper sets aside blocks for at start (`.NAME.reserved`), so that they can be
# written on a full disk: the exit status, and a stop request with its outcome.
RESERVED_BYTES = {"exit_code": 16, "stop.json": 4096}
LAUNCH_SETTLE_S = 30.0  # a launch still in flight this long after its directory was made has failed
# A tmux pane's command starts with the environment of the tmux server, which the first launch of the workspace
# started with ITS environment (an earlier deploy's secrets included): wrappers started in tmux drop it all.
CLEAN_ENV = ("env", "-i")


def program() -> str:
    """What python runs to start this agent again (the launch wrapper, a standby): the zipapp it was loaded
    from (zipimport's loader names its archive), else, from a checkout, the package folder (its __main__.py)."""
    archive = getattr(__spec__.loader, "archive", None) if __spec__ is not None else None
    return archive if isinstance(archive, str) else os.path.dirname(os.path.abspath(__file__))


def tmux_socket(workspace: str) -> str:
    """One tmux server per workspace, so `=name` targets and kills never touch anyone else's sessions."""
    return "dflashops-" + hashlib.sha1(workspace.encode()).hexdigest()[:10]


def session_name(run: str) -> str:
    """The run's tmux session name. tmux rewrites `.` and `:` in session names to `_`, so `exp.1` and `exp_1`
    would share one session; this encoding is injective (prefix-free: `_` -> `__`, `.` -> `_d`) and leaves
    names without `_` or `.` as typed."""
    return run.replace("_", "__").replace(".", "_d")


def check_launch(req: dict) -> tuple:
    """(run dir, argv, env, launcher) of a launch request, or AgentFailure; changes nothing."""
    directory = run_dir(req)
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise AgentFailure("argv must be a non-empty list of strings", "bad_request")
    env = req.get("env") or {}
    if not isinstance(env, dict):
        raise AgentFailure("env must be an object", "bad_request")
    launcher = req.get("launcher", "nohup")
    if launcher not in LAUNCHERS:
        raise AgentFailure(f"unknown launcher {launcher!r}", "bad_request")
    if launcher == "tmux" and not shutil.which("tmux"):
        raise AgentFailure("tmux is not installed on the target", "missing_tool")
    return directory, argv, env, launcher


def verb_launch(req: dict) -> dict:
    """Start a run: a new wrapper and job, or (`standby: true` and a `python -m trainer` argv) the waiting
    interpreter of a matching standby (see the standby section), which skips the job's imports. Either way the
    run directory gets the same records (run.json, marker, pgid, pid, exit_code) and `stop` treats both alike."""
    directory, argv, env, launcher = check_launch(req)
    if os.path.exists(directory):  # the same refusal as the mkdir below, before a pre-flight's seconds
        raise AgentFailure(f"run directory {directory} already exists", "conflict")
    launch_env = {str(k): str(v) for k, v in env.items()}
    wants_standby = bool(req.get("standby")) and standby_eligible(argv)
    fingerprint = (
        standby_fingerprint(argv[0], launch_env, launcher, list(req.get("secret_keys") or [])) if wants_standby else ""
    )
    verdict = None
    if req.get("preflight"):  # before the name is taken: a refused launch leaves nothing behind
        release = str((req.get("run_json") or {}).get("release") or env.get("PYTHONPATH") or "")
        if os.path.isdir(release):
            if wants_standby:  # none ready (a fresh workspace): the check waits for this one, the run adopts it,
                start_standby(req, argv, launch_env, launcher, "", fingerprint)  # and the imports are paid once
            verdict = preflight_release(req, release, argv, env)
    cleared = verb_clear_cache(req) if req.get("clear_cache") else None
    session = session_name(req["name"])
    if launcher == "tmux" and tmux_has_session(req["workspace"], session):  # refused before the name is taken
        raise AgentFailure(
            f"a tmux session named {session!r} already exists on this workspace's tmux server "
            f"(socket {tmux_socket(req['workspace'])})",
            "conflict",
        )
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    try:
        os.mkdir(directory)  # atomic claim of the name: a second launch of the same name fails here
    except FileExistsError:
        raise AgentFailure(f"run directory {directory} already exists", "conflict") from None
    run_json = dict(req.get("run_json") or {})
    run_json.update(name=req["name"], launcher=launcher, session=session, run_dir=directory)
    write_atomic(os.path.join(directory, "run.json"), json.dumps(run_json, indent=2, sort_keys=True) + "\n")
    cwd = req.get("cwd") or directory
    if wants_standby:
        adopted = adopt_standby(req, directory, argv, launch_env, cwd, launcher, session, fingerprint)
        if adopted is not None:
            start_standby(req, argv, launch_env, launcher, directory, fingerprint)
            return {**adopted, "preflight": verdict, "cleared": cleared}
    elif req.get("standby") is False:
        retire_standbys(req["workspace"], keep=None)
    marker = f"{req['name']}.{os.urandom(6).hex()}"
    write_atomic(os.path.join(directory, "marker"), marker + "\n")
    launch_env.update(DFLASHOPS_RUN=req["name"], **{MARKER_KEY: marker})
    # The job's whole environment: this agent's (what the controller gave this call) with the launch's on top.
    # Never the tmux server's: that server was started by an earlier call, with an earlier deploy's environment.
    spec = {"argv": argv, "env": {**os.environ, **launch_env}, "cwd": cwd}
    spec_path = os.path.join(directory, LAUNCH_SPEC)
    wrapper = [sys.executable, program(), "wrap", "--json-args", json.dumps({"dir": directory})]
    try:
        # Secrets reach the wrapper through this 0600 file; the wrapper deletes it as soon as it has read it.
        write_atomic(spec_path, json.dumps(spec), mode=0o600)
        if launcher == "tmux":
            started = subprocess.run(
                [
                    "tmux",
                    "-L",
                    tmux_socket(req["workspace"]),
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
    if wants_standby:
        start_standby(req, argv, launch_env, launcher, directory, fingerprint)
    answer = launch_answer(directory, pgid, marker, launcher, session, standby=False)
    return {**answer, "preflight": verdict, "cleared": cleared}


def tmux_has_session(workspace: str, session: str) -> bool:
    """The workspace's tmux server has a session of exactly this name (`=`: no prefix match)."""
    found = subprocess.run(
        ["tmux", "-L", tmux_socket(workspace), "has-session", "-t", "=" + session],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20,
    )  # fmt: skip
    return found.returncode == 0


def launch_answer(directory: str, pgid: int | None, marker: str, launcher: str, session: str, *, standby: bool) -> dict:
    """What `launch` answers: where the run is, its group and marker, how it was started (`standby`: a standby
    interpreter took it)."""
    return {
        "run_dir": directory,
        "pgid": pgid,
        "marker": marker,
        "launcher": launcher,
        "session": session,
        "standby": standby,
    }


def launch_failed(directory: str, reason: str) -> None:
    """Record a launch that did not start (so status says crashed, not launching forever) and refuse."""
    append_log(directory, reason)
    record_exit_code(directory, 127)
    raise AgentFailure(reason, "launch_failed")


def wait_for_file(path: str, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read_int(path)
        if value is not None:
            return value
        time.sleep(0.02)
    return None


def reserve_records(directory: str) -> None:
    """Set aside, while the disk still has room, the blocks that `exit_code` and `stop.json` will need: a run
    that fills its disk must still end with its exit status and its stop recorded, or status could only
    call a stopped run `lost` or `crashed`."""
    for name, size in RESERVED_BYTES.items():
        try:
            write_atomic(os.path.join(directory, f".{name}.reserved"), " " * (size - 1) + "\n")
        except OSError:
            pass


def write_record(directory: str, name: str, text: str) -> None:
    """`write_atomic(directory/name, text)`; on a full disk, the text goes into the file `reserve_records` set
    aside (overwritten in place, which needs no new blocks, padded with whitespace that JSON and int readers
    ignore), which is then renamed over `name`."""
    path, reserve = os.path.join(directory, name), os.path.join(directory, f".{name}.reserved")
    try:
        write_atomic(path, text)
    except OSError:
        data = text.encode()
        # The reserve, or (once it was used) the record it became: both hold blocks this write can reuse.
        spare = reserve if os.path.exists(reserve) else path
        if not os.path.exists(spare) or len(data) > os.path.getsize(spare):
            raise
        with open(spare, "r+b") as handle:
            handle.write(data.ljust(os.path.getsize(spare)))
            handle.flush()
            os.fsync(handle.fileno())
        if spare == reserve:
            os.replace(reserve, path)
    else:
        remove_quietly(reserve)


def record_exit_code(directory: str, status: int) -> None:
    write_record(directory, "exit_code", f"{status}\n")


def stop_requested(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "stop.json"))


def verb_wrap(req: dict) -> dict:
    """Runs as the leader of the run's new process group/session (setsid or tmux pane). Records pgid, starts
    the job with output appended to train.log unless a stop was requested first, records its pid, waits, and
    writes `exit_code` (128+N for signal N). With `standby` (a standby's folder): the standby's wrapper."""
    if "standby" in req:
        return wrap_standby(req["standby"])
    directory = req["dir"]
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


def become_group_leader() -> None:
    """The wrapper's start: leader of its own session and process group (the run's pgid), and alive through
    the group-wide SIGTERM of a stop: Python-level handlers (not SIG_IGN, which exec would pass on to the job),
    so it can record the job's real exit status."""
    if os.getpgrp() != os.getpid():
        os.setsid()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: None)


def wait_job(child: subprocess.Popen, log_path: str) -> int:
    """Wait for the job, mirroring `log_path` to a tmux pane meanwhile; its exit status (128+N for signal N)."""
    tee = sys.stdout.isatty()  # in a tmux pane: mirror the log for humans who attach
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if tee:
            offset = mirror(log_path, offset)
    if tee:
        mirror(log_path, offset)
    return code if code >= 0 else 128 - code


def mirror(path: str, offset: int) -> int:
    """Copy new log bytes to the tmux pane. A pane that went away (EIO) must not kill the wrapper, which
    still has to record the exit code, so write errors are swallowed."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:  # an adopted standby's job has not written its first line yet
        return offset
    if data:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except OSError:
            pass
    return offset + len(data)


# --------------------------------------------------------------------------------------------- standby
# A standby is a `python -m trainer` interpreter started ahead of its run. After a launch with `standby: true`
# the agent starts one more wrapper and interpreter in <workspace>/standby/<id>/. The interpreter waits until
# the run it follows has taken its first step (so that its imports do not slow that start), imports torch,
# dynamo, inductor, triton and transformers (~9-10 s of every start on the H200 machine: bench/RESULTS.md,
# session 7), and waits. The next launch with the same python, launcher and start-up environment adopts it: the
# run directory gets the standby's marker and process group, its wrapper records pgid, pid and exit_code there,
# and the interpreter takes the run's argv, environment, working directory and log, then runs `trainer` as
# `python -m` would. Only third-party modules are imported ahead, never the release's code (PYTHONPATH is left
# out until the adoption), so a restart after a code change runs the new code. A standby that is not adopted
# exits after its idle time (default 1 h), when its folder is removed, or when a launch with another start-up
# environment (or `standby: false`) retires it; nothing else ever stops it.
STANDBY_ROOT = "standby"
STANDBY_IDLE_S = 3600.0
STANDBY_AFTER_S = 600.0  # the longest a new standby waits for the run it follows to start before importing
STANDBY_POLL_S = 0.02  # how often a ready standby looks for its run: the adoption's latency
STANDBY_PRELOAD = (  # module or module:attribute (transformers builds its lazy import table on first access)
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.nn.attention.flex_attention",
    "triton",
    "transformers:AutoConfig",
    "transformers.models.qwen3.modeling_qwen3",
    "safetensors.torch",
    "numpy",
)
# What an interpreter reads as it starts (its flags, the import-time settings of torch, inductor, triton,
# transformers, the loader's paths): these must be the same for a standby and the run it takes. Not among them,
# and not given to a standby ahead: what is only read later and changes with the code (PYTHONPATH names the
# release, which a standby never imports from; the compile caches are per code hash and read when compiling).
# Inductor's config also reads the C/C++ toolchain (CC, CXX, ... and their paths) and a few names of its own when
# it is imported; a standby imported without them keys its compile-cache entries apart from a fresh interpreter's
# (measured: the first restart after a cold deploy compiled every graph again; bench/RESULTS.md, session 10).
STARTUP_ENV_RE = re.compile(
    r"^(PYTHON|TORCH|PYTORCH|TRITON|CUDA|NCCL|HF_|TRANSFORMERS|LD_|OMP_|MKL_|KMP_|PATH$|VIRTUAL_ENV$"
    r"|CC$|CXX$|CFLAGS$|CXXFLAGS$|LDFLAGS$|CPATH$|LIBRARY_PATH$|C_INCLUDE_PATH$|CPLUS_INCLUDE_PATH$|NVCC"
    r"|INDUCTOR_|AOT_?INDUCTOR|CUTLASS|CUTEDSL|NVIDIA|ENABLE_(PERSISTENT|TEMPLATE|TMA)|LOG_AUTOTUNE)"
)
PER_RUN_ENV = ("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
BASIC_ENV = ("HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "SHELL", "TERM")
# Never in a standby's files or environment: the launch's `secret_keys` (the profile's pass_env), and any name
# that looks like one.
SECRET_KEY_RE = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def standby_env(env: dict, secret_keys: list) -> dict:
    """The part of a launch's environment a standby may start with: no secrets, nothing per run."""
    return {
        k: v
        for k, v in env.items()
        if k not in PER_RUN_ENV
        and k not in secret_keys
        and not k.startswith("DFLASHOPS_")
        and not SECRET_KEY_RE.search(k)
    }


def standby_start_env(launch_env: dict, secret_keys: list) -> dict:
    """The whole environment a standby's interpreter starts with: the start-up part of the launch's environment
    (on this agent's own), plus the few basics a process expects (HOME, USER, LANG, ...). Nothing else: a
    standby outlives the deploy that started it and is adopted by a later run, and /proc/PID/environ keeps what
    a process started with for its whole life, whatever it later sets."""
    return {
        k: v
        for k, v in standby_env({**os.environ, **launch_env}, secret_keys).items()
        if STARTUP_ENV_RE.match(k) or k in BASIC_ENV or k.startswith("LC_")
    }


def standby_eligible(argv: list[str]) -> bool:
    """Only `<python> -m trainer ...` jobs: the modules a standby imports ahead are the trainer's."""
    return len(argv) >= 3 and argv[1:3] == ["-m", "trainer"]


def standby_fingerprint(python: str, env: dict, launcher: str, secret_keys: list) -> str:
    """Which standby may take a launch: the same python, launcher and start-up environment (the agent's own
    environment with the launch's on top, as the wrapper gives the job)."""
    view = {k: v for k, v in standby_env({**os.environ, **env}, secret_keys).items() if STARTUP_ENV_RE.match(k)}
    text = json.dumps([python, launcher, sorted(view.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def standbys(workspace: str) -> list[tuple[str, dict]]:
    """(folder, spec) of every standby of the workspace, oldest first."""
    root = os.path.join(workspace, STANDBY_ROOT)
    found = []
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        spec = read_json(os.path.join(root, entry, "spec.json"))
        if spec is not None:
            found.append((os.path.join(root, entry), spec))
    return sorted(found, key=lambda item: float(item[1].get("created", 0.0)))


def carries_marker(pid: int | None, marker: str) -> bool:
    return bool(pid) and f"{MARKER_KEY}={marker}".encode() in read_proc(int(pid or 0), "environ").split(b"\0")


def standby_alive(folder: str, spec: dict) -> bool:
    """Its wrapper is running (or was started less than LAUNCH_SETTLE_S ago and has not said so yet)."""
    pgid = read_int(os.path.join(folder, "pgid"))
    if pgid is None:
        return time.time() - float(spec.get("created", 0.0)) < LAUNCH_SETTLE_S
    return carries_marker(pgid, spec["marker"])


def retire_standbys(workspace: str, keep: str | None) -> list[tuple[str, dict]]:
    """Ask every standby of another fingerprint than `keep` (all with None) to exit; forget dead ones. Returns
    the live standbys of fingerprint `keep`, oldest first."""
    kept = []
    for folder, spec in standbys(workspace):
        if not standby_alive(folder, spec):
            shutil.rmtree(folder, ignore_errors=True)
        elif spec.get("fingerprint") != keep:
            write_atomic(os.path.join(folder, "retired"), "\n")
        else:
            kept.append((folder, spec))
    return kept


def start_standby(req: dict, argv: list[str], launch_env: dict, launcher: str, after: str, fingerprint: str) -> None:
    """Make sure one unclaimed standby for the next launch like this one (`fingerprint`) exists (best effort: a
    standby that cannot start costs the next launch its head start, never this launch)."""
    workspace, secret_keys = req["workspace"], list(req.get("secret_keys") or [])
    if any(
        not os.path.exists(os.path.join(folder, "claimed")) for folder, _ in retire_standbys(workspace, fingerprint)
    ):
        return
    ident = f"{int(time.time() * 1000):x}-{os.urandom(3).hex()}"
    folder = os.path.join(workspace, STANDBY_ROOT, ident)
    marker, session = f"standby-{ident}.{os.urandom(6).hex()}", f"standby-{ident}"
    env = standby_start_env(launch_env, secret_keys)
    spec = {
        "fingerprint": fingerprint,
        "python": argv[0],
        "launcher": launcher,
        "session": session,
        "marker": marker,
        "env": {**env, MARKER_KEY: marker},
        "after": after,
        "idle_s": float(req.get("standby_idle_s") or STANDBY_IDLE_S),
        "preload": list(req.get("standby_preload") or STANDBY_PRELOAD),
        "created": time.time(),
    }
    wrapper = [sys.executable, program(), "wrap", "--json-args", json.dumps({"standby": folder})]
    try:
        os.makedirs(folder)
        write_atomic(os.path.join(folder, "spec.json"), json.dumps(spec), mode=0o600)
        if launcher == "tmux":
            command = [*CLEAN_ENV, f"{MARKER_KEY}={marker}", *wrapper]
            subprocess.run(
                ["tmux", "-L", tmux_socket(workspace), "new-session", "-d", "-s", session, "-x", "200",
                 "-y", "50", "--", *command],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20, check=True,
            )  # fmt: skip
        else:
            with open(os.devnull, "rb") as devnull, open(os.path.join(folder, "wrapper.log"), "ab") as log:
                subprocess.Popen(
                    wrapper, stdin=devnull, stdout=log, stderr=log, start_new_session=True, close_fds=True,
                    env={MARKER_KEY: marker},
                )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        shutil.rmtree(folder, ignore_errors=True)


def ready_standbys(workspace: str, fingerprint: str) -> Iterator[tuple[str, dict]]:
    """(folder, spec) of each standby of `fingerprint` whose interpreter is ready (its imports done), whose
    wrapper is alive (someone takes a claim) and that no launch has claimed yet, oldest first."""
    for folder, spec in standbys(workspace):
        if spec.get("fingerprint") != fingerprint or os.path.exists(os.path.join(folder, "claimed")):
            continue
        if carries_marker(read_int(os.path.join(folder, "ready")), spec["marker"]) and standby_alive(folder, spec):
            yield folder, spec


def adopt_standby(
    req: dict,
    directory: str,
    argv: list[str],
    launch_env: dict,
    cwd: str,
    launcher: str,
    session: str,
    fingerprint: str,
) -> dict | None:
    """Hand this launch to a ready standby of its `fingerprint`; the launch's answer, or None (none ready: the
    caller launches as usual)."""
    workspace = req["workspace"]
    for folder, spec in ready_standbys(workspace, fingerprint):
        try:
            os.mkdir(os.path.join(folder, "claimed"))  # one launch per standby (the standby claims itself to exit)
        except FileExistsError:
            continue
        marker = spec["marker"]
        if launcher == "tmux":
            renamed = subprocess.run(
                ["tmux", "-L", tmux_socket(workspace), "rename-session", "-t", "=" + spec["session"], session],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20,
            )  # fmt: skip
            if renamed.returncode != 0:
                write_atomic(os.path.join(folder, "retired"), "\n")
                continue
        write_atomic(os.path.join(directory, "marker"), marker + "\n")
        env = {**os.environ, **launch_env, "DFLASHOPS_RUN": req["name"], MARKER_KEY: marker}
        claim = os.path.join(folder, "claim.json")
        # The run's secrets reach the standby's wrapper through this 0600 file, deleted as soon as it is read.
        write_atomic(claim, json.dumps({"dir": directory, "argv": argv, "env": env, "cwd": cwd}), mode=0o600)
        pgid = wait_for_file(os.path.join(directory, "pgid"), 10.0)
        if pgid is None and take_file(claim) is not None:  # its wrapper never took it: launch as usual
            write_atomic(os.path.join(folder, "retired"), "\n")
            if launcher == "tmux":
                subprocess.run(
                    ["tmux", "-L", tmux_socket(workspace), "rename-session", "-t", "=" + session, spec["session"]],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20,
                )  # fmt: skip
            return None
        if pgid is None:
            pgid = wait_for_file(os.path.join(directory, "pgid"), 10.0)
        if pgid is None:
            launch_failed(directory, f"the standby {os.path.basename(folder)} took the run but did not start it")
        return launch_answer(directory, pgid, marker, launcher, session, standby=True)
    return None


def take_file(path: str) -> dict | None:
    """Read and delete a JSON hand-off file, atomically with respect to anyone else taking it (rename first)."""
    taken = f"{path}.taken.{os.getpid()}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return None
    try:
        return read_json(taken) or {}
    finally:
        remove_quietly(taken)


def wrap_standby(folder: str) -> dict:
    """The standby's wrapper: the leader of its process group, it starts the interpreter, waits for a launch
    to claim it (`claim.json`), then does for that run what `verb_wrap` does (pgid, a stop that came first, pid,
    the job's exit code) and passes the run on to the interpreter (`go.json`, 0600)."""
    spec = read_json(os.path.join(folder, "spec.json")) or {}
    become_group_leader()
    write_atomic(os.path.join(folder, "pgid"), f"{os.getpgrp()}\n")
    try:
        with open(os.devnull, "rb") as devnull, open(os.path.join(folder, "standby.log"), "ab") as log:
            child = subprocess.Popen(
                [spec["python"], program(), "standby", "--json-args", json.dumps({"dir": folder})],
                cwd=folder, env=spec["env"], stdin=devnull, stdout=log, stderr=log,
            )  # fmt: skip
    except (OSError, KeyError):
        shutil.rmtree(folder, ignore_errors=True)
        return {"exit_code": 127}
    claim = None
    while claim is None:
        if child.poll() is not None:  # idle time over, retired, or broken: the standby is gone
            shutil.rmtree(folder, ignore_errors=True)
            return {"exit_code": 0}
        claim = take_file(os.path.join(folder, "claim.json"))
        if claim is None:
            time.sleep(STANDBY_POLL_S)
    directory = claim["dir"]
    reserve_records(directory)
    write_atomic(os.path.join(directory, "pgid"), f"{os.getpgrp()}\n")
    log_path = os.path.join(directory, "train.log")
    if stop_requested(directory) or child.poll() is not None:
        reason = "stop requested before the job started" if child.poll() is None else "the standby had exited"
        child.terminate()
        child.wait()
        append_log(directory, f"{reason}; not starting it")
        status = 128 + signal.SIGTERM if reason.startswith("stop") else 127
    else:
        write_atomic(os.path.join(folder, "go.json"), json.dumps({**claim, "log": log_path}), mode=0o600)
        write_atomic(os.path.join(directory, "pid"), f"{child.pid}\n")
        status = wait_job(child, log_path)
    record_exit_code(directory, status)
    shutil.rmtree(folder, ignore_errors=True)
    return {"exit_code": status}


def verb_standby(req: dict) -> dict:
    """The standby's interpreter (run with the run's python): wait for the run it follows to start, import
    ahead, say `ready`, then run the launch it is given, or exit when idle, retired or removed."""
    folder = req["dir"]
    spec = read_json(os.path.join(folder, "spec.json")) or {}
    after = spec.get("after")
    deadline = time.monotonic() + STANDBY_AFTER_S
    while after and time.monotonic() < deadline and os.path.isdir(folder):
        timeline = (read_json(os.path.join(after, "status.json")) or {}).get("timeline") or {}
        if "first_step" in timeline or os.path.exists(os.path.join(after, "exit_code")) or not os.path.isdir(after):
            break
        time.sleep(1.0)
    import importlib

    for name in spec.get("preload", ()):
        module, _, attribute = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if attribute:
                getattr(imported, attribute)
        except Exception as exc:  # noqa: BLE001 - the run imports what it needs itself, and reports it
            print(f"standby: cannot import {name} ahead: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    write_atomic(os.path.join(folder, "ready"), f"{os.getpid()}\n")
    go = wait_for_go(folder, float(spec.get("idle_s", STANDBY_IDLE_S)))
    return {"exit_code": 0 if go is None else run_adopted(go)}


def wait_for_go(folder: str, idle_s: float) -> dict | None:
    """The run handed to this standby, or None once it should exit (claiming itself first, so that no launch
    can claim it meanwhile; a launch that got there first is waited for)."""
    deadline = time.monotonic() + idle_s
    next_check = 0.0
    while True:
        go = take_file(os.path.join(folder, "go.json"))
        if go is not None:
            return go
        check = take_file(os.path.join(folder, CHECK_REQUEST))
        if check is not None:
            check_in_child(folder, check)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 1.0
            leaving = now >= deadline or os.path.exists(os.path.join(folder, "retired")) or not os.path.isdir(folder)
            if leaving:
                try:
                    os.mkdir(os.path.join(folder, "claimed"))
                    return None
                except FileExistsError:  # a launch claimed it: its run comes within seconds
                    pass
                except FileNotFoundError:  # the folder is gone
                    return None
        time.sleep(STANDBY_POLL_S)


def check_in_child(folder: str, check: dict) -> None:
    """A launch's pre-flight (`python -m trainer check ...`, see preflight_release) in a forked child of this
    standby: it has torch, inductor and transformers imported already, so the check costs the trainer's own
    imports and its pre-flight, not an interpreter's start. The child imports the release's code; the standby
    itself never does (a fork shares nothing back). Its verdict goes to CHECK_ANSWER."""
    log = os.path.join(folder, "check.log")
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = run_module_as_main(check)
    finally:
        try:
            write_atomic(
                os.path.join(folder, CHECK_ANSWER),
                json.dumps({"exit_code": code, "output": read_text(log) or ""}),
                mode=0o600,
            )
        finally:
            remove_quietly(log)
            os._exit(0)


def run_adopted(go: dict) -> int:
    """Become the run `go` describes, as `python -m trainer ...` would have started: its log on stdout and
    stderr, its working directory, exactly its environment, `-m`'s sys.path (the working directory, then
    PYTHONPATH) and argv; returns its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(go["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return run_module_as_main(go)


def run_module_as_main(go: dict) -> int:
    """Run `go["argv"]` (`python -m MODULE ...`) in this process as the interpreter would: `go`'s working
    directory, exactly its environment, `-m`'s sys.path and argv; returns its exit status."""
    import runpy
    import traceback

    os.chdir(go["cwd"])
    os.environ.clear()
    os.environ.update(go["env"])
    pythonpath = [os.path.abspath(p) for p in go["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [os.getcwd(), *pythonpath]  # sys.path[0] was this file's folder
    argv = go["argv"]
    sys.argv = [argv[0], *argv[3:]]  # run_module puts the module's file in argv[0]
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


# ------------------------------------------------------------------------------------------- pre-flight
# Before a deploy launches and before a restart stops the old run, the new release proves it can start: every
# Python file of it compiles (here, with the target's python), and for a trainer job `python -m trainer check
# <its train flags>` (trainer/check.py: the package compiles, the flags validate, the training stack imports,
# train's own pre-flight passes). In a ready standby that check is a fork of an interpreter with torch imported
# already; else a fresh interpreter pays the imports. A refusal (code `preflight`) changes nothing.
CHECK_REQUEST, CHECK_ANSWER, CHECK_CLAIM = "check.json", "check.out.json", "checking"
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


def preflight_release(req: dict, release: str, argv: list[str], env: dict) -> dict:
    """The pre-flight of `argv` (run from `release`, with `env`): what it checked, or AgentFailure `preflight`
    whose message is the check's own `error:`/`hint:` lines. Secrets stay out of it: a check needs none."""
    started = time.monotonic()
    compile_release(release)
    flags = trainer_flags(argv)
    if flags is None:
        return {"checked": "compile", "seconds": round(time.monotonic() - started, 3)}
    secret_keys = list(req.get("secret_keys") or [])
    check_env = {k: v for k, v in {**os.environ, **env}.items() if k not in secret_keys and not SECRET_KEY_RE.search(k)}
    check = {"argv": [argv[0], "-m", "trainer", "check", *flags], "env": check_env, "cwd": req["workspace"]}
    answer, where = None, "a new interpreter"
    if req.get("standby") and standby_eligible(argv):
        fingerprint = standby_fingerprint(argv[0], env, str(req.get("launcher", "nohup")), secret_keys)
        await_starting_standby(req["workspace"], fingerprint, time.monotonic() + PREFLIGHT_TIMEOUT_S)
        answer = check_in_standby(req["workspace"], fingerprint, check)
        where = "a standby interpreter" if answer is not None else where
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
    return {"checked": "trainer", "summary": output.splitlines()[-1] if output else "", "in": where,
            "seconds": seconds}  # fmt: skip


def verb_preflight(req: dict) -> dict:
    """The pre-flight alone, read-only (a dry run's verdict): release `release` (a hash) must be on the target
    already; with `old`, the resume placeholder stands for that run's newest checkpoint (or the one it started
    from). Answers `{"preflight": verdict}`, `{"preflight": None, "skipped": why}`, or refuses as a launch
    would (code `preflight`)."""
    workspace = workspace_of(req)
    code_hash = str(req.get("release") or "")
    release = os.path.join(workspace, "releases", code_hash)
    if not HASH_RE.match(code_hash) or not os.path.isdir(release):
        return {"preflight": None, "skipped": "the new code is not on the target yet: it is checked after its upload"}
    argv = req.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise AgentFailure("argv must be a list of strings", "bad_request")
    if req.get("old"):
        old_dir = run_dir({"workspace": workspace, "name": req["old"]})
        probe = (latest_checkpoint(old_dir) or started_from(old_dir)) if os.path.isdir(old_dir) else None
        argv = argv_for_check(argv, req.get("resume_placeholder"), req.get("resume_checkpoint") or probe)
    return {"preflight": preflight_release(req, release, argv, dict(req.get("env") or {}))}


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
    """The check in a ready standby of `fingerprint` (check_in_child), or None when none is free (none ready,
    one busy with another check, or it left meanwhile): the caller checks in a new interpreter."""
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
                if answer is not None:
                    return answer
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


# ------------------------------------------------------------------------------------------------ stop
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


# ------------------------------------------------------------------------------------- per-run control
# The commands that change a run (stop, restart, the supervisor's stop of a stalled run) are serialised per run:
# each holds an exclusive flock on the run's directory while it acts, including the part of a hand-over stop
# that finishes in the background. Two that meet act once: the second waits for the first, then reports what
# the first did instead of acting again. Without this, two stops each sent SIGTERM, and the trainer reads a
# second SIGTERM as "exit now, without the checkpoint the first one asked for". flock needs no new disk blocks
# (a full disk cannot keep a stop from taking it), and the kernel drops it when its holder dies, so a command
# killed mid-way never leaves a stale lock behind.
CONTROL = ".control.json"  # the last holder of the run's lock: op, pid, since; its outcome once it let go


def control_wait_s(req: dict) -> float:
    """How long a command waits for another one on the same run: as long as that one's stop may take with the
    same settings (grace, save grace, the SIGKILL and GPU waits), plus a launch's settle time."""
    return (
        float(req.get("grace", 60.0))
        + float(req.get("save_grace", 600.0))
        + float(req.get("kill_timeout", 10.0))
        + float(req.get("gpu_timeout", 60.0))
        + LAUNCH_SETTLE_S
    )


def try_control(directory: str, op: str) -> int | None:
    """Take the run's control lock if it is free: its descriptor (close it with release_control), else None."""
    fd = lock_run(directory)
    if fd is not None:
        note_control(directory, {"op": op, "pid": os.getpid(), "since": time.time()})
    return fd


def lock_run(directory: str) -> int | None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def take_control(directory: str, op: str, wait_s: float) -> tuple[int, dict | None]:
    """The run's control lock: (descriptor, None) when it was free; (descriptor, the previous holder's record
    with its outcome) when another command held it and this one waited for it to finish. AgentFailure `busy`
    when it is still held after `wait_s`. The wait is a blocking flock (the kernel lists it in /proc/locks as a
    waiter), bounded by an interval timer."""
    fd = try_control(directory, op)
    if fd is not None:
        return fd, None
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    previous = signal.signal(signal.SIGALRM, _wait_expired)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(wait_s, 0.001))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _WaitExpired:  # during the wait, or just after it ended: holding the lock is what counts
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = read_json(os.path.join(directory, CONTROL)) or {}
                since = holder.get("since")
                age = f", for {time.time() - float(since):.0f} s" if isinstance(since, (int, float)) else ""
                raise AgentFailure(
                    f"a {holder.get('op', 'stop or restart')} of run {os.path.basename(directory)!r} is already in "
                    f"progress (pid {holder.get('pid', '?')}{age}); nothing was done",
                    "busy",
                ) from None
    finally:
        signal.signal(signal.SIGALRM, previous)
    holder = read_json(os.path.join(directory, CONTROL)) or {}  # read before this holder's record replaces it
    note_control(directory, {"op": op, "pid": os.getpid(), "since": time.time()})
    return fd, holder


class _WaitExpired(Exception):
    pass


def _wait_expired(signum: int, frame: object) -> None:
    raise _WaitExpired


def note_control(directory: str, fields: dict, *, replace: bool = True) -> None:
    """Write the lock holder's record (best effort: the lock itself is what serialises; this only tells)."""
    record = fields if replace else {**(read_json(os.path.join(directory, CONTROL)) or {}), **fields}
    try:
        write_atomic(os.path.join(directory, CONTROL), json.dumps(record) + "\n")
    except OSError:
        pass


def release_control(directory: str, fd: int, outcome: dict) -> None:
    """Record this holder's outcome for a command that waited, then let go (a background part of a hand-over
    stop that inherited `fd` keeps the lock until it exits)."""
    if (read_json(os.path.join(directory, CONTROL)) or {}).get("pid") == os.getpid():
        note_control(directory, {"outcome": outcome, "finished_at": time.time()}, replace=False)
    os.close(fd)


def joined_answer(directory: str, holder: dict, started: float) -> dict:
    """A stop's answer when another command had the run and stopped it meanwhile: what that one did."""
    status = run_status(directory)
    stop = read_json(os.path.join(directory, "stop.json")) or {}
    return {
        "joined": {k: holder.get(k) for k in ("op", "pid", "since", "outcome", "finished_at")},
        "state": status["state"],
        "escalated": bool(stop.get("escalated")),
        "signalled": [],
        "gpu_released": stop.get("gpu_released"),
        "waited_for_checkpoint_s": 0.0,
        "before_start": bool(stop.get("before_start")),
        "exit_code": status["exit_code"],
        "checkpoints": status["checkpoints"][-1:],
        "seconds": round(time.monotonic() - started, 3),
        "recorded": True,
    }


def verb_stop(req: dict) -> dict:
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
    host memory and its devices are free (`handover`, trainer/handover.py), answer at once with that offer;
    steps 2-5 then finish in a background process of the agent, exactly as they would have here, holding
    the run's control lock until they are done."""
    directory = run_dir(req)
    if not os.path.isdir(directory):
        raise AgentFailure(f"run {req['name']!r} does not exist on this target", "not_found")
    if req.get("now"):
        return stop_now(req, directory)
    started = time.monotonic()
    supervisor_cancelled = cancel_supervisor(directory)  # first: it must not restart what is being stopped
    by = "restart" if req.get("by") == "restart" else "stop"  # a restart of a run on several targets stops here
    lock, met = take_control(directory, by, control_wait_s(req))
    answer: dict = {}
    try:
        if met is not None and by == "restart" and met.get("op") == "restart":
            raise AgentFailure(
                f"run {req['name']!r} was restarted meanwhile by another command; nothing was done", "superseded"
            )
        if met is not None and not run_processes_of(directory)[1]:
            answer = joined_answer(directory, met, started)
        else:
            answer = stop_held(req, directory, started, lock, supervisor_cancelled=supervisor_cancelled)
        return answer
    finally:
        release_control(directory, lock, {"exit_code": answer.get("exit_code"), "handover": "handover" in answer})


def stop_held(req: dict, directory: str, started: float, lock: int, *, supervisor_cancelled: bool = False) -> dict:
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
        return {
            "escalated": False,
            "signalled": [],
            "gpu_released": None,
            "waited_for_checkpoint_s": 0.0,
            "before_start": False,
            "exit_code": read_int(os.path.join(directory, "exit_code")),
            "seconds": round(time.monotonic() - started, 3),
            "recorded": True,
            "supervisor_cancelled": True,
        }
    if not pids:
        raise AgentFailure(f"run {req['name']!r} is not running", "not_running")
    grace = float(req.get("grace", 60.0))
    first = first_to_stop(directory, pids)
    job = first if first in pids else None  # goes first when it is one of the run's processes
    job_first = job is not None
    signal_run(None if job_first else pgid, {job} if job is not None else pids, signal.SIGTERM)
    recorded = record_stop(directory, {"requested_at": time.time()})
    grace_deadline = time.monotonic() + grace
    save_deadline = grace_deadline + float(req.get("save_grace", 600.0))
    stopping = (req, directory, started, pgid, marker, pids, job, job_first, grace_deadline, save_deadline, recorded)
    if req.get("handover") and job_first:
        offer = wait_for_handover(directory, job, grace_deadline, save_deadline)
        if offer is not None:

            def finish() -> None:
                try:
                    complete_stop(*stopping)
                except Exception as exc:  # noqa: BLE001 - nobody is listening: stop.json says what went wrong
                    record_stop(directory, {"error": f"{type(exc).__name__}: {exc}", "finished_at": time.time()})

            in_background(finish, keep_fd=lock)
            return {
                "handover": offer,
                "escalated": False,
                "signalled": [job],
                "gpu_released": True,
                "waited_for_checkpoint_s": 0.0,
                "before_start": False,
                "exit_code": None,
                "seconds": round(time.monotonic() - started, 3),
                "recorded": recorded,
                "supervisor_cancelled": supervisor_cancelled,
            }
    return {**complete_stop(*stopping), "supervisor_cancelled": supervisor_cancelled}


def stop_now(req: dict, directory: str) -> dict:
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
        raise AgentFailure(f"run {req['name']!r} is not running", "not_running")
    signal_run(pgid, pids, signal.SIGKILL)
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    left = wait_gone(pgid, marker, directory, float(req.get("kill_timeout", 10.0)))
    if left:
        raise AgentFailure(f"processes {sorted(left)} of run {req['name']!r} survived SIGKILL", "stuck")
    lock = try_control(directory, "stop --now")
    if lock is None:  # a stop or restart holds the run: it sees the processes gone and records the end itself
        return {"now": True, "escalated": True, "signalled": sorted(pids), "exit_code": 128 + signal.SIGKILL,
                "seconds": round(time.monotonic() - started, 3), "recorded": None, "gpu_released": None,
                "waited_for_checkpoint_s": 0.0, "before_start": False}  # fmt: skip
    try:
        record_stop(directory, {"requested_at": time.time(), "now": True})
        answer = finish_stop(req, directory, started, escalated=True, seen=set(pids), waited=0.0,
                             gpu_timeout=float(req.get("gpu_timeout", 60.0)))  # fmt: skip
        return {**answer, "now": True}
    finally:
        release_control(directory, lock, {"exit_code": 128 + signal.SIGKILL, "now": True})


def run_processes_of(directory: str) -> tuple[int | None, set[int]]:
    """run_processes with the run directory's own pgid and marker."""
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    return run_processes(read_int(os.path.join(directory, "pgid")), marker, directory)


def complete_stop(
    req: dict,
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
) -> dict:
    """verb_stop after its first SIGTERM: wait for the job, TERM the rest of the group, KILL what is left
    after the grace (a checkpoint being written gets its save grace), then the bookkeeping (finish_stop)."""
    grace = float(req.get("grace", 60.0))
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
        left = wait_gone(pgid, marker, directory, float(req.get("kill_timeout", 10.0)))
    if left:
        raise AgentFailure(f"processes {sorted(left)} of run {req['name']!r} survived SIGKILL", "stuck")
    return finish_stop(
        req,
        directory,
        started,
        escalated=escalated,
        seen=seen,
        waited=waited,
        recorded=recorded,
        gpu_timeout=float(req.get("gpu_timeout", 60.0)),
    )


def handover_offer(directory: str) -> dict | None:
    """The trainer's hand-over offer in status.json (trainer/handover.py): its final checkpoint is in host
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


def launch_in_flight(directory: str) -> bool:
    """The run directory exists but its job has not started yet (no pid, no exit code) and is young enough
    that its launch may still be running."""
    if any(os.path.exists(os.path.join(directory, f)) for f in ("pid", "exit_code")):
        return False
    try:
        return time.time() - os.stat(directory).st_ctime < LAUNCH_SETTLE_S
    except OSError:
        return False


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
    req: dict,
    directory: str,
    started: float,
    *,
    escalated: bool,
    seen: set[int],
    waited: float,
    recorded: bool = True,
    before_start: bool = False,
    gpu_timeout: float = 0.0,
) -> dict:
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
            ["tmux", "-L", tmux_socket(req["workspace"]), "kill-session", "-t", "=" + session_name(req["name"])],
            capture_output=True,
            timeout=10,
        )
    exit_code = read_int(os.path.join(directory, "exit_code"))
    trainer_exit = trainer_exit_code(directory, read_json(os.path.join(directory, "status.json")))
    result = {
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
    return result


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


# ---------------------------------------------------------------------------------------------- status
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


def run_status(directory: str) -> dict:
    name = os.path.basename(directory)
    run_json = read_json(os.path.join(directory, "run.json")) or {}
    exit_code = read_int(os.path.join(directory, "exit_code"))
    pgid = read_int(os.path.join(directory, "pgid"))
    marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
    live = sorted(run_processes(pgid, marker, directory)[1]) if exit_code is None or pgid else []
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
    log_tail = last_lines(os.path.join(directory, "train.log"))
    error_line = next((ln for ln in reversed(log_tail) if ERROR_LINE_RE.search(ln) and "Traceback" not in ln), None)
    if error_line is None and trainer_status and trainer_status.get("error"):
        error_line = str(trainer_status["error"])
    # status.json names the step in progress (the one that crashed); metrics.jsonl the last one logged.
    steps = [v for v in ((last_metrics or {}).get("step"), (trainer_status or {}).get("step")) if isinstance(v, int)]
    step = max(steps) if steps else None
    # Stopped = by `dflashops stop` (stop.json), or the trainer itself recorded a graceful stop after a signal
    # from elsewhere (status.json phase "stopped": it checkpointed and exited), which is no crash.
    stopped = os.path.exists(os.path.join(directory, "stop.json")) or (trainer_status or {}).get("phase") == "stopped"
    if launcher_exit_code is not None and exit_code == 0 and (trainer_status or {}).get("phase") == "done":
        stopped = False  # the trainer had finished; the stop only met its launcher on the way out
    stall = read_json(os.path.join(directory, "stall.json"))  # written by agent_supervisor.py
    if stall and stall.get("reason"):
        error_line = f"stalled: {stall['reason']}"
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
    checkpoints = (
        sorted(d for d in os.listdir(os.path.join(directory, "checkpoints")) if d.startswith("step_"))
        if os.path.isdir(os.path.join(directory, "checkpoints"))
        else []
    )
    workspace = os.path.dirname(os.path.dirname(os.path.abspath(directory)))
    return {
        "name": name,
        "state": state,
        "exit_code": exit_code,
        "launcher_exit_code": launcher_exit_code,
        "tmux": {"socket": tmux_socket(workspace), "session": run_json.get("session") or session_name(name)},
        "pids": live,
        "pgid": pgid,
        "step": step,
        "error_line": error_line if state in ("crashed", "lost") else None,
        "trainer_status": trainer_status,
        "last_metrics": last_metrics,
        "last_log_line": last_log_line(log_tail),
        "checkpoints": checkpoints,
        "run_dir": directory,
        "run_json": run_json,
        **supervision(directory),
    }


# ------------------------------------------------------------------------------------------ checkpoints
# The trainer writes checkpoints/.tmp-step_N-<pid>/ (state.json last), fsyncs it and renames it to step_N
# (trainer/checkpoint.py). A checkpoint exists when it is durable under its final name. A writer killed after its
# data was complete but before the rename leaves a temporary that holds the whole checkpoint: whoever resumes
# (restart --resume, the supervisor, the hand-over child in trainer/handover.py) commits it before using it.
CHECKPOINT_RE = re.compile(r"^step_(\d{6,})$")
TEMPORARY_CHECKPOINT_RE = re.compile(r"^\.tmp-(step_\d{6,})-(\d+)$")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")


def checkpoint_names(directory: str) -> list[str]:
    """The run's complete checkpoints (step_N with state.json), oldest first."""
    root = os.path.join(directory, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    done = [n for n in names if CHECKPOINT_RE.match(n) and os.path.isfile(os.path.join(root, n, "state.json"))]
    return sorted(done, key=lambda n: int(n[5:]))


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint of a run (after committing one its dead writer left unfinished), or None."""
    commit_orphans(directory)
    names = checkpoint_names(directory)
    return os.path.join(directory, "checkpoints", names[-1]) if names else None


def complete_checkpoint(path: str) -> bool:
    """`path` is a complete checkpoint (committing it first when its dead writer left it unfinished)."""
    if not os.path.isfile(os.path.join(path, "state.json")):
        commit_orphans(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    return os.path.isfile(os.path.join(path, "state.json"))


def commit_orphans(directory: str) -> list[str]:
    """Commit (fsync every file, rename into place, fsync the folder) each temporary checkpoint of the run whose
    writer has died after writing all of it and which has no final folder yet; return their final paths. A
    temporary that is incomplete, or whose writer lives (it is still fsyncing), is left alone."""
    root = os.path.join(directory, "checkpoints")
    committed = []
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        match = TEMPORARY_CHECKPOINT_RE.match(entry)
        if not match or alive(int(match.group(2))):
            continue
        tmp, final = os.path.join(root, entry), os.path.join(root, match.group(1))
        if os.path.exists(final) or not checkpoint_data_complete(tmp, int(match.group(1)[5:])):
            continue
        try:
            for name in CHECKPOINT_FILES:
                fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.rename(tmp, final)
            fsync_folder(root)
        except OSError:  # another resumer committed it first, or the disk failed: the caller looks again
            continue
        committed.append(final)
    return committed


def checkpoint_data_complete(path: str, step: int) -> bool:
    """Every file of checkpoint `path` was written to its end: state.json (written last) parses and names `step`,
    the safetensors file is as long as its header says, and the torch files end in a zip directory."""
    state = read_json(os.path.join(path, "state.json"))
    if state is None or state.get("step") != step:
        return False
    if not all(zipfile.is_zipfile(os.path.join(path, name)) for name in ("optimizer.pt", "rng.pt")):
        return False
    try:
        with open(os.path.join(path, "model.safetensors"), "rb") as handle:
            header_bytes = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_bytes))
            size = os.fstat(handle.fileno()).st_size
    except (OSError, ValueError):
        return False
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    return size == 8 + header_bytes + max(ends, default=0)


def fsync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def supervision(directory: str) -> dict:
    """What agent_supervisor.py left in the run directory: the run that replaced this one, the events it
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
    """`pid` is a live supervisor process (its command line names a supervisor file: a reused pid is not)."""
    return isinstance(pid, int) and alive(pid) and b"supervisor-" in read_proc(pid, "cmdline")


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


def verb_status(req: dict) -> dict:
    if req.get("name"):
        directory = run_dir(req)
        if not os.path.isdir(directory):
            raise missing_run(req, "does not exist on this target")
        return {"runs": [run_status(directory)]}
    runs_root = os.path.join(workspace_of(req), "runs")
    names = sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []
    return {"runs": [run_status(os.path.join(runs_root, n)) for n in names if NAME_RE.match(n)]}


# ------------------------------------------------------------------------------------------------ tail
CHECK_BYTES = 64  # the bytes before the cursor that a follower's `check` covers


def verb_tail(req: dict) -> dict:
    """Bytes of train.log from `offset`, cut at the last newline so no line is split or repeated. `inode`
    (from the previous answer) detects rotation: the rest of the rotated `train.log.1` comes first. `check`
    (also from the previous answer: a digest of the bytes just before `offset`) detects a log that was
    truncated or rewritten in place, and an inode with no `train.log.1` a log replaced by a new file: then
    reading starts again at byte 0 and the answer's `notice` says so, instead of losing or repeating lines.
    `wait_s` (long poll, at most 10 s): when there is nothing new yet, wait here for up to that long, checking
    the file every 50 ms, so a follower sees a line ~50 ms after it is written instead of a poll period later."""
    directory = run_dir(req)
    path = os.path.join(directory, "train.log")
    if not os.path.exists(path):
        raise missing_run(req, "has no log (it never started here)")
    req = start_of_reading(req, path)
    deadline = time.monotonic() + max(0.0, min(float(req.get("wait_s", 0)), 10.0))
    while True:
        answer = _tail_once(req, directory, path)
        moved = answer["offset"] != int(req.get("offset", 0)) or answer["inode"] != req.get("inode")
        if answer["data"] or answer["finished"] or moved or answer["notice"] or time.monotonic() >= deadline:
            return answer
        time.sleep(0.05)


FOLLOW_POLL_S = 0.02  # how often `follow` looks at the file: the floor of its write-to-screen latency
FOLLOW_HEARTBEAT_S = 1.0  # an empty answer this often, so both ends notice a dead link or a gone reader


def verb_follow(req: dict) -> dict:
    """`tail`, streamed: one JSON answer line (the `tail` fields, `ok` true) each time the log moves, starting
    from the request's cursor, until the run has ended and its log is drained; in between an empty answer
    every FOLLOW_HEARTBEAT_S. This is the one verb that prints more than one line. One `pct exec` for a
    whole `logs -f` instead of one per answer: a line reaches the reader ~FOLLOW_POLL_S + half a round trip
    after it is written. A reader that goes away closes the pipe; the next heartbeat's write ends this
    process (BrokenPipeError), so nothing lingers in the container. Returns the last answer (already printed)."""
    directory = run_dir(req)
    path = os.path.join(directory, "train.log")
    if not os.path.exists(path):
        raise missing_run(req, "has no log (it never started here)")
    req = start_of_reading(req, path)
    cursor = {"offset": int(req.get("offset") or 0), "inode": req.get("inode"), "check": req.get("check")}
    last_sent = 0.0
    while True:
        answer = _tail_once({**req, **cursor}, directory, path)
        moved = answer["offset"] != cursor["offset"] or answer["inode"] != cursor["inode"]
        done = answer["finished"] and not answer["more"] and not answer["data"] and not moved
        now = time.monotonic()
        if answer["data"] or moved or answer["notice"] or done or now - last_sent >= FOLLOW_HEARTBEAT_S:
            sys.stdout.write(json.dumps({"ok": True, **answer}) + "\n")
            sys.stdout.flush()
            last_sent = now
            cursor = {"offset": answer["offset"], "inode": answer["inode"], "check": answer["check"]}
        if done:
            return {"streamed": True}
        if not (answer["data"] and answer["more"]):
            time.sleep(FOLLOW_POLL_S)


def start_of_reading(req: dict, path: str) -> dict:
    """A reader's first request, moved to a line start: `lines` N starts at the last N lines of train.log
    (`logs -n N`); `align` moves an `offset` inside a line (`logs --since N` typed by hand) forward to the start
    of the next line, so no line is shown from its middle. Later requests carry neither: their offsets are the
    answers' own, which may be inside a line longer than one answer."""
    if req.get("lines") is None and not req.get("align"):
        return req
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if req.get("lines") is not None:
            offset = last_lines_start(handle, size, int(req["lines"]))
        else:
            offset = int(req.get("offset") or 0)
            if 0 < offset <= size:
                offset = next_line_start(handle, offset, size)
    return {**req, "offset": offset, "check": None, "lines": None, "align": False}


def last_lines_start(handle, size: int, lines: int) -> int:
    """The offset where the last `lines` lines of the file start (a last line without its newline counts)."""
    if lines <= 0 or size == 0:
        return size
    handle.seek(size - 1)
    end = size - 1 if handle.read(1) == b"\n" else size  # the newline that ends the last line starts nothing
    found, pos = 0, end
    while pos > 0:
        start = max(0, pos - 65536)
        handle.seek(start)
        block = handle.read(pos - start)
        index = len(block)
        while (index := block.rfind(b"\n", 0, index)) >= 0:
            found += 1
            if found == lines:
                return start + index + 1
        pos = start
    return 0


def next_line_start(handle, offset: int, size: int) -> int:
    """`offset` when a line starts there, else the start of the next line (the end of the file if none)."""
    handle.seek(offset - 1)
    if handle.read(1) == b"\n":
        return offset
    while offset < size:
        block = handle.read(65536)
        if (index := block.find(b"\n")) >= 0:
            return offset + index + 1
        offset += len(block)
    return size


def prefix_check(handle, offset: int) -> str:
    """Digest of the CHECK_BYTES bytes before `offset` ("" at 0)."""
    if offset <= 0:
        return ""
    handle.seek(max(0, offset - CHECK_BYTES))
    return hashlib.sha1(handle.read(min(offset, CHECK_BYTES))).hexdigest()[:16]


def utf8_whole(data: bytes) -> bytes:
    """`data` without a trailing incomplete UTF-8 sequence, so a piece of a long line never ends inside a
    character (the rest comes with the next piece)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
        return data[:-back] if need > back else data
    return data


def _tail_once(req: dict, directory: str, path: str) -> dict:
    offset, inode = int(req.get("offset", 0)), req.get("inode")
    max_bytes = int(req.get("max_bytes", 1 << 20))
    current_inode = os.stat(path).st_ino
    source, rotated, notice = path, False, None
    if inode is not None and int(inode) != current_inode:
        old = path + ".1"
        if os.path.exists(old) and os.stat(old).st_ino == int(inode):
            source, rotated = old, True
        else:
            offset, notice = 0, "train.log was replaced by a new file; reading the new one from its start"
    with open(source, "rb") as handle:
        expected = req.get("check")
        if notice is None and (
            offset > os.fstat(handle.fileno()).st_size
            or (expected is not None and prefix_check(handle, offset) != expected)
        ):
            offset, notice = 0, "train.log was truncated or rewritten; reading it again from its start"
        handle.seek(offset)
        data = handle.read(max_bytes)
        at_end = handle.read(1) == b""
        finished = read_int(os.path.join(directory, "exit_code")) is not None
        if at_end and (rotated or finished):
            pass  # the file is complete: deliver everything, including a last line without a newline
        elif b"\n" in data:
            data = data[: data.rfind(b"\n") + 1]  # keep a partial last line for the next call
        elif len(data) < max_bytes:
            data = b""
        else:
            data = utf8_whole(data)  # a line longer than max_bytes: deliver it in pieces, whole characters
        next_offset = offset + len(data)
        check = prefix_check(handle, next_offset)
    if rotated and at_end:
        next_offset, check, source = 0, "", path
    return {
        "data": data.decode("utf-8", errors="replace"),
        "offset": next_offset,
        "inode": os.stat(source).st_ino,
        "check": check,
        "finished": finished,
        "notice": notice,
        "more": not at_end or rotated,
    }


# -------------------------------------------------------------------------------- gpus, cache, releases
def verb_gpus(req: dict) -> dict:
    if not shutil.which("nvidia-smi"):
        return {"available": False, "gpus": []}
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
                {
                    "index": int(parts[0]),
                    "name": parts[1],
                    "memory_used_mib": int(parts[2]),
                    "memory_total_mib": int(parts[3]),
                    "utilization_pct": int(parts[4]),
                }
            )
    return {"available": True, "gpus": gpus}


def workspace_of(req: dict) -> str:
    workspace = req.get("workspace")
    if not isinstance(workspace, str) or not os.path.isabs(workspace):
        raise AgentFailure("workspace must be an absolute path", "bad_request")
    return workspace


COMPILE_CACHE_KEY_RE = re.compile(r"^py\d+\.\d+-torch[A-Za-z0-9._-]+$")  # trainer/compile_cache.py cache_key


def verb_clear_cache(req: dict) -> dict:
    """`--clear-cache`: remove the compile caches and nothing else: in the compile cache root (`compile_cache`,
    default <workspace>/cache/compile) only the folders named like a cache key and their artifacts (the
    `<key>.artifacts.d/` folder, or an older trainer's `<key>.artifacts` file), and the per-code-hash folders of
    the old layout (<workspace>/cache/inductor/<hash>). How much went."""
    workspace = workspace_of(req)
    root = str(req.get("compile_cache") or os.path.join(workspace, "cache", "compile"))
    if not os.path.isabs(root):
        raise AgentFailure("compile_cache must be an absolute path", "bad_request")
    doomed = []
    for folder, pattern in ((root, COMPILE_CACHE_KEY_RE), (os.path.join(workspace, "cache", "inductor"), HASH_RE)):
        for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if pattern.match(entry.removesuffix(".d").removesuffix(".artifacts")):
                doomed.append(os.path.join(folder, entry))
    freed = files = 0
    for path in doomed:
        size, count = tree_size(path)
        freed, files = freed + size, files + count
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            remove_quietly(path)
    return {"removed": doomed, "bytes": freed, "files": files}


def tree_size(path: str) -> tuple[int, int]:
    """(bytes, files) of a file or of every file under a folder; what vanishes meanwhile counts nothing."""
    paths = [os.path.join(b, n) for b, _, names in os.walk(path) for n in names] if os.path.isdir(path) else [path]
    size = count = 0
    for each in paths:
        try:
            size += os.lstat(each).st_size
            count += 1
        except OSError:
            pass
    return size, count


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verb_manifest(req: dict) -> dict:
    """The current release's code hash and per-file sha256 (written at install, so this reads one file)."""
    current = os.path.join(workspace_of(req), "releases", "current")
    if not os.path.islink(current):
        return {"release": None, "files": {}}
    target = os.path.realpath(current)
    if req.get("hash") and req.get("hash") == os.path.basename(target):
        return {"release": os.path.basename(target), "path": target, "files": {}}  # up to date: skip the list
    manifest = read_json(os.path.join(target, ".manifest.json"))
    if manifest is None:
        return {"release": None, "files": {}}
    return {"release": os.path.basename(target), "path": target, "files": manifest}


def safe_members(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members = []
    for member in archive.getmembers():
        parts = member.name.split("/")
        if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
            raise AgentFailure(f"refusing tar member {member.name!r}", "bad_request")
        members.append(member)
    return members


def install_manifest(req: dict, releases: str) -> tuple:
    """(full manifest, files to hard-link from the base). The request carries either the full `files`
    manifest and a `link` list, or only `changed` entries and `removed` paths relative to `base` (the
    compact form: an install of one changed file then sends about that file, not the whole manifest)."""
    if isinstance(req.get("files"), dict):
        return req["files"], list(req.get("link") or [])
    changed, removed, base = req.get("changed"), req.get("removed") or [], req.get("base")
    if not isinstance(changed, dict) or not isinstance(removed, list):
        return None, []
    base_files = {}
    if isinstance(base, str) and HASH_RE.match(base):
        base_files = read_json(os.path.join(releases, base, ".manifest.json")) or {}
    files = {rel: digest for rel, digest in base_files.items() if rel not in removed}
    files.update(changed)
    return files, sorted(rel for rel in files if rel not in changed)


def build_release(req: dict, stdin: bytes, stale_code: str = "conflict") -> tuple:
    """Make releases/<hash>/ complete (or find it already there) WITHOUT making it current; returns
    (code_hash, path). Unpack the tar of changed files into a temp dir, hard-link unchanged files from
    the base release, verify every hash, then rename. A failure removes its own `.tmp-*` folder; a cut
    connection or a crash leaves one, removed by a later install once its owner is gone: a release is
    complete or absent, and concurrent installs never delete each other's work."""
    workspace = workspace_of(req)
    code_hash = str(req.get("hash") or "")
    releases = os.path.join(workspace, "releases")
    files, link = install_manifest(req, releases)
    if not HASH_RE.match(code_hash) or not isinstance(files, dict):
        raise AgentFailure("install needs a hash and a files manifest", "bad_request")
    # The release name is the hash of its manifest (ops/sync.py code_hash_of): a rebuilt manifest that does
    # not match (base release pruned or changed since `manifest` was read) is refused, never installed.
    if hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16] != code_hash:
        raise AgentFailure(
            f"manifest does not match release {code_hash} (base {req.get('base')!r} changed?); sync again", stale_code
        )
    os.makedirs(releases, exist_ok=True)
    remove_abandoned_temporaries(releases)
    final = os.path.join(releases, code_hash)
    if os.path.isdir(final):
        return code_hash, final
    tmp = os.path.join(releases, f".tmp-{code_hash}-{os.getpid()}")
    os.makedirs(tmp)
    try:
        fill_release(tmp, stdin, link, releases, req.get("base"), files, stale_code)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent install of the same code finished first
    return code_hash, final


def remove_abandoned_temporaries(releases: str) -> None:
    """Remove `.tmp-<hash>-<pid>` folders whose installing agent is gone (a cut connection, a crash); never
    one whose owner is still running: two deploys of new code may build releases side by side."""
    for entry in os.listdir(releases):
        owner = entry.rsplit("-", 1)[-1]
        if entry.startswith(".tmp-") and owner.isdigit() and int(owner) != os.getpid() and not alive(int(owner)):
            shutil.rmtree(os.path.join(releases, entry), ignore_errors=True)


def fill_release(tmp: str, stdin: bytes, link: list, releases: str, base: object, files: dict, stale_code: str) -> None:
    """Unpack the changed files into `tmp`, hard-link the unchanged ones from `base`, verify every hash."""
    with tarfile.open(fileobj=io.BytesIO(stdin), mode="r:*") as archive:  # plain or gzip
        archive.extractall(tmp, members=safe_members(archive))
    base_dir = os.path.join(releases, base) if isinstance(base, str) and HASH_RE.match(base) else None
    for rel in link:
        source = os.path.join(base_dir or "/nonexistent", rel)
        dest = os.path.join(tmp, rel)
        if ".." in rel.split("/") or not os.path.isfile(source):
            raise AgentFailure(f"cannot link unchanged file {rel!r} from release {base!r}", stale_code)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.link(source, dest)
    for rel, digest in files.items():
        path = os.path.join(tmp, rel)
        if not os.path.isfile(path) or file_sha256(path) != digest:
            raise AgentFailure(f"release file {rel!r} is missing or corrupt after transfer", "corrupt")
    write_atomic(os.path.join(tmp, ".manifest.json"), json.dumps(files, sort_keys=True))


def flip_current(workspace: str, code_hash: str) -> None:
    releases = os.path.join(workspace, "releases")
    link_tmp = os.path.join(releases, f".current-{os.getpid()}")
    os.symlink(code_hash, link_tmp)
    os.replace(link_tmp, os.path.join(releases, "current"))  # rename(2) over the old link: atomic flip


def verb_install(req: dict, stdin: bytes) -> dict:
    """build_release, then flip `current` atomically and prune old releases; `current` never points at a
    partial tree."""
    code_hash, final = build_release(req, stdin)
    flip_current(workspace_of(req), code_hash)
    removed = prune_releases(workspace_of(req), int(req.get("keep", 5)))
    return {"release": code_hash, "path": final, "removed": removed}


def substitute(value: object, placeholder: str, text: str) -> object:
    """`value` with every occurrence of `placeholder` in its strings replaced by `text` (lists/dicts deep)."""
    if isinstance(value, str):
        return value.replace(placeholder, text)
    if isinstance(value, list):
        return [substitute(item, placeholder, text) for item in value]
    if isinstance(value, dict):
        return {key: substitute(item, placeholder, text) for key, item in value.items()}
    return value


def verb_restart(req: dict, stdin: bytes) -> dict:
    """The kill-copy-relaunch cycle in ONE call (one ssh round trip instead of six): `old` is stopped,
    the release `install` describes is made current, and the new run `name` is launched from it.

    Order, so that a refusal or a cut connection never leaves anything half-done:
    1. every check that can refuse, with nothing changed yet: names, the old run exists, the new run
       directory is free, the launch request is valid, the upload is complete (`tar_bytes`), and the
       release manifest rebuilt against `install.base` matches its hash (code `stale_release` when the
       base is gone: the controller's cached idea of the target is out of date; it then asks `manifest`
       and calls again);
    2. the release is built complete under releases/<hash>/, not yet current;
    3. the old run is stopped exactly like `stop` (its group + marker, TERM, grace, KILL, GPU wait);
       a run that already ended is fine;
    4. with `resume_placeholder`: the old run's latest checkpoint replaces it in argv and run.json; with
       `handover` too, the stop may answer as soon as the old trainer has its final checkpoint in host memory
       and its devices free: that checkpoint (still being written) is the one resumed, and the new run's
       environment names the old run directory (DFLASHOPS_RESUME_WRITER), so the trainer waits for the
       checkpoint to be complete before it reads it (trainer/handover.py) while it builds meanwhile;
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
    if req.get("tar_bytes") is not None and len(stdin) != int(req["tar_bytes"]):
        raise AgentFailure(
            f"upload incomplete ({len(stdin)} of {req['tar_bytes']} bytes); nothing was changed", "incomplete"
        )
    install = req.get("install")
    if not isinstance(install, dict):
        raise AgentFailure("restart needs an install request", "bad_request")
    install = {**install, "workspace": workspace}
    placeholder = req.get("resume_placeholder")
    chosen = req.get("resume_checkpoint")  # restart --checkpoint: this one, not the run's newest
    if chosen is not None and (not isinstance(chosen, str) or not complete_checkpoint(chosen)):
        raise AgentFailure(f"checkpoint {chosen} is not a complete checkpoint on this target", "not_found")
    code_hash, release = build_release(install, stdin, stale_code="stale_release")  # not current yet
    verdict = None
    if req.get("preflight"):  # the new code and flags prove they can start before the old run is signalled
        probe = chosen or latest_checkpoint(old_dir) or started_from(old_dir)
        verdict = preflight_release(req, release, argv_for_check(req["argv"], placeholder, probe), req.get("env") or {})
    lock, met = take_control(old_dir, "restart", control_wait_s(req))
    outcome: dict = {}
    try:
        child = ((met or {}).get("outcome") or {}).get("name") if (met or {}).get("op") == "restart" else None
        if child:  # two restarts met: the first one's child is the answer, not a second child
            raise AgentFailure(
                f"run {old!r} was restarted meanwhile by another command, as {child!r}; nothing was done", "superseded"
            )
        # Refused before anything is stopped when the run has no checkpoint and will write none.
        fallback = resume_fallback(old_dir, old) if placeholder and chosen is None else None
        stop = None
        try:
            stop = stop_held(
                {
                    "workspace": workspace,
                    "name": old,
                    "grace": req.get("grace", 60.0),
                    "handover": bool(placeholder and chosen is None and req.get("handover")),
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
        if placeholder:
            if chosen is not None:
                checkpoint = chosen
            elif handover:
                checkpoint = handover["checkpoint"]
                launch["env"] = {**(req.get("env") or {}), RESUME_WRITER_KEY: old_dir}
            else:
                checkpoint = latest_checkpoint(old_dir) or fallback
            if checkpoint is None:
                how = "was stopped" if stop else "had ended"
                raise AgentFailure(f"run {old!r} {how} but left no checkpoint to resume from", "not_found")
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


def trained_a_step(status: dict) -> bool:
    """The job has finished an optimizer step in this process, so a stop makes it checkpoint: the trainer's
    timeline says `first_step`; a job that keeps no timeline counts when status.json names a step past 0."""
    timeline = status.get("timeline")
    if isinstance(timeline, dict):
        return "first_step" in timeline
    return isinstance(status.get("step"), int) and status["step"] > 0


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


def releases_in_use(workspace: str) -> set[str]:
    """Releases that a live run was started from (its run.json names the resolved release path)."""
    used: set[str] = set()
    runs_root = os.path.join(workspace, "runs")
    for name in os.listdir(runs_root) if os.path.isdir(runs_root) else []:
        directory = os.path.join(runs_root, name)
        if read_int(os.path.join(directory, "exit_code")) is None:
            release = (read_json(os.path.join(directory, "run.json")) or {}).get("release")
            if isinstance(release, str):
                used.add(os.path.basename(release.rstrip("/")))
    return used


def prunable_releases(workspace: str, keep: int) -> list[str]:
    """The releases gc may delete: beyond the newest `keep`, neither `current` nor in use by a run."""
    releases = os.path.join(workspace, "releases")
    current = os.path.basename(os.path.realpath(os.path.join(releases, "current")))
    entries = [e for e in os.listdir(releases) if HASH_RE.match(e) and os.path.isdir(os.path.join(releases, e))]
    entries.sort(key=lambda e: os.stat(os.path.join(releases, e)).st_mtime, reverse=True)
    protected = releases_in_use(workspace) | {current}
    return [entry for entry in entries[max(keep, 1) :] if entry not in protected]


def prune_releases(workspace: str, keep: int) -> list[str]:
    """Delete the prunable releases; their names."""
    removed = prunable_releases(workspace, keep)
    for entry in removed:
        shutil.rmtree(os.path.join(workspace, "releases", entry))
    return removed


COLLECTED = "collected.jsonl"  # in the workspace: one line per run directory gc deleted (name, when, by)


def collected_run(workspace: str, name: str) -> dict | None:
    """The last record of gc deleting run `name`'s directory in `workspace`, or None."""
    found = None
    for line in (read_text(os.path.join(workspace, COLLECTED)) or "").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(entry, dict) and entry.get("name") == name:
            found = entry
    return found


def missing_run(req: dict, what: str) -> AgentFailure:
    """The refusal for a run without a directory (`what`: "does not exist" ...): one that gc deleted says so."""
    name = req["name"]
    entry = collected_run(workspace_of(req), name)
    if entry is not None:
        return AgentFailure(
            f"run {name!r} was collected: its run directory was deleted by `dflashops gc` at {entry.get('at')}",
            "not_found",
        )
    return AgentFailure(f"run {name!r} {what}", "not_found")


def verb_gc(req: dict) -> dict:
    """Explicit clean-up: old releases beyond `keep`, the run directories named in `runs` that are not
    running, and with `standby` every waiting standby interpreter (asked to exit: `retired`; one that a launch
    has just claimed runs its run). Nothing else is ever deleted. `removed` lists each deleted folder with its
    path, bytes and files; a deleted run directory is recorded in <workspace>/collected.jsonl (so `logs` and
    `status` of it say it was collected). With `dry_run`, the same answer and nothing deleted or asked."""
    workspace = workspace_of(req)
    dry_run = bool(req.get("dry_run"))
    final = {}  # each run's last state, for the lineage record that outlives its directory
    for name in req.get("runs") or []:
        directory = run_dir({"workspace": workspace, "name": name})
        if not os.path.isdir(directory):
            raise missing_run({"workspace": workspace, "name": name}, "does not exist on this target")
        status = run_status(directory)
        if status["state"] in ("running", "stopping", "launching"):
            raise AgentFailure(f"run {name!r} is still running; stop it first", "conflict")
        final[name] = {key: status[key] for key in ("state", "exit_code", "step")}
    removed = []
    for name in req.get("runs") or []:
        directory = run_dir({"workspace": workspace, "name": name})
        size, files = tree_size(directory)
        if not dry_run:
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(os.path.join(workspace, COLLECTED), "a", encoding="utf-8") as handle:  # before: no silent loss
                handle.write(json.dumps({"name": name, "at": at, "by": "gc", "bytes": size}) + "\n")
            shutil.rmtree(directory)
        removed.append(
            {"kind": "run", "name": name, "path": directory, "bytes": size, "files": files, "final": final[name]}
        )
    releases = os.path.join(workspace, "releases")
    for entry in prunable_releases(workspace, int(req.get("keep", 5))) if os.path.isdir(releases) else []:
        path = os.path.join(releases, entry)
        size, files = tree_size(path)
        if not dry_run:
            shutil.rmtree(path)
        removed.append({"kind": "release", "name": entry, "path": path, "bytes": size, "files": files})
    retired = []
    if req.get("standby"):
        retired = [os.path.basename(folder) for folder, _ in standbys(workspace)]
        if not dry_run:
            retire_standbys(workspace, keep=None)
    return {
        "removed_releases": [r["name"] for r in removed if r["kind"] == "release"],
        "removed_runs": [r["name"] for r in removed if r["kind"] == "run"],
        "retired_standbys": retired,
        "removed": removed,
        "dry_run": dry_run,
    }


# ----------------------------------------------------------------------------------------------- fetch
FETCH_CACHE = ".fetch-sha256.json"  # in the run dir: (size, mtime_ns, inode) -> sha256, so a resumed fetch does
# not hash a 12 GB checkpoint again (~30 s); an entry whose file changed in any of the three is recomputed.


def run_file(directory: str, rel: object) -> str:
    """The absolute path of `rel` inside the run directory; refuses anything that leaves it (`..`, absolute
    paths, symlinks pointing out)."""
    text = str(rel or "")
    if not text or text.startswith("/") or ".." in text.split("/"):
        raise AgentFailure(f"invalid path {text!r} in the run directory", "bad_request")
    path = os.path.join(directory, text)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if real != root and not real.startswith(root + os.sep):
        raise AgentFailure(f"path {text!r} leaves the run directory", "bad_request")
    return path


def verb_fetch_manifest(req: dict) -> dict:
    """Size and sha256 of every regular file under the run-relative `paths` (files or folders); `missing`
    names the paths that do not exist. Hashes are computed here, on the target, next to the data. With
    `"hash": false` only cached hashes are given (`sha256` null for the rest): the controller starts the
    transfer at once and asks for the missing hashes on a second channel meanwhile."""
    directory = run_dir(req)
    if not os.path.isdir(directory):
        raise AgentFailure(f"run {req['name']!r} does not exist on this target", "not_found")
    cache_path = os.path.join(directory, FETCH_CACHE)
    cache = read_json(cache_path) or {}
    files, missing, changed = [], [], False
    for rel in req.get("paths") or []:
        top = run_file(directory, rel)
        if not os.path.exists(top):
            missing.append(rel)
            continue
        walk = [(os.path.dirname(top), [], [os.path.basename(top)])] if os.path.isfile(top) else os.walk(top)
        for folder, dirs, names in walk:
            dirs.sort()
            for entry in sorted(names):
                path = os.path.join(folder, entry)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                stat = os.stat(path)
                key = os.path.relpath(path, directory)
                stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
                known = cache.get(key)
                if not (isinstance(known, list) and known[:3] == stamp):
                    if not req.get("hash", True):
                        files.append({"path": key, "size": stat.st_size, "sha256": None})
                        continue
                    known, changed = [*stamp, file_sha256(path)], True
                    cache[key] = known
                files.append({"path": key, "size": stat.st_size, "sha256": known[3]})
    if changed and req.get("cache", True):  # a dry run's manifest writes nothing
        try:
            write_atomic(cache_path, json.dumps(cache))
        except OSError:
            pass  # a full disk: the cache is only a shortcut
    return {"files": files, "missing": missing, "run_dir": directory}


def verb_read_file(req: dict) -> None:
    """RAW verb (the one exception to the one-JSON-line rule): writes bytes [offset, offset+length) of one run
    file to stdout, nothing else. The controller knows the length and the sha256 from `fetch-manifest` and
    checks both; a refusal before the first byte is a JSON line on stderr and exit status 3."""
    directory = run_dir(req)
    path = run_file(directory, req.get("path"))
    offset, length = int(req.get("offset", 0)), int(req.get("length", -1))
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        end = size if length < 0 else min(size, offset + length)
        out = sys.stdout.buffer
        out.flush()
        position = offset
        try:
            while position < end:  # sendfile: no copy through Python, ~2x less CPU than read/write here
                sent = os.sendfile(out.fileno(), handle.fileno(), position, min(end - position, 1 << 24))
                if sent == 0:
                    break
                position += sent
        except OSError:
            handle.seek(position)
            while position < end:
                block = handle.read(min(end - position, 1 << 20))
                if not block:
                    break
                out.write(block)
                position += len(block)
            out.flush()


# ------------------------------------------------------------------------------------------------ main
VERBS = {
    "ping": lambda req: {"version": 1, "python": sys.version.split()[0]},
    "launch": verb_launch,
    "stop": verb_stop,
    "status": verb_status,
    "tail": verb_tail,
    "follow": verb_follow,
    "gpus": verb_gpus,
    "clear-cache": verb_clear_cache,
    "manifest": verb_manifest,
    "gc": verb_gc,
    "wrap": verb_wrap,
    "standby": verb_standby,
    "fetch-manifest": verb_fetch_manifest,
    "preflight": verb_preflight,
}
# Verbs whose answer is raw bytes on stdout (a refusal: JSON on stderr, exit 3).
RAW_VERBS = {"read-file": verb_read_file}

# Verbs whose stdin is one JSON request line followed by a tar stream.
STDIN_VERBS = {"install": verb_install, "restart": verb_restart}


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    try:
        if verb not in STDIN_VERBS and verb not in VERBS and verb not in RAW_VERBS:
            raise AgentFailure(
                f"unknown verb {verb!r}; verbs: {', '.join(sorted([*VERBS, *STDIN_VERBS, *RAW_VERBS]))}", "bad_request"
            )
        stdin = b""
        if verb in STDIN_VERBS:  # stdin: one JSON request line, then the tar stream (no argv length limits)
            header, _, stdin = sys.stdin.buffer.read().partition(b"\n")
            raw = header.decode("utf-8", errors="replace")
        elif "--json-args" in argv[1:]:
            raw = argv[argv.index("--json-args") + 1] if argv.index("--json-args") + 1 < len(argv) else ""
        elif "--json-stdin" in argv[1:]:
            raw = sys.stdin.read()
        else:
            raw = "{}"
        try:
            req = json.loads(raw)
        except ValueError as exc:
            raise AgentFailure(f"request is not valid JSON: {exc}", "bad_request") from None
        if not isinstance(req, dict):
            raise AgentFailure("request must be a JSON object", "bad_request")
        if verb in RAW_VERBS:
            return raw_call(RAW_VERBS[verb], req)
        result = STDIN_VERBS[verb](req, stdin) if verb in STDIN_VERBS else VERBS[verb](req)
        if verb in ("wrap", "standby"):
            return int(result["exit_code"])
        if result.get("streamed"):  # `follow` printed its answers itself
            return 0
        print(json.dumps({"ok": True, **result}), flush=True)
        return 0
    except BrokenPipeError:  # the reader of a `follow` stream went away: nothing to tell anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0
    except KeyboardInterrupt:
        # Ctrl-C in the terminal of a local-target `logs -f` reaches this process too (same process group): the
        # CLI says what to do next; a traceback from here would only bury that line. Its reader is going away.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGINT
    except AgentFailure as exc:
        print(json.dumps({"ok": False, "error": str(exc), "code": exc.code}), flush=True)
        return 2 if exc.code == "bad_request" else 0
    except (OSError, subprocess.SubprocessError, KeyError, ValueError, TypeError, EOFError, tarfile.TarError) as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": "internal"}), flush=True)
        return 0


def raw_call(verb, req: dict) -> int:
    """Run a RAW verb: its refusals go to stderr (stdout carries only data), exit status 3."""
    try:
        verb(req)
        return 0
    except AgentFailure as exc:
        sys.stderr.write(json.dumps({"ok": False, "error": str(exc), "code": exc.code}) + "\n")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        sys.stderr.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": "internal"}) + "\n")
    return 3
