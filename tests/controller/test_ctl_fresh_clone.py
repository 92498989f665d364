"""Issue 29 ("daily use, round two: what a new user tripped over in a fresh clone"): every item is checked by
running the command as a user types it (real processes, real tmux, real SQLite, the local target)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env


def dflashops(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """dflashops as a real process started in `cwd`, with no inventory named (as a user types it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DFLASHOPS_INVENTORY", None)
    return subprocess.run(
        [sys.executable, "-m", "dflashops.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


# ------------------------------------------------------------------ item 4: trainer arguments without `--`
@pytest.mark.parametrize(
    ("words", "unrecognized", "fixed"),
    [
        (
            ["deploy", "--profile", "tiny", "--max-steps", "10"],
            "--max-steps 10",
            "dflashops deploy --profile tiny -- --max-steps 10",
        ),
        (["restart", "R", "--lr", "1e-3"], "--lr 1e-3", "dflashops restart R -- --lr 1e-3"),
    ],
)
def test_item4_trainer_arguments_without_the_separator_get_the_fixed_command(
    env: Env, words: list[str], unrecognized: str, fixed: str
) -> None:
    out = env.run_cli(*words)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith(f"usage: dflashops {words[0]} "), out.stderr  # the verb's usage, not the top level
    assert lines[-2:] == [
        f"error: unrecognized arguments: {unrecognized}",
        f"hint: trainer arguments go after `--`: {fixed}",
    ]
    assert not any(env.runs.glob("*")), "nothing was launched"
