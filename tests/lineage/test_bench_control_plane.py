"""bench/control_plane_scale.py at a tiny scale, this checkout only: every measure runs to the end and no command
in it fails (the figures themselves are bench/results/control-plane.md's, never checked here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_measure_of_the_scale_bench_runs(tmp_path: Path) -> None:
    argv = [sys.executable, str(REPO / "bench" / "control_plane_scale.py"), "all", "--after-only", "--repeat", "1",
            "--runs", "8", "--records", "30", "--processes", "0", "--release-mb", "1", "--workdir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) >= 30, done.stdout
    assert [row for row in rows if "exit " in row or "timed out" in row or "Error" in row] == [], done.stdout
    assert "5 runs answered" in done.stdout  # the default window: the 5 runs that ended recently
