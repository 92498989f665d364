"""Ctrl-C typed as a user would (SIGINT to the command's process group, as a terminal sends it; issue 46 item 9):
`watch` ends as q ends it (exit 0, no `error:`), and `deploy` interrupted during its pre-flight says that nothing
was launched, and nothing was: no run directory, no lineage row, the name free for the same command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env

TINY = """\
  tiny:
    argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "2",
           --wandb, "off"]
"""


def group_runs(pgid: int, needle: bytes) -> bool:
    """Whether a process of group `pgid` has `needle` in its command line (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid and needle in (entry / "cmdline").read_bytes():
                return True
        except (OSError, ProcessLookupError):
            continue
    return False


def interrupted(env: Env, *words: str, ready: Callable[[int, str], bool]) -> tuple[int, str, str]:
    """dflashops as a real process in a process group of its own (as a shell runs a job); once `ready(its pgid,
    its output so far)`, SIGINT to that group, as Ctrl-C in a terminal. (exit code, stdout, stderr)."""
    out_path, err_path = env.root / "ctrl-c.out", env.root / "ctrl-c.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), *words],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            cwd=env.root,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal job's Ctrl-C default
        )
        try:
            deadline = time.monotonic() + 60
            while not ready(proc.pid, out_path.read_text() + err_path.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGINT)  # the group we started: the CLI, its local agent, the pre-flight
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code, out_path.read_text(), err_path.read_text()


def test_ctrl_c_ends_watch_as_q_does(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "w1", "--launcher", "nohup", "--wait", "step 2", "--",
        "--interval", "0.2", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    # Ctrl-C while the view reads the run's state (its agent runs): there it used to end in `error: interrupted`
    code, out, err = interrupted(
        env, "watch", "w1", "--interval", "0.01", ready=lambda pgid, _: group_runs(pgid, b".pyz")
    )
    assert (code, out) == (0, ""), err  # (a piped view prints its frames only on a terminal)
    assert "error" not in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_during_the_preflight_says_nothing_was_launched(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env.inventory.write_text(env.inventory.read_text() + TINY)
    code, out, err = interrupted(
        env, "deploy", "--profile", "tiny", "--name", "pf1", "--launcher", "nohup", "--wait", "step 2",
        ready=lambda pgid, _: group_runs(pgid, b"trainer\0check"),
    )  # fmt: skip
    assert (code, out) == (130, ""), err
    assert err.splitlines()[-1] == (
        "interrupted before the launch: nothing was launched (pf1 does not exist there); the same command starts it "
        "again"
    ), err
    assert "error: interrupted" not in err and "Traceback" not in err, err
    assert not (env.runs / "pf1").exists()
    code, out, _ = env.cli("runs", "list", capsys=capsys)
    assert "pf1" not in out
