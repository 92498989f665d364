"""The agent's shared ground: the run directory's names (RUN_FILES), the name rule, atomic files, reading
records, process discovery by process group and marker, the tmux socket and session names, and how the agent
starts itself again (program). It never kills by name: only the recorded process group of a run and processes
whose environment carries the run's unique marker (DFLASHOPS_RUN_ID=<name>.<nonce>).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
import time

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LAUNCHERS = ("tmux", "nohup")  # how a run is started: a tmux session, or setsid + nohup (the controller uses these)
HASH_RE = re.compile(r"^[0-9a-f]{8,64}$")
MARKER_KEY = "DFLASHOPS_RUN_ID"
# trainer/state/handover.py: the run still writing the --resume checkpoint
RESUME_WRITER_KEY = "DFLASHOPS_RESUME_WRITER"
# A crash's one-line reason in train.log: a Python exception line, or the `error: ...` line that the trainer
# (and dflashops' own wrapper) print for failures they explain themselves.
ERROR_LINE_RE = re.compile(r"(Traceback \(most recent call last\)|^\w*(Error|Exception)\b.*|^error: .+)")
# THE list of names in a run directory `<workspace>/runs/<name>/` (a folder ends in "/"), with who writes each:
# this agent, its supervisor (supervisor.py), the trainer, the wandb library it starts, `trainer export`
# (run by `dflashops fetch --export`), or nobody here ("none": read when present). The trainer cannot import
# this file, so it keeps its own names (trainer/core/run_files.py); tests/test_run_directory_contract.py checks that
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


# A long call's progress (`restart`, `launch` with `progress: true`): one line per phase as it starts, on stderr,
# `dflashops-progress {json}`; stdout keeps its one JSON answer. The controller reads them as they come
# (ops/agent_client.py) and says each phase to the user; any other stderr line is ignored as before.
PROGRESS_PREFIX = "dflashops-progress "


def report_progress(progress: bool, phase: str, **fields: object) -> None:
    """Say on stderr that `phase` starts, when the request asked for `progress`; never fails the call."""
    if not progress:
        return
    try:
        sys.stderr.write(PROGRESS_PREFIX + json.dumps({"phase": phase, **fields}, default=str) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stderr: the answer on stdout still counts
        pass


class AgentFailure(Exception):
    """A refusal the controller shows to the user; `code` is machine-readable (not_found, conflict, ...)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


def is_safe_name(text: str) -> bool:
    """THE rule for names that reach command lines, file paths and tmux (runs, sessions, targets, hosts,
    profiles): 1-64 of A-Z a-z 0-9 . _ -, no `..`, no leading `-`. The controller imports it from here
    (dflashops/core/shell.py), so the agent and the controller can never disagree on a name."""
    return bool(NAME_RE.match(text)) and text != "." and ".." not in text and not text.startswith("-")


def check_name(value: object, what: str = "run name") -> str:
    text = str(value or "")
    if not is_safe_name(text):
        raise AgentFailure(f"invalid {what} {text!r}", "bad_request")
    return text


def run_dir(workspace: object, name: object) -> str:
    """<workspace>/runs/<name>, or AgentFailure `bad_request` for a relative workspace or an unsafe name."""
    return os.path.join(workspace_of(workspace), "runs", check_name(name))


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


def run_processes(
    pgid: int | None, marker: str | None, directory: str, table: ProcessTable | None = None
) -> tuple[int | None, set[int]]:
    """(the run's process group or None, its live processes), from one scan of /proc (`table`: one taken
    already, shared by every run of a `status` call).

    Live processes: members of the recorded group, plus any process whose environment has the run's exact
    marker (children that called setsid left the group but kept the environment). A pgid outlives its run on
    disk: after a lost wrapper (SIGKILL, reboot) the number can be reused by an unrelated group. So the group
    counts, and is returned for killpg, only while a member carries the marker or is the run's own launch
    wrapper (its command line names this run directory); otherwise only marked processes are the run's."""
    table = table or ProcessTable()
    marked = set(table.marked.get(marker, ())) if marker else set()
    members = set(table.groups.get(pgid, ())) if pgid and pgid > 1 else set()
    wrapper_arg = json.dumps({"dir": directory}).encode()  # exactly as verb_launch builds the wrapper's argv
    owned = bool(members & marked) or any(wrapper_arg in table.cmdline(pid) for pid in members)
    return (pgid, members | marked) if owned else (None, marked)


class ProcessTable:
    """One walk of /proc: every live process's group, and the run marker in its environment (read once).

    `status` of a workspace asks about every run in it, finished ones included (a finished run keeps its pgid
    file); a walk per run was O(runs x processes): 59,671 stat and 59,592 environ reads for 500 runs, 91% of
    the call (cProfile, issue 47). With one table the call is O(runs + processes). A table is a snapshot:
    take it before reading a run's exit_code, so a run whose processes are gone from it has written its
    exit code already if it ever will (the wrapper writes it before it exits)."""

    def __init__(self) -> None:
        self.groups: dict[int, set[int]] = {}  # pgid -> live members
        self.marked: dict[str, set[int]] = {}  # marker -> live processes whose environment carries it
        self._cmdlines: dict[int, bytes] = {}
        self.taken_at = time.time()
        prefix = f"{MARKER_KEY}=".encode()
        me = os.getpid()
        for pid in all_pids():
            if pid == me:
                continue
            stat = proc_stat(pid)
            if stat is None or stat[0] in ("Z", "X"):
                continue
            self.groups.setdefault(stat[1], set()).add(pid)
            for entry in read_proc(pid, "environ").split(b"\0"):
                if entry.startswith(prefix):
                    marker = entry[len(prefix) :].decode("utf-8", errors="replace")
                    self.marked.setdefault(marker, set()).add(pid)

    def predates(self, path: str) -> bool:
        """The file at `path` was written after this table was taken (1 s of slack for coarse file times), so
        a process it names may be missing from the table: a run launched while `status` read the others."""
        try:
            return os.stat(path).st_mtime >= self.taken_at - 1.0
        except OSError:
            return False

    def cmdline(self, pid: int) -> bytes:
        """/proc/PID/cmdline, read once per table (only group members of a run with no marked member need it)."""
        if pid not in self._cmdlines:
            self._cmdlines[pid] = read_proc(pid, "cmdline")
        return self._cmdlines[pid]


# A supervisor daemon's /proc/PID/cmdline holds these words (`python3 agent-<sha12>.pyz supervise start ...`).
SUPERVISOR_ARGV = b"\0supervise\0start\0"


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


LAUNCH_SETTLE_S = 30.0  # a launch still in flight this long after its directory was made has failed


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


def tmux_has_session(workspace: str, session: str) -> bool:
    """The workspace's tmux server has a session of exactly this name (`=`: no prefix match)."""
    found = subprocess.run(
        ["tmux", "-L", tmux_socket(workspace), "has-session", "-t", "=" + session],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20,
    )  # fmt: skip
    return found.returncode == 0


def workspace_of(workspace: object) -> str:
    """`workspace` itself, or AgentFailure `bad_request` when it is not an absolute path."""
    if not isinstance(workspace, str) or not os.path.isabs(workspace):
        raise AgentFailure("workspace must be an absolute path", "bad_request")
    return workspace


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def missing_run(workspace: str, name: str, what: str) -> AgentFailure:
    """The refusal for a run without a directory (`what`: "does not exist" ...): one that gc deleted says so."""
    entry = collected_run(workspace_of(workspace), name)
    if entry is not None:
        return AgentFailure(
            f"run {name!r} was collected: its run directory was deleted by `dflashops gc` at {entry.get('at')}",
            "not_found",
        )
    return AgentFailure(f"run {name!r} {what}", "not_found")


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_space(path: str) -> tuple[int, int] | None:
    """(bytes, inodes) free to this user on the disk of `path` (of its nearest existing folder); None when the
    disk gives no answer."""
    where = path
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        stat = os.statvfs(where)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize, stat.f_favail


def no_space(workspace: str, needs: str) -> AgentFailure:
    """The refusal (code `no_space`) of a launch or an install the workspace's disk cannot take: the disk, what is
    free on it now, what the step needs (`needs`), and that nothing was launched or stopped."""
    free = free_space(workspace)
    shown = "" if free is None else f" ({free[0] / 2**10:.0f} KiB free{', no free inode' if free[1] == 0 else ''})"
    return AgentFailure(
        f"no space left on the disk of the workspace {workspace}{shown}: {needs}; nothing was launched or stopped",
        "no_space",
    )
