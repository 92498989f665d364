"""fetch: bring a run's checkpoint (or its export) and logs back to this machine, resumably and verified.

1. `fetch-manifest` on the target: size of every file to bring, and the sha256 sums it has cached; the
   missing sums are computed there (next to the data, cached in the run directory so a resumed fetch does
   not hash 12 GB again) by a second call on its own channel WHILE the bytes flow: hashing 1 GB first
   would hold the transfer ~1 s per GB (bench/results/control-plane.md 2026-12-01 "Fetch").
2. Per file: bytes go to `.<name>.partial` beside the final name, never under it; a partial left by a cut
   (this call's or an earlier one's, same sha256 recorded beside it) is continued from its size, never
   restarted. Each piece is one `read-file` stream (raw bytes from an offset, `sendfile` on the target).
3. A cut connection: the next stream reconnects (the ssh transport does) and continues from the bytes
   already written, with backoff, up to RESUME_ATTEMPTS times within this call.
4. The sha256 of the whole local file must equal the manifest's; then fsync and rename(2) to the final name.
A file already present with the manifest's size and hash is left alone (`unchanged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashops.agent.answers import FetchManifestAnswer
from dflashops.agent.protocol import FetchManifestRequest
from dflashops.core.errors import NotFound, UsageError
from dflashops.core.inventory import Target
from dflashops.core.shell import validate_name
from dflashops.ops.fetch.fetch_file import (
    RESUME_ATTEMPTS,
    FileOutcome,
    Progress,
    TargetHashes,
    fetch_file,
    resume_point,
)
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import run_status

METADATA = ("run.json", "status.json", "metrics.jsonl", "exit_code")
LOGS = ("train.log", "train.log.1")
EXPORT_FORMATS = ("zlab", "speculators")  # trainer/export/export.py FORMATS (dflashops does not import the trainer)


@dataclass
class FetchRequest:
    run: str
    target: str | None = None
    checkpoint: str | None = None  # "latest", a step number, or None (latest unless only --logs/--export)
    export: bool = False
    export_format: str = "zlab"  # `trainer export --format`: zlab (the public DFlash format) or speculators
    target_model: str | None = None  # speculators: `trainer export --target-model` (a directory on the target)
    verifier: str | None = None  # speculators: `trainer export --verifier` (the name loaders look the target up by)
    logs: bool = False
    to: Path | None = None
    retries: int = RESUME_ATTEMPTS  # continues after a cut, per file, within this call


@dataclass
class FetchOutcome:
    run: str
    target: str
    to: str
    selected: list[str]
    files: list[FileOutcome] = field(default_factory=list)
    exported: str | None = None
    seconds: float = 0.0  # the whole call, an export on the target included
    transfer_seconds: float = 0.0  # the files' transfer alone: what the rate is of

    def to_dict(self) -> dict[str, Any]:
        sent = sum(f.sent for f in self.files)
        return {
            **asdict(self),
            "bytes_sent": sent,
            "bytes_total": sum(f.size for f in self.files),
            "rate_mib_s": round(sent / 2**20 / self.transfer_seconds, 3) if self.transfer_seconds > 0 else None,
        }


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
        raise NotFound(
            f"run {name!r} has no checkpoint at step {int(wanted)}",
            hint=f"its checkpoints: {', '.join(c.removeprefix('step_').lstrip('0') or '0' for c in checkpoints)}",
        )
    return step


def export_dir(step: str, export_format: str) -> str:
    """The run-relative folder of a checkpoint's export: `export/<step>` (zlab), `export/<step>-speculators`."""
    return f"export/{step}" if export_format == "zlab" else f"export/{step}-{export_format}"


def export_on_target(
    invocation: Invocation,
    target: Target,
    entry: dict[str, Any],
    step: str,
    note: Callable[[str], None],
    export_format: str = "zlab",
    target_model: str | None = None,
    verifier: str | None = None,
) -> str:
    """`python -m trainer export [--format F]` of checkpoint `step` into `export_dir(step, F)` on the target (with
    the run's release on PYTHONPATH), unless that export exists already; returns its run-relative path. The
    speculators form takes the target's embedding, LM head and final norm from `target_model` (a directory on the
    target), else from the run's recorded target model (the trainer records it in every checkpoint; a tiny-preset
    run's target is rebuilt from its recorded config); `verifier` names the target in the export's config."""
    from dflashops.core.errors import CommandFailed

    if export_format not in EXPORT_FORMATS:
        raise UsageError(f"--format takes {' or '.join(EXPORT_FORMATS)}, not {export_format!r}", hint="--format zlab")
    run_dir = entry["run_dir"]
    rel = export_dir(step, export_format)
    listed = invocation.agent(target).ask(
        "fetch-manifest",
        FetchManifestRequest(workspace=target.workspace, name=entry["name"], paths=[rel], cache=not invocation.dry_run),
        FetchManifestAnswer,
    )
    if export_format != "speculators" and (target_model or verifier):
        raise UsageError(
            "--target-model and --verifier apply to the speculators export only",
            hint="add --format speculators, or drop them",
        )
    if listed is not None and listed.files:
        unused = " (--target-model/--verifier unused: it was exported before)" if target_model or verifier else ""
        note(f"export {rel} exists on {target.name}; fetching it{unused}")
        return rel
    release = (entry.get("run_json") or {}).get("release") or f"{target.workspace}/releases/current"
    argv = [target.python, "-m", "trainer", "export", f"{run_dir}/checkpoints/{step}", "--output", f"{run_dir}/{rel}"]
    if export_format != "zlab":  # the default needs no flag, so releases older than --format still export it
        argv += ["--format", export_format]
    argv += [
        *(["--target-model", target_model] if target_model else []),
        *(["--verifier", verifier] if verifier else []),
    ]
    env = {**target.env, "PYTHONPATH": release}
    agent = invocation.agent(target)
    if invocation.dry_run:
        agent.record(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        return rel
    note(f"exporting {step} ({export_format} format) on {target.name} (python -m trainer export)")
    result = agent.transport.run(argv, env=env, check=False, timeout=3600)
    if result.exit_code != 0:
        raise CommandFailed(result, hint="the trainer's own error is above; `dflashops exec` runs it by hand")
    return rel


def select(
    invocation: Invocation, target: Target, entry: dict[str, Any], request: FetchRequest, note: Callable[[str], None]
) -> tuple[list[str], str | None]:
    """(run-relative paths to bring, the export's path when one was made)."""
    paths = list(METADATA)
    exported = None
    wants_checkpoint = request.checkpoint is not None or not (request.logs or request.export)
    if request.export:
        step = pick_checkpoint(entry, request.checkpoint or "latest")
        exported = export_on_target(
            invocation, target, entry, step, note, request.export_format, request.target_model, request.verifier
        )
        paths.append(exported)
    elif wants_checkpoint:
        paths.append(f"checkpoints/{pick_checkpoint(entry, request.checkpoint or 'latest')}")
    if request.logs:
        paths += LOGS
    return paths, exported


def fetch(invocation: Invocation, request: FetchRequest, progress: Progress | None = None) -> FetchOutcome:
    """Bring the selected files of `request.run` into `request.to` (default ./fetched/RUN)."""
    progress = progress or Progress()
    validate_name(request.run, what="run name")
    started = time.monotonic()
    entry = run_status(invocation, request.run, target=request.target)[0]
    target = invocation.inventory.target(entry["target"])
    root = (request.to or Path.cwd() / "fetched" / request.run).resolve()
    paths, exported = select(invocation, target, entry, request, progress.note)
    agent = invocation.agent(target)
    outcome = FetchOutcome(run=request.run, target=target.name, to=str(root), selected=paths, exported=exported)
    transfer_started = time.monotonic()  # after the export: a rate over its minutes said `0 MiB/s` for 1 MB
    listed = agent.ask(
        "fetch-manifest",
        FetchManifestRequest(
            workspace=target.workspace, name=request.run, paths=paths, cache=not invocation.dry_run, hash=False
        ),
        FetchManifestAnswer,
    )
    assert listed is not None  # read-only, and the run's status before it put the agent there: never only planned
    files = listed.files
    optional = {*METADATA, *LOGS[1:], *([exported] if invocation.dry_run else [])}  # a dry run made no export
    required = [p for p in listed.missing if p not in optional]
    if required:
        raise NotFound(
            f"{target.name}: run {request.run!r} has no {required[0]}",
            hint=f"`dflashops status {request.run}` lists its checkpoints",
        )
    if invocation.dry_run:
        outcome.files = [FileOutcome(f.path, f.size, f.sha256 or "(at fetch)", "planned", 0) for f in files]
        return outcome
    hashes = TargetHashes(agent, request.run, [f.path for f in files if not f.sha256])
    starts = [resume_point(item, root, hashes) for item in files]
    progress.begin(
        sum(f.size for f in files),
        sum(f.size if start is None else start for f, start in zip(files, starts)),
    )
    for item, start in zip(files, starts):
        outcome.files.append(fetch_file(agent, request.run, item, root, start, progress, hashes, request.retries))
    outcome.seconds = round(time.monotonic() - started, 3)
    outcome.transfer_seconds = round(time.monotonic() - transfer_started, 3)
    return outcome
