"""Lineage with the real controller on the local target: three real runs (deploy, then two `--name +`
children), viewed with `runs tree` / `runs plot`, then the database deleted and rebuilt by `runs sync`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashops.cli.main import main

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "dflashops" / "agent"  # the package folder: python runs its __main__.py
INVENTORY = """\
targets:
  local:
    kind: local
    workspace: ws
    python: {python}
profiles:
  work:
    argv: ["{{python}}", "{{release}}/workload.py", --output-dir, "{{run_dir}}", --interval, "0.01", --steps, "6"]
    files: [workload.py]
"""


@pytest.fixture
def inventory(tmp_path: Path):
    shutil.copy(REPO / "tests" / "workloads" / "workload.py", tmp_path / "workload.py")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(python=sys.executable))
    yield path
    runs = tmp_path / "ws" / "runs"
    for run in sorted(runs.iterdir()) if runs.is_dir() else []:  # stop only our own runs, by their records
        subprocess.run(
            [
                sys.executable,
                str(AGENT),
                "stop",
                "--json-args",
                json.dumps({"workspace": str(tmp_path / "ws"), "name": run.name, "grace": 1}),
            ],
            capture_output=True,
            timeout=60,
        )


def cli(capsys: pytest.CaptureFixture[str], inventory: Path, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--inventory", str(inventory), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_three_run_lineage_views_and_rebuild(
    inventory: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launches = [
        ("exp-flex5", [], "baseline"),
        ("+", ["--parent", "exp-flex5"], "faster steps"),
        ("+", ["--parent", "exp-flex6"], "even faster"),
    ]
    for index, (name, parent_args, note) in enumerate(launches):
        code, out, err = cli(
            capsys,
            inventory,
            "deploy",
            "local",
            "--profile",
            "work",
            "--name",
            name,
            *parent_args,
            "--note",
            note,
            "--launcher",
            "nohup",
            "--wait",
            "^done",
            "--timeout",
            "30",
            "--",
            "--interval",
            f"0.00{index + 1}",
        )
        assert code == 0, err
    runs = tmp_path / "ws" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["exp-flex5", "exp-flex6", "exp-flex7"]
    deadline = time.monotonic() + 20
    while not all((runs / n / "exit_code").exists() for n in ("exp-flex5", "exp-flex6", "exp-flex7")):
        assert time.monotonic() < deadline, "runs did not record their exit codes"
        time.sleep(0.05)

    code, out, err = cli(capsys, inventory, "runs", "tree")
    assert code == 0, err
    assert "exp-flex5  [" in out and "step 6  best tau_sim 1.060" in out and "note: faster steps" in out
    assert "exp-flex5  [finished]  step 6  best tau_sim 1.060\n      note: baseline\n" in out  # live state
    assert (
        "note: faster steps\n        vs parent: --interval 0.001->0.002\n" in out
    )  # nothing else: extra args replace the profile's value; an only child continues its parent's column

    png = tmp_path / "loss.png"
    code, out, err = cli(
        capsys, inventory, "runs", "plot", "exp-flex5", "exp-flex6", "exp-flex7", "--metric", "loss", "--out", str(png)
    )
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG" and "warning" not in err  # metrics found via the local workspace

    (tmp_path / "lineage.sqlite").unlink()
    for sidecar in tmp_path.glob("lineage.sqlite-*"):
        sidecar.unlink()
    code, out, err = cli(capsys, inventory, "runs", "sync", "local", "--json")
    assert code == 0, err
    assert sorted((o["name"], o["outcome"]) for o in json.loads(out)) == [
        ("exp-flex5", "added"),
        ("exp-flex6", "added"),
        ("exp-flex7", "added"),
    ]
    code, out, err = cli(capsys, inventory, "runs", "list", "--json")
    rebuilt = {r["name"]: (r["parent"], r["state"], r["exit_code"], r["last_step"], r["note"]) for r in json.loads(out)}
    assert rebuilt == {
        "exp-flex5": (None, "finished", 0, 6, "baseline"),
        "exp-flex6": ("exp-flex5", "finished", 0, 6, "faster steps"),
        "exp-flex7": ("exp-flex6", "finished", 0, 6, "even faster"),
    }
    assert cli(capsys, inventory, "runs", "sync", "local")[0] == 0  # idempotent
