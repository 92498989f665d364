"""The laptop's memory of file digests: path -> (size, mtime_ns, inode, sha256), so a deploy or restart hashes
only the files that changed since the last one (a 200 MB file was re-read in full by every deploy: 5-7 s of an
unchanged deploy, issue 47).

An entry is used only while the file's size, mtime (ns) and inode are what they were when it was hashed, and
an entry is kept only for a file whose mtime was at least RACY_S older than the moment it was hashed: a file
written in the same clock tick as its hashing could change again without a new mtime (git's "racy" rule).
The release manifest stays a proof of content: the target checks every uploaded file's sha256 against it.

Stored in `$DFLASHOPS_MANIFEST_CACHE`, else `$XDG_CACHE_HOME/dflashops/manifest-cache.json` (~/.cache),
written atomically; a missing, unreadable or malformed file is an empty cache, and two controllers writing
at once lose at most the other's new entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RACY_S = 2.0
Stamp = tuple[int, int, int]  # (size, mtime_ns, inode)


def cache_file() -> Path:
    explicit = os.environ.get("DFLASHOPS_MANIFEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflashops" / "manifest-cache.json"


def stamp_of(stat: os.stat_result) -> Stamp:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino)


class ManifestCache:
    """Digests by absolute path, valid while the file's stamp is unchanged."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_file()
        self._entries: dict[str, list] = {}
        self._dirty = False
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = {}
        if isinstance(loaded, dict):
            self._entries = {k: v for k, v in loaded.items() if isinstance(v, list) and len(v) == 4}

    def get(self, path: Path, stat: os.stat_result) -> str | None:
        entry = self._entries.get(str(path.absolute()))
        if entry is None or tuple(entry[:3]) != stamp_of(stat) or not isinstance(entry[3], str):
            return None
        return entry[3]

    def put(self, path: Path, stat: os.stat_result, digest: str, hashed_at: float) -> None:
        """Remember `digest` for the file as `stat` found it, unless it was modified within RACY_S of hashing."""
        if stat.st_mtime_ns / 1e9 > hashed_at - RACY_S:
            return
        self._entries[str(path.absolute())] = [*stamp_of(stat), digest]
        self._dirty = True

    def save(self) -> None:
        """Write the cache if anything was added; a cache that cannot be written is only a slower next deploy."""
        if not self._dirty:
            return
        # Entries of files that are gone (a test's or an old project's folder) are dropped, so the file does
        # not grow without end: one stat each, only when something was added.
        self._entries = {name: entry for name, entry in self._entries.items() if os.path.exists(name)}
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(self._entries), encoding="utf-8")
            os.replace(temporary, self.path)
            self._dirty = False
        except OSError:
            try:
                temporary.unlink()
            except OSError:
                pass
