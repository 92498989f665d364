"""The client side of the ssh multiplexer (mux_server.py): a Transport that sends each command to the
background process holding the connection, starting that process when none is listening.

Standard library only: a CLI process that finds its multiplexer running imports neither fabric nor paramiko
and opens no connection (~0.45 s less per invocation at 50 ms RTT). Which multiplexer: mux_frames.mux_key
(name + settings + ssh_config + the connecting code). Where: $DFLASHOPS_MUX_DIR, else
$XDG_RUNTIME_DIR/dflashops-mux, else /tmp/dflashops-mux-<uid>; the folder must be this user's and mode
0700 (refused otherwise: someone else's socket there could impersonate the host). An invocation that finds
none connects in-process and, when it closes, starts one in the background (see MuxTransport); SOCKET.lock
makes that one.

Knobs: DFLASHOPS_SSH_PERSIST = seconds an idle multiplexer stays (default 600, OpenSSH's usual
ControlPersist 10m); 0 turns multiplexing off (one in-process connection per invocation, as before).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashops.core.errors import TransportError
from dflashops.transport.base import StderrSink, Stdin, Transport
from dflashops.transport.mux_frames import error_from, mux_key, recv_frame, send_json, send_stdin, settings_to_json

if TYPE_CHECKING:
    from dflashops.transport.ssh import SshTransport

DEFAULT_PERSIST_S = 600.0
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def persist_seconds() -> float:
    """DFLASHOPS_SSH_PERSIST as seconds (0: no multiplexing); a bad value is an error, not a silent default."""
    text = os.environ.get("DFLASHOPS_SSH_PERSIST", "").strip()
    if not text:
        return DEFAULT_PERSIST_S
    try:
        value = float(text)
    except ValueError:
        raise TransportError(
            f"DFLASHOPS_SSH_PERSIST={text!r} is not a number of seconds",
            hint="set it to e.g. 600, or 0 to connect anew on every command",
        ) from None
    return max(0.0, value)


def mux_dir() -> Path | None:
    """This user's multiplexer folder (created 0700), or None when none can be made safe here."""
    base = os.environ.get("DFLASHOPS_MUX_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "dflashops-mux")
        if os.environ.get("XDG_RUNTIME_DIR")
        else f"/tmp/dflashops-mux-{os.getuid()}"
    )
    path = Path(base)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or not path.is_dir() or path.is_symlink():
        raise TransportError(
            f"the ssh multiplexer folder {path} is not yours alone (owner uid {info.st_uid}, "
            f"mode {oct(info.st_mode & 0o777)})",
            hint="remove it, or set DFLASHOPS_MUX_DIR to a folder of yours with mode 0700",
        )
    return path


# What the multiplexer reads from its environment, and nothing else: it outlives the invocation that started it
# (DFLASHOPS_SSH_PERSIST, 10 min by default) and /proc/PID/environ keeps what a process started with for its whole
# life, so a shell's secrets (a profile's pass_env: DB_PASS, OPENAI_KEY, WANDB_API_KEY) must not reach it. Each
# command's own environment travels in its request (MuxTransport.request), never in the daemon's. Kept: the
# interpreter's and loader's start-up names (PYTHON*, LD_*, PATH, VIRTUAL_ENV), the basics a process expects
# (HOME for ~/.ssh, USER, LANG, LC_*, TZ, TMPDIR), the ssh agent's socket, Kerberos' ticket cache (paramiko's
# GSS-API), and dflashops' own connection knobs (DFLASHOPS_SSH_CONFIG, DFLASHOPS_CONNECT_TIMEOUT, ...), minus any
# name that looks like a secret.
DAEMON_ENV_RE = re.compile(
    r"^(PYTHON[A-Z_]*|LD_[A-Z_]+|LC_[A-Z_]+|PATH|VIRTUAL_ENV|HOME|USER|LOGNAME|LANG|LANGUAGE|TZ|TMPDIR"
    r"|SSH_AUTH_SOCK|KRB5CCNAME|KRB5_CONFIG|XDG_RUNTIME_DIR|DFLASHOPS_[A-Z_]+)$"
)
DAEMON_SECRET_RE = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|PASS$|CREDENTIAL)", re.IGNORECASE)


def daemon_env() -> dict[str, str]:
    """The multiplexer's whole start-up environment: this process's, filtered by DAEMON_ENV_RE, no secret-like
    name (see above)."""
    return {k: v for k, v in os.environ.items() if DAEMON_ENV_RE.match(k) and not DAEMON_SECRET_RE.search(k)}


@dataclass
class MuxTransport(Transport):
    """Runs argv on a host through its multiplexer (see the module docstring); same contract as SshTransport.

    Which way is decided at the first command and kept for the invocation: a multiplexer answers -> every
    command goes to it; none answers -> this invocation connects in-process (an SshTransport: fabric and
    paramiko are imported now) and, at close(), when that connection worked and still no multiplexer
    listens, starts one in the background for the invocations that follow. At close, not at the first
    command: a multiplexer started alongside the invocation imports paramiko and does its key exchange
    while the invocation does the same, and on a 2-core machine that made the invocation ~0.25 s slower
    than without multiplexing (bench/remote_restart.py --cold at 50 ms RTT, 2026-12-02); waiting for it
    would cost ~0.3 s more than connecting here (a second interpreter importing paramiko)."""

    settings: Any = None  # SshSettings
    persist_s: float = DEFAULT_PERSIST_S
    folder: Path | None = None
    _path: Path | None = field(default=None, init=False, repr=False)
    _direct: SshTransport | None = field(default=None, init=False, repr=False)
    _via_mux: bool | None = field(default=None, init=False, repr=False)

    @property
    def path(self) -> Path:
        if self._path is None:
            assert self.folder is not None
            self._path = self.folder / f"{mux_key(self.name, self.settings)}.sock"
        return self._path

    # -- Transport ----------------------------------------------------------------------------------
    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        return self._run_either(argv, env, stdin, timeout, None)

    def _run_watched(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink,
    ) -> tuple[int, bytes, bytes]:
        """Live stderr, on the direct link and through the multiplexer (its `e` frames: a remote restart shows
        its phases while it runs, not all at the end)."""
        return self._run_either(argv, env, stdin, timeout, on_stderr)

    def _run_either(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink | None,
    ) -> tuple[int, bytes, bytes]:
        """One command in-process or through the multiplexer (`run`, or `run_watched` when `on_stderr` is given;
        the multiplexer's key includes this code, so it always knows both)."""
        conn = self.backend()
        if conn is None:
            assert self._direct is not None
            if on_stderr is None:
                return self._direct._run(argv, env=env, stdin=stdin, timeout=timeout)
            return self._direct._run_watched(argv, env=env, stdin=stdin, timeout=timeout, on_stderr=on_stderr)
        with self.request(conn, "run" if on_stderr is None else "run_watched", argv, env, timeout, stdin):
            out, err = b"", b""
            while True:
                kind, payload = self.frame(conn, argv)
                if kind == b"e" and on_stderr is not None:
                    on_stderr(payload)
                elif kind == b"O":
                    out = payload
                elif kind == b"E":
                    err = payload
                elif kind == b"R":
                    return int(json.loads(payload)["exit_code"]), out, err
                elif kind == b"X":
                    raise error_from(payload)

    def stream(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Iterator[bytes]:
        merged = {**self.default_env, **(env or {})}
        conn = self.backend()
        if conn is None:
            assert self._direct is not None
            yield from self._direct.stream(argv, env=merged, timeout=timeout)
            return
        with self.request(conn, "stream", argv, merged, timeout, None):
            while True:
                kind, payload = self.frame(conn, argv)
                if kind == b"O":
                    yield payload
                elif kind == b"R":
                    return
                elif kind == b"X":
                    raise error_from(payload)

    def close(self) -> None:
        """Close the in-process connection, if any; then, when it worked and no multiplexer listens (none
        did at the first command, or the one in use went away), start one for the next invocations."""
        if self._direct is None:
            return
        worked = self._direct.connected
        self._direct.close()
        if worked:
            conn = self._try_connect()
            if conn is None:
                self._start_in_background()
            else:
                conn.close()  # another invocation's multiplexer is up meanwhile

    # -- which way ----------------------------------------------------------------------------------
    def backend(self) -> socket.socket | None:
        """A socket to the multiplexer for one command, or None: run it in-process (self._direct)."""
        if self._via_mux is not False:
            conn = self._try_connect()
            if conn is not None:
                self._via_mux = True
                return conn
        self._via_mux = False
        if self._direct is None:
            from dflashops.transport.ssh import SshTransport

            self._direct = SshTransport(name=self.name, default_env={}, settings=self.settings)
        return None

    def _try_connect(self) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.path))
            return conn
        except OSError:  # no socket, or a dead daemon's
            conn.close()
            return None

    def _start_in_background(self) -> None:
        """Start a multiplexer unless one is starting already (its lock is held); never waits for it. The
        lock's open file is handed to the server, which holds it until it listens, so of several invocations
        that find none at once exactly one starts it. Called only after this invocation connected itself; a
        multiplexer that cannot connect all the same (the host went down, its key changed) just exits, and
        the next invocation connects itself and reports the error."""
        lock = open(f"{self.path}.lock", "a")  # noqa: SIM115 - closed in the finally below
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another invocation is starting one right now
            settings = json.dumps(settings_to_json(self.settings))
            pythonpath = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
            starter = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dflashops.transport.mux_server",
                    str(self.path),
                    settings,
                    self.name,
                    str(self.persist_s),
                    str(lock.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**daemon_env(), "PYTHONPATH": pythonpath},
                pass_fds=(lock.fileno(),),
            )
            # It forks the server and exits as soon as its interpreter is up, which under load took 0.1-0.25 s
            # of this invocation's wall time when waited for here; a daemon thread reaps it instead (the CLI
            # usually exits first, and then init does).
            threading.Thread(target=starter.wait, name="dflashops-mux-starter", daemon=True).start()
        except OSError:
            pass  # no multiplexer this time; the in-process connection works regardless
        finally:
            lock.close()  # the server's inherited descriptor keeps the lock until it listens

    # -- one command over the socket ----------------------------------------------------------------
    def request(
        self,
        conn: socket.socket,
        op: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        timeout: float | None,
        stdin: Stdin,
    ) -> socket.socket:
        try:
            send_json(
                conn,
                b"Q",
                {"op": op, "argv": list(argv), "env": dict(env), "timeout": timeout, "stdin": stdin is not None},
            )
            if stdin is not None:
                send_stdin(conn, stdin)  # in chunks, as read from a file object (a release's tar, upload.py)
        except OSError as exc:
            conn.close()
            raise TransportError(
                f"{self.name}: the ssh multiplexer refused the command: {exc.strerror or exc}",
                hint="run the command again (a new multiplexer starts)",
            ) from None
        return conn

    def frame(self, conn: socket.socket, argv: Sequence[str]) -> tuple[bytes, bytes]:
        try:
            return recv_frame(conn)
        except (EOFError, OSError):
            raise TransportError(
                f"{self.name}: the ssh multiplexer went away during: {' '.join(argv)[:200]}",
                hint="run the command again (a new multiplexer starts)",
            ) from None


def open_ssh(name: str, settings: Any) -> Transport:
    """The transport to reach `settings`' host: through a multiplexer unless DFLASHOPS_SSH_PERSIST=0 or no
    safe folder exists for its socket; then an in-process SshTransport (imports fabric + paramiko)."""
    persist = persist_seconds()
    folder = mux_dir() if persist > 0 else None
    if folder is not None:
        return MuxTransport(name=name, default_env={}, settings=settings, persist_s=persist, folder=folder)
    from dflashops.transport.ssh import SshTransport

    return SshTransport(name=name, default_env={}, settings=settings)


def stop_multiplexers(folder: Path, timeout: float = 5.0) -> list[int]:
    """SIGTERM every multiplexer whose pid file is in `folder` (the pids they recorded themselves; a pid
    whose process is no longer a mux_server is skipped), and wait until their sockets are gone. For test
    and benchmark teardown; an idle multiplexer also ends by itself after DFLASHOPS_SSH_PERSIST seconds."""
    stopped = []
    for pid_file in sorted(folder.glob("*.sock.pid")):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"dflashops.transport.mux_server" not in cmdline:
            continue  # the pid was reused by another program: not ours
        os.kill(pid, signal.SIGTERM)
        stopped.append(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in stopped):
        time.sleep(0.02)
    return stopped
