"""One file of a fetch: resumable and verified (ops/fetch/fetch.py's steps 2-4), and the target's hashes that
arrive while the bytes flow.

`resume_point` decides where a file starts (an earlier partial for the same content is continued);
`fetch_file` streams `read-file` from that byte into `.NAME.partial`, continues after a cut with backoff,
checks the sha256 of the whole file and renames it into place. A local disk that fills up ends the fetch
with LocalDiskFull, the partial and its record kept, so the next fetch continues from them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops.agent.answers import FetchFile, FetchManifestAnswer
from dflashops.agent.protocol import FetchManifestRequest, ReadFileRequest, wire
from dflashops.core.errors import DflashopsError, LocalDiskFull, NotFound, TransportError
from dflashops.ops.agent_client import Agent

RESUME_ATTEMPTS = 8
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
PIECE_BYTES = 1 << 62  # one stream per file: the cut-and-continue loop, not pieces, bounds a lost transfer


@dataclass
class FileOutcome:
    path: str
    size: int
    sha256: str
    how: str  # fetched | resumed | unchanged
    sent: int  # bytes that crossed the link for this file in this call
    resumes: int = 0


@dataclass
class Progress:
    """What fetch tells its caller while it works (the CLI draws a bar); every callback is optional."""

    begin: Callable[[int, int], None] = lambda total, done: None  # bytes in all, bytes already here
    advance: Callable[[int], None] = lambda n: None
    note: Callable[[str], None] = lambda text: None


def sha256_of(path: Path, upto: int | None = None) -> hashlib._Hash:
    digest = hashlib.sha256()
    left = path.stat().st_size if upto is None else upto
    with path.open("rb") as handle:
        while left > 0 and (block := handle.read(min(left, 1 << 22))):
            digest.update(block)
            left -= len(block)
    return digest


def partial_paths(final: Path) -> tuple[Path, Path]:
    return final.with_name(f".{final.name}.partial"), final.with_name(f".{final.name}.partial.json")


class TargetHashes:
    """The target's sha256 of the files `fetch-manifest` had no cached sum for, computed by one agent call
    in a thread (its own channel on the same connection) while the transfer runs; `get` waits for it."""

    def __init__(self, agent: Agent, run: str, paths: list[str]) -> None:
        self._sums: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._ask, args=(agent, run, paths), daemon=True)
        if paths:
            self._thread.start()

    def _ask(self, agent: Agent, run: str, paths: list[str]) -> None:
        from dflashops.ops.runs.control import ask_resuming  # read-only: retried across a cut, with backoff

        try:
            request = FetchManifestRequest(workspace=agent.target.workspace, name=run, paths=paths)
            listed = ask_resuming(agent, "fetch-manifest", request, FetchManifestAnswer)
            files = listed.files if listed is not None else []  # None: only planned (fetch plans no transfer)
            self._sums = {f.path: f.sha256 for f in files if f.sha256 is not None}
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by get()
            self._error = exc

    def peek(self, item: FetchFile) -> str | None:
        """The sum if it is known already (never waits)."""
        return item.sha256 or (None if self._thread.is_alive() else self._sums.get(item.path))

    def get(self, item: FetchFile) -> str:
        if item.sha256:
            return item.sha256
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if item.path not in self._sums:
            raise NotFound(f"{item.path} vanished from the target during the fetch")
        return self._sums[item.path]


def write_record(meta: Path, record: dict[str, Any], width: int, fresh: bool = False) -> None:
    """The partial's record, padded with spaces to `width` (JSON allows them) and written over the file's
    own bytes, never truncating it: `fresh` (at the start) sets aside its blocks while there is room, and
    the later write with the sum needs no new block, so it still lands once the disk has filled up."""
    fd = os.open(meta, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o644)
    try:
        os.write(fd, json.dumps(record).ljust(width).encode())
    finally:
        os.close(fd)


def disk_full(rel: str, root: Path, partial: Path, written: int, size: int) -> LocalDiskFull:
    """The error of a full local disk; with nothing of the file written, its partial and record go (they
    would only hold space), else they stay for the next fetch to continue."""
    if not written:
        for path in partial_paths(root / rel):
            path.unlink(missing_ok=True)
        return LocalDiskFull(
            f"{rel}: the local disk is full at {root}: none of its {size:,} bytes fetched",
            hint="free space on that disk and run the same fetch again (files already fetched are kept), "
            "or choose --to on another disk",
        )
    return LocalDiskFull(
        f"{rel}: the local disk is full at {root}: {written:,} of {size:,} bytes of it fetched, kept in {partial.name}",
        hint=f"free space on that disk and run the same fetch again: it continues from byte {written:,} "
        "(or choose --to on another disk; that fetch starts this file over)",
    )


def resume_point(item: FetchFile, root: Path, hashes: TargetHashes) -> int | None:
    """None when the final file is already there with the manifest's size and sha256; else the byte to
    start at: the size of a partial left for this same content (its .partial.json names the sha256), or 0.
    Waits for the target's hash only when a local file or partial has to be compared with it."""
    final = root / item.path
    size = item.size
    partial, meta = partial_paths(final)
    if not final.is_file() and not partial.is_file():
        return 0
    want = hashes.get(item)
    if final.is_file() and final.stat().st_size == size and sha256_of(final).hexdigest() == want:
        return None
    try:
        recorded = json.loads(meta.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return partial.stat().st_size if partial.is_file() and recorded == want and partial.stat().st_size <= size else 0


@dataclass
class Landed:
    """What the partial file holds, kept exact while bytes arrive (so a full disk can say it, and keep it)."""

    written: int
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)  # of the partial's `written` bytes
    resumes: int = 0


def stream_into(
    agent: Agent,
    run: str,
    item: FetchFile,
    partial: Path,
    landed: Landed,
    progress: Progress,
    record: Callable[[], None],
    retries: int,
) -> None:
    """Append the file's bytes from `landed.written` to `partial` with `read-file` streams, continuing after
    a cut with backoff. An OSError of the local disk (full) propagates with `landed` true to the byte."""
    rel, size = item.path, item.size
    landed.digest = sha256_of(partial, landed.written) if landed.written else hashlib.sha256()
    last_error = ""
    with partial.open("ab", buffering=0) as out:  # unbuffered: what write() returns is on the disk
        out.truncate(landed.written)
        while landed.written < size:
            args = wire(
                ReadFileRequest(
                    workspace=agent.target.workspace,
                    name=run,
                    path=rel,
                    offset=landed.written,
                    length=min(size - landed.written, PIECE_BYTES),
                )
            )
            try:
                for chunk in agent.transport.stream(agent.argv("read-file", args)):
                    view = memoryview(chunk)
                    while view:  # a write may land part of a chunk (the last bytes that fit a disk)
                        count = out.write(view)
                        landed.digest.update(view[:count])
                        landed.written += count
                        progress.advance(count)
                        view = view[count:]
                    if landed.written % (64 << 20) < len(chunk):
                        record()  # once the sum is known (a no-op after)
            except TransportError as exc:
                last_error = exc.message.splitlines()[0]
            record()
            if landed.written >= size:
                break
            landed.resumes += 1
            if landed.resumes > retries:
                raise TransportError(
                    f"{rel}: transfer stopped at byte {landed.written} of {size} {landed.resumes - 1} times "
                    f"({last_error or 'the stream ended early'})",
                    hint=f"run the same fetch again: it continues from byte {landed.written}",
                )
            progress.note(
                f"{rel}: link lost at byte {landed.written:,} of {size:,}; continuing from there "
                f"(attempt {landed.resumes} of {retries})"
            )
            time.sleep(min(0.25 * 2 ** (landed.resumes - 1), 5.0))
        os.fsync(out.fileno())


def fetch_file(
    agent: Agent,
    run: str,
    item: FetchFile,
    root: Path,
    start: int | None,
    progress: Progress,
    hashes: TargetHashes,
    retries: int = RESUME_ATTEMPTS,
) -> FileOutcome:
    """One file from byte `start` (resume_point), resumable and verified (module docstring, steps 2-4)."""
    rel, size = item.path, item.size
    if start is None:
        return FileOutcome(rel, size, hashes.get(item), "unchanged", 0)
    final = root / rel
    partial, meta = partial_paths(final)
    shape = {"size": size, "run": run, "path": rel}
    width = len(json.dumps({"sha256": "0" * 64, **shape}))  # the record with any sum fits its first blocks
    recorded = False

    def record() -> None:
        """Name the content beside the partial as soon as its sum is known, so a later fetch (after a kill,
        a sleep, a cut, a full disk) continues it; a partial without this record is started again."""
        nonlocal recorded
        if not recorded and (known := hashes.peek(item)):
            write_record(meta, {"sha256": known, **shape}, width)
            recorded = True

    landed = Landed(start)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if not start:
            partial.unlink(missing_ok=True)
        write_record(meta, {"sha256": None, **shape}, width, fresh=True)
        record()
        stream_into(agent, run, item, partial, landed, progress, record, retries)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        try:
            hashes.get(item)  # the sum, even if it is still being computed on the target: the record needs it
            record()
        except (DflashopsError, OSError):
            pass  # no record: the next fetch starts this file over, as it did before
        raise disk_full(rel, root, partial, landed.written, size) from None
    written, digest, resumes = landed.written, landed.digest, landed.resumes
    want = hashes.get(item)
    if written != size or digest.hexdigest() != want:
        partial.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        raise DflashopsError(
            f"{rel}: sha256 of the fetched bytes does not match the target's (got {written} of "
            f"{size} bytes); the partial file was removed",
            hint="the file changed on the target while it was fetched? run fetch again",
        )
    os.replace(partial, final)  # atomic: the final name only ever holds a verified file
    meta.unlink(missing_ok=True)
    return FileOutcome(rel, size, want, "resumed" if start or resumes else "fetched", size - start, resumes)
