"""The lineage at scale, small: a restart chain deeper than Python's recursion limit, `tree RUN` reading only
its family, `runs list` paging, `runs sync` in one transaction, and secrets redacted on write read back through
every view. The timed figures at full size are bench/control_plane_scale.py's (bench/results/control-plane.md)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.cli.main import main
from dflashops.lineage import LineageDB, RunRecord

DEPTH = 1200  # `runs tree` raised RecursionError past ~450 generations (two frames each)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["runs", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def chain(db: LineageDB, depth: int, prefix: str = "g") -> list[str]:
    names = [f"{prefix}{index}" for index in range(depth)]
    with db.batch():
        for index, name in enumerate(names):
            db.record(RunRecord(name=name, parent=names[index - 1] if index else None, argv=["--lr", str(index)]))
    return names


@pytest.fixture
def default_recursion_limit() -> Iterator[None]:
    """The interpreter's default limit (1000) for the test: an earlier test in the same worker process may have
    raised it (torch's compiler does), and a chain deeper than the limit is what the test is about."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)


def test_tree_of_a_chain_deeper_than_the_recursion_limit(
    db: LineageDB, db_path: Path, capsys: pytest.CaptureFixture[str], default_recursion_limit: None
) -> None:
    assert sys.getrecursionlimit() < DEPTH
    names = chain(db, DEPTH)
    db.record(RunRecord(name="side", parent="g5"))  # a branch: siblings hang under their parent
    code, out, err = run_cli(capsys, "tree", "--db", str(db_path))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].startswith("└── g0  [launched]")
    # an only child continues its parent's column: the chain does not walk off to the right
    assert any(line.startswith("    ↳ g5  [launched]") for line in lines)
    # under g6, the first of g5's two children
    assert any(line.startswith("      │   ↳ g1199  [launched]") for line in lines)
    assert max(len(line) for line in lines) < 120
    assert "├── g6  [" in out and "└── side  [" in out
    code, out, err = run_cli(capsys, "tree", "--db", str(db_path), "--json")
    assert code == 0, err
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10 * DEPTH)  # the reader's own limit; the JSON itself is plain nested objects
    try:
        node = json.loads(out)[0]
    finally:
        sys.setrecursionlimit(limit)
    walked = []
    while node:
        walked.append(node["name"])
        node = next((child for child in node["children"] if child["name"] != "side"), None)
    assert walked == names


def test_tree_run_reads_its_ancestors_and_descendants_only(
    db: LineageDB, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain(db, 6)
    db.record(RunRecord(name="cousin", parent="g2"))
    db.record(RunRecord(name="other-root"))
    assert [run.name for run in db.family("g3")] == ["g0", "g1", "g2", "g3", "g4", "g5"]
    code, out, err = run_cli(capsys, "tree", "g3", "--db", str(db_path), "--json")
    assert code == 0, err
    text = json.dumps(json.loads(out))
    assert '"g5"' in text and "cousin" not in text and "other-root" not in text
    assert {run.name for run in db.family("cousin")} == {"g0", "g1", "g2", "cousin"}


def test_list_is_newest_first_in_pages(db: LineageDB, db_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with db.batch():
        for index in range(120):
            db.record(RunRecord(name=f"p{index:03d}", started_at=f"2026-11-01T00:{index // 60:02d}:{index % 60:02d}Z"))
    code, out, err = run_cli(capsys, "list", "--db", str(db_path))
    assert code == 0, err
    rows = [line.split()[0] for line in out.splitlines()[1:]]
    assert rows == [f"p{index:03d}" for index in range(119, 69, -1)]  # the newest 50
    assert "runs 1-50 of 120, newest first; the next: --page 2; --all for every run" in err
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), "--page", "3", "--json")
    assert [row["name"] for row in json.loads(out)] == [f"p{index:03d}" for index in range(19, -1, -1)]
    assert "runs 101-120 of 120" in err and "--page 4" not in err
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), "--limit", "7", "--page", "2")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [f"p{index:03d}" for index in range(112, 105, -1)]
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), "--json")
    assert len(json.loads(out)) == 120 and err == ""  # --json: every run unless a page is asked for
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), "--all")
    assert len(out.splitlines()) == 121 and err == ""
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), "--page", "9")
    assert code == 0 and out == "" and "no runs on page 9: 120 runs make 3 pages" in err


@pytest.mark.parametrize("bad", [["--limit", "0"], ["--page", "0"], ["--all", "--limit", "5"]])
def test_bad_paging_is_one_error_line(
    db: LineageDB, db_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    db.record(RunRecord(name="only"))
    code, out, err = run_cli(capsys, "list", "--db", str(db_path), *bad)
    assert code == 2 and out == ""
    assert err.splitlines()[0].startswith("error: ") and err.splitlines()[1].startswith("hint: ")


SECRETS = ("hf_abcdefghijklmnopqrst", "sk-proj0123456789abcdef", "s3cr3t-pa55")


def test_a_secret_written_is_read_back_redacted_through_every_view(
    db: LineageDB, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows are redacted once, when written (reads no longer redact again): every write path, then every view."""
    db.record(RunRecord(name="base"))
    run = RunRecord(name="leaky", parent="base", argv=["train", "--hf-token", SECRETS[0]])
    run.env["OPENAI_API_KEY"] = SECRETS[1]  # changed after it was built: the write redacts it all the same
    run.argv.append(f"--db-url=postgres://user:{SECRETS[2]}@host/db")
    run.extra["pushed_to"] = f"https://user:{SECRETS[2]}@example.com/repo"
    db.record(run)
    db.set_state("leaky", "running", extra={"token_seen": SECRETS[0]})
    db.import_run_json(
        {"name": "synced", "target": "local", "argv": ["--api-key", SECRETS[1]], "extra": {"k": SECRETS[0]}}
    )
    raw = db_path.read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("lineage.sqlite-*"))
    assert not any(secret.encode() in raw for secret in SECRETS)
    views = [
        ["list"], ["list", "--json"], ["list", "--all"], ["tree"], ["tree", "--json"], ["tree", "leaky"],
        ["show", "leaky"], ["show", "leaky", "--json"], ["show", "synced", "--json"], ["diff", "base", "leaky"],
        ["diff", "base", "leaky", "--json"], ["export"], ["export", "--json"],
    ]  # fmt: skip
    for view in views:
        code, out, err = run_cli(capsys, *view, "--db", str(db_path))
        assert code == 0, (view, err)
        assert not any(secret in out + err for secret in SECRETS), view
        if view == ["show", "leaky", "--json"]:
            shown = json.loads(out)
            assert shown["env"]["OPENAI_API_KEY"] == "<redacted>" and shown["extra"]["token_seen"] == "<redacted>"


def test_reads_do_not_redact_again(db: LineageDB, db_path: Path) -> None:
    """A read builds records from the stored row as it is (RunRecord.stored): the row was redacted when written.
    The evidence without timing: a token-shaped word put into a stored row behind the writer's back (plain
    SQLite, as no write path can) comes back verbatim through every read, which the redactor would have
    replaced. The write path still redacts it (the test above; this one writes it through the DB too)."""
    db.record(RunRecord(name="a", argv=["train", "--hf-token", SECRETS[0]], env={"HF_TOKEN": SECRETS[0]}))
    assert db.get("a").argv == ["train", "--hf-token", "<redacted>"] and db.get("a").env["HF_TOKEN"] == "<redacted>"
    with sqlite3.connect(db_path) as raw:  # behind the writer: what a redactor on the read path would catch
        raw.execute(
            "UPDATE runs SET argv = ?, env = ? WHERE name = 'a'",
            (json.dumps(["train", "--hf-token", SECRETS[0]]), json.dumps({"HF_TOKEN": SECRETS[0]})),
        )
    raw.close()
    for record in (db.get("a"), db.list()[0], db.family("a")[0]):
        assert record.argv == ["train", "--hf-token", SECRETS[0]] and record.env == {"HF_TOKEN": SECRETS[0]}


def test_sync_of_many_run_directories_is_one_transaction_beside_a_concurrent_writer(
    db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs sync` writes every run in one transaction while another process records runs one by one: both
    finish (each waits for the other's lock), every row is there, and the file stays one sound database."""
    runs = tmp_path / "ws" / "runs"
    for index in range(150):
        run = runs / f"s{index:03d}"
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"name": run.name, "target": "local", "launcher": "nohup"}))
        (run / "exit_code").write_text("0\n")
    LineageDB(db_path).close()  # the schema exists before both start
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        with LineageDB(db_path) as db:
            while db.count() == 0:  # the writer is writing: the sync starts in the middle of it
                assert writer.poll() is None and time.monotonic() < deadline, writer.stderr
                time.sleep(0.01)
        code, _, err = run_cli(capsys, "sync", "--workspace", str(tmp_path / "ws"), "--db", str(db_path))
    finally:
        out, werr = writer.communicate(timeout=120)
    assert code == 0, err
    assert writer.returncode == 0, werr
    assert "sync: 150 added, 0 updated, 0 unchanged, 0 failed" in err
    with LineageDB(db_path) as db:
        assert db.count() == 150 + 60
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


WRITER = """
import sys, time
from dflashops.lineage import LineageDB, RunRecord
with LineageDB(sys.argv[1]) as db:
    for index in range(60):
        db.record(RunRecord(name=f"w{index:03d}"))
        time.sleep(0.01)
"""
