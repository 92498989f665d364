"""The lineage at scale, small: a restart chain deeper than Python's recursion limit, `tree RUN` reading only
its family, `runs list` paging, `runs sync` in one transaction, and secrets redacted on write read back through
every view. The timed figures at full size are bench/control_plane_scale.py's (bench/RESULTS.md)."""

from __future__ import annotations

import json
import sys
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


def test_tree_of_a_chain_deeper_than_the_recursion_limit(
    db: LineageDB, db_path: Path, capsys: pytest.CaptureFixture[str]
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
