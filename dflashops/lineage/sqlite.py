"""The SQLite connection under LineageDB: opening (read-only when the file cannot be written) and turning
every sqlite3 error into one LineageDBError line that names the file and says how to recover.

Why a wrapper: sqlite3 raises from `execute` and also while rows are iterated, and "database disk image is
malformed" can surface on any page at any later query (a corrupt page is only found when it is read). Every
statement therefore goes through `Connection.query`/`Connection.run`, which fetch eagerly inside one
`except sqlite3.Error`, so no caller can leak a raw traceback.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from dflashops.core.errors import DflashopsError

# Raised messages that mean the file's bytes are bad, as opposed to the file being locked or unwritable.
CORRUPT_WORDS = ("malformed", "not a database", "file is encrypted", "disk image", "corrupt")
READ_ONLY_WORDS = ("readonly", "read-only", "unable to open", "permission", "disk i/o error")


class LineageDBError(DflashopsError):
    """The lineage database file cannot be used (not SQLite, foreign, newer schema, corrupt, unwritable)."""

    exit_code = 2


def rebuild_hint(path: Path) -> str:
    return (
        f"move it aside (mv {path} {path}.corrupt) and run `dflashops runs sync` to rebuild the lineage "
        f"from the run.json files on the targets"
    )


def writable_hint(path: Path) -> str:
    return f"make {path} and its folder writable, or use an inventory in a folder you can write"


def not_writable_reason(path: Path) -> str | None:
    """Why this process cannot write the database (None when it can). os.access honours read-only mounts
    (EROFS) even for root; SQLite in WAL mode also needs the folder, for its -wal and -shm files."""
    if str(path) == ":memory:":
        return None
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    if not os.access(path.parent, os.W_OK):
        return "its folder is read-only"
    return None


class Connection:
    """One sqlite3 connection; `query` returns all rows, `run` executes; both raise LineageDBError only."""

    def __init__(self, path: Path, *, timeout_s: float, read_only: bool = False) -> None:
        self.path = path
        # `read_only`: the caller only reads (logs, watch), so this connection never writes, whatever the file allows.
        self.read_only = "opened for reading only" if read_only else not_writable_reason(path)
        try:
            if self.read_only is None:
                self.raw = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
            else:
                self.raw = open_read_only(path, timeout_s)
        except sqlite3.Error as exc:
            raise self.error(exc, doing="open") from None

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self.raw.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self.error(exc) from None

    def run(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        try:
            self.raw.execute(sql, params)
        except sqlite3.Error as exc:
            raise self.error(exc) from None

    def error(self, exc: sqlite3.Error, *, doing: str = "use") -> LineageDBError:
        text = str(exc)
        lowered = text.lower()
        if any(word in lowered for word in CORRUPT_WORDS) or (
            isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)
        ):
            return LineageDBError(f"lineage database {self.path} is corrupt ({text})", hint=rebuild_hint(self.path))
        if any(word in lowered for word in READ_ONLY_WORDS):
            return LineageDBError(
                f"lineage database {self.path} cannot be written ({text}); nothing was changed",
                hint=writable_hint(self.path),
            )
        if "locked" in lowered or "busy" in lowered:
            return LineageDBError(
                f"lineage database {self.path} is locked by another dflashops ({text})",
                hint="wait for the other command to finish, then try again",
            )
        return LineageDBError(f"cannot {doing} lineage database {self.path}: {text}", hint=rebuild_hint(self.path))

    def refuse_writes(self) -> None:
        """LineageDBError when this connection is read-only: every write starts here (Transaction), so a
        deploy meets it when it claims the run name, before anything is synced or launched."""
        if self.read_only is not None:
            raise LineageDBError(
                f"lineage database {self.path} cannot be written: {self.read_only}; nothing was changed",
                hint=writable_hint(self.path),
            )

    def close(self) -> None:
        self.raw.close()


def open_read_only(path: Path, timeout_s: float) -> sqlite3.Connection:
    """A read-only connection. `mode=ro` needs the WAL's -shm file, which a read-only folder cannot hold; then
    `immutable=1` reads the file as it is (safe here: nobody can write it from this machine's view either)."""
    uri = path.resolve().as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout_s, isolation_level=None)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        return conn
    except sqlite3.OperationalError:
        return sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=timeout_s, isolation_level=None)


class Transaction:
    """`BEGIN IMMEDIATE` ... COMMIT (ROLLBACK on error): takes the write lock up front, so a read-then-write
    (name taken? then insert) cannot interleave with another process's."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.refuse_writes()
        self._conn.run("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self._conn.run("COMMIT")
            return
        try:
            self._conn.raw.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the transaction is gone already (corrupt page, closed file): the first error is the one to show
