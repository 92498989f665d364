"""`fetch-manifest` and `read-file`: what `dflashops fetch` copies out of a run directory, and its bytes."""

from __future__ import annotations

import json
import os
import sys

from .answers import FetchFile, FetchManifestAnswer
from .common import AgentFailure, file_sha256, read_json, run_dir, write_atomic
from .protocol import FetchManifestRequest, ReadFileRequest

FETCH_CACHE = ".fetch-sha256.json"  # in the run dir: (size, mtime_ns, inode) -> sha256, so a resumed fetch does
# not hash a 12 GB checkpoint again (~30 s); an entry whose file changed in any of the three is recomputed.


def run_file(directory: str, rel: object) -> str:
    """The absolute path of `rel` inside the run directory; refuses anything that leaves it (`..`, absolute
    paths, symlinks pointing out)."""
    text = str(rel or "")
    if not text or text.startswith("/") or ".." in text.split("/"):
        raise AgentFailure(f"invalid path {text!r} in the run directory", "bad_request")
    path = os.path.join(directory, text)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if real != root and not real.startswith(root + os.sep):
        raise AgentFailure(f"path {text!r} leaves the run directory", "bad_request")
    return path


def verb_fetch_manifest(req: FetchManifestRequest) -> FetchManifestAnswer:
    """Size and sha256 of every regular file under the run-relative `paths` (files or folders); `missing`
    names the paths that do not exist. Hashes are computed here, on the target, next to the data. With
    `"hash": false` only cached hashes are given (`sha256` null for the rest): the controller starts the
    transfer at once and asks for the missing hashes on a second channel meanwhile."""
    directory = run_dir(req.workspace, req.name)
    if not os.path.isdir(directory):
        raise AgentFailure(f"run {req.name!r} does not exist on this target", "not_found")
    cache_path = os.path.join(directory, FETCH_CACHE)
    cache = read_json(cache_path) or {}
    files: list[FetchFile] = []
    missing: list[str] = []
    changed = False
    for rel in req.paths:
        top = run_file(directory, rel)
        if not os.path.exists(top):
            missing.append(rel)
            continue
        walk = [(os.path.dirname(top), [], [os.path.basename(top)])] if os.path.isfile(top) else os.walk(top)
        for folder, dirs, names in walk:
            dirs.sort()
            for entry in sorted(names):
                path = os.path.join(folder, entry)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                stat = os.stat(path)
                key = os.path.relpath(path, directory)
                stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
                known = cache.get(key)
                if not (isinstance(known, list) and known[:3] == stamp):
                    if not req.hash:
                        files.append(FetchFile(path=key, size=stat.st_size, sha256=None))
                        continue
                    known, changed = [*stamp, file_sha256(path)], True
                    cache[key] = known
                files.append(FetchFile(path=key, size=stat.st_size, sha256=known[3]))
    if changed and req.cache:  # a dry run's manifest writes nothing
        try:
            write_atomic(cache_path, json.dumps(cache))
        except OSError:
            pass  # a full disk: the cache is only a shortcut
    return FetchManifestAnswer(files=files, missing=missing, run_dir=directory)


def verb_read_file(req: ReadFileRequest) -> None:
    """RAW verb (the one exception to the one-JSON-line rule): writes bytes [offset, offset+length) of one run
    file to stdout, nothing else. The controller knows the length and the sha256 from `fetch-manifest` and
    checks both; a refusal before the first byte is a JSON line on stderr and exit status 3."""
    directory = run_dir(req.workspace, req.name)
    path = run_file(directory, req.path)
    offset, length = int(req.offset), int(req.length)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        end = size if length < 0 else min(size, offset + length)
        out = sys.stdout.buffer
        out.flush()
        position = offset
        try:
            while position < end:  # sendfile: no copy through Python, ~2x less CPU than read/write here
                sent = os.sendfile(out.fileno(), handle.fileno(), position, min(end - position, 1 << 24))
                if sent == 0:
                    break
                position += sent
        except OSError:
            handle.seek(position)
            while position < end:
                block = handle.read(min(end - position, 1 << 20))
                if not block:
                    break
                out.write(block)
                position += len(block)
            out.flush()
