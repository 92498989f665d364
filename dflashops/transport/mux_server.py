"""The ssh multiplexer: one background process per (host, settings) that keeps ONE ssh connection open
and runs the commands of every dflashops invocation over it, like OpenSSH's ControlMaster + ControlPersist.

Why: at 50 ms RTT a fresh connection costs ~0.3 s (TCP, key exchange, authentication) and importing
fabric + paramiko ~0.15 s of every CLI start; a scripted restart cycle pays both on every call. Through
the multiplexer a CLI process imports neither and its commands start on the live connection.

Started by mux_client.py, in the background, when an invocation that connected in-process closes, as
`python -m dflashops.transport.mux_server SOCKET SETTINGS_JSON NAME PERSIST_S LOCK_FD`: the first process
forks at once (no threads exist yet, so the fork is safe) and exits, so the client never adopts a
long-lived child; the server connects (host key checked exactly as in-process: an unknown or changed key
ends it quietly, the invocation's own connection reports it), listens on SOCKET (mode 0600, in a 0700
folder), then releases the start lock LOCK_FD it inherited (held until now, so concurrent invocations start
one server). It serves each client connection in its own thread (paramiko multiplexes the channels),
accepts only its own user (SO_PEERCRED), and exits after PERSIST_S seconds without a client or when its
socket file is removed or replaced. Its pid is in SOCKET.pid (tests end their daemons by that pid).
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflashops.core.errors import DflashopsError
from dflashops.transport.base import Transport
from dflashops.transport.mux_frames import (
    STDIN_CHUNK,
    FramedStdin,
    drain,
    error_payload,
    recv_frame,
    send_frame,
    send_json,
)
from dflashops.transport.ssh_settings import SshSettings

ACCEPT_TICK_S = 1.0  # how often the idle and socket checks run


def settings_from_json(data: dict[str, Any] | None) -> SshSettings | None:
    if data is None:
        return None
    return SshSettings(**{**data, "gateway": settings_from_json(data.get("gateway"))})


class Server:
    def __init__(self, path: Path, transport: Transport, persist_s: float) -> None:
        self.path, self.transport, self.persist_s = path, transport, persist_s
        self.active = 0
        self.last_activity = time.monotonic()
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def listen(self) -> None:
        self.path.unlink(missing_ok=True)  # a stale socket of a dead daemon (the client holds the spawn lock)
        old_umask = os.umask(0o177)
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self.listener.listen(64)
        self.listener.settimeout(ACCEPT_TICK_S)
        self.inode = self.path.stat().st_ino

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                if self.should_exit():
                    return
                continue
            with self.lock:
                self.active += 1
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def should_exit(self) -> bool:
        try:
            if self.path.stat().st_ino != self.inode:
                return True  # replaced by a newer daemon
        except FileNotFoundError:
            return True  # removed: someone wants this daemon gone
        with self.lock:
            return self.active == 0 and time.monotonic() - self.last_activity > self.persist_s

    def handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != os.getuid():
                    return
                kind, payload = recv_frame(conn)
                request = json.loads(payload)
                # Stdin is read from the socket as the command reads it (FramedStdin), not whole first; what the
                # command leaves unread is drained before the answer (the client sends all of it first).
                stdin = io.BufferedReader(FramedStdin(conn), STDIN_CHUNK) if request.get("stdin") else None
                try:
                    if request["op"] == "stream":
                        for chunk in self.transport.stream(
                            request["argv"], env=request["env"], timeout=request.get("timeout")
                        ):
                            send_frame(conn, b"O", chunk)  # a gone client raises here: the stream closes
                        send_json(conn, b"R", {"exit_code": 0})
                    else:
                        try:
                            code, out, err = self.transport._run_watched(
                                request["argv"],
                                env=request["env"],
                                stdin=stdin,
                                timeout=request.get("timeout"),
                                on_stderr=live_stderr(conn) if request["op"] == "run_watched" else ignore,
                            )
                        finally:
                            if stdin is not None:
                                drain(stdin)
                        send_frame(conn, b"O", out)
                        send_frame(conn, b"E", err)
                        send_json(conn, b"R", {"exit_code": code})
                except DflashopsError as exc:
                    send_json(conn, b"X", error_payload(exc))
        except (OSError, EOFError, ValueError, KeyError):
            pass  # the client went away or spoke nonsense: nothing to answer
        finally:
            with self.lock:
                self.active -= 1
                self.last_activity = time.monotonic()


def ignore(_piece: bytes) -> None:
    pass


def live_stderr(conn: socket.socket) -> Callable[[bytes], None]:
    """Sends each piece of a `run_watched` command's stderr as it comes (an `e` frame: a remote restart's phases
    while it runs). A client gone meanwhile (its terminal closed) gets no more, and the command runs on to its
    end, as a `run` does: an agent call cut half-way would leave a restart half done."""
    gone = False

    def send(piece: bytes) -> None:
        nonlocal gone
        if not gone:
            try:
                send_frame(conn, b"e", piece)
            except OSError:
                gone = True

    return send


def main(argv: list[str]) -> int:
    path, settings_json, name, persist_s, lock_fd = Path(argv[0]), argv[1], argv[2], float(argv[3]), int(argv[4])
    if os.fork() > 0:
        return 0  # the starter: the client reaps this exit (in a thread), never waits for the server
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    # Imported after the fork: the starter exits at once (nothing of its start-up is paid twice), and fabric +
    # paramiko take ~0.25 s to import.
    from dflashops.transport.ssh import SshTransport

    settings = settings_from_json(json.loads(settings_json))
    assert settings is not None
    transport = SshTransport(name=name, default_env={}, settings=settings)
    server = Server(path, transport, persist_s)
    try:
        transport.connection()  # host key checked here as anywhere: a refusal simply ends this process
        server.listen()
    except (DflashopsError, OSError):
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a stop by pid still removes the socket
    Path(f"{path}.pid").write_text(f"{os.getpid()}\n")
    fcntl.flock(lock_fd, fcntl.LOCK_UN)  # listening: the next starter may look again
    os.close(lock_fd)
    try:
        server.serve_forever()
    finally:
        for leftover in (path, Path(f"{path}.pid")):
            try:
                if leftover == path and leftover.stat().st_ino != server.inode:
                    continue  # a newer daemon's socket: not ours to remove
                if leftover != path and leftover.read_text().strip() != str(os.getpid()):
                    continue
                leftover.unlink()
            except OSError:
                pass
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
