"""LineageDB on real SQLite files: records, errors, refusal of bad files, two writer processes."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dflashops.core.errors import Conflict, NotFound, UsageError
from dflashops.lineage import SCHEMA_VERSION, LineageDB, LineageDBError, RunRecord

REPO = Path(__file__).resolve().parents[2]


def test_record_roundtrip_real_wal_file_with_schema_version(db: LineageDB, db_path: Path) -> None:
    stored = db.record(
        RunRecord(
            name="exp-a",
            note="try bigger lr",
            argv=["python", "-m", "trainer", "--lr", "3e-4"],
            gpus="0,1",
            exit_code=None,
        )
    )
    assert stored.name == "exp-a" and stored.gpus == [0, 1] and stored.note == "try bigger lr"
    assert db.get("exp-a") == stored
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] == SCHEMA_VERSION
    raw.close()
    db.close()
    with LineageDB(db_path) as reopened:  # reopening does not migrate twice
        assert [r.name for r in reopened.list()] == ["exp-a"]


def test_duplicate_name_is_a_conflict_and_changes_nothing(db: LineageDB) -> None:
    db.record(RunRecord(name="exp-a", note="first"))
    with pytest.raises(Conflict) as caught:
        db.record(RunRecord(name="exp-a", note="second"))
    assert "already used" in caught.value.message and "--name +" in caught.value.hint
    assert [(r.name, r.note) for r in db.list()] == [("exp-a", "first")]


def test_unknown_run_hint_lists_close_names(db: LineageDB) -> None:
    for name in ("exp-flex5", "exp-flex6", "other"):
        db.record(RunRecord(name=name))
    with pytest.raises(NotFound) as caught:
        db.get("exp-flx6")
    assert "exp-flex6" in caught.value.hint and "other" not in caught.value.hint
    with pytest.raises(NotFound):
        db.children("nope")


def test_parent_must_be_recorded_unless_allowed(db: LineageDB) -> None:
    with pytest.raises(NotFound):
        db.record(RunRecord(name="child", parent="ghost"))
    assert db.list() == []
    db.record(RunRecord(name="child", parent="ghost"), allow_missing_parent=True)
    assert db.ancestors("child")[0].name == "child" and db.root("child") == "child"


@pytest.mark.parametrize("bad", ["a;b", "a b", "..", "a/b", "it's", "x" * 65])
def test_invalid_names_are_refused(db: LineageDB, bad: str) -> None:
    with pytest.raises(UsageError):
        db.record(RunRecord(name=bad))
    assert db.list() == []


def test_lineage_queries_and_set_state(three_runs: dict, db: LineageDB) -> None:
    assert [r.name for r in db.children("exp-flex5")] == ["exp-flex6"]
    assert [r.name for r in db.ancestors("exp-flex7")] == ["exp-flex5", "exp-flex6", "exp-flex7"]
    assert db.root("exp-flex7") == "exp-flex5"
    updated = db.set_state("exp-flex7", "stopped", exit_code=143, last_step=30, extra={"pgid": 42})
    assert (updated.state, updated.exit_code, updated.last_step) == ("stopped", 143, 30)
    assert updated.extra["pgid"] == 42 and "run_dir" in updated.extra  # extra is merged, not replaced
    with pytest.raises(ValueError):
        db.set_state("exp-flex7", "exploded")
    with pytest.raises(TypeError):
        db.set_state("exp-flex7", "running", argv=["x"])
    with pytest.raises(NotFound):
        db.set_state("ghost", "running")


def test_record_as_next_derives_the_name(db: LineageDB) -> None:
    db.record(RunRecord(name="exp-ddtree-flex5"))
    db.record(RunRecord(name="exp-ddtree-flex6"))
    child = db.record_as_next(RunRecord(name="placeholder", parent="exp-ddtree-flex5"), after="exp-ddtree-flex5")
    assert child.name == "exp-ddtree-flex7" and child.parent == "exp-ddtree-flex5"


def test_import_run_json_is_idempotent(db: LineageDB) -> None:
    run_json = {
        "name": "exp-a",
        "hypothesis": "h1",
        "code_hash": "c" * 40,
        "argv": ["python", "x"],
        "env": {"HF_TOKEN": "hf_abcdefghijklmnop"},
        "target": "local",
        "launcher": "tmux",
        "session": "exp-a",
        "started_at": "2026-11-29T07:00:00Z",
        "pgid": 1234,
    }
    assert db.import_run_json(run_json) == "added"
    assert db.import_run_json(run_json) == "unchanged"
    stored = db.get("exp-a")
    assert stored.note == "h1" and stored.extra["pgid"] == 1234 and stored.env["HF_TOKEN"] == "<redacted>"
    assert db.import_run_json({**run_json, "state": "finished", "exit_code": 0, "last_step": 99}) == "updated"
    assert (db.get("exp-a").state, db.get("exp-a").last_step) == ("finished", 99)
    assert db.import_run_json(run_json) == "unchanged"  # no state in run.json: the known state is kept
    with pytest.raises(Conflict):
        db.import_run_json({**run_json, "target": "ct200", "started_at": "2026-11-30T00:00:00Z"})
    with pytest.raises(LineageDBError):
        db.import_run_json({"argv": []})


def test_secrets_never_reach_the_file(db: LineageDB, db_path: Path) -> None:
    secrets = ["wandbsecret0123456789", "hf_topsecretvalue123", "pw-hunter2-xyz"]
    db.record(
        RunRecord(
            name="exp-s",
            env={"WANDB_API_KEY": secrets[0], "HF_TOKEN": secrets[1], "DB_PASSWORD": secrets[2]},
            argv=["python", "-m", "trainer", "--hf-token", secrets[1], f"--api-key={secrets[0]}"],
        )
    )
    db.close()
    blob = b"".join(p.read_bytes() for p in db_path.parent.iterdir() if p.name.startswith(db_path.name))
    for secret in secrets:
        assert secret.encode() not in blob
    assert b"WANDB_API_KEY" in blob  # the key is kept (diffs show it), only the value is gone


def _snapshot(path: Path) -> tuple[bytes, int, list[str]]:
    return path.read_bytes(), path.stat().st_mtime_ns, sorted(p.name for p in path.parent.iterdir())


def test_garbage_file_is_refused_untouched(db_path: Path) -> None:
    db_path.write_bytes(b"this is not sqlite\n" * 100)
    before = _snapshot(db_path)
    with pytest.raises(LineageDBError) as caught:
        LineageDB(db_path)
    assert "not a lineage database" in caught.value.message
    assert _snapshot(db_path) == before


def test_foreign_sqlite_file_is_refused_untouched(db_path: Path) -> None:
    foreign = sqlite3.connect(db_path)
    foreign.execute("CREATE TABLE photos (id INTEGER)")
    foreign.commit()
    foreign.close()
    before = _snapshot(db_path)
    with pytest.raises(LineageDBError) as caught:
        LineageDB(db_path)
    assert "not a dflashops lineage database" in caught.value.message and "photos" in caught.value.message
    assert _snapshot(db_path) == before


def test_newer_schema_is_refused_untouched(db_path: Path) -> None:
    LineageDB(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute("INSERT INTO schema_migrations VALUES (?, 'future')", (SCHEMA_VERSION + 1,))
    raw.commit()
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.close()
    before = _snapshot(db_path)
    with pytest.raises(LineageDBError) as caught:
        LineageDB(db_path)
    assert "newer" in caught.value.message and "upgrade" in caught.value.hint
    assert _snapshot(db_path) == before


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        LineageDB(tmp_path / "nope" / "lineage.sqlite")
    assert not (tmp_path / "nope").exists()


WRITER = """
import sys
from dflashops.lineage import LineageDB, RunRecord
db = LineageDB(sys.argv[1])
for _ in range(20):
    db.record_as_next(RunRecord(name="x", parent="base"), after="base")
db.close()
"""


def test_two_processes_write_at_once(db: LineageDB, db_path: Path) -> None:
    db.record(RunRecord(name="base"))
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(db_path)], cwd=REPO, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for writer in writers:
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err.decode()
    names = {r.name for r in db.list()}
    assert names == {"base", *(f"base-v{n}" for n in range(2, 42))}


def _hold_a_read_lock(path: Path) -> sqlite3.Connection:
    """Another process's open read transaction on the (new, empty) file: what a second dflashops command has
    while this one switches the file to WAL."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)  # released from a timer thread
    other.execute("BEGIN")
    other.execute("SELECT * FROM sqlite_master").fetchall()
    return other


_OPEN_AT = """
import sys, time
from pathlib import Path
from dflashops.lineage import LineageDB
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time() - 0.03))  # asleep until 30 ms before: 48 spinning interpreters cost ~18 CPU-s
while time.time() < start:  # then spin, so both leave within microseconds of each other
    pass
LineageDB(Path(sys.argv[1]))
"""


def test_commands_opening_a_new_database_together_all_succeed(tmp_path: Path) -> None:
    """Two processes opening the same new file at the same instant both switch it to WAL. SQLite answers the
    loser of that race "database is locked" at once, without its busy handler (each holds a read lock the
    other's switch waits for); before the retry that failed ~1 pair in 6 here, so 24 pairs all failing to hit
    it has a probability of ~1%."""
    import time

    repo = str(Path(__file__).resolve().parents[2])
    for pair in range(24):
        path = tmp_path / f"lineage-{pair}.sqlite"
        start = time.time() + 0.4  # both interpreters are up and spinning by then
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _OPEN_AT, str(path), str(start)],
                stderr=subprocess.PIPE,
                text=True,
                env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin"},
            )
            for _ in range(2)
        ]
        errors = [proc.communicate(timeout=60)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], f"pair {pair}: {errors}"


def test_a_reader_that_never_leaves_is_a_clear_locked_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflashops.lineage import db as db_module

    monkeypatch.setattr(db_module, "BUSY_TIMEOUT_MS", 300)
    path = tmp_path / "lineage.sqlite"
    other = _hold_a_read_lock(path)
    with pytest.raises(LineageDBError, match="is locked by another dflashops") as caught:
        LineageDB(path)
    assert caught.value.hint and "try again" in caught.value.hint
    other.close()


def test_an_in_memory_database_opens_at_once() -> None:
    """:memory: cannot be WAL (SQLite answers the old mode, no error): that is no reason to wait or fail."""
    import time

    started = time.monotonic()
    db = LineageDB(Path(":memory:"))
    assert time.monotonic() - started < 5
    assert db._conn.query("PRAGMA journal_mode")[0][0] == "memory"
