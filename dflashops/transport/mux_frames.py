"""The wire format between a CLI process and its ssh multiplexer (mux_client.py <-> mux_server.py).

Frames on a Unix stream socket: one type byte, a 4-byte big-endian length, the payload. Standard library
only, so the client side never imports paramiko. Types:
  client -> server: Q (JSON request: op run|run_watched|stream, argv, env, timeout, stdin), then with `stdin`:
  I frames of at most STDIN_CHUNK bytes each, ended by an empty I frame (a 200 MB upload is never one frame in
  memory);
  server -> client: e (a piece of a `run_watched` command's stderr, as it comes), O (stdout bytes), E (the whole
  stderr), R (JSON end: exit_code), X (JSON error: the DflashopsError class name, message and hint, re-raised
  as the same class on the client side).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import struct
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from dflashops.core import errors
from dflashops.core.errors import DflashopsError, TransportError

HEADER = struct.Struct(">cI")
MAX_FRAME = 1 << 31  # a command's output: bounded by the length field itself
STDIN_CHUNK = 1 << 20  # the most stdin bytes one I frame carries


def send_stdin(sock: socket.socket, stdin: bytes | bytearray | memoryview | IO[bytes]) -> None:
    """Stdin as I frames of at most STDIN_CHUNK bytes, read from a file object one chunk at a time, then the
    empty I frame that ends it."""
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        view = memoryview(stdin)
        for start in range(0, len(view), STDIN_CHUNK):
            send_frame(sock, b"I", bytes(view[start : start + STDIN_CHUNK]))
    else:
        while chunk := stdin.read(STDIN_CHUNK):
            send_frame(sock, b"I", chunk)
    send_frame(sock, b"I")


class FramedStdin(io.RawIOBase):
    """The server's side of `send_stdin`: the I frames as a stream a transport reads as the command does
    (wrap it in io.BufferedReader). `drain()` reads what the command left unread, up to the end frame, so the
    client, which sends all of stdin before it reads the answer, is never left blocked mid-send."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self._pending = memoryview(b"")
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._pending and not self._ended:
            kind, payload = recv_frame(self._sock)
            if kind != b"I":
                raise EOFError(f"expected a stdin frame, got {kind!r}")
            self._ended = not payload
            self._pending = memoryview(payload)
        view = memoryview(buffer).cast("B")
        count = min(len(view), len(self._pending))
        view[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count


def drain(stdin: IO[bytes]) -> None:
    """Read `stdin` (a FramedStdin's reader) to its end."""
    while stdin.read(STDIN_CHUNK):
        pass


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    header = HEADER.pack(kind, len(payload))
    if len(payload) < 65536:  # one write for the usual small frame
        sock.sendall(header + payload)
    else:
        sock.sendall(header)
        sock.sendall(payload)


def send_json(sock: socket.socket, kind: bytes, value: dict[str, Any]) -> None:
    send_frame(sock, kind, json.dumps(value).encode())


def recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise EOFError("the multiplexer's socket closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    """(type, payload); EOFError when the peer closed the socket between or inside frames."""
    kind, size = HEADER.unpack(recv_exact(sock, HEADER.size))
    if size > MAX_FRAME:
        raise EOFError(f"frame of {size} bytes is too large")
    return kind, recv_exact(sock, size)


def error_payload(exc: DflashopsError) -> dict[str, Any]:
    return {"class": type(exc).__name__, "message": exc.message, "hint": exc.hint}


def error_from(payload: bytes) -> DflashopsError:
    """The DflashopsError the server reported (TransportError when the class is not a known one)."""
    data = json.loads(payload)
    cls = getattr(errors, str(data.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, DflashopsError)) or cls is errors.CommandFailed:
        cls = TransportError
    return cls(str(data.get("message")), hint=data.get("hint"))


def settings_to_json(settings: Any) -> dict[str, Any]:
    """SshSettings (a frozen dataclass, gateways nested) as plain JSON for the server's command line."""
    return asdict(settings)


def mux_key(name: str, settings: Any) -> str:
    """Which multiplexer serves this transport: the name, every connection setting, the ssh_config file the
    connection reads, and the code that connects (so an upgraded dflashops never talks to an old daemon)."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(json.dumps([name, settings_to_json(settings)], sort_keys=True).encode())
    config = os.environ.get("DFLASHOPS_SSH_CONFIG") or os.path.expanduser("~/.ssh/config")
    for path in (Path(config), here / "mux_server.py", here / "mux_frames.py", here / "ssh.py", here / "ssh_keys.py"):
        try:
            digest.update(str(path).encode() + path.read_bytes())
        except OSError:
            digest.update(str(path).encode())
    return digest.hexdigest()[:20]
