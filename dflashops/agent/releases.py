"""`manifest` and `install`: content-addressed releases built from a tar stream, verified, flipped, pruned."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import zlib

from .answers import InstallAnswer, ManifestAnswer
from .common import (
    DISK_FULL_ERRNOS,
    HASH_RE,
    AgentFailure,
    alive,
    file_sha256,
    free_space,
    no_space,
    read_int,
    read_json,
    workspace_of,
    write_atomic,
)
from .protocol import InstallRequest, ManifestRequest


def verb_manifest(req: ManifestRequest) -> ManifestAnswer:
    """The current release's code hash and per-file sha256 (written at install, so this reads one file); with
    `release` (a code hash), that release's, or `release: None` when it is not there (never installed, or
    removed by gc): `runs diff` names the files that changed between two runs' code."""
    named = req.release
    if named is not None:
        if not isinstance(named, str) or not HASH_RE.match(named):
            raise AgentFailure(f"release must be a code hash, not {named!r}", "bad_request")
        files = read_json(os.path.join(workspace_of(req.workspace), "releases", named, ".manifest.json"))
        return ManifestAnswer(
            release=named if isinstance(files, dict) else None, files=files if isinstance(files, dict) else {}
        )
    current = os.path.join(workspace_of(req.workspace), "releases", "current")
    if not os.path.islink(current):
        return ManifestAnswer(release=None, files={})
    target = os.path.realpath(current)
    if req.hash and req.hash == os.path.basename(target):
        return ManifestAnswer(release=os.path.basename(target), path=target, files={})  # up to date: skip the list
    manifest = read_json(os.path.join(target, ".manifest.json"))
    if manifest is None:
        return ManifestAnswer(release=None, files={})
    return ManifestAnswer(release=os.path.basename(target), path=target, files=manifest)


def safe_member(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """`member` when it is a plain file or folder inside the release; a refusal otherwise (an absolute path,
    `..`, a link or a device)."""
    parts = member.name.split("/")
    if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
        raise AgentFailure(f"refusing tar member {member.name!r}", "bad_request")
    return member


class Upload:
    """The tar of an install as it arrives on stdin (or given whole, as bytes), read once from the start and
    counted: `size` is what the request announced (`tar_bytes`; the length of bytes given whole), and `finish()`
    refuses (code `incomplete`) an upload that was cut short or ran long. Nothing holds more than tarfile's
    buffer of it: a 200 MB upload was read whole into memory first (bench/results/control-plane.md
    "2026-12-05 — The control plane at scale")."""

    def __init__(self, source: bytes | io.BufferedIOBase, announced: object = None) -> None:
        self._source: io.BufferedIOBase = io.BytesIO(source) if isinstance(source, bytes) else source
        self.size: int | None = int(announced) if announced is not None else None  # type: ignore[call-overload]
        if self.size is None and isinstance(source, bytes):
            self.size = len(source)
        self.read_bytes = 0

    def read(self, count: int = -1) -> bytes:
        data = self._source.read(count)
        self.read_bytes += len(data)
        return data

    def finish(self) -> None:
        """Read what tarfile left after the end of the archive (its last record's padding), then check the
        count against the announced size; a mismatch is code `incomplete` (nothing is made current)."""
        while self.read(1 << 16):
            pass
        if self.size is not None and self.read_bytes != self.size:
            raise AgentFailure(
                f"upload incomplete ({self.read_bytes} of {self.size} bytes); nothing was changed", "incomplete"
            )


def install_manifest(req: InstallRequest, releases: str) -> tuple:
    """(full manifest, files to hard-link from the base). The request carries either the full `files`
    manifest and a `link` list, or only `changed` entries and `removed` paths relative to `base` (the
    compact form: an install of one changed file then sends about that file, not the whole manifest)."""
    if isinstance(req.files, dict):
        return req.files, list(req.link or [])
    changed, removed, base = req.changed, req.removed or [], req.base
    if not isinstance(changed, dict) or not isinstance(removed, list):
        return None, []
    base_files = {}
    if isinstance(base, str) and HASH_RE.match(base):
        base_files = read_json(os.path.join(releases, base, ".manifest.json")) or {}
    files = {rel: digest for rel, digest in base_files.items() if rel not in removed}
    files.update(changed)
    return files, sorted(rel for rel in files if rel not in changed)


def build_release(req: InstallRequest, stdin: bytes | io.BufferedIOBase, stale_code: str = "conflict") -> tuple:
    """Make releases/<hash>/ complete (or find it already there) WITHOUT making it current; returns
    (code_hash, path). `stdin` is the tar, whole or as a stream read as it arrives (its size in the request's
    `tar_bytes`). Unpack the tar of changed files into a temp dir, hard-link unchanged files from
    the base release, verify every hash, then rename. A failure removes its own `.tmp-*` folder; a cut
    connection or a crash leaves one, removed by a later install once its owner is gone: a release is
    complete or absent, and concurrent installs never delete each other's work."""
    workspace = workspace_of(req.workspace)
    code_hash = str(req.hash or "")
    releases = os.path.join(workspace, "releases")
    files, link = install_manifest(req, releases)
    if not HASH_RE.match(code_hash) or not isinstance(files, dict):
        raise AgentFailure("install needs a hash and a files manifest", "bad_request")
    # The release name is the hash of its manifest (ops/releases/sync.py code_hash_of): a rebuilt manifest that does
    # not match (base release pruned or changed since `manifest` was read) is refused, never installed.
    if hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16] != code_hash:
        raise AgentFailure(
            f"manifest does not match release {code_hash} (base {req.base!r} changed?); sync again", stale_code
        )
    os.makedirs(releases, exist_ok=True)
    remove_abandoned_temporaries(releases)
    upload = Upload(stdin, req.tar_bytes)
    final = os.path.join(releases, code_hash)
    if os.path.isdir(final):
        return code_hash, final
    tmp = os.path.join(releases, f".tmp-{code_hash}-{os.getpid()}")
    # The upload unpacks to about its own size (the unchanged files are hard links): a full workspace disk is one
    # `no_space` refusal naming that size, not an OSError from the middle of the unpacking.
    size = upload.size or 0
    needs = f"the upload of {len(files)} files needs about {max(1, size >> 10)} KiB"
    free = free_space(workspace)
    if free is not None and free[0] < size + (64 << 10):
        raise no_space(workspace, needs)
    try:
        os.makedirs(tmp)
        fill_release(tmp, upload, link, releases, req.base, files, stale_code)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            raise no_space(workspace, needs) from None
        raise
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent install of the same code finished first
    return code_hash, final


def remove_abandoned_temporaries(releases: str) -> None:
    """Remove `.tmp-<hash>-<pid>` folders whose installing agent is gone (a cut connection, a crash); never
    one whose owner is still running: two deploys of new code may build releases side by side."""
    for entry in os.listdir(releases):
        owner = entry.rsplit("-", 1)[-1]
        if entry.startswith(".tmp-") and owner.isdigit() and int(owner) != os.getpid() and not alive(int(owner)):
            shutil.rmtree(os.path.join(releases, entry), ignore_errors=True)


STATS_FILE = ".manifest.stat.json"  # beside .manifest.json: each file's [size, mtime_ns, inode] when verified


def fill_release(
    tmp: str, upload: Upload, link: list, releases: str, base: object, files: dict, stale_code: str
) -> None:
    """Unpack the changed files into `tmp` as the upload arrives (member by member: tarfile's stream mode, no
    seeking back), hard-link the unchanged ones from `base`, verify every hash.

    An uploaded file's digest is taken from the bytes as they are written (unpack_file): reading the file back
    to hash it was a second pass over every uploaded byte (0.17 s of sha256 for 200 MB here, plus the read).

    A hard-linked file is the base release's own inode: when the base verified it at its install (its digest in
    the base's .manifest.json is this manifest's) and the inode's size and mtime are still those recorded then
    (.manifest.stat.json), its digest is taken from there instead of reading it again (a 200 MB file cost every
    restart seconds, issue 47). Any write to the file since changes its mtime, and then it is hashed as before;
    a base from before the stat file is hashed in full."""
    received: dict[str, str] = {}  # path in the release -> sha256 of the bytes written there
    try:
        with tarfile.open(fileobj=upload, mode="r|*") as archive:  # type: ignore[call-overload]  # plain or gzip
            for member in archive:
                dest = os.path.join(tmp, safe_member(member).name)
                if member.isdir():
                    os.makedirs(dest, exist_ok=True)
                else:
                    received[member.name] = unpack_file(archive, member, dest)
    except (tarfile.TarError, EOFError, zlib.error):
        upload.finish()  # a cut upload is `incomplete`, not a tar error
        raise
    upload.finish()
    base_dir = os.path.join(releases, base) if isinstance(base, str) and HASH_RE.match(base) else None
    base_digests = (read_json(os.path.join(base_dir, ".manifest.json")) or {}) if base_dir else {}
    base_stats = (read_json(os.path.join(base_dir, STATS_FILE)) or {}) if base_dir else {}
    verified: set[str] = set()
    for rel in link:
        source = os.path.join(base_dir or "/nonexistent", rel)
        dest = os.path.join(tmp, rel)
        if ".." in rel.split("/") or not os.path.isfile(source):
            raise AgentFailure(f"cannot link unchanged file {rel!r} from release {base!r}", stale_code)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.link(source, dest)
        if base_digests.get(rel) == files.get(rel) and base_stats.get(rel) == file_stamp(dest):
            verified.add(rel)
    for rel, digest in files.items():
        path = os.path.join(tmp, rel)
        if rel in verified:
            continue
        got = received.get(rel) or (file_sha256(path) if os.path.isfile(path) else None)
        if got != digest:
            raise AgentFailure(f"release file {rel!r} is missing or corrupt after transfer", "corrupt")
    write_atomic(os.path.join(tmp, STATS_FILE), json.dumps({rel: file_stamp(os.path.join(tmp, rel)) for rel in files}))
    write_atomic(os.path.join(tmp, ".manifest.json"), json.dumps(files, sort_keys=True))


def unpack_file(archive: tarfile.TarFile, member: tarfile.TarInfo, dest: str) -> str:
    """Write a file member's bytes to `dest` (its permission bits without setuid/setgid/sticky or write for
    others, its mtime, as tarfile's `data` filter leaves them) and return their sha256, taken as they are written."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    source = archive.extractfile(member)
    if source is None:  # safe_member lets only files and folders through
        raise AgentFailure(f"refusing tar member {member.name!r}", "bad_request")
    digest = hashlib.sha256()
    with open(dest, "xb") as out:  # a fresh folder: a name twice in one upload is refused, not overwritten
        while block := source.read(1 << 20):
            digest.update(block)
            out.write(block)
    os.chmod(dest, member.mode & 0o755)
    os.utime(dest, (member.mtime, member.mtime))
    return digest.hexdigest()


def file_stamp(path: str) -> list[int]:
    """[size, mtime_ns, inode]: what .manifest.stat.json records of a verified file."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def flip_current(workspace: str, code_hash: str) -> None:
    releases = os.path.join(workspace, "releases")
    link_tmp = os.path.join(releases, f".current-{os.getpid()}")
    os.symlink(code_hash, link_tmp)
    os.replace(link_tmp, os.path.join(releases, "current"))  # rename(2) over the old link: atomic flip


def verb_install(req: InstallRequest, stdin: bytes | io.BufferedIOBase) -> InstallAnswer:
    """build_release, then flip `current` atomically and prune old releases; `current` never points at a
    partial tree."""
    code_hash, final = build_release(req, stdin)
    flip_current(workspace_of(req.workspace), code_hash)
    removed = prune_releases(workspace_of(req.workspace), int(req.keep))
    return InstallAnswer(release=code_hash, path=final, removed=removed)


def releases_in_use(workspace: str) -> set[str]:
    """Releases that a live run was started from (its run.json names the resolved release path)."""
    used: set[str] = set()
    runs_root = os.path.join(workspace, "runs")
    for name in os.listdir(runs_root) if os.path.isdir(runs_root) else []:
        directory = os.path.join(runs_root, name)
        if read_int(os.path.join(directory, "exit_code")) is None:
            release = (read_json(os.path.join(directory, "run.json")) or {}).get("release")
            if isinstance(release, str):
                used.add(os.path.basename(release.rstrip("/")))
    return used


def prunable_releases(workspace: str, keep: int) -> list[str]:
    """The releases gc may delete: beyond the newest `keep`, neither `current` nor in use by a run."""
    releases = os.path.join(workspace, "releases")
    current = os.path.basename(os.path.realpath(os.path.join(releases, "current")))
    entries = [e for e in os.listdir(releases) if HASH_RE.match(e) and os.path.isdir(os.path.join(releases, e))]
    entries.sort(key=lambda e: os.stat(os.path.join(releases, e)).st_mtime, reverse=True)
    protected = releases_in_use(workspace) | {current}
    return [entry for entry in entries[max(keep, 1) :] if entry not in protected]


def prune_releases(workspace: str, keep: int) -> list[str]:
    """Delete the prunable releases; their names."""
    removed = prunable_releases(workspace, keep)
    for entry in removed:
        shutil.rmtree(os.path.join(workspace, "releases", entry))
    return removed
