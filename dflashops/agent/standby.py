"""Standby interpreters (`python -m trainer` started ahead of its run) and the `standby` verb."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from .answers import LaunchAnswer
from .common import (
    LAUNCH_SETTLE_S,
    MARKER_KEY,
    append_log,
    program,
    read_int,
    read_json,
    read_proc,
    read_text,
    remove_quietly,
    tmux_socket,
    write_atomic,
)
from .protocol import LaunchRequest, StandbyRequest
from .wrap import (
    CLEAN_ENV,
    become_group_leader,
    launch_answer,
    launch_failed,
    record_exit_code,
    reserve_records,
    stop_requested,
    wait_for_file,
    wait_job,
)

# A standby is a `python -m trainer` interpreter started ahead of its run. After a launch with `standby: true`
# the agent starts one more wrapper and interpreter in <workspace>/standby/<id>/. The interpreter waits until
# the run it follows has taken its first step (so that its imports do not slow that start), imports torch,
# dynamo, inductor, triton and transformers (~9-10 s of every start on the H200 machine:
# bench/results/restart.md 2026-12-02 "Where the child's start goes"), and waits. The next launch with the same python, launcher and start-up environment adopts it: the
# run directory gets the standby's marker and process group, its wrapper records pgid, pid and exit_code there,
# and the interpreter takes the run's argv, environment, working directory and log, then runs `trainer` as
# `python -m` would. Only third-party modules are imported ahead, never the release's code (PYTHONPATH is left
# out until the adoption), so a restart after a code change runs the new code. A standby that is not adopted
# exits after its idle time (default 1 h), when its folder is removed, or when a launch with another start-up
# environment (or `standby: false`) retires it; nothing else ever stops it.
STANDBY_ROOT = "standby"
STANDBY_IDLE_S = 3600.0
STANDBY_AFTER_S = 600.0  # the longest a new standby waits for the run it follows to start before importing
# A pre-flight in a ready standby (preflight.py): the request it takes, the answer its forked child leaves.
CHECK_REQUEST, CHECK_ANSWER, CHECK_CLAIM = "check.json", "check.out.json", "checking"
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
# (measured: the first restart after a cold deploy compiled every graph again; bench/results/restart.md 2026-12-02 "The edit -> restart loop through the CLI").
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


def start_standby(
    req: LaunchRequest, argv: list[str], launch_env: dict, launcher: str, after: str, fingerprint: str
) -> str | None:
    """Make sure one unclaimed standby for the next launch like this one (`fingerprint`) exists (best effort: a
    standby that cannot start costs the next launch its head start, never this launch). Returns the folder of
    the one it started, None when one was waiting already or none could start."""
    workspace, secret_keys = req.workspace, list(req.secret_keys)
    if any(
        not os.path.exists(os.path.join(folder, "claimed")) for folder, _ in retire_standbys(workspace, fingerprint)
    ):
        return None
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
        "idle_s": float(req.standby_idle_s or STANDBY_IDLE_S),
        "preload": list(req.standby_preload or STANDBY_PRELOAD),
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
        return None
    return folder


def retire_unclaimed(folder: str) -> None:
    """Ask the standby in `folder` to exit unless a launch has claimed it (then it is that run now); it leaves
    within a second (wait_for_go looks once a second), its wrapper removes the folder."""
    if os.path.isdir(folder) and not os.path.exists(os.path.join(folder, "claimed")):
        try:
            write_atomic(os.path.join(folder, "retired"), "\n")
        except OSError:  # the folder went meanwhile: it has left
            pass


def ready_standbys(workspace: str, fingerprint: str) -> Iterator[tuple[str, dict]]:
    """(folder, spec) of each standby of `fingerprint` whose interpreter is ready (its imports done), whose
    wrapper is alive (someone takes a claim) and that no launch has claimed yet, oldest first."""
    for folder, spec in standbys(workspace):
        if spec.get("fingerprint") != fingerprint or os.path.exists(os.path.join(folder, "claimed")):
            continue
        if carries_marker(read_int(os.path.join(folder, "ready")), spec["marker"]) and standby_alive(folder, spec):
            yield folder, spec


def adopt_standby(
    req: LaunchRequest,
    directory: str,
    argv: list[str],
    launch_env: dict,
    cwd: str,
    launcher: str,
    session: str,
    fingerprint: str,
) -> LaunchAnswer | None:
    """Hand this launch to a ready standby of its `fingerprint`; the launch's answer, or None (none ready: the
    caller launches as usual)."""
    workspace = req.workspace
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
        env = {**os.environ, **launch_env, "DFLASHOPS_RUN": req.name, MARKER_KEY: marker}
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


def verb_standby(req: StandbyRequest) -> dict:
    """The standby's interpreter (run with the run's python): wait for the run it follows to start, import
    ahead, say `ready`, then run the launch it is given, or exit when idle, retired or removed."""
    folder = req.dir
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
    sys.path[0:1] = [os.getcwd(), *pythonpath]  # sys.path[0] was the agent's zipapp (or its folder)
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
