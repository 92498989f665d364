"""`logs` and `watch` only read (docs/architecture.md "Reading and acting"): with a real agent, real runs and the real
SQLite lineage file, they leave that file as it was (content and mtime), never create it and never migrate it,
while `status`, the verb that acts on what it reads, still brings the lineage up to date."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from tests.controller.helpers import Env


def lineage_state(db: Path, run: str) -> str:
    """The run's state in the lineage, read without writing (the test must not change what it checks)."""
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return str(conn.execute("SELECT state FROM runs WHERE name = ?", (run,)).fetchone()[0])
    finally:
        conn.close()


def fingerprint(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def finished_but_recorded_running(env: Env, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """A run launched with --detach that has finished on the target while its lineage record still says it was
    launched: the state a verb that acts would write, and a read must leave alone."""
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", name, "--launcher", "nohup", "--", "--steps", "2",
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    deadline = time.monotonic() + 60
    while env.agent("status", {"workspace": str(env.workspace), "name": name})["runs"][0]["state"] != "finished":
        assert time.monotonic() < deadline, f"{name} did not finish"
        time.sleep(0.05)
    assert lineage_state(env.db, name) in ("launched", "running")
    time.sleep(0.01)  # a write now would show in the mtime, whatever the file system's clock granularity


def test_logs_leaves_the_lineage_file_as_it_was(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    finished_but_recorded_running(env, capsys, "rd")
    before = fingerprint(env.db)
    for args in (["logs", "rd"], ["logs", "rd", "-f", "--timeout", "30"], ["logs", "rd", "-n", "1"]):
        code, out, err = env.cli(*args, capsys=capsys)
        assert code == 0 and out, (args, err)
    assert fingerprint(env.db) == before
    assert lineage_state(env.db, "rd") in ("launched", "running")
    code, _, err = env.cli("status", "rd", capsys=capsys)  # the verb that acts brings the record up to date
    assert code == 0, err
    assert lineage_state(env.db, "rd") == "finished"


def test_logs_does_not_create_the_lineage(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    finished_but_recorded_running(env, capsys, "rd")
    env.db.rename(env.root / "kept.sqlite")
    code, out, err = env.cli("logs", "rd", capsys=capsys)
    assert code == 0 and "step" in out, err  # found on the default target, as with no record
    assert not env.db.exists()


def test_logs_does_not_migrate_the_lineage(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A lineage file of schema version 0 (its migrations table, nothing applied): reading it must not migrate it."""
    finished_but_recorded_running(env, capsys, "rd")
    for suffix in ("", "-wal", "-shm"):  # the whole database, its WAL files included, so no old page comes back
        env.db.with_name(env.db.name + suffix).unlink(missing_ok=True)
    conn = sqlite3.connect(env.db)
    conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
    conn.commit()
    conn.close()
    before = fingerprint(env.db)
    time.sleep(0.01)
    code, out, err = env.cli("logs", "rd", "-f", "--timeout", "30", capsys=capsys)
    assert code == 0 and "step" in out, err
    assert fingerprint(env.db) == before


def test_a_watch_snapshot_changes_nothing(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    finished_but_recorded_running(env, capsys, "rd")
    before = fingerprint(env.db)
    code, out, err = env.cli("watch", "rd", "--json", capsys=capsys)
    assert code == 0, err
    assert [row["state"] for row in json.loads(out)["runs"]] == ["finished"]
    code, out, err = env.cli("watch", "--all", "--once", capsys=capsys)
    assert code == 0 and "rd" in out, err
    assert fingerprint(env.db) == before
    assert lineage_state(env.db, "rd") in ("launched", "running")
