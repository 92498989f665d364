"""fetch: bring a run's checkpoint (or its export) and logs back to this machine, resumably and verified.

1. `fetch-manifest` on the target: size of every file to bring, and the sha256 sums it has cached; the
   missing sums are computed there (next to the data, cached in the run directory so a resumed fetch does
   not hash 12 GB again) by a second call on its own channel WHILE the bytes flow: hashing 1 GB first
   would hold the transfer ~1 s per GB (bench/RESULTS.md).
2. Per file: bytes go to `.<name>.partial` beside the final name, never under it; a partial left by a cut
   (this call's or an earlier one's, same sha256 recorded beside it) is continued from its size, never
   restarted. Each piece is one `read-file` stream (raw bytes from an offset, `sendfile` on the target).
3. A cut connection: the next stream reconnects (the ssh transport does) and continues from the bytes
   already written, with backoff, up to RESUME_ATTEMPTS times within this call.
4. The sha256 of the whole local file must equal the manifest's; then fsync and rename(2) to the final name.
A file already present with the manifest's size and hash is left alone (`unchanged`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashops.errors import DflashopsError, NotFound, TransportError, UsageError
from dflashops.inventory import Target
from dflashops.ops.agent_client import Agent
from dflashops.ops.control import run_status
from dflashops.ops.session import Session
from dflashops.shell import validate_name

METADATA = ("run.json", "status.json", "metrics.jsonl", "exit_code")
LOGS = ("train.log", "train.log.1")
RESUME_ATTEMPTS = 8
PIECE_BYTES = 1 << 62  # one stream per file: the cut-and-continue loop, not pieces, bounds a lost transfer


@dataclass
class FetchRequest:
    run: str
    target: str | None = None
    checkpoint: str | None = None  # "latest", a step number, or None (latest unless only --logs/--export)
    export: bool = False
    logs: bool = False
    to: Path | None = None
    retries: int = RESUME_ATTEMPTS  # continues after a cut, per file, within this call


@dataclass
class FileOutcome:
    path: str
    size: int
    sha256: str
    how: str  # fetched | resumed | unchanged
    sent: int  # bytes that crossed the link for this file in this call
    resumes: int = 0


@dataclass
class FetchOutcome:
    run: str
    target: str
    to: str
    selected: list[str]
    files: list[FileOutcome] = field(default_factory=list)
    exported: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        sent = sum(f.sent for f in self.files)
        return {**asdict(self), "bytes_sent": sent, "bytes_total": sum(f.size for f in self.files),
                "rate_mib_s": round(sent / 2 ** 20 / self.seconds, 1) if self.seconds > 0 else None}


@dataclass
class Progress:
    """What fetch tells its caller while it works (the CLI draws a bar); every callback is optional."""

    begin: Callable[[int, int], None] = lambda total, done: None  # bytes in all, bytes already here
    advance: Callable[[int], None] = lambda n: None
    note: Callable[[str], None] = lambda text: None


def pick_checkpoint(entry: dict[str, Any], wanted: str) -> str:
    checkpoints = list(entry.get("checkpoints") or [])
    name = entry["name"]
    if not checkpoints:
        raise NotFound(f"run {name!r} has no checkpoint yet", hint=f"`dflashops fetch {name} --logs` brings its logs")
    if wanted == "latest":
        return checkpoints[-1]
    if not wanted.isdigit():
        raise UsageError(f"--checkpoint takes `latest` or a step number, not {wanted!r}", hint="--checkpoint 1000")
    step = f"step_{int(wanted):06d}"
    if step not in checkpoints:
        raise NotFound(f"run {name!r} has no checkpoint at step {int(wanted)}",
                       hint=f"its checkpoints: {', '.join(c.removeprefix('step_').lstrip('0') or '0' for c in checkpoints)}")
    return step


def export_on_target(session: Session, target: Target, entry: dict[str, Any], step: str,
                     note: Callable[[str], None]) -> str:
    """`python -m trainer export` of checkpoint `step` into `export/<step>/` on the target (with the run's
    release on PYTHONPATH), unless that export exists already; returns its run-relative path."""
    from dflashops.errors import CommandFailed

    run_dir = entry["run_dir"]
    rel = f"export/{step}"
    listed = session.agent(target).call("fetch-manifest", {"workspace": target.workspace, "name": entry["name"],
                                                           "paths": [rel], "cache": not session.dry_run})
    if listed["files"]:
        note(f"export {rel} exists on {target.name}; fetching it")
        return rel
    release = (entry.get("run_json") or {}).get("release") or f"{target.workspace}/releases/current"
    argv = [target.python, "-m", "trainer", "export", f"{run_dir}/checkpoints/{step}", "--output", f"{run_dir}/{rel}"]
    env = {**target.env, "PYTHONPATH": release}
    agent = session.agent(target)
    if session.dry_run:
        agent.record(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        return rel
    note(f"exporting {step} on {target.name} (python -m trainer export)")
    result = agent.transport.run(argv, env=env, check=False, timeout=3600)
    if result.exit_code != 0:
        raise CommandFailed(result, hint="the trainer's own error is above; `dflashops exec` runs it by hand")
    return rel


def select(session: Session, target: Target, entry: dict[str, Any], request: FetchRequest,
           note: Callable[[str], None]) -> tuple[list[str], str | None]:
    """(run-relative paths to bring, the export's path when one was made)."""
    paths = list(METADATA)
    exported = None
    wants_checkpoint = request.checkpoint is not None or not (request.logs or request.export)
    if request.export:
        step = pick_checkpoint(entry, request.checkpoint or "latest")
        exported = export_on_target(session, target, entry, step, note)
        paths.append(exported)
    elif wants_checkpoint:
        paths.append(f"checkpoints/{pick_checkpoint(entry, request.checkpoint or 'latest')}")
    if request.logs:
        paths += LOGS
    return paths, exported


def sha256_of(path: Path, upto: int | None = None) -> "hashlib._Hash":
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
            answer = call_resuming(agent, "fetch-manifest", {"workspace": agent.target.workspace, "name": run,
                                                             "paths": paths})
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


def fetch_file(agent: Agent, run: str, item: dict[str, Any], root: Path, start: int | None,
               progress: Progress, hashes: TargetHashes, retries: int = RESUME_ATTEMPTS) -> FileOutcome:
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
            args = {"workspace": agent.target.workspace, "name": run, "path": rel, "offset": written,
                    "length": min(size - written, PIECE_BYTES)}
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
                raise TransportError(f"{rel}: transfer stopped at byte {written} of {size} {resumes - 1} times "
                                     f"({last_error or 'the stream ended early'})",
                                     hint=f"run the same fetch again: it continues from byte {written}")
            progress.note(f"{rel}: link lost at byte {written:,} of {size:,}; continuing from there "
                          f"(attempt {resumes} of {retries})")
            time.sleep(min(0.25 * 2 ** (resumes - 1), 5.0))
        os.fsync(out.fileno())
    want = hashes.get(item)
    if written != size or digest.hexdigest() != want:
        partial.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        raise DflashopsError(f"{rel}: sha256 of the fetched bytes does not match the target's (got {written} of "
                             f"{size} bytes); the partial file was removed",
                             hint="the file changed on the target while it was fetched? run fetch again")
    os.replace(partial, final)  # atomic: the final name only ever holds a verified file
    meta.unlink(missing_ok=True)
    return FileOutcome(rel, size, want, "resumed" if start or resumes else "fetched", size - start, resumes)


def fetch(session: Session, request: FetchRequest, progress: Progress | None = None) -> FetchOutcome:
    """Bring the selected files of `request.run` into `request.to` (default ./fetched/RUN)."""
    progress = progress or Progress()
    validate_name(request.run, what="run name")
    started = time.monotonic()
    entry = run_status(session, request.run, target=request.target)[0]
    target = session.inventory.target(entry["target"])
    root = (request.to or Path.cwd() / "fetched" / request.run).resolve()
    paths, exported = select(session, target, entry, request, progress.note)
    agent = session.agent(target)
    outcome = FetchOutcome(run=request.run, target=target.name, to=str(root), selected=paths, exported=exported)
    listed = agent.call("fetch-manifest", {"workspace": target.workspace, "name": request.run, "paths": paths,
                                           "cache": not session.dry_run, "hash": False})
    files = listed["files"]
    optional = {*METADATA, *LOGS[1:], *([exported] if session.dry_run else [])}  # a dry run made no export
    required = [p for p in listed["missing"] if p not in optional]
    if required:
        raise NotFound(f"{target.name}: run {request.run!r} has no {required[0]}",
                       hint=f"`dflashops status {request.run}` lists its checkpoints")
    if session.dry_run:
        outcome.files = [FileOutcome(f["path"], f["size"], f["sha256"] or "(at fetch)", "planned", 0) for f in files]
        return outcome
    hashes = TargetHashes(agent, request.run, [f["path"] for f in files if not f["sha256"]])
    starts = [resume_point(item, root, hashes) for item in files]
    progress.begin(sum(int(f["size"]) for f in files),
                   sum(int(f["size"]) if start is None else start for f, start in zip(files, starts)))
    for item, start in zip(files, starts):
        outcome.files.append(fetch_file(agent, request.run, item, root, start, progress, hashes, request.retries))
    outcome.seconds = round(time.monotonic() - started, 3)
    return outcome
