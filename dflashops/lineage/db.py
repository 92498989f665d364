"""Run lineage in a SQLite file next to the inventory: which run came from which, with what change.

The database is a real file in WAL mode (readers never block the one writer; two CLI processes may write
at once: every write is one `BEGIN IMMEDIATE` transaction and waits up to `busy_timeout` for the other).
The schema is versioned by a `schema_migrations` table. A file that is not SQLite, is some other
program's database, or was written by a newer dflashops is refused before anything is written to it.

Every record is also mirrored by its run's `run.json` on the target, so `runs sync` can rebuild this
file (`import_run_json` is idempotent). The package (dflashops.lineage) exports the public names.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from dflashops.core.errors import Conflict, DflashopsError, NotFound
from dflashops.core.shell import validate_name
from dflashops.lineage.naming import close_names, lineage_root, next_name
from dflashops.lineage.record import (
    STATES,
    RunRecord,
    record_from_run_json,
    redact_argv,
    redact_env,
    redact_value,
    utc_now_iso,
)
from dflashops.lineage.sqlite import (
    Connection,
    LineageDBError,
    Transaction,
    not_writable_reason,
    rebuild_hint,
    writable_hint,
)

__all__ = ["SCHEMA_VERSION", "LineageDB"]

SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 15_000  # a writer waits this long for the other process's transaction (each is < 10 ms)

_MIGRATIONS: dict[int, str] = {
    1: f"""
    CREATE TABLE runs (
        name TEXT PRIMARY KEY,
        parent TEXT,
        note TEXT NOT NULL DEFAULT '',
        code_hash TEXT NOT NULL DEFAULT '',
        argv TEXT NOT NULL DEFAULT '[]',    -- JSON list, secret flag values redacted
        env TEXT NOT NULL DEFAULT '{{}}',   -- JSON object, secrets redacted
        target TEXT NOT NULL,
        gpus TEXT NOT NULL DEFAULT '[]',    -- JSON list of GPU ids
        launcher TEXT NOT NULL,
        session TEXT NOT NULL DEFAULT '',
        profile TEXT,
        started_at TEXT NOT NULL,           -- ISO 8601 UTC
        state TEXT NOT NULL CHECK (state IN ({", ".join(repr(s) for s in STATES)})),
        exit_code INTEGER,
        last_step INTEGER,
        extra TEXT NOT NULL DEFAULT '{{}}', -- JSON object
        updated_at TEXT NOT NULL
    );
    CREATE INDEX runs_parent ON runs(parent);
    """,
}
_JSON_COLUMNS = ("argv", "env", "gpus", "extra")
_COLUMNS = tuple(RunRecord.__dataclass_fields__)
_SETTABLE = {"exit_code", "last_step", "note", "session", "extra"}
RESERVED = "reserved"  # extra key of a name claimed by a launch in progress (LineageDB.reserve)

ImportOutcome = Literal["added", "updated", "unchanged"]


class LineageDB:
    """Run records in one SQLite file. Open with `LineageDB(path)`; use as a context manager or `close()`."""

    def __init__(self, path: Path | str, *, read_only: bool = False) -> None:
        """`read_only`: never written, never migrated, never created (NotFound when the file is missing); a file
        of an older schema then reads as holding no runs (`needs_migration`), since migrating it is a write."""
        self.path = Path(path)
        if read_only and not (self.path.exists() and self.path.stat().st_size > 0):
            raise NotFound(f"lineage database {self.path} does not exist", hint="a deploy or `runs sync` creates it")
        if not self.path.parent.is_dir():
            raise NotFound(
                f"lineage database folder {self.path.parent} does not exist",
                hint="create it, or pass --db PATH inside an existing folder",
            )
        existed = self.path.exists() and self.path.stat().st_size > 0
        if not existed and not_writable_reason(self.path):
            raise LineageDBError(
                f"cannot create lineage database {self.path}: {not_writable_reason(self.path)}",
                hint=writable_hint(self.path),
            )
        # A file this process cannot write is opened read-only: list/show/status still read it, and the
        # first write (a deploy's name claim, before anything is synced) is refused with one error line.
        self._conn = Connection(self.path, timeout_s=BUSY_TIMEOUT_MS / 1000, read_only=read_only)
        self._in_batch = False
        self.needs_migration = False
        try:
            if existed:
                self._check_readable()  # reads only: a refused file is left byte-for-byte as it was
            self._conn.run(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if self._conn.read_only is None:
                self._switch_to_wal()
                self._conn.run(
                    "PRAGMA synchronous = NORMAL"
                )  # WAL + NORMAL: durable at checkpoint, no fsync per commit
                self._migrate()
            elif self._schema_version() < SCHEMA_VERSION:
                self.needs_migration = True
                if not read_only:
                    self._conn.refuse_writes()  # it needs a migration, which is a write
        except DflashopsError:
            self._conn.close()
            raise

    @property
    def read_only(self) -> str | None:
        """Why this database cannot be written here (read-only file or folder), or None."""
        return self._conn.read_only

    def _switch_to_wal(self) -> None:
        """Put the file in WAL mode (persistent: once per file). The switch needs the file to itself, and
        SQLite answers "database is locked" at once instead of running the busy handler, so two commands
        opening a new database together failed one of them (a concurrent-deploy test, ~1 run in 6). Retry until
        the busy timeout, re-reading the mode each time: the other command may have switched it meanwhile."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        pause_s = 0.005
        while True:
            try:
                if self._conn.query("PRAGMA journal_mode")[0][0].lower() != "wal":
                    self._conn.run("PRAGMA journal_mode = WAL")  # answers the old mode where WAL cannot be (:memory:)
                return
            except LineageDBError as exc:
                if "is locked" not in exc.message:
                    raise
            if time.monotonic() > deadline:
                raise LineageDBError(
                    f"lineage database {self.path} is locked by another dflashops (could not switch it to WAL "
                    f"within {BUSY_TIMEOUT_MS / 1000:g} s)",
                    hint="wait for the other command to finish, then try again",
                )
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.1)

    # -- schema ---------------------------------------------------------------------------------------
    def _schema_version(self) -> int:
        tables = {row[0] for row in self._conn.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return 0
        if "schema_migrations" not in tables:
            raise LineageDBError(
                f"{self.path} is a SQLite database but not a dflashops lineage database "
                f"(tables: {', '.join(sorted(tables))})",
                hint="point --db at another file; this one was left untouched",
            )
        return int(self._conn.query("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")[0][0])

    def _check_readable(self) -> None:
        try:
            version = self._schema_version()
        except LineageDBError as exc:
            if "file is not a database" not in exc.message:
                raise
            raise LineageDBError(
                f"{self.path} is not a lineage database (file is not a database)", hint=rebuild_hint(self.path)
            ) from None
        if version > SCHEMA_VERSION:
            raise LineageDBError(
                f"{self.path} has lineage schema version {version}, newer than this dflashops "
                f"understands ({SCHEMA_VERSION})",
                hint="upgrade dflashops; the file was left untouched",
            )

    def _migrate(self) -> None:
        with self._write():
            self._conn.run(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"
            )
            current = self._schema_version()  # re-read inside the lock: another process may have migrated
            if current > SCHEMA_VERSION:
                raise LineageDBError(
                    f"{self.path} has lineage schema version {current}, newer than {SCHEMA_VERSION}",
                    hint="upgrade dflashops",
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        self._conn.run(statement)
                self._conn.run("INSERT INTO schema_migrations VALUES (?, ?)", (version, utc_now_iso()))

    def _write(self) -> contextlib.AbstractContextManager[None]:
        """One write transaction; inside `batch()` the batch's own (a write there commits with the batch)."""
        return contextlib.nullcontext() if self._in_batch else Transaction(self._conn)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Every write inside is one `BEGIN IMMEDIATE` transaction: `runs sync` of 1,000 run directories pays
        one commit, not 1,000 (and a second writer waits once for the whole batch, up to busy_timeout). An
        exception leaving the block rolls all of it back; a caller that catches a refusal (Conflict) inside
        keeps the batch going, since a refused write wrote nothing."""
        if self._in_batch:
            yield
            return
        with Transaction(self._conn):
            self._in_batch = True
            try:
                yield
            finally:
                self._in_batch = False

    # -- rows -----------------------------------------------------------------------------------------
    @staticmethod
    def _to_row(run: RunRecord) -> dict[str, Any]:
        """The row to write: every write goes through here, and here secrets are redacted (argv, env, extra's
        values), whatever the caller did to the record after building it; reads trust it (RunRecord.stored)."""
        row = run.to_dict()
        row["argv"], row["env"] = redact_argv(row["argv"]), redact_env(row["env"])
        row["extra"] = redact_value(row["extra"])
        for column in _JSON_COLUMNS:
            row[column] = json.dumps(row[column], sort_keys=True)
        row["updated_at"] = utc_now_iso()
        return row

    def _from_row(self, row: tuple[Any, ...]) -> RunRecord:
        values = dict(zip(_COLUMNS, row))
        for column in _JSON_COLUMNS:
            values[column] = json.loads(values[column])
        return RunRecord.stored(values)

    def _select(self, where: str = "", params: tuple[Any, ...] = ()) -> list[RunRecord]:
        sql = f"SELECT {', '.join(_COLUMNS)} FROM runs {where} ORDER BY started_at, name"
        return [self._from_row(row) for row in self._conn.query(sql, params)]

    def _exists(self, name: str) -> bool:
        return bool(self._conn.query("SELECT 1 FROM runs WHERE name = ?", (name,)))

    def _insert(self, run: RunRecord) -> None:
        row = self._to_row(run)
        columns = [*_COLUMNS, "updated_at"]
        self._conn.run(
            f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})",
            tuple(row[c] for c in columns),
        )

    # -- public API -----------------------------------------------------------------------------------
    def record(self, run: RunRecord, *, allow_missing_parent: bool = False) -> RunRecord:
        """Store a new run. Raises Conflict when the name is taken, NotFound when `run.parent` is not
        recorded (unless `allow_missing_parent`), UsageError for an invalid name. Returns the stored record."""
        validate_name(run.name, what="run name")
        with self._write():
            self._check_new(run, allow_missing_parent)
            self._insert(run)
        return self.get(run.name)

    def record_as_next(self, run: RunRecord, after: str) -> RunRecord:
        """`--name +`: store `run` under `next_name(after, taken)`, chosen and inserted in one transaction
        so two processes deriving a name from the same parent at once get different names."""
        with self._write():
            taken = {row[0] for row in self._conn.query("SELECT name FROM runs")}
            run.name = next_name(after, taken)
            self._check_new(run, allow_missing_parent=False)
            self._insert(run)
        return self.get(run.name)

    def reserve(self, run: RunRecord, *, after: str | None = None) -> str:
        """Claim `run.name` (with `after`: the next free name after it, chosen in the same transaction) BEFORE
        anything is launched, so two controllers launching at once never pick the same name, and a name
        that is taken is refused before a byte moves. Returns the claimed name. `fill` replaces the claim
        by the launched run's record; `release` drops it when the launch fails."""
        run.extra = {**run.extra, RESERVED: True}
        return (self.record_as_next(run, after) if after else self.record(run)).name

    def fill(self, run: RunRecord) -> RunRecord:
        """Replace the reservation of `run.name` by `run` (the launched run's full record)."""
        with self._write():
            self._conn.run("DELETE FROM runs WHERE name = ?", (run.name,))
            self._insert(run)
        return self.get(run.name)

    def release(self, name: str) -> None:
        """Drop a reservation (the launch failed); a filled record is never touched."""
        with self._write():
            self._conn.run(f"DELETE FROM runs WHERE name = ? AND json_extract(extra, '$.{RESERVED}') = 1", (name,))

    def _check_new(self, run: RunRecord, allow_missing_parent: bool) -> None:
        if self._exists(run.name):
            existing = self._select("WHERE name = ?", (run.name,))[0]
            raise Conflict(
                f"run name {run.name!r} is already used (started {existing.started_at} on {existing.target})",
                hint="choose another --name, or --name + for the next free name after it",
            )
        if run.parent is not None:
            validate_name(run.parent, what="parent run name")
            if not allow_missing_parent and not self._exists(run.parent):
                raise self._not_found(run.parent, what="parent run")

    def get(self, name: str) -> RunRecord:
        """The record named `name`; NotFound (with close names as the hint) when there is none."""
        rows = self._select("WHERE name = ?", (name,))
        if not rows:
            raise self._not_found(name)
        return rows[0]

    def _not_found(self, name: str, what: str = "run") -> NotFound:
        close = close_names(name, self.names())
        hint = (
            f"did you mean: {', '.join(close)}?"
            if close
            else "`dflashops runs list` shows recorded runs; `dflashops runs sync` rebuilds them from the targets"
        )
        return NotFound(f"no {what} named {name!r} in the lineage database {self.path}", hint=hint)

    def updated_at(self, name: str) -> str | None:
        """When the run's row was last written (ISO 8601 UTC): the last time dflashops saw its state."""
        rows = self._conn.query("SELECT updated_at FROM runs WHERE name = ?", (name,))
        return str(rows[0][0]) if rows else None

    def updated_at_all(self) -> dict[str, str]:
        """updated_at of every run, in one query (a view of 10,000 rows asked once per row)."""
        return {str(name): str(at) for name, at in self._conn.query("SELECT name, updated_at FROM runs")}

    def names(self) -> set[str]:
        return {row[0] for row in self._conn.query("SELECT name FROM runs")}

    def list(
        self,
        *,
        state: str | None = None,
        target: str | None = None,
        newest_first: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[RunRecord]:
        """Runs oldest first (newest first with `newest_first`), optionally filtered by state and/or target;
        `limit`/`offset` page through them in SQL (a page of 50 of 10,000 records reads 50 rows)."""
        where, params = self._filters(state, target)
        order = "started_at DESC, name DESC" if newest_first else "started_at, name"
        page = "" if limit is None else f" LIMIT {int(limit)} OFFSET {int(offset)}"
        sql = f"SELECT {', '.join(_COLUMNS)} FROM runs {where} ORDER BY {order}{page}"
        return [self._from_row(row) for row in self._conn.query(sql, params)]

    def count(self, *, state: str | None = None, target: str | None = None) -> int:
        """How many runs `list` with the same filters gives."""
        where, params = self._filters(state, target)
        return int(self._conn.query(f"SELECT COUNT(*) FROM runs {where}", params)[0][0])

    @staticmethod
    def _filters(state: str | None, target: str | None) -> tuple[str, tuple[Any, ...]]:
        clauses, params = [], []
        for column, value in (("state", state), ("target", target)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", tuple(params)

    def children(self, name: str) -> builtins.list[RunRecord]:  # `list` is the method above here
        """Direct children of `name`, oldest first. NotFound when `name` is not recorded."""
        self.get(name)
        return self._select("WHERE parent = ?", (name,))

    def ancestors(self, name: str) -> builtins.list[RunRecord]:
        """The chain root ... name (inclusive), stopping at a parent that is not recorded."""
        chain = [self.get(name)]
        seen = {name}
        while (parent := chain[-1].parent) and parent not in seen and self._exists(parent):
            seen.add(parent)
            chain.append(self.get(parent))
        return chain[::-1]

    def family(self, name: str) -> builtins.list[RunRecord]:
        """`name`'s recorded ancestors, itself and all its descendants, oldest first (what `runs tree NAME`
        shows): two recursive queries over `parent` (the primary key upwards, the runs_parent index
        downwards), so a lineage of 10,000 records costs only the rows of this family. UNION, not UNION ALL:
        a cycle of parents (hand-edited run.json files) ends the walk instead of looping. NotFound as get."""
        self.get(name)
        sql = f"""
            WITH RECURSIVE
              up(name, parent) AS (
                SELECT name, parent FROM runs WHERE name = ?
                UNION SELECT runs.name, runs.parent FROM runs JOIN up ON runs.name = up.parent),
              down(name) AS (
                SELECT ? UNION SELECT runs.name FROM runs JOIN down ON runs.parent = down.name)
            SELECT {", ".join(_COLUMNS)} FROM runs
            WHERE name IN (SELECT name FROM up UNION SELECT name FROM down)
            ORDER BY started_at, name"""
        return [self._from_row(row) for row in self._conn.query(sql, (name, name))]

    def root(self, name: str) -> str:
        """Lineage root of `name` (the W&B group): its oldest recorded ancestor."""
        self.get(name)
        names = self.names()
        return lineage_root(name, lambda n: parent if (parent := self.get(n).parent) in names else None)

    def set_state(self, name: str, state: str, **fields: Any) -> RunRecord:
        """Update a run's state and any of exit_code, last_step, note, session, extra (merged into the
        stored extra). Raises ValueError for an unknown state, TypeError for an unknown field, NotFound."""
        if state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
        unknown = set(fields) - _SETTABLE
        if unknown:
            raise TypeError(f"set_state() cannot set {', '.join(sorted(unknown))}")
        with self._write():
            current = self.get(name)
            current.state = state
            for key, value in fields.items():
                setattr(current, key, {**current.extra, **value} if key == "extra" else value)
            row = self._to_row(current)
            assignments = ", ".join(f"{c} = ?" for c in ("state", *fields, "updated_at"))
            self._conn.run(
                f"UPDATE runs SET {assignments} WHERE name = ?",
                (*(row[c] for c in ("state", *fields, "updated_at")), name),
            )
        return self.get(name)

    def import_run_json(self, data: Mapping[str, Any]) -> ImportOutcome:
        """Add or refresh a run from its run.json (idempotent; used by `runs sync`).

        Launch fields come from run.json; state/exit_code/last_step only when run.json (or the caller's
        status merged into it) carries them; `extra` is merged. Raises UsageError for a run.json without a
        valid name, Conflict when a different run (other target and start time) already has the name.
        """
        try:
            incoming = record_from_run_json(data)
        except (ValueError, TypeError) as exc:
            raise LineageDBError(f"run.json cannot be imported: {exc}") from None
        validate_name(incoming.name, what="run name in run.json")
        with self._write():
            if not self._exists(incoming.name):
                self._insert(incoming)
                return "added"
            stored = self.get(incoming.name)
            if (stored.target, stored.started_at) != (incoming.target, incoming.started_at):
                raise Conflict(
                    f"run {incoming.name!r} on {incoming.target} (started {incoming.started_at}) clashes "
                    f"with the recorded run of that name on {stored.target} (started {stored.started_at})",
                    hint="rename one of the run directories; names are unique across targets",
                )
            merged = RunRecord(
                **{
                    **stored.to_dict(),
                    **{
                        k: v
                        for k, v in incoming.to_dict().items()
                        if k not in ("state", "exit_code", "last_step", "extra")
                    },
                }
            )
            for key in ("state", "exit_code", "last_step"):
                if key in data:
                    setattr(merged, key, getattr(incoming, key))
            merged.extra = {**stored.extra, **incoming.extra}
            if merged.to_dict() == stored.to_dict():
                return "unchanged"
            self._conn.run("DELETE FROM runs WHERE name = ?", (incoming.name,))
            self._insert(merged)
            return "updated"

    def close(self) -> None:
        """Close the connection (safe to call twice)."""
        self._conn.close()

    def __enter__(self) -> LineageDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
