"""`gc` and `clear-cache`: run directories, compile caches and releases removed, what was collected recorded."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

from .answers import ClearCacheAnswer, GcAnswer, RemovedEntry
from .common import COLLECTED, HASH_RE, AgentFailure, missing_run, remove_quietly, run_dir, workspace_of
from .protocol import ClearCacheRequest, GcRequest
from .releases import prunable_releases
from .standby import retire_standbys, standbys
from .status import run_status

COMPILE_CACHE_KEY_RE = re.compile(r"^py\d+\.\d+-torch[A-Za-z0-9._-]+$")  # trainer/core/compile_cache.py cache_key


def verb_clear_cache(req: ClearCacheRequest) -> ClearCacheAnswer:
    """`--clear-cache`: remove the compile caches and nothing else: in the compile cache root (`compile_cache`,
    default <workspace>/cache/compile) only the folders named like a cache key and their artifacts (the
    `<key>.artifacts.d/` folder, or an older trainer's `<key>.artifacts` file), and the per-code-hash folders of
    the old layout (<workspace>/cache/inductor/<hash>). How much went."""
    return clear_cache(workspace_of(req.workspace), req.compile_cache)


def clear_cache(workspace: str, compile_cache: str | None) -> ClearCacheAnswer:
    """verb_clear_cache's work, for a launch or restart that asks `clear_cache` too (same answer, their
    `cleared`)."""
    root = str(compile_cache or os.path.join(workspace, "cache", "compile"))
    if not os.path.isabs(root):
        raise AgentFailure("compile_cache must be an absolute path", "bad_request")
    doomed = []
    for folder, pattern in ((root, COMPILE_CACHE_KEY_RE), (os.path.join(workspace, "cache", "inductor"), HASH_RE)):
        for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if pattern.match(entry.removesuffix(".d").removesuffix(".artifacts")):
                doomed.append(os.path.join(folder, entry))
    freed = files = 0
    for path in doomed:
        size, count = tree_size(path)
        freed, files = freed + size, files + count
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            remove_quietly(path)
    return ClearCacheAnswer(removed=doomed, bytes=freed, files=files)


def tree_size(path: str) -> tuple[int, int]:
    """(bytes, files) of a file or of every file under a folder; what vanishes meanwhile counts nothing."""
    paths = [os.path.join(b, n) for b, _, names in os.walk(path) for n in names] if os.path.isdir(path) else [path]
    size = count = 0
    for each in paths:
        try:
            size += os.lstat(each).st_size
            count += 1
        except OSError:
            pass
    return size, count


def verb_gc(req: GcRequest) -> GcAnswer:
    """Explicit clean-up: old releases beyond `keep`, the run directories named in `runs` that are not
    running, and with `standby` every waiting standby interpreter (asked to exit: `retired`; one that a launch
    has just claimed runs its run). Nothing else is ever deleted. `removed` lists each deleted folder with its
    path, bytes and files; a deleted run directory is recorded in <workspace>/collected.jsonl (so `logs` and
    `status` of it say it was collected). With `dry_run`, the same answer and nothing deleted or asked."""
    workspace = workspace_of(req.workspace)
    dry_run = bool(req.dry_run)
    final = {}  # each run's last state, for the lineage record that outlives its directory
    for name in req.runs:
        directory = run_dir(workspace, name)
        if not os.path.isdir(directory):
            raise missing_run(workspace, name, "does not exist on this target")
        status = run_status(directory)
        if status.state in ("running", "stopping", "launching"):
            raise AgentFailure(f"run {name!r} is still running; stop it first", "conflict")
        final[name] = {"state": status.state, "exit_code": status.exit_code, "step": status.step}
    removed: list[RemovedEntry] = []
    for name in req.runs:
        directory = run_dir(workspace, name)
        size, files = tree_size(directory)
        if not dry_run:
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(os.path.join(workspace, COLLECTED), "a", encoding="utf-8") as handle:  # before: no silent loss
                handle.write(json.dumps({"name": name, "at": at, "by": "gc", "bytes": size}) + "\n")
            shutil.rmtree(directory)
        removed.append(RemovedEntry(kind="run", name=name, path=directory, bytes=size, files=files, final=final[name]))
    releases = os.path.join(workspace, "releases")
    for entry in prunable_releases(workspace, int(req.keep)) if os.path.isdir(releases) else []:
        path = os.path.join(releases, entry)
        size, files = tree_size(path)
        if not dry_run:
            shutil.rmtree(path)
        removed.append(RemovedEntry(kind="release", name=entry, path=path, bytes=size, files=files))
    retired = []
    if req.standby:
        retired = [os.path.basename(folder) for folder, _ in standbys(workspace)]
        if not dry_run:
            retire_standbys(workspace, keep=None)
    return GcAnswer(
        removed_releases=[r.name for r in removed if r.kind == "release"],
        removed_runs=[r.name for r in removed if r.kind == "run"],
        retired_standbys=retired,
        removed=removed,
        dry_run=dry_run,
    )
