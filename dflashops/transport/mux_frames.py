"""The wire format between a CLI process and its ssh multiplexer (mux_client.py <-> mux_server.py).

Frames on a Unix stream socket: one type byte, a 4-byte big-endian length, the payload. Standard library
only, so the client side never imports paramiko. Types:
  client -> server: Q (JSON request: op run|stream, argv, env, timeout), I (stdin bytes, whole);
  server -> client: O (stdout bytes), E (stderr bytes), R (JSON end: exit_code), X (JSON error: the
  DflashopsError class name, message and hint, re-raised as the same class on the client side).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflashops import errors
from dflashops.errors import DflashopsError, TransportError

HEADER = struct.Struct(">cI")
MAX_FRAME = 1 << 31  # a tar upload or a command's output: bounded by the length field itself


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
