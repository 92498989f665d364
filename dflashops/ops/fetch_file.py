"""One file of a fetch: resumable and verified (ops/fetch.py's steps 2-4), and the target's hashes that
arrive while the bytes flow.

`resume_point` decides where a file starts (an earlier partial for the same content is continued);
`fetch_file` streams `read-file` from that byte into `.NAME.partial`, continues after a cut with backoff,
checks the sha256 of the whole file and renames it into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashops.errors import DflashopsError, NotFound, TransportError
from dflashops.ops.agent_client import Agent

RESUME_ATTEMPTS = 8
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
        from dflashops.ops.control import call_resuming  # read-only: retried across a cut, with backoff

        try:
            answer = call_resuming(
                agent, "fetch-manifest", {"workspace": agent.target.workspace, "name": run, "paths": paths}
            )
            self._sums = {f["path"]: f["sha256"] for f in answer["files"]}
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by get()
            self._error = exc

    def peek(self, item: dict[str, Any]) -> str | None:
        """The sum if it is known already (never waits)."""
        return item.get("sha256") or (None if self._thread.is_alive() else self._sums.get(item["path"]))

    def get(self, item: dict[str, Any]) -> str:
        if item.get("sha256"):
            return str(item["sha256"])
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if item["path"] not in self._sums:
            raise NotFound(f"{item['path']} vanished from the target during the fetch")
        return self._sums[item["path"]]


def resume_point(item: dict[str, Any], root: Path, hashes: TargetHashes) -> int | None:
    """None when the final file is already there with the manifest's size and sha256; else the byte to
    start at: the size of a partial left for this same content (its .partial.json names the sha256), or 0.
    Waits for the target's hash only when a local file or partial has to be compared with it."""
    final = root / str(item["path"])
    size = int(item["size"])
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


def fetch_file(
    agent: Agent,
    run: str,
    item: dict[str, Any],
    root: Path,
    start: int | None,
    progress: Progress,
    hashes: TargetHashes,
    retries: int = RESUME_ATTEMPTS,
) -> FileOutcome:
    """One file from byte `start` (resume_point), resumable and verified (module docstring, steps 2-4)."""
    rel, size = str(item["path"]), int(item["size"])
    if start is None:
        return FileOutcome(rel, size, hashes.get(item), "unchanged", 0)
    final = root / rel
    partial, meta = partial_paths(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if not start:
        partial.unlink(missing_ok=True)
    recorded = False

    def record() -> None:
        """Name the content beside the partial as soon as its sum is known, so a later fetch (after a kill,
        a sleep, a cut) continues it; a partial without this record is started again."""
        nonlocal recorded
        if not recorded and (known := hashes.peek(item)):
            meta.write_text(json.dumps({"sha256": known, "size": size, "run": run, "path": rel}))
            recorded = True

    meta.unlink(missing_ok=True)
    record()
    digest = sha256_of(partial, start) if start else hashlib.sha256()
    written, resumes, last_error = start, 0, ""
    with partial.open("ab") as out:
        out.truncate(start)
        while written < size:
            args = {
                "workspace": agent.target.workspace,
                "name": run,
                "path": rel,
                "offset": written,
                "length": min(size - written, PIECE_BYTES),
            }
            try:
                for chunk in agent.transport.stream(agent.argv("read-file", args)):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    progress.advance(len(chunk))
                    if not recorded and written % (64 << 20) < len(chunk):
                        record()
            except TransportError as exc:
                last_error = exc.message.splitlines()[0]
            out.flush()
            record()
            if written >= size:
                break
            resumes += 1
            if resumes > retries:
                raise TransportError(
                    f"{rel}: transfer stopped at byte {written} of {size} {resumes - 1} times "
                    f"({last_error or 'the stream ended early'})",
                    hint=f"run the same fetch again: it continues from byte {written}",
                )
            progress.note(
                f"{rel}: link lost at byte {written:,} of {size:,}; continuing from there "
                f"(attempt {resumes} of {retries})"
            )
            time.sleep(min(0.25 * 2 ** (resumes - 1), 5.0))
        os.fsync(out.fileno())
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
