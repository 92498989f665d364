"""What `make setup` (and so `make demo`, `make test` on a fresh machine) prints, typed as a user types it: one
`setup:` line per stage on stderr, saying what it installs, and none of the recipes' shell (issue 46 item 5).
The installers are stand-ins in a scratch VENV (make's own variable), which record what they were asked to do;
the real install is the same recipe (`make -n` shows it: tests/controller/test_ctl_fresh_clone.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAND_IN = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls"\n'


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_setup_says_each_stage_in_one_line_and_echoes_no_recipe(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip", "uv"):
        (venv / "bin" / tool).write_text(STAND_IN)
        (venv / "bin" / tool).chmod(0o755)
    typed = ["make", "-B", f"{venv}/.installed", f"VENV={venv}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    done = subprocess.run(typed, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith("setup: ") for line in lines), done.stderr
    assert any("torch" in line and "CPU build" in line and str(venv) in line for line in lines), lines
    assert lines[-1] == f"setup: done ({venv})"
    calls = (venv / "calls").read_text()
    assert "uv pip install" in calls and "python -m compileall -q dflashops" in calls  # the stages did run
    assert (venv / ".installed").is_file()
