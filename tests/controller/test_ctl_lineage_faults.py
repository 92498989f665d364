"""A lineage.sqlite that cannot be written or has a corrupt page (issue 15, item 14), made for real: a
read-only bind mount over the file (root only; os.access and SQLite both see EROFS, as on a read-only
share), and a page of the `runs` table overwritten with garbage. Every verb answers with one `error:` line
naming the file and a `hint:`; a deploy launches nothing; a stop still stops the run (the lineage is a
warning then); `runs sync` rebuilds a moved-aside database from the run.json files."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import Env

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")


def deploy(env: Env, name: str) -> subprocess.CompletedProcess[str]:
    return env.run_cli("deploy", "local", "--profile", "work", "--name", name, "--wait", r"^step 1 ", "--timeout", "30")


def assert_one_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


@pytest.fixture
def read_only_db(env: Env) -> Iterator[Env]:
    """env with a stopped run and a running one recorded, then its lineage.sqlite bind-mounted read-only."""
    assert deploy(env, "ro-a1").returncode == 0
    assert env.run_cli("stop", "ro-a1", "--grace", "5").returncode == 0
    assert deploy(env, "ro-run").returncode == 0
    sqlite3.connect(env.db).execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
    subprocess.run(["mount", "--bind", str(env.db), str(env.db)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(env.db)], check=True)
        yield env
    finally:
        subprocess.run(["umount", str(env.db)], check=True)


@needs_root
def test_item14_read_only_lineage_refuses_a_deploy_before_it_launches(read_only_db: Env) -> None:
    env = read_only_db
    before = env.db.read_bytes()
    result = deploy(env, "ro-a2")
    assert result.returncode == 2
    assert_one_error(result, f"lineage database {env.db} cannot be written", "writable")
    assert not (env.runs / "ro-a2").exists()  # refused at the name claim, before the sync and the launch
    assert env.db.read_bytes() == before


@needs_root
def test_item14_read_only_lineage_still_lists_shows_and_stops(read_only_db: Env) -> None:
    env = read_only_db
    listed = env.run_cli("runs", "list")
    assert listed.returncode == 0 and "ro-a1" in listed.stdout and "Traceback" not in listed.stderr
    shown = env.run_cli("status", "ro-a1")
    assert shown.returncode == 0 and "stopped" in shown.stdout and "Traceback" not in shown.stderr
    # The stop signals first; only the bookkeeping after it meets the read-only file, and that is a warning.
    stopped = env.run_cli("stop", "ro-run", "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert "warning: the lineage was not updated" in stopped.stderr and "Traceback" not in stopped.stderr
    assert (env.runs / "ro-run" / "exit_code").read_text().strip() == "143"


@pytest.fixture
def corrupt_db(env: Env) -> Iterator[Env]:
    """env with a running run and a stopped one recorded, then the `runs` table's root page overwritten."""
    assert deploy(env, "co-a1").returncode == 0
    assert env.run_cli("stop", "co-a1", "--grace", "5").returncode == 0
    assert deploy(env, "co-a2").returncode == 0
    conn = sqlite3.connect(env.db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root_page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
    conn.close()
    with env.db.open("r+b") as handle:
        handle.seek((root_page - 1) * page_size)
        handle.write(b"\xde\xad" * (page_size // 2))
    yield env


def test_item14_corrupt_lineage_gives_one_error_with_the_file_and_the_rebuild_hint(corrupt_db: Env) -> None:
    env = corrupt_db
    for verb in (("runs", "list"), ("runs", "tree"), ("runs", "show", "co-a1")):
        result = env.run_cli(*verb)
        assert result.returncode == 2, (verb, result.stderr)
        assert_one_error(result, f"lineage database {env.db} is corrupt", "runs sync")
    result = deploy(env, "co-a3")
    assert result.returncode == 2
    assert_one_error(result, "is corrupt")
    assert not (env.runs / "co-a3").exists()


def test_item14_stop_and_status_work_past_a_corrupt_lineage(corrupt_db: Env) -> None:
    env = corrupt_db
    status = env.run_cli("status", "co-a2")
    assert status.returncode == 0 and "running" in status.stdout
    assert "warning:" in status.stderr and "is corrupt" in status.stderr and "Traceback" not in status.stderr
    stopped = env.run_cli("stop", "co-a2", "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert "exit_code=143" in stopped.stdout and "warning: the lineage was not updated" in stopped.stderr
    assert (env.runs / "co-a2" / "exit_code").read_text().strip() == "143"


def test_item14_a_corrupt_lineage_moved_aside_is_rebuilt_by_runs_sync(corrupt_db: Env) -> None:
    env = corrupt_db
    env.run_cli("stop", "co-a2", "--grace", "5")
    env.db.rename(env.db.with_name("lineage.sqlite.corrupt"))
    for suffix in ("-wal", "-shm"):
        Path(f"{env.db}{suffix}").unlink(missing_ok=True)
    synced = env.run_cli("runs", "sync")  # no target named: every target of the inventory
    assert synced.returncode == 0, synced.stderr
    assert "added     co-a1 (local)" in synced.stdout and "added     co-a2 (local)" in synced.stdout
    listed = env.run_cli("runs", "list")
    assert listed.returncode == 0 and "co-a1" in listed.stdout and "co-a2" in listed.stdout
