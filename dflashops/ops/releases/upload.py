"""The tar of a release's changed files as it travels: in an unlinked temporary file, never whole in memory.

A first deploy of a 200 MB file held the tar in a BytesIO, and the agent call joined it to its request line in a
second copy (controller max RSS 435 MB, bench/results/control-plane.md "2026-12-05 — The control plane at
scale"). Here the tar is written to a temporary file as it is built, and the call's stdin is read from it in
chunks behind the request line (`RequestAndTar`): the local and ssh transports and the ssh multiplexer (its I
frames, transport/mux_frames.py) copy it chunk by chunk, so the controller holds about one chunk of it at a time.
"""

from __future__ import annotations

import io
import tempfile
from typing import IO

CHUNK = 1 << 20


class TarUpload:
    """A finished tar in an unlinked temporary file (gone when closed or collected): `len()` is its size in
    bytes, `open()` its file rewound to the start, `read_bytes()` all of it (tests and small uploads)."""

    def __init__(self) -> None:
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix="dflashops-upload-")  # noqa: SIM115  # held until close()
        self._size = 0

    @property
    def writer(self) -> IO[bytes]:
        """The file to write the tar into (tarfile's fileobj); `finish()` when it is complete."""
        return self._file

    def finish(self) -> TarUpload:
        self._file.flush()
        self._size = self._file.tell()
        return self

    def __len__(self) -> int:
        return self._size

    def open(self) -> IO[bytes]:
        self._file.seek(0)
        return self._file

    def read_bytes(self) -> bytes:
        return self.open().read()

    def close(self) -> None:
        self._file.close()


class RequestAndTar(io.RawIOBase):
    """An agent call's stdin: the request line, then the tar, read in chunks (`read(n)`) or whole (`read()`).
    Each `RequestAndTar` reads from the start: a call that must run again (the agent was uploaded first) makes
    a new one (`again()`)."""

    def __init__(self, head: bytes, tar: TarUpload) -> None:
        super().__init__()
        self._head = head
        self._tar = tar
        self._at = 0  # bytes of the head already read
        self._body = tar.open()

    def again(self) -> RequestAndTar:
        return RequestAndTar(self._head, self._tar)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        if self._at < len(self._head):
            part = self._head[self._at : self._at + len(view)]
            view[: len(part)] = part
            self._at += len(part)
            return len(part)
        return self._body.readinto(view)  # type: ignore[attr-defined]  # a TemporaryFile is a BufferedRandom
