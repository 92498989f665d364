"""Content-addressed code sync over any Transport (local now, ssh/pct later with no change here).

What travels: the `trainer` package, the agent, and the files a profile lists. The code hash is the
sha256 of the sorted (path, file sha256) list, so the same tree always gives the same release name.
Only files whose hash differs from the current release's manifest go into the tar stream; the agent
hard-links the unchanged ones from the previous release, verifies every hash, renames the folder into
`releases/<hash>/` and flips `current` atomically. Cost: one `manifest` call + one `install` call
(`restart` folds the install into its one combined call, against a cached base: ops/runs/restart.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflashops.errors import UsageError
from dflashops.ops.agent_build import package_files
from dflashops.ops.agent_client import AGENT_SOURCE, Agent
from dflashops.ops.releases import release_cache

REPO_ROOT = AGENT_SOURCE.parent.parent
SKIP_PARTS = {"__pycache__", ".pytest_cache"}


@dataclass(frozen=True)
class SyncOutcome:
    code_hash: str
    release_path: str
    uploaded: tuple[str, ...]
    linked: tuple[str, ...]
    tar_bytes: int


def release_files(
    extra_files: tuple[str, ...] = (), extra_root: Path | None = None, packages: tuple[str, ...] = ("trainer",)
) -> dict[str, Path]:
    """relative path in the release -> local file: the agent's package (dflashops/agent/*.py), each package's tree, the profile's files.
    Every file must really lie inside the folder it is listed from: a symlink (of the file or of a folder
    on its path) that leads outside is refused, so `files: [rootlink/etc/passwd]` cannot ship /etc/passwd."""
    files: dict[str, Path] = {path.relative_to(REPO_ROOT).as_posix(): path for path in package_files().values()}
    for package in packages:
        root = REPO_ROOT / package
        if not root.is_dir():
            raise UsageError(f"package {package!r} is not in {REPO_ROOT}", hint="check the profile's `packages`")
        for path in sorted(root.rglob("*")):
            if path.is_file() and not SKIP_PARTS & set(path.parts) and path.suffix != ".pyc":
                rel = path.relative_to(REPO_ROOT).as_posix()
                files[rel] = inside(path, REPO_ROOT, f"file {rel!r} of package {package!r}")
    for rel in extra_files:
        path = (extra_root or REPO_ROOT) / rel
        if not path.is_file():
            raise UsageError(
                f"profile file {rel!r} does not exist at {path}",
                hint="profile `files` are paths relative to the inventory's folder",
            )
        files[rel] = inside(path, extra_root or REPO_ROOT, f"profile file {rel!r}")
    return files


def inside(path: Path, root: Path, what: str) -> Path:
    """`path` when its real location (symlinks resolved) is inside `root`'s; UsageError otherwise."""
    real, real_root = path.resolve(), root.resolve()
    if not real.is_relative_to(real_root):
        raise UsageError(
            f"{what} is {real} through a symlink, outside {real_root}",
            hint="copy the file into the folder, or list a path that stays inside it",
        )
    return path


def file_sha256(path: Path) -> str:
    with readable(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def readable(path: Path) -> Iterator[None]:
    """Turn a file that cannot be read while the release is built into one error line: unreadable
    (permissions), or gone (deleted or renamed between listing the tree and reading it)."""
    try:
        yield
    except FileNotFoundError:
        raise UsageError(
            f"{path} disappeared while the release was being built (deleted or renamed meanwhile)",
            hint="run the command again once whatever is changing the tree has finished",
        ) from None
    except OSError as exc:
        raise UsageError(
            f"cannot read {path}: {exc.strerror}",
            hint=f"make it readable (chmod u+r {path}), or keep it out of the synced tree",
        ) from None


def code_hash_of(manifest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(manifest.items())).encode()).hexdigest()[:16]


def local_manifest(files: dict[str, Path]) -> tuple[str, dict[str, str]]:
    manifest = {rel: file_sha256(path) for rel, path in files.items()}
    return code_hash_of(manifest), manifest


def install_payload(
    workspace: str,
    files: dict[str, Path],
    code_hash: str,
    manifest: dict[str, str],
    base: str | None,
    base_files: dict[str, str],
    keep: int = 5,
) -> tuple[dict, bytes, tuple, tuple]:
    """(install request, gzip tar of the changed files, uploaded paths, linked paths) for making release
    `code_hash` from release `base` (whose manifest is `base_files`) on the target."""
    linked = tuple(sorted(rel for rel, digest in manifest.items() if base_files.get(rel) == digest))
    uploaded = tuple(sorted(set(manifest) - set(linked)))
    buffer = io.BytesIO()
    # gzip: a plain tar pads even one small file to a 10 KiB record; compressed, the padding costs ~nothing.
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for rel in uploaded:
            with readable(files[rel]), files[rel].open("rb") as handle:
                info = archive.gettarinfo(arcname=rel, fileobj=handle)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                archive.addfile(info, handle)
    # Compact request: only the changed entries and the removed paths; the agent rebuilds the full
    # manifest from the base release's (one 4 KiB change then sends ~4 KiB, not the whole manifest).
    request = {
        "workspace": workspace,
        "hash": code_hash,
        "base": base,
        "changed": {rel: manifest[rel] for rel in uploaded},
        "removed": sorted(set(base_files) - set(manifest)),
        "keep": keep,
    }
    return request, buffer.getvalue(), uploaded, linked


def sync(
    agent: Agent,
    *,
    extra_files: tuple[str, ...] = (),
    extra_root: Path | None = None,
    packages: tuple[str, ...] = ("trainer",),
    keep: int = 5,
    cache: Path | None = None,
) -> SyncOutcome:
    """Make `releases/<hash>` on the target hold exactly the local tree and point `current` at it.
    With `cache` (the lineage database path), remember what is now installed there (release_cache)."""
    files = release_files(extra_files, extra_root, packages)
    code_hash, manifest = local_manifest(files)
    remote = agent.call("manifest", {"workspace": agent.target.workspace, "hash": code_hash})
    release_path = f"{agent.target.workspace}/releases/{code_hash}"
    if remote.get("release") == code_hash:
        if cache is not None and not agent.dry_run:
            release_cache.save(cache, agent.target, code_hash, manifest)
        return SyncOutcome(code_hash, release_path, (), tuple(sorted(manifest)), 0)
    request, tar, uploaded, linked = install_payload(
        agent.target.workspace, files, code_hash, manifest, remote.get("release"), remote.get("files") or {}, keep
    )
    agent.call("install", request, stdin_tar=tar)
    if cache is not None and not agent.dry_run:
        release_cache.save(cache, agent.target, code_hash, manifest)
    return SyncOutcome(code_hash, release_path, uploaded, linked, len(tar))
