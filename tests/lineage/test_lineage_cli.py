"""The `runs` verbs end to end: in-process through cli.runs.main, and one real process for output hygiene."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflashops.cli.main import main
from dflashops.lineage import LineageDB
from dflashops.ops.observe.plot import LINE_STYLES, style_for

from .conftest import write_metrics

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["runs", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_show_diff_json(three_runs: dict, db_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "list", "--db", str(db_path), "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == three_runs["names"]
    code, out, _ = run_cli(capsys, "list", "--db", str(db_path), "--state", "crashed")
    assert code == 0 and "exp-flex6" in out and "crashed (exit 1)" in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["exp-flex6"]
    code, out, _ = run_cli(capsys, "show", "exp-flex6", "--db", str(db_path), "--json")
    shown = json.loads(out)
    assert shown["children"] == ["exp-flex7"] and "~ --lr 1e-4 -> 3e-4" in shown["changes_vs_parent"]
    assert shown["env"]["WANDB_API_KEY"] == "<redacted>"
    code, out, _ = run_cli(capsys, "show", "exp-flex6", "--db", str(db_path))
    assert code == 0 and "exp-flex6" in out and "children: exp-flex7" in out
    # rich pads each cell to its column's width: piped, no line keeps those trailing blanks
    assert [line for line in out.splitlines() if line.endswith(" ")] == []
    code, out, _ = run_cli(capsys, "diff", "exp-flex5", "exp-flex7", "--db", str(db_path))
    assert code == 0 and "+ --compile (set)" in out and "~ --lr 1e-4 -> 3e-4" in out and "code_hash" in out
    code, out, _ = run_cli(capsys, "diff", "exp-flex6", "exp-flex7", "--db", str(db_path), "--json")
    assert json.loads(out)["args"]["added"] == {"--compile": "(set)"}


def test_tree_shows_state_steps_tau_note_and_change(
    three_runs: dict, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "tree", "--db", str(db_path))
    assert code == 0
    assert "exp-flex5  [finished]  step 40  best tau_sim 1.500" in out
    assert "exp-flex6  [crashed (exit 1)]" in out and "note: hypothesis 1" in out
    assert "vs parent: code abababab" in out and "--lr 1e-4->3e-4" in out
    assert "vs parent: add --compile" in out
    code, out, _ = run_cli(capsys, "tree", "exp-flex7", "--db", str(db_path), "--json")
    (root,) = json.loads(out)
    assert root["name"] == "exp-flex5" and root["children"][0]["children"][0]["name"] == "exp-flex7"
    assert root["children"][0]["children"][0]["best_tau_sim"] == pytest.approx(2.5)


def test_unknown_run_and_missing_diff_side(three_runs: dict, db_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "show", "exp-flex8", "--db", str(db_path))
    assert code == 3 and out == ""
    assert err.splitlines()[0].startswith("error: no run named 'exp-flex8'")
    assert err.splitlines()[1].startswith("hint: did you mean: exp-flex")
    code, out, err = run_cli(capsys, "diff", "exp-flex5", "ghost", "--db", str(db_path))
    assert code == 3 and "ghost" in err and out == ""
    code, _, err = run_cli(capsys, "tree", "ghost", "--db", str(db_path))
    assert code == 3 and "ghost" in err


def test_reads_never_create_a_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "lineage.sqlite"
    assert run_cli(capsys, "list", "--db", str(missing), "--json")[:2] == (0, "[]\n")
    code, _, err = run_cli(capsys, "show", "x", "--db", str(missing))
    assert code == 3 and "no lineage database" in err
    assert not missing.exists()


def test_plot_writes_png_and_refuses_unknown_metric(
    three_runs: dict, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_png = tmp_path / "tau.png"
    code, out, _ = run_cli(
        capsys, "plot", *three_runs["names"], "--metric", "tau_sim", "--out", str(out_png), "--db", str(db_path)
    )
    assert code == 0 and out.strip() == str(out_png)
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_cli(
        capsys, "plot", "exp-flex5", "--metric", "accuracy", "--out", str(tmp_path / "x.png"), "--db", str(db_path)
    )
    assert code == 2 and "error: no run among exp-flex5 has metric 'accuracy'" in err
    assert "hint: metrics found: block_tok_s, loss, tau_sim" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    code, _, err = run_cli(capsys, "plot", "exp-flex5", "--out", str(tmp_path / "x.svg"), "--db", str(db_path))
    assert code == 2 and ".png" in err


def test_plot_without_out_writes_a_named_file_here_and_says_where(
    three_runs: dict, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dflashops runs plot A B` with no --out (was an argparse error): RUN-RUN-METRIC.png in this folder, said on
    stderr, its path on stdout; a second plot is numbered, never written over the first."""
    monkeypatch.chdir(tmp_path)
    names = three_runs["names"][:2]
    code, out, err = run_cli(capsys, "plot", *names, "--db", str(db_path))
    first = Path(f"{names[0]}-{names[1]}-loss.png")
    assert code == 0 and out.strip() == str(first) and first.read_bytes()[:4] == b"\x89PNG"
    assert err == f"plot of loss written to {first} (--out FILE.png names another file)\n"
    code, out, _ = run_cli(capsys, "plot", *names, "--db", str(db_path))
    assert code == 0 and out.strip() == f"{names[0]}-{names[1]}-loss-2.png" and first.read_bytes()[:4] == b"\x89PNG"


def test_item23_plot_without_matplotlib_says_how_to_get_it(three_runs: dict, db_path: Path, tmp_path: Path) -> None:
    # A real process in which `import matplotlib` fails, as in a plain install without the plot extra.
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named matplotlib (hidden by the test)')\n")
    out_png = tmp_path / "loss.png"
    env = {**os.environ, "PYTHONPATH": f"{shim.parent}{os.pathsep}{REPO}"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflashops.cli.main",
            "runs",
            "plot",
            *three_runs["names"],
            "--out",
            str(out_png),
            "--db",
            str(db_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and out.stdout == "" and not out_png.exists(), out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("error: runs plot needs matplotlib") and "Traceback" not in out.stderr, out.stderr
    assert lines[-1] == "hint: pip install 'dflashops[plot]'", out.stderr
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["plot"])


def test_plot_styles_distinguish_runs_without_colour() -> None:
    pairs = {(str(style_for(i)["linestyle"]), style_for(i)["marker"]) for i in range(len(LINE_STYLES) * 8)}
    assert len(pairs) == len(LINE_STYLES) * 8


def test_item20_export_takes_json_like_the_other_data_verbs(
    three_runs: dict, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, as_json, _ = run_cli(capsys, "export", "--json", "--db", str(db_path))
    assert code == 0 and [row["name"] for row in json.loads(as_json)] == three_runs["names"]
    assert run_cli(capsys, "export", "--format", "json", "--db", str(db_path))[1] == as_json  # --format still works
    code, out, err = run_cli(capsys, "export", "--json", "--format", "csv", "--db", str(db_path))
    assert code == 2 and out == "" and err.startswith("error: ") and "hint: " in err


def test_export_csv_and_json(
    three_runs: dict, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "export", "--format", "csv", "--db", str(db_path))
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["name"] for r in rows] == three_runs["names"]
    assert json.loads(rows[1]["argv"])[-4:] == ["--lr", "3e-4", "--batch", "8"] and rows[1]["exit_code"] == "1"
    target = tmp_path / "export.json"
    code, out, _ = run_cli(capsys, "export", "--format", "json", "--out", str(target), "--db", str(db_path))
    assert code == 0 and [r["parent"] for r in json.loads(target.read_text())] == [None, "exp-flex5", "exp-flex6"]
    code, _, err = run_cli(capsys, "export", "--out", str(tmp_path / "no" / "x.csv"), "--db", str(db_path))
    assert code == 2 and "does not exist" in err


def _run_dir(workspace: Path, name: str, parent: str | None, exit_code: int | None, stopped: bool = False) -> None:
    directory = workspace / "runs" / name
    write_metrics(directory, [{"step": 5, "loss": 2.0, "tau_sim": 1.5}])
    run_json = {
        "name": name,
        "parent": parent,
        "hypothesis": f"why {name}",
        "code_hash": "e" * 40,
        "argv": ["python", "-m", "trainer", "train"],
        "env": {"HF_TOKEN": "<redacted>"},
        "target": "local",
        "launcher": "nohup",
        "session": name,
        "started_at": f"2026-11-29T07:0{len(name) % 10}:00Z",
        "run_dir": str(directory),
    }
    (directory / "run.json").write_text(json.dumps(run_json))
    if exit_code is not None:
        (directory / "exit_code").write_text(f"{exit_code}\n")
    if stopped:
        (directory / "stop.json").write_text("{}")


def test_sync_rebuilds_lineage_from_a_workspace(
    tmp_path: Path, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    _run_dir(workspace, "exp-b", "exp-a", 1)  # child first: import order must not matter
    _run_dir(workspace, "exp-a", None, 0)
    _run_dir(workspace, "exp-c", "exp-b", 143, stopped=True)
    (workspace / "runs" / "junk").mkdir()  # a folder without run.json is reported, not fatal
    code, out, err = run_cli(capsys, "sync", "--workspace", str(workspace), "--db", str(db_path), "--json")
    outcomes = {item["name"]: item["outcome"] for item in json.loads(out)}
    assert code == 0 and outcomes == {"exp-a": "added", "exp-b": "added", "exp-c": "added", "junk": "skipped"}
    with LineageDB(db_path) as db:
        assert [(r.name, r.state, r.exit_code, r.last_step) for r in db.list()] == [
            ("exp-a", "finished", 0, 5),
            ("exp-b", "crashed", 1, 5),
            ("exp-c", "stopped", 143, 5),
        ]
        assert db.get("exp-b").note == "why exp-b" and db.root("exp-c") == "exp-a"
    code, out, err = run_cli(capsys, "sync", "--workspace", str(workspace), "--db", str(db_path))
    assert code == 0 and "0 added, 0 updated, 3 unchanged" in err


def test_sync_without_a_source_is_refused(
    db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runs sync` alone reads every target of the inventory; one with no targets has nothing to read."""
    (tmp_path / "inventory.yaml").write_text("targets: {}\n")
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(tmp_path / "inventory.yaml"))
    code, _, err = run_cli(capsys, "sync", "--db", str(db_path))
    assert code == 2 and "nothing to sync" in err and not db_path.exists()


def test_real_process_no_colour_and_data_on_stdout(three_runs: dict, db_path: Path) -> None:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO), "TERM": "xterm-256color"}
    done = subprocess.run(
        [sys.executable, "-m", "dflashops.cli.main", "runs", "tree", "--db", str(db_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0 and "\x1b[" not in done.stdout and "exp-flex7" in done.stdout and done.stderr == ""
