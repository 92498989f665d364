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
import json
import tarfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflashops.agent.answers import InstallAnswer, ManifestAnswer
from dflashops.agent.protocol import InstallRequest, ManifestRequest
from dflashops.core.errors import UsageError
from dflashops.ops.agent_build import package_files
from dflashops.ops.agent_client import AGENT_SOURCE, Agent
from dflashops.ops.releases import release_cache
from dflashops.ops.releases.manifest_cache import ManifestCache, stamp_of
from dflashops.ops.upload import PlainTar, Tar, TarUpload

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
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(1 << 20):  # 1 MiB at a time: a 200 MB file is not held in memory
                digest.update(block)
        return digest.hexdigest()


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


def local_manifest(files: dict[str, Path], cache: ManifestCache | None = None) -> tuple[str, dict[str, str]]:
    """(code hash, {path in the release: sha256}). A file whose size, mtime and inode are those it had when it
    was last hashed takes its digest from the manifest cache (manifest_cache.py) instead of being read again."""
    cache = cache or ManifestCache()
    manifest: dict[str, str] = {}
    for rel, path in files.items():
        with readable(path):
            stat = path.stat()
        digest = cache.get(path, stat)
        if digest is None:
            started = time.time()
            digest = file_sha256(path)
            with readable(path):
                after = path.stat()
            if stamp_of(after) == stamp_of(stat):  # not changed while it was read
                cache.put(path, stat, digest, started)
        manifest[rel] = digest
    cache.save()
    return code_hash_of(manifest), manifest


@dataclass(frozen=True)
class InstallPayload:
    """What makes a release on a target: the agent's `install` request, the tar of the changed files (read it
    once), the paths the tar carries (`uploaded`) and those the target hard-links from its base (`linked`)."""

    request: InstallRequest
    tar: Tar
    uploaded: tuple[str, ...]
    linked: tuple[str, ...]


def install_payload(
    workspace: str,
    files: dict[str, Path],
    code_hash: str,
    manifest: dict[str, str],
    base: str | None,
    base_files: dict[str, str],
    keep: int = 5,
) -> InstallPayload:
    """The install request, the tar of the changed files (gzip in a temporary file; generated as it is read when
    large and incompressible), the uploaded and the linked paths, for making release `code_hash` from release
    `base` (whose manifest is `base_files`) on the target. The request's `tar_bytes` is the tar's size: the agent reads the tar as it arrives and checks
    that all of it came."""
    linked = tuple(sorted(rel for rel, digest in manifest.items() if base_files.get(rel) == digest))
    uploaded = tuple(sorted(set(manifest) - set(linked)))
    # gzip: a plain tar pads even one small file to a 10 KiB record; compressed, the padding costs ~nothing. Not
    # for incompressible bytes (a 200 MB random file: 45 s at level 6 for 0% saved, issue 47): that plain tar is
    # generated as it is sent (PlainTar), the gzip one written to a temporary file; neither is held in memory
    # (upload.py). The agent reads either ("r|*").
    upload: Tar
    if incompressible([files[rel] for rel in uploaded]):
        upload = PlainTar()
        for rel in uploaded:
            with readable(files[rel]):
                upload.add(rel, files[rel])
    else:
        upload = TarUpload()
        with tarfile.open(fileobj=upload.writer, mode="w:gz", compresslevel=6) as archive:
            for rel in uploaded:
                with readable(files[rel]), files[rel].open("rb") as handle:
                    info = archive.gettarinfo(arcname=rel, fileobj=handle)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    archive.addfile(info, handle)
        upload.finish()
    # Compact request: only the changed entries and the removed paths; the agent rebuilds the full
    # manifest from the base release's (one 4 KiB change then sends ~4 KiB, not the whole manifest).
    request = InstallRequest(
        workspace=workspace,
        hash=code_hash,
        base=base,
        changed={rel: manifest[rel] for rel in uploaded},
        removed=sorted(set(base_files) - set(manifest)),
        keep=keep,
        tar_bytes=len(upload),
    )
    return InstallPayload(request, upload, uploaded, linked)


PLAIN_TAR_FROM_BYTES = 8 << 20  # an upload this large is sent uncompressed when its samples do not compress
SAMPLE_BYTES = 1 << 20


def incompressible(paths: list[Path]) -> bool:
    """The files to upload are large (>= PLAIN_TAR_FROM_BYTES) and a 1 MiB sample of each large one saves
    under 10% at zlib level 1: gzip would cost seconds for nothing (random data, checkpoints, archives)."""
    sizes = {path: path.stat().st_size for path in paths}
    if sum(sizes.values()) < PLAIN_TAR_FROM_BYTES:
        return False
    sample_in = sample_out = 0
    for path, size in sizes.items():
        if size < SAMPLE_BYTES:
            continue
        with readable(path), path.open("rb") as handle:
            handle.seek(size // 2 - SAMPLE_BYTES // 2)
            sample = handle.read(SAMPLE_BYTES)
        sample_in += len(sample)
        sample_out += len(zlib.compress(sample, 1))
    return sample_in > 0 and sample_out > 0.9 * sample_in


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
    remote = agent.ask("manifest", ManifestRequest(workspace=agent.target.workspace, hash=code_hash), ManifestAnswer)
    base, base_files = (remote.release, remote.files) if remote is not None else (None, {})
    release_path = f"{agent.target.workspace}/releases/{code_hash}"
    if base == code_hash:
        if cache is not None and not agent.dry_run:
            release_cache.save(cache, agent.target, code_hash, manifest)
        return SyncOutcome(code_hash, release_path, (), tuple(sorted(manifest)), 0)
    payload = install_payload(agent.target.workspace, files, code_hash, manifest, base, base_files, keep)
    try:
        agent.ask("install", payload.request, InstallAnswer, stdin_tar=payload.tar)  # checked; nothing in it is read
    finally:
        payload.tar.close()
    if cache is not None and not agent.dry_run:
        release_cache.save(cache, agent.target, code_hash, manifest)
    return SyncOutcome(code_hash, release_path, payload.uploaded, payload.linked, len(payload.tar))
