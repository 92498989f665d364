"""The tar of a release's changed files as it travels, never whole in memory.

A first deploy of a 200 MB file held the tar in a BytesIO, and the agent call joined it to its request line in a
second copy (controller max RSS 435 MB, bench/results/control-plane.md "2026-12-05 — The control plane at
scale"). Now a plain tar (a large upload that does not compress) is generated as it is sent (`PlainTar`: its
headers made up front, so its exact size is known before the first byte goes, each file read in chunks as the
stream reaches it); a gzip tar (small or compressible uploads) is written to an unlinked temporary file
(`TarUpload`). Either is read behind the request line (`RequestAndTar`) in chunks: the local and ssh transports
and the ssh multiplexer (its I frames, transport/mux_frames.py) copy it chunk by chunk, so the controller holds
about one chunk of it at a time.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
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


class PlainTar:
    """A plain (uncompressed) tar of `files` (path in the release -> local file), generated as it is read: the
    bytes tarfile's `w` mode writes for them (each member's header, its data padded to 512 bytes, two zero blocks,
    zeros to a whole 10 KiB record), without a copy of the data anywhere. `add()` each file, then `len()` is its
    exact size, computed from the headers and the files' sizes; `open()` a new stream from the start.

    A file that changes size after the headers were made is sent as exactly the size its header names (cut, or
    padded with zeros), and one that cannot be read as zeros: the stream never fails mid-call (a transport's
    feeder thread would leave the agent waiting), and the agent, which checks every file's sha256 against the
    manifest, refuses the release (`corrupt`) instead."""

    def __init__(self) -> None:
        self._archive = tarfile.TarFile(fileobj=io.BytesIO(), mode="w")  # only its header format and gettarinfo
        self._members: list[tuple[bytes, Path, int]] = []
        self._body = 0  # bytes of the members, headers and padding included

    def add(self, rel: str, path: Path) -> None:
        """File `path` as `rel` in the tar, with its size, mode and mtime now (OSError when it cannot be read)."""
        archive = self._archive
        with path.open("rb") as handle:  # fstat: a symlink to a file becomes that file, as before
            info = archive.gettarinfo(arcname=rel, fileobj=handle)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        header = info.tobuf(archive.format, archive.encoding, archive.errors)
        self._members.append((header, path, info.size))
        self._body += len(header) + _padded(info.size)

    def __len__(self) -> int:
        return self._body + len(self._end())

    def _end(self) -> bytes:
        """Two zero blocks, then zeros to a whole record (TarFile.close)."""
        size = self._body + 2 * tarfile.BLOCKSIZE
        return tarfile.NUL * (2 * tarfile.BLOCKSIZE + (-size) % tarfile.RECORDSIZE)

    def open(self) -> IO[bytes]:
        return io.BufferedReader(_Pieces(self._pieces()), CHUNK)

    def read_bytes(self) -> bytes:
        return self.open().read()

    def close(self) -> None:
        pass

    def _pieces(self) -> Iterator[bytes]:
        for header, path, size in self._members:
            yield header
            left = size
            try:
                with path.open("rb") as handle:
                    while left and (block := handle.read(min(CHUNK, left))):
                        left -= len(block)
                        yield block
            except OSError:
                pass  # the rest as zeros: the agent's digest check refuses the file
            while left:
                block = tarfile.NUL * min(CHUNK, left)
                left -= len(block)
                yield block
            yield tarfile.NUL * (_padded(size) - size)
        yield self._end()


def _padded(size: int) -> int:
    return size + (-size) % tarfile.BLOCKSIZE


class _Pieces(io.RawIOBase):
    """A raw stream over an iterator of byte strings."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        super().__init__()
        self._pieces = pieces
        self._current = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._current:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._current = memoryview(piece)
        view = memoryview(buffer).cast("B")
        count = min(len(view), len(self._current))
        view[:count] = self._current[:count]
        self._current = self._current[count:]
        return count


Tar = TarUpload | PlainTar


class RequestAndTar(io.RawIOBase):
    """An agent call's stdin: the request line, then the tar, read in chunks (`read(n)`) or whole (`read()`).
    Each `RequestAndTar` reads from the start: a call that must run again (the agent was uploaded first) makes
    a new one (`again()`)."""

    def __init__(self, head: bytes, tar: Tar) -> None:
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
        return self._body.readinto(view)  # type: ignore[attr-defined]  # a BufferedRandom or BufferedReader
